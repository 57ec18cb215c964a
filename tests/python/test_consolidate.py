"""`ckpt consolidate` end to end with Hugging Face transformers (format-spec/global.md
§Consolidate): a tiny GPT-2 saved as a 2-rank checkpoint (row chunks of every 2-D weight,
1-D tensors whole from rank 0) is consolidated, and ``GPT2LMHeadModel.from_pretrained``
loads it from the destination; every parameter must equal the original bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import ckptstore

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not importable (pip install -r tests/python/requirements.txt)",
)
torch = pytest.importorskip("torch", reason="torch is not importable")


def test_consolidate_loads_with_from_pretrained(tmp_path, ckpt):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    # lm_head.weight is tied to transformer.wte.weight: like save_pretrained, store it once
    # (from_pretrained ties it again).
    state = {
        k: v.detach().cpu().numpy().copy()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    src, dst = tmp_path / "src", tmp_path / "dst"
    cid = ckptstore.new_checkpoint_id()
    parts = []
    n_globals = 0
    for rank in range(2):
        items = {}
        for name, a in state.items():
            if a.ndim == 2:
                rows = a.shape[0]
                r0, r1 = (0, rows // 2) if rank == 0 else (rows // 2, rows)
                items[name] = ckptstore.Chunk(a[r0:r1], a.shape, (r0, 0))
                n_globals += rank == 0
            elif rank == 0:
                items[name] = a
        parts.append(ckptstore.write_part(src, cid, rank, items))
    ckptstore.commit(src, cid, parts, world_size=2)
    assert n_globals > 0

    out = ckpt("consolidate", src, "--out", dst, "--max-shard-size", "64KiB", expect=0)
    assert "consolidated" in out.stdout
    ckpt("verify", dst, expect=0)

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in state.values())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"

    config.save_pretrained(dst)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(dst)
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name} differs after consolidate + from_pretrained"
    # The tie survives: lm_head shares the (consolidated) embedding.
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    # ckptstore still opens DST as its own checkpoint (the manifest wins over the index).
    ck = ckptstore.open(dst)
    assert ck.kind == "ckptstore"
    assert np.array_equal(np.asarray(ck["transformer.wte.weight"]), state["transformer.wte.weight"])
