"""Moment layouts from the one engine, on every Python path that takes a ``layout``.

The motivating case: an Adam moment that barely moved (absmax about 1e-36) cannot be held
as FP16 codes with a per-tensor scale (``1/scale`` overflows FP32, every code would be
inf). The engine refuses it; so must every path: ``ckptstore.torch.load``, its manager,
``ckptstore.torch.distributed.load`` on 1 and 3 ranks (the scale from the global absmax
over the shards), and the tiered ``restore_latest``, each raising
``OptimizerStateError`` with the engine's message, naming the parameter and the state,
with the model and optimizer unchanged. Ordinary values come back bit-identical to the
engine's single-process conversion of the same values (``Checkpoint.load_optimizer``,
a different engine path: the absmax recorded at save time, the fused kernel).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402
import ckptstore.torch.distributed as ctd  # noqa: E402
import dist_helpers as dh  # noqa: E402
from ckptstore import OptimizerStateError  # noqa: E402

TINY = "too small for FP16 scaling"
LAYOUTS = {"f16": "f16_scaled", "bf16": "bf16", "mixed": {"exp_avg": "f16_scaled_scalar", "exp_avg_sq": "bf16"}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 10)  # rows 10: uneven on 3 ranks
        self.l2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def build(world: int, seed: int):
    torch.manual_seed(seed)
    m = Net()
    if world:
        mesh = init_device_mesh("cpu", (world,))
        for mod in (m.l1, m.l2, m):
            fully_shard(mod, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def step(m, o, s: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * s + rank)
    (m(torch.randn(4, 8, generator=g)) ** 2).mean().backward()
    o.step()
    o.zero_grad()


def full(v):
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()


def snapshot(m, o) -> dict:
    """Parameters and optimizer states, gathered (collective under FSDP2), by name."""
    names = {id(p): n for n, p in m.named_parameters()}
    out = {n: full(p) for n, p in m.named_parameters()}
    for p, st in o.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}/{k}"] = full(v)
    return out


def shrink(m, o) -> None:
    """Make l1.weight's first moment barely moved: absmax about 1e-36 (on every shard)."""
    st = o.state[m.l1.weight]["exp_avg"]
    (st.to_local() if hasattr(st, "to_local") else st).mul_(1e-34)


def differ(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):
            bad.append(k)
    return sorted(bad)


# ---- jobs (every rank) -------------------------------------------------------------------------


def job_save(rank, world, base):
    m, o = build(world, 0)
    step(m, o, 0, rank)
    ctd.save(os.path.join(base, "ok"), m, o)
    ok = snapshot(m, o)
    shrink(m, o)
    ctd.save(os.path.join(base, "tiny"), m, o)
    return ok, snapshot(m, o)


def job_load(rank, world, base):
    """Each layout into a fresh model (its values gathered), then the tiny checkpoint
    (the error seen, and whether anything changed)."""
    out = {}
    for key, layout in LAYOUTS.items():
        m, o = build(world, 1)
        step(m, o, 9, rank)
        ctd.load(os.path.join(base, "ok"), m, o, layout=layout)
        out[key] = snapshot(m, o)
    m, o = build(world, 1)
    step(m, o, 9, rank)
    before = snapshot(m, o)
    try:
        ctd.load(os.path.join(base, "tiny"), m, o, layout="f16_scaled")
        out["tiny"] = None
    except Exception as e:  # noqa: BLE001 - reported
        out["tiny"] = (type(e).__name__, isinstance(e, OptimizerStateError), str(e), getattr(e, "param", None),
                       getattr(e, "state", None))
    out["tiny_changed"] = differ(before, snapshot(m, o))
    # The same checkpoint loads as stored, and as BF16 (which keeps tiny values).
    ctd.load(os.path.join(base, "tiny"), m, o, layout="bf16")
    out["tiny_bf16"] = snapshot(m, o)
    return out


# ---- the reference: the engine's single-process conversion of the same values ---------------


def reference(tmp, state: dict, layout) -> dict:
    """``state`` (gathered names -> tensors) put into a plain model and optimizer, saved by
    ``ckptstore.torch.save`` and loaded back by ``ckptstore.torch.load`` with ``layout``
    (the engine's ``load_optimizer``); the result gathered the same way."""
    m, o = build(0, 2)
    step(m, o, 0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(state[n])
            for k in o.state[p]:
                o.state[p][k].copy_(state[f"{n}/{k}"])
    path = os.path.join(tmp, f"ref-{abs(hash(repr(layout)))}")
    ct.save(path, m, o)
    m2, o2 = build(0, 3)
    step(m2, o2, 5)
    ct.load(path, m2, o2, layout=layout)
    return snapshot(m2, o2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    ok, tiny = dh.results(2, job_save, str(base))[0]
    return base, ok, tiny


@pytest.mark.parametrize("world", [1, 3])
def test_distributed_load_converts_with_the_engine_and_refuses_a_tiny_moment(saved, world, tmp_path):
    base, ok, tiny = saved
    res = dh.results(world, job_load, str(base))
    for key, layout in LAYOUTS.items():
        want = reference(tmp_path, ok, layout)
        for r in range(world):
            assert differ(res[r][key], want) == [], (key, r)
        # Really converted: the f16 / bf16 moments differ from the stored ones.
        assert differ(res[0][key], ok) != [], key
    for r in range(world):
        cls, is_ose, msg, param, state = res[r]["tiny"]
        assert is_ose and cls == "_LayoutRefused", res[r]["tiny"]
        assert 'parameter "l1.weight", state "exp_avg"' in msg and TINY in msg, msg
        assert (param, state) == ("l1.weight", "exp_avg")
        assert res[r]["tiny_changed"] == [], r
        # As BF16 the tiny moment is kept (rounded), never inf.
        v = res[r]["tiny_bf16"]["l1.weight/exp_avg"]
        assert torch.isfinite(v).all() and v.abs().max() > 0
        assert differ({"x": v}, {"x": tiny["l1.weight/exp_avg"].to(torch.bfloat16).float()}) == []


def test_single_process_paths_refuse_the_same_tiny_moment(saved, tmp_path):
    base, ok, tiny = saved
    m, o = build(0, 4)
    step(m, o, 0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            for k in o.state[p]:
                o.state[p][k].copy_(tiny[f"{n}/{k}"])
    ct.save(tmp_path / "single", m, o)
    before = snapshot(m, o)
    with pytest.raises(OptimizerStateError, match=TINY) as e:
        ct.load(tmp_path / "single", m, o, layout="f16_scaled")
    assert (e.value.param, e.value.state) == ("l1.weight", "exp_avg")
    assert differ(before, snapshot(m, o)) == []
    # The engine's message, word for word, on the distributed path too.
    engine_msg = str(e.value)
    with pytest.raises(OptimizerStateError) as d:
        ctd.load(base / "tiny", m, o, layout="f16_scaled")
    assert str(d.value).endswith(engine_msg), (str(d.value), engine_msg)
    # The manager passes the layout down.
    with ct.CheckpointManager(tmp_path / "mgr") as mgr:
        mgr.save(1, m, o)
        mgr.wait()
        with pytest.raises(OptimizerStateError, match=TINY):
            mgr.restore_latest(m, o, layout="f16_scaled")
    assert differ(before, snapshot(m, o)) == []


def test_tiered_restore_refuses_a_tiny_moment_and_converts_ordinary_ones(tmp_path):
    from ckptstore.torch.distributed import CheckpointManager

    m, o = build(0, 5)
    step(m, o, 0)
    ok = snapshot(m, o)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1) as mgr:
            mgr.save(1, m, o)
            mgr.wait()
            shrink(m, o)
            mgr.save(2, m, o)
            mgr.wait()
            m2, o2 = build(0, 6)
            step(m2, o2, 3)
            before = snapshot(m2, o2)
            with pytest.raises(OptimizerStateError, match=TINY) as e:
                mgr.restore_latest(m2, o2, layout="f16_scaled")
            # Refused, not passed over to step 1: every copy holds the same values.
            assert "l1.weight" in str(e.value) and differ(before, snapshot(m2, o2)) == []
            assert mgr.restore_latest(m2, o2, layout="bf16") == 2
    # Ordinary values: what the engine's single-process load gives.
    m3, o3 = build(0, 5)
    step(m3, o3, 0)
    with CheckpointManager(tmp_path / "local3", None) as mgr:
        mgr.save(7, m3, o3)
        mgr.wait()
        m4, o4 = build(0, 8)
        step(m4, o4, 1)
        assert mgr.restore_latest(m4, o4, layout="f16_scaled") == 7
    assert differ(snapshot(m3, o3), ok) == []
    assert differ(snapshot(m4, o4), reference(tmp_path, ok, "f16_scaled")) == []


def test_f16_scaled_to_float32_is_the_engines():
    q = np.array([1.0, -2.5, 65504.0, 0.0], dtype=np.float16)
    s = np.array([3.0e-5], dtype=np.float32)
    got = ckptstore.F16Scaled(q, s).to_float32()
    assert got.dtype == np.float32 and got.flags.writeable
    assert np.array_equal(got.view(np.uint32), (q.astype(np.float32) * s[0]).view(np.uint32))
    # A 0-dim state keeps its shape; a scale of several values is refused.
    assert ckptstore.F16Scaled(np.array(2.0, dtype=np.float16), np.array(0.5, dtype=np.float32)).to_float32().shape == ()
    with pytest.raises(ckptstore.InvalidArgumentError):
        ckptstore.F16Scaled(q, np.ones(2, dtype=np.float32)).to_float32()


def test_round_state_is_convert_state_read_back_and_refuses_aliasing():
    """The fused engine pass ``distributed.load`` uses for float32 states gives the values of
    ``convert_state`` read back (``to_float32``), bit for bit; its destination must be a
    buffer of its own."""
    from ckptstore import _ckptstore

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_000) * 1e-3).astype(np.float32)
    bits = _ckptstore.state_absbits("w", "exp_avg", "F32", x[:50_000])  # one shard's absmax
    bits = max(bits, _ckptstore.state_absbits("w", "exp_avg", "F32", x[50_000:]))
    for target, absmax in (("f16_scaled", None), ("f16_scaled", bits), ("bf16", None), ("f32", None)):
        want = _ckptstore.convert_state("w", "exp_avg", "F32", x, target, absmax_bits=absmax)
        want = want.to_float32() if isinstance(want, ckptstore.F16Scaled) else want.astype(np.float32)
        out = np.empty_like(x)
        _ckptstore.round_state("w", "exp_avg", x, target, out, absmax_bits=absmax)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), target
    with pytest.raises(TypeError, match="already borrowed"):
        _ckptstore.round_state("w", "exp_avg", x, "bf16", x)
    with pytest.raises(OptimizerStateError, match=TINY):
        _ckptstore.round_state("w", "exp_avg", np.full(4, 1e-36, np.float32), "f16_scaled", np.empty(4, np.float32))
