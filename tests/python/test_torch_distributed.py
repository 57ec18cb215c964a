"""ckptstore.torch.distributed: FSDP2 (``fully_shard`` on a CPU device mesh, gloo) models
with Adam and AdamW, saved on 2 ranks and restored on 3, 1 and 2 ranks; bit-for-bit
comparisons of the gathered parameters and optimizer states; a resumed run equal to an
uninterrupted one; stale per-rank optimizer state dropped (the ColossalAI scenario); a
damaged checkpoint refused with the model and optimizer untouched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.torch.distributed as ctd  # noqa: E402
import dist_helpers as dh  # noqa: E402
from ckptstore.torch import _sharded  # noqa: E402
from ckptstore.torch.dcp import Reader  # noqa: E402

OPTIMS = ("Adam", "AdamW")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # Uneven on 2 and 3 ranks: rows 10 and 5.
        self.l1 = nn.Linear(8, 10)
        self.l2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def build(world: int, seed: int, opt_name: str):
    torch.manual_seed(seed)
    m = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(m.l1, mesh=mesh)
    fully_shard(m.l2, mesh=mesh)
    fully_shard(m, mesh=mesh)
    if opt_name == "Adam":
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
    else:
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return m, o


def train(m, o, start: int, steps: int, rank: int):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (m(x) ** 2).mean()
        loss.backward()
        o.step()
        o.zero_grad()


def snapshot(m, o) -> dict:
    """Gathered parameters and optimizer states (collective: every rank calls it)."""
    out = {}
    names = {id(p): n for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        out[n] = p.detach().full_tensor().clone()
    for p, st in o.state.items():
        for k, v in st.items():
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone()
    out["hyper"] = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    return out


def same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bit for bit) or are missing on either side."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.view(-1).view(torch.uint8) if x.numel() else x, y.view(-1).view(torch.uint8) if y.numel() else y
            ):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return sorted(bad)


# ---- jobs ----------------------------------------------------------------------------------


def job_save(rank, world, base):
    out = {}
    for name in OPTIMS:
        m, o = build(world, 0, name)
        train(m, o, 0, 2, rank)
        info = ctd.save(os.path.join(base, name), m, o, extra={"epoch": 2, "t": torch.arange(3)})
        s2 = snapshot(m, o)
        train(m, o, 2, 3, rank)
        s5 = snapshot(m, o)
        out[name] = (s2, s5, info is not None)
        if name == "Adam":
            # A checkpoint of an optimizer that has state for l1 only (as after steps in
            # which l2 got no gradient).
            for p in m.l2.parameters():
                del o.state[p]
            ctd.save(os.path.join(base, "partial"), m, o)
            out["partial"] = snapshot(m, o)
    return out


def job_load(rank, world, base, damaged):
    out = {}
    for name in OPTIMS:
        m, o = build(world, 1, name)
        train(m, o, 7, 2, rank)  # its own state, to be replaced
        if damaged and name == "Adam":
            before = snapshot(m, o)
            errs = []
            try:
                ctd.load(damaged, m, o)
            except ckptstore.CheckpointError as e:
                errs.append(str(e))
            # The same through dcp.load on get_state_dict (DCP's way): refused before any
            # rank writes.
            msd, osd = get_state_dict(m, o)
            try:
                dcp.load({"model": msd}, storage_reader=Reader(damaged))
            except BaseException as e:  # noqa: BLE001 - CheckpointException
                errs.append(str(e))
            out["damaged"] = (errs, same(before, snapshot(m, o)))
        extra = ctd.load(os.path.join(base, name), m, o)
        out[name] = (snapshot(m, o), {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in extra.items()})
        if name == "Adam":
            # ColossalAI: this optimizer has state for every parameter; the checkpoint only
            # for l1. After the load, l2's state is gone on every rank.
            ctd.load(os.path.join(base, "partial"), m, o)
            l2 = [p for p in m.l2.parameters()]
            out["partial"] = (snapshot(m, o), [len(o.state.get(p, {})) for p in l2])
        if world == 1 and name == "Adam":
            ctd.load(os.path.join(base, name), m, o, layout="bf16")
            out["bf16"] = snapshot(m, o)
            ctd.load(os.path.join(base, name), m, o, layout={"exp_avg": "f16_scaled"})
            out["f16"] = snapshot(m, o)
    return out


def job_load_refused(rank, world, path):
    """A load that must fail: its error, and what of the model and optimizer changed."""
    m, o = build(world, 1, "Adam")
    train(m, o, 7, 2, rank)
    before = snapshot(m, o)
    err = None
    try:
        ctd.load(path, m, o)
    except ckptstore.CheckpointError as e:
        err = (type(e).__name__, str(e))
    return err, same(before, snapshot(m, o))


def job_versions(rank, world, base):
    """An Adam state saved with this writer (metadata version 2) and as version 1 wrote it
    (``_sharded._META_VERSION = 1``: state named ``optim.<param>.<state>``); each restored into a
    fresh model, gathered, and the stored names of each."""
    m, o = build(world, 0, "Adam")
    train(m, o, 0, 2, rank)
    want = snapshot(m, o)
    out = {"want": want}
    for version in (2, 1):
        path = os.path.join(base, f"v{version}")
        _sharded._META_VERSION = version
        try:
            ctd.save(path, m, o)
        finally:
            _sharded._META_VERSION = 2
        m2, o2 = build(world, 1, "Adam")
        train(m2, o2, 7, 1, rank)
        ctd.load(path, m2, o2)
        with ckptstore.open(path) as ck:
            names = [n for n in ck.globals() if n.startswith("optim")]
        out[version] = (snapshot(m2, o2), sorted(names))
    return out


def job_check_extra(rank, world, path):
    """``check_extra`` refusing on rank 1 only, then accepting: what each load did."""
    m, o = build(world, 1, "Adam")
    train(m, o, 7, 2, rank)
    before = snapshot(m, o)
    seen = []

    def refuse_on_1(extra):
        seen.append({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in extra.items()})
        if rank == 1:
            raise ValueError("no such data loader position")

    err = None
    try:
        ctd.load(path, m, o, check_extra=refuse_on_1)
    except ckptstore.CheckpointError as e:
        err = str(e)
    refused = same(before, snapshot(m, o))
    extra = ctd.load(path, m, o, check_extra=seen.append)
    return {"err": err, "changed_when_refused": refused, "changed": bool(same(before, snapshot(m, o))),
            "seen": seen[0], "returned": extra is seen[1]}


def job_plan_fails_on_one_rank(rank, world, path):
    """Rank 1's reader fails while the ranks plan (each plans alone: no exchange of plans)."""
    m, o = build(world, 1, "Adam")
    train(m, o, 7, 2, rank)
    before = snapshot(m, o)
    if rank == 1:
        def gone(self):
            raise OSError(5, "Input/output error")
        Reader.read_metadata = gone
    err = None
    try:
        ctd.load(path, m, o)
    except ckptstore.CheckpointError as e:
        err = str(e)
    return {"err": err, "changed": same(before, snapshot(m, o))}


def job_resume(rank, world, base):
    out = {}
    for name in OPTIMS:
        m, o = build(world, 2, name)
        ctd.load(os.path.join(base, name), m, o)
        train(m, o, 2, 3, rank)
        out[name] = snapshot(m, o)
    return out


# ---- tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    res = dh.results(2, job_save, str(base))
    assert res[0]["Adam"][2] and not res[1]["Adam"][2]  # the coordinator committed
    return base, res[0]


def _damaged_copy(src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    import ckpt_helpers as h

    f, victim, start = h.stored_tensor(dst, "model.l1.weight@")
    h.flip_byte(f, start + 5, 0x01)
    return victim


def test_fsdp2_load_on_3_ranks_bit_identical_damage_and_stale_state(saved, tmp_path):
    base, ref = saved
    victim = _damaged_copy(base / "Adam", tmp_path / "damaged")
    res = dh.results(3, job_load, str(base), str(tmp_path / "damaged"))
    for r, out in enumerate(res):
        for name in OPTIMS:
            assert same(out[name][0], ref[name][0]) == [], (r, name)
            assert out[name][1] == {"epoch": 2, "t": [0, 1, 2]}
        # Damage: refused on every rank, naming the tensor; nothing changed.
        errs, changed = out["damaged"]
        assert len(errs) == 2 and all(victim in e for e in errs), errs
        assert changed == [], changed
        # Stale state for parameters the checkpoint does not name is gone, on every rank.
        snap, l2_state = out["partial"]
        assert l2_state == [0, 0]
        want = {k: v for k, v in ref["partial"].items()}
        assert same(snap, want) == []


def test_fsdp2_load_on_1_rank_and_moment_layouts(saved):
    base, ref = saved
    (out,) = dh.results(1, job_load, str(base), "")
    for name in OPTIMS:
        assert same(out[name][0], ref[name][0]) == [], name
    s2 = ref["Adam"][0]
    for k, v in out["bf16"].items():
        if k.endswith("/exp_avg") or k.endswith("/exp_avg_sq"):
            assert torch.equal(v, s2[k].to(torch.bfloat16).float()), k
            assert not torch.equal(v, s2[k]) or k.endswith("_sq"), k  # really rounded
        else:
            assert same({k: v}, {k: s2[k]}) == [], k
    for k, v in out["f16"].items():
        if k.endswith("/exp_avg"):
            s = s2[k].abs().max() / 32752.0
            assert torch.equal(v, (s2[k] * (1.0 / s)).half().float() * s), k
        else:
            assert same({k: v}, {k: s2[k]}) == [], k


def test_a_malformed_extra_value_fails_the_load_before_anything_changes(saved, tmp_path):
    import ckpt_helpers as h

    base, _ = saved
    bad = tmp_path / "bad"
    h.clone_checkpoint(base / "Adam", bad)
    h.rewrite_manifest(bad, lambda m: m["metadata"][ctd.META_KEY]["extra"].__setitem__("epoch", {"$int": "1e3"}))
    ((err, differ),) = dh.results(1, job_load_refused, str(bad))
    assert err is not None and err[0] == "CorruptCheckpointError", err
    assert differ == []  # the model and the optimizer as they were
    assert f"{str(bad)!r}, extra 'epoch'" in err[1] and "not a decimal integer" in err[1], err


def test_check_extra_refusing_on_one_rank_fails_the_load_on_every_rank_before_anything_changes(saved):
    base, _ = saved
    res = dh.results(2, job_check_extra, str(base / "Adam"))
    for r in range(2):
        assert res[r]["changed_when_refused"] == [], r
        assert "check_extra refused its extra on rank(s) [1]: ValueError: no such data loader position" in res[r]["err"]
        assert res[r]["seen"] == {"epoch": 2, "t": [0, 1, 2]}  # the tensors read too
        assert res[r]["changed"] and res[r]["returned"]  # accepted: loaded, the same dict returned


def test_a_rank_failing_to_plan_fails_the_load_on_every_rank(saved):
    base, _ = saved
    res = dh.results(2, job_plan_fails_on_one_rank, str(base / "Adam"))
    for r in range(2):
        assert res[r]["changed"] == [], r
        assert res[r]["err"] and "failed on rank(s) [1]: [Errno 5] Input/output error" in res[r]["err"], res[r]["err"]


def test_fsdp2_resume_equals_uninterrupted_run(saved):
    base, ref = saved
    res = dh.results(2, job_resume, str(base))
    for out in res:
        for name in OPTIMS:
            assert same(out[name], ref[name][1]) == [], name


def job_model_state_dict(rank, world):
    """What ``_model_state_dict`` returns against ``get_model_state_dict`` itself, and when
    it calls torch's function (counted)."""
    from torch.distributed.checkpoint import state_dict as tsd
    from torch.nn.parallel import DistributedDataParallel

    from ckptstore.torch import _sharded as d

    real, calls = tsd.get_model_state_dict, []

    def counted(model, **kw):
        calls.append(1)
        return real(model, **kw)

    tsd.get_model_state_dict = counted

    def agrees(model) -> bool:
        got, want = d._model_state_dict(model), real(model)
        return list(got) == list(want) and all(d._same_tensor(got[k], want[k]) for k in want)

    out = {}
    m, _ = build(world, 0, "Adam")  # FSDP2: its state_dict() is the model state dict
    out["fsdp2"] = [agrees(m) for _ in range(3)], len(calls)
    m.register_buffer("counter", torch.zeros(2))  # the keys change: torch's function again
    out["new_key"] = agrees(m), "counter" in d._model_state_dict(m), len(calls)
    ddp = DistributedDataParallel(nn.Linear(3, 2))  # keys "module.*" mapped: never cached
    n0 = len(calls)
    out["ddp"] = [agrees(ddp) for _ in range(2)], len(calls) - n0, sorted(d._model_state_dict(ddp))
    return out


def test_model_state_dict_is_torchs_and_skips_its_name_maps_only_where_they_change_nothing():
    (out,) = dh.results(1, job_model_state_dict)
    assert out["fsdp2"] == ([True, True, True], 1), out  # one call of torch's, the first
    assert out["new_key"] == (True, True, 2), out
    assert out["ddp"] == ([True, True], 2, ["bias", "weight"]), out  # torch's every time


def test_optimizer_state_has_the_packages_one_stored_name_and_version_1_is_still_read(tmp_path):
    """format-spec/optimizer.md, one stored name: ``optim/<param>/<state>`` from metadata
    version 2 on; version 1 checkpoints (``optim.<param>.<state>``) restore as before."""
    res = dh.results(2, job_versions, str(tmp_path))
    for r in range(2):
        want = res[r]["want"]
        for version, sep in ((2, "/"), (1, ".")):
            got, names = res[r][version]
            assert same(got, want) == [], (version, r)
            assert f"optim{sep}l1.weight{sep}exp_avg" in names, (version, names)
            assert all(n.startswith(f"optim{sep}") for n in names), names
            assert len(names) == 4 * 3, names  # 4 parameters x (step, exp_avg, exp_avg_sq)


def test_a_metadata_version_from_the_future_is_refused_naming_it(saved, tmp_path):
    import ckpt_helpers as h

    base, _ = saved
    bad = tmp_path / "v3"
    h.clone_checkpoint(base / "Adam", bad)
    h.rewrite_manifest(bad, lambda m: m["metadata"][ctd.META_KEY].__setitem__("version", 3))
    ((err, differ),) = dh.results(1, job_load_refused, str(bad))
    assert err is not None and err[0] == "UnsupportedFormatError", err
    assert "version 3" in err[1] and "upgrade ckptstore" in err[1], err
    assert differ == []


def test_a_load_and_a_tiered_restore_run_with_the_cyclic_collector_paused_then_restored():
    """A restore's many small objects would set off a full collection of the training
    process's heap (0.15 s on a bare torch import's): ``load`` and ``restore_latest`` run
    with the collector paused, and leave it as they found it, also when they raise."""
    import gc

    from ckptstore.torch import _sharded
    from ckptstore.torch.tiered import CheckpointManager

    assert _sharded.load.__wrapped__ and CheckpointManager.restore_latest.__wrapped__
    seen = []

    @_sharded._gc_paused
    def body(fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("boom")
        return 7

    assert gc.isenabled()
    assert body() == 7 and seen == [False] and gc.isenabled()
    with pytest.raises(ValueError):
        body(fail=True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        body()
        assert not gc.isenabled(), "a collector paused by the caller stays paused"
    finally:
        gc.enable()


# ---- decisions made once (ckptstore.torch.internal.decided_once) -----------------------------


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def job_decided_once(rank, world):
    from ckptstore.errors import CheckpointNotFoundError
    from ckptstore.torch.internal import decided_once

    out = {"value": decided_once(lambda: f"seen by rank {rank}", what="a listing")}
    for err in (CheckpointNotFoundError("no step under /ck"), _Unpicklable("a socket")):
        def decide(err=err):
            if rank == 0:
                raise err
            return "rank 1's own view"  # never asked: rank 0 decides

        try:
            decided_once(decide, what="choosing a step")
            out[type(err).__name__] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            out[type(err).__name__] = (type(e).__name__, str(e))
    return out


def test_decided_once_hands_the_first_ranks_answer_or_its_error_to_every_rank():
    """What every rank must act on alike (issue 52: ranks whose caches show different
    listings) is decided by rank 0: its value on every rank, its error raised on every rank
    (the same type where it pickles, else a CheckpointError naming what was decided)."""
    r0, r1 = dh.results(2, job_decided_once)
    assert r0["value"] == r1["value"] == "seen by rank 0"
    assert r0["CheckpointNotFoundError"] == r1["CheckpointNotFoundError"] == (
        "CheckpointNotFoundError", "no step under /ck")
    assert r0["_Unpicklable"] == ("_Unpicklable", "a socket")
    assert r1["_Unpicklable"] == (
        "CheckpointError", "choosing a step (decided on the first rank): _Unpicklable: a socket")
