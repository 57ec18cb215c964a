"""Read once, fan out (python/py_src/ckptstore/torch/_fanout.py): a replicated (DDP-style)
model with Adam saved by ``ckptstore.torch.distributed.save`` and loaded on 3 ranks, every
one of which needs every stored chunk: each chunk is read from storage by one rank only
(the bytes read across the job are the checkpoint's, 1.0x, not 3x) and reaches the
others over the process group straight into their fresh tensors; a byte changed on the
way to one rank is caught there by the stored CRC32s and that chunk read from storage
again; the state bit-identical on every rank. The assignment is checked alone too: each
key to one of the ranks that want it, the largest first to the least loaded.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ckptstore.torch.distributed as ctd  # noqa: E402
import dist_helpers as dh  # noqa: E402
from ckptstore.torch import _fanout  # noqa: E402


def _model(seed: int):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 32))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(4, 64)).sum().backward()
    o.step()
    return m, o


def _state(m, o) -> dict:
    out = {f"model/{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in o.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = torch.as_tensor(v).detach().clone()
    return out


def job_read_once(rank, world, path):
    m, o = _model(seed=0)  # replicated: the same on every rank
    ref = _state(m, o) if rank == 0 else None
    ctd.save(path, m, o, extra={"step": 1})
    out = []
    for damage in (False, True):  # then a byte changed on the way to rank 2's first chunk
        box = {"damaged": 0}
        real = _fanout.transfer
        if damage and rank == 2:
            def damaging(items, error, dst, src, tag, pg, receive, dest=None, box=box, real=real):
                def recv(inc, key, data):
                    if key is not None and data is not None and not box["damaged"]:
                        data[len(data) // 2] ^= 0x10
                        box["damaged"] += 1
                    receive(inc, key, data)

                return real(items, error, dst, src, tag, pg, recv, dest)

            _fanout.transfer = damaging
        try:
            m2, o2 = _model(seed=rank + 10)  # a state of its own, replaced whole
            extra = ctd.load(path, m2, o2)
        finally:
            _fanout.transfer = real
        out.append({"state": _state(m2, o2), "extra": extra, "last": dict(_fanout.LAST), "damaged": box["damaged"]})
    return {"ref": ref, "loads": out}


def _same(a: dict, b: dict) -> list:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8),
                                                                          y.view(-1).view(torch.uint8)):
            bad.append(k)
    return bad


def test_each_chunk_is_read_once_and_fanned_out_bit_identical(tmp_path):
    res = dh.results(3, job_read_once, str(tmp_path / "ck"))
    ref = res[0]["ref"]
    for damage in (0, 1):
        outs = [r["loads"][damage] for r in res]
        for r, out in enumerate(outs):
            assert _same(out["state"], ref) == [], (damage, r)
            assert out["extra"] == {"step": 1}
        lasts = [o["last"] for o in outs]
        chunks = lasts[0]["read_chunks"] + lasts[0]["incoming"]  # every rank wants every chunk
        assert chunks >= 9, lasts  # 4 parameters, their 2 moments each and the steps
        assert all(x["read_chunks"] + x["incoming"] == chunks for x in lasts), lasts
        assert sum(x["read_chunks"] for x in lasts) == chunks, lasts  # each chunk read by one rank
        assert all(x["incoming"] > 0 and x["received"] == x["incoming"] for x in lasts), lasts
        again = [x["read_again"] for x in lasts]
        if not damage:
            assert again == [0, 0, 0], lasts
            total = sum(x["read_bytes"] for x in lasts)  # 1.0x the stored bytes, not 3x
            assert total == sum(x["sent_bytes"] for x in lasts) // 2, lasts
        else:  # caught on rank 2, that chunk read from storage there
            assert [o["damaged"] for o in outs] == [0, 0, 1], outs
            assert again == [0, 0, 1], lasts


def test_assignment_gives_each_shared_key_to_one_of_its_ranks_largest_first():
    wants = [
        [(("a", (0,)), 100), (("b", (0,)), 40), (("c", (0,)), 10)],
        [(("a", (0,)), 100), (("b", (0,)), 40), (("only1", (0,)), 500)],
        [(("a", (0,)), 100), (("c", (0,)), 10)],
    ]
    got = _fanout.assign(wants)
    assert got == {("a", (0,)): 0, ("b", (0,)): 0, ("c", (0,)): 2}  # rank 1 has 500 of its own
    assert _fanout.assign([[(("x", ()), 8)]]) == {}  # wanted once: nothing to share
