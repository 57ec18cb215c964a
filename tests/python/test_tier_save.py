"""The tiered manager's save without DCP's global plan (``_tier_local.save_part``), 2 ranks on
one host (one local tier directory):

- FSDP2 (1-D mesh) and HSDP (2-D mesh, replicated over one dimension): DCP's
  ``create_global_plan`` never runs; a replicated chunk is written once (by the replica at
  coordinate 0), each plain tensor by one rank; the step restores bit-identically; and the
  record's manifest metadata is the one ``dcp.save``'s global plan gives for the same state;
- ranks whose state dicts differ in their entries take ``dcp.save`` (its global plan) and
  restore bit-identically too.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import dist_helpers as dh  # noqa: E402

JOB_S = 600  # a 2-rank job's processes start slowly on a loaded 2-core machine


def _results(fn, *args):
    out, _ = dh.run(2, fn, *args, join_timeout=JOB_S)
    return [out[r][1] for r in range(2)]


def _model(world: int, mesh_shape: tuple, seed: int = 0):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 5))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("rep", "shard")[-len(mesh_shape):])
    for mod in (m[0], m[2], m):
        fully_shard(mod, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m, o, s: int, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + rank))
    (m(x) ** 2).mean().backward()
    o.step()
    o.zero_grad()


def _bits(m, o) -> dict:
    """Each rank's own shards of every parameter and state, as bytes."""
    out = {}
    for n, p in m.named_parameters():
        out[n] = p.to_local().detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for i, st in o.state_dict()["state"].items():
        for k, v in st.items():
            t = v.to_local() if hasattr(v, "to_local") else v
            out[f"{i}.{k}"] = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


def _record_meta(local: str, step: int) -> dict:
    from ckptstore.torch.dcp import META_KEY

    with open(os.path.join(local, f"step-{step:08d}", "commit.json")) as f:
        meta = json.load(f)["metadata"][META_KEY]
    meta.pop("storage_meta")  # names the directory and the checkpoint id
    return meta


def _shard_bytes(local: str, step: int) -> int:
    """The tensor bytes the step's shard files hold (their safetensors headers' ranges)."""
    d = os.path.join(local, f"step-{step:08d}")
    n = 0
    for r, _, fs in os.walk(d):
        for f in fs:
            if f.startswith("shard-"):
                with open(os.path.join(r, f), "rb") as fh:
                    head = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
                n += sum(e - b for k, v in head.items() if k != "__metadata__" for b, e in [v["data_offsets"]])
    return n


def _one_copy(m, o) -> int:
    """The bytes of one copy of the whole state (every global tensor once)."""
    ts = list(m.parameters()) + [v for st in o.state_dict()["state"].values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in ts)


def _spmd_job(rank, world, root, mesh_shape):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptstore.torch import _tier_local
    from ckptstore.torch.distributed import CheckpointManager

    warnings.filterwarnings("ignore", message=".*replica.*needs.*hosts")
    m, o = _model(world, mesh_shape)
    _train(m, o, 1, rank)
    calls = []
    orig = DefaultSavePlanner.create_global_plan

    def counted(self, plans):
        calls.append(len(plans))
        return orig(self, plans)

    DefaultSavePlanner.create_global_plan = counted
    out = {}
    for way, local in (("local plan", os.path.join(root, "a")), ("global plan", os.path.join(root, "b"))):
        _tier_local.SPMD_PLAN = way == "local plan"
        del calls[:]
        with CheckpointManager(local, keep_last=1) as mgr:
            saved = _bits(m, o)
            mgr.save(3, m, o, extra={"note": way})
            mgr.wait()
            _train(m, o, 2, rank)  # the live state moves on
            assert _bits(m, o) != saved
            assert mgr.restore_latest(m, o) == 3
            out[way] = {"global_plans": len(calls), "same": _bits(m, o) == saved, "extra": mgr.last_extra,
                        "meta": _record_meta(local, 3), "shard_bytes": _shard_bytes(local, 3),
                        "one_copy": _one_copy(m, o)}
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 1)], ids=["fsdp", "hsdp"])
def test_an_spmd_save_makes_no_global_plan_and_restores_bit_identical(tmp_path, mesh_shape):
    got = _results(_spmd_job, str(tmp_path), mesh_shape)
    for rank, g in enumerate(got):
        local, glob = g["local plan"], g["global plan"]
        assert local["global_plans"] == 0, "DCP's global plan ran"
        assert glob["global_plans"] == (1 if rank == 0 else 0), "the comparison save used dcp.save"
        assert local["same"] and glob["same"], rank
        assert local["extra"] == {"note": "local plan"}
        # The manifest metadata (kinds, dtypes, sizes, planner data) as DCP's global plan gives it.
        assert local["meta"] == glob["meta"]
        # Each chunk written once (HSDP: each replicated chunk by rank 0 alone), each
        # plain tensor (Adam's steps) by one rank: one copy of the state, as DCP's
        # deduplicated save holds.
        assert local["shard_bytes"] == glob["shard_bytes"] == g["local plan"]["one_copy"] > 0


def _differ_job(rank, world, root):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptstore.torch.distributed import CheckpointManager

    warnings.filterwarnings("ignore", message=".*replica.*needs.*hosts")
    torch.manual_seed(0)  # the entries both ranks have are the same (DCP keeps one copy)
    m = torch.nn.Linear(6, 6)
    if rank == 1:  # an entry rank 0 does not have
        m.register_buffer("only_on_1", torch.arange(3.0))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    (m(torch.randn(2, 6, generator=torch.Generator().manual_seed(5))) ** 2).mean().backward()
    o.step()
    calls = []
    orig = DefaultSavePlanner.create_global_plan
    DefaultSavePlanner.create_global_plan = lambda self, plans: (calls.append(len(plans)), orig(self, plans))[1]
    with CheckpointManager(os.path.join(root, "t"), keep_last=1) as mgr:
        saved = _bits_plain(m, o)
        mgr.save(1, m, o)
        mgr.wait()
        with torch.no_grad():
            for p in list(m.parameters()) + list(m.buffers()):
                p.add_(1.0)
        step = mgr.restore_latest(m, o)
    return {"global_plans": len(calls), "step": step, "same": _bits_plain(m, o) == saved}


def _bits_plain(m, o) -> dict:
    out = {k: v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in m.state_dict().items()}
    for i, st in o.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{i}.{k}"] = v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


def test_ranks_whose_entries_differ_take_dcp_save_and_restore_bit_identical(tmp_path):
    got = _results(_differ_job, str(tmp_path))
    assert [g["global_plans"] for g in got] == [1, 0], "dcp.save's coordinator planned"
    assert all(g["step"] == 1 and g["same"] for g in got), got
