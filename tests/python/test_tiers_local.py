"""The tiered manager (ckptstore.torch.distributed.CheckpointManager) in one process, without
torch.distributed: the parts of its contract that need no second host, checked where network
namespaces cannot be made too (tests/python/test_tiers.py has the hosts).

- save is non-blocking and saves the state as it was at the call (the snapshot), not as
  training changed it afterwards; restore_latest is bit-identical;
- the snapshot buffers are reused: none allocated after the first save;
- the persistent tier holds ordinary checkpoints (ckptstore.open, ckpt verify) with retention;
- a failed persist is raised by wait(), the fast-tier step stands;
- a damaged local copy with no other copy falls back to the persisted step, with a warning;
- leftovers of an interrupted save are removed at start and by gc.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import ckptstore  # noqa: E402
from ckptstore.torch.distributed import CheckpointManager  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m, o, s):
    g = torch.Generator().manual_seed(s)
    o.zero_grad()
    (m(torch.randn(8, 16, generator=g)) ** 2).mean().backward()
    o.step()


def _state(m, o):
    out = {f"m.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in o.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*replica.*needs.*hosts")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def test_save_snapshots_then_restore_bit_identical_and_buffers_reused(tmp_path):
    import threading

    m, o = _model()
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=2, keep_last=2) as mgr:
        allocs = []
        for s in range(1, 6):
            _train(m, o, s)
            if s < 5:
                mgr.save(s, m, o, extra={"step": s})
                mgr.wait()
                allocs.append(mgr._saver.allocations)
                continue
            # Step 5's writer is held (a test seam) until the live weights have changed
            # after save returned: what it writes must be the state at the call.
            gate = threading.Event()
            write = mgr._write
            mgr._write = lambda job: (gate.wait(), write(job))[1]
            mgr.save(s, m, o, extra={"step": s})
            want = _state(m, o)
            with torch.no_grad():
                m[0].weight.add_(1.0)
            gate.set()
            mgr.wait()
        assert mgr._saver.buffer_sets == 1
        assert allocs[0] == len(want) and allocs == [allocs[0]] * 4, allocs  # allocated once, reused
    assert sorted(os.listdir(tmp_path / "local")) == ["index.json", "step-00000004", "step-00000005"]
    m2, o2 = _model(seed=1)
    _train(m2, o2, 99)
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=2) as mgr:
        assert mgr.restore_latest(m2, o2) == 5
        assert mgr.last_tier == "fast" and mgr.last_extra == {"step": 5}
    _same(_state(m2, o2), want)  # the snapshot, not the weights changed after save returned
    assert not torch.equal(m2[0].weight, m[0].weight)
    for s in (2, 4):  # the persisted steps: ordinary checkpoints
        ck = ckptstore.open(tmp_path / "pers" / f"step-{s:08d}")
        assert ck.verify()["tensors"] > 0


def test_persistent_retention_and_fallback_with_warning(tmp_path):
    m, o = _model()
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1, keep_last=1, persist_keep_last=2) as mgr:
        for s in range(1, 5):
            _train(m, o, s)
            mgr.save(s, m, o)
            if s == 3:
                want3 = _state(m, o)
        mgr.wait()
        mgr.gc()
    assert sorted(n for n in os.listdir(tmp_path / "pers") if n.startswith("step-")) == ["step-00000003", "step-00000004"]
    # Damage the only fast copy of step 4 and drop the persisted step 4: step 3 from the
    # persistent tier, with a warning naming what was missing.
    d = tmp_path / "local" / "step-00000004" / "src-0"
    shard = next(p for p in d.iterdir() if p.name.startswith("shard-"))
    b = bytearray(shard.read_bytes())
    b[-1] ^= 1
    shard.write_bytes(bytes(b))
    ckptstore.atomic.remove_dir(tmp_path / "pers" / "step-00000004")
    m2, o2 = _model(seed=1)
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mgr.restore_latest(m2, o2) == 3
        assert mgr.last_tier == "persistent"
    msgs = [str(w.message) for w in caught if "restored step" in str(w.message)]
    assert len(msgs) == 1 and "step 4" in msgs[0] and "damaged" in msgs[0], msgs
    _same(_state(m2, o2), want3)


def test_failed_persist_is_raised_by_wait_and_the_fast_step_stands(tmp_path):
    (tmp_path / "pers").write_text("a file where the persistent directory should be")
    m, o = _model()
    with pytest.raises(ckptstore.CheckpointError):  # the persistent root itself is refused
        CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1)
    os.unlink(tmp_path / "pers")
    mgr = CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1)
    (tmp_path / "pers" / "step-00000001").write_text("in the way")  # step 1's location
    _train(m, o, 1)
    mgr.save(1, m, o)
    with pytest.raises(ckptstore.CheckpointError, match="persisting step 1"):
        mgr.wait()
    mgr.close()
    m2, o2 = _model(seed=1)
    with CheckpointManager(tmp_path / "local", None) as mgr:
        assert mgr.restore_latest(m2, o2) == 1 and mgr.last_tier == "fast"
    _same(_state(m2, o2), _state(m, o))


def test_leftovers_of_an_interrupted_save_are_removed(tmp_path):
    m, o = _model()
    with CheckpointManager(tmp_path / "local") as mgr:
        _train(m, o, 1)
        mgr.save(1, m, o)
    half = tmp_path / "local" / "step-00000002" / "src-0"  # a save that never reached the index
    half.mkdir(parents=True)
    (half / "part-x-r0.json").write_text("{}")
    (tmp_path / "local" / ".restore-1").mkdir()
    (tmp_path / "local" / "step-00000001" / ".src-0.tmp-1234").mkdir()
    with CheckpointManager(tmp_path / "local") as mgr:
        assert sorted(os.listdir(tmp_path / "local")) == ["index.json", "step-00000001"]
        assert sorted(os.listdir(tmp_path / "local" / "step-00000001")) == ["commit.json", "src-0"]
        assert mgr.restore_latest(*_model(seed=2)) == 1


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    for kw in ({"replicas": -1}, {"keep_last": 0}, {"persist_every": -2}, {"persist_keep_last": 0}, {"timeout": 0},
               {"timeout": True}):
        with pytest.raises(ckptstore.InvalidArgumentError):
            CheckpointManager(tmp_path / "local", tmp_path / "p", **kw)
    with pytest.raises(ckptstore.InvalidArgumentError):
        CheckpointManager("s3://bucket/local")
    assert not (tmp_path / "local").exists() and not (tmp_path / "p").exists()
    with CheckpointManager(tmp_path / "local") as mgr:
        m, o = _model()
        with pytest.raises(ckptstore.InvalidArgumentError):
            mgr.save(-1, m, o)
    with pytest.raises(ckptstore.InvalidArgumentError):
        mgr.save(1, m, o)  # closed


def test_persist_forced_or_skipped_per_save(tmp_path):
    m, o = _model()
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=2) as mgr:
        for s, persist in ((1, True), (2, False), (3, None), (4, None)):
            _train(m, o, s)
            mgr.save(s, m, o, persist=persist)
        with pytest.raises(ckptstore.InvalidArgumentError):
            mgr.save(5, m, o, persist="yes")
        mgr.wait()
    assert sorted(n for n in os.listdir(tmp_path / "pers") if n.startswith("step-")) == [
        "step-00000001", "step-00000004"]


def test_restore_into_another_optimizer_class_only_when_allowed(tmp_path):
    m, o = _model()
    _train(m, o, 1)
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(1, m, o)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    m2, _ = _model(seed=1)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    sgd = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(tmp_path / "local") as mgr:
        with pytest.raises(ckptstore.CheckpointError, match="optimizer"):
            mgr.restore_latest(m2, sgd)
        for k, v in m2.state_dict().items():  # nothing changed
            assert torch.equal(v, before[k]), k
        assert mgr.restore_latest(m2, sgd, allow_optimizer_change=True) == 1
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert sgd.param_groups[0]["momentum"] == 0.9  # the live group's own setting kept


def test_a_fast_tier_restore_plans_its_load_once(tmp_path, monkeypatch):
    """The restore plans the load to learn which bytes to fetch, then loads with that plan:
    DCP's planner runs once per restore (twice before, ~0.7 s each at 1 GiB per host), and
    the state comes back bit-identical. A persistent-tier restore is one load: once too."""
    import shutil

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    m, o = _model()
    _train(m, o, 1)
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1) as mgr:
        mgr.save(1, m, o, extra={"step": 1})
    want = _state(m, o)
    plans = []
    create = DefaultLoadPlanner.create_local_plan
    monkeypatch.setattr(DefaultLoadPlanner, "create_local_plan", lambda self: plans.append(1) or create(self))
    for tier in ("fast", "persistent"):
        if tier == "persistent":  # the fast tier's step gone: the persisted one is left
            shutil.rmtree(tmp_path / "local" / "step-00000001")
        plans.clear()
        m2, o2 = _model(seed=1)
        _train(m2, o2, 99)
        with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=1) as mgr:
            assert mgr.restore_latest(m2, o2) == 1 and mgr.last_tier == tier
        assert len(plans) == 1, (tier, len(plans))
        _same(_state(m2, o2), want)


def test_the_managers_vocabulary_steps_latest_gc_and_the_old_names(tmp_path):
    """The tiered manager speaks as the other managers do: ``keep_last``, ``steps()``,
    ``latest()``, ``gc()`` reporting what it removed, steps in ``step-<8 digits>``; ``keep``
    and ``persist_keep`` still work, with a DeprecationWarning."""
    m, o = _model()
    with CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_every=2, keep_last=2,
                           persist_keep_last=1) as mgr:
        assert mgr.steps() == [] and mgr.latest() is None
        for s in range(1, 5):
            _train(m, o, s)
            mgr.save(s, m, o)
        mgr.wait()
        # local: 3, 4 (retention at each save); persistent: 2 and 4 were persisted.
        assert mgr.steps() == [2, 3, 4] and mgr.latest() == 4
        report = mgr.gc()
        assert report["deleted"] == [] and report["interrupted_removed"] == 0
        assert report["persistent"]["deleted"] == [2], report
        assert mgr.steps() == [3, 4]
        assert mgr.keep_last == 2 and mgr.keep == 2
    assert sorted(os.listdir(tmp_path / "local")) == ["index.json", "step-00000003", "step-00000004"]
    with pytest.warns(DeprecationWarning, match="keep= is now keep_last="):
        with CheckpointManager(tmp_path / "local", tmp_path / "pers", keep=1) as mgr:
            assert mgr.keep_last == 1
    with pytest.warns(DeprecationWarning, match="persist_keep= is now persist_keep_last="):
        CheckpointManager(tmp_path / "local", tmp_path / "pers", persist_keep=3).close()


def test_a_step_directory_of_an_earlier_version_is_still_restored(tmp_path):
    """Earlier versions named the local tier's steps ``step-<n>`` (unpadded): such a step
    restores, bit-identical, and gc keeps or removes it like any other."""
    m, o = _model()
    with CheckpointManager(tmp_path / "local") as mgr:
        _train(m, o, 1)
        mgr.save(1, m, o)
        mgr.wait()
        want = _state(m, o)
    os.rename(tmp_path / "local" / "step-00000001", tmp_path / "local" / "step-1")
    m2, o2 = _model(seed=1)
    with CheckpointManager(tmp_path / "local") as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore_latest(m2, o2) == 1
        _same(_state(m2, o2), want)
        _train(m2, o2, 2)
        mgr.save(2, m2, o2)
        mgr.save(3, m2, o2)
        mgr.wait()
        mgr.gc()
    assert sorted(os.listdir(tmp_path / "local")) == ["index.json", "step-00000002", "step-00000003"]
