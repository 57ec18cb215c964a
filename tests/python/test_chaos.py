"""Chaos resume: a real PyTorch training run (Adam, StepLR, dropout on the global RNG whose
state travels in ``extra``) SIGKILLed again and again and restarted from its newest committed
checkpoint until it reaches its last step, on a local ``ckptstore.torch.CheckpointManager``
(non-blocking saves, ``keep_last=2``), on ``s3://`` (s3s-fs on loopback) and as a 2-rank
FSDP2 job through ``ckptstore.torch.distributed``. The driver is chaos_harness.py, the
training run chaos_train.py (which documents the kill points); scripts/chaos.sh runs the
long version.

Kills are at named points through test seams (the package's ``CKPTSTORE_FAULT``, the
Rust writer's pause seam, an ``unlink`` interposer for the retention sweep), each drawn from
a printed seed (``CKPT_CHAOS_SEED`` changes the suite's base seed), with random timer kills
on top that assert only the invariants: every restored state and every trained step is the
uninterrupted baseline's, bit for bit; every committed step loads CRC-checked and holds its
step's state; the final state is bitwise the baseline's; after ``gc`` nothing but the kept
steps is left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402
import chaos_harness as ch  # noqa: E402
import chaos_train as tr  # noqa: E402

SEED = int(os.environ.get("CKPT_CHAOS_SEED", "1"))


@pytest.fixture(scope="module")
def chaos():
    work = Path(tempfile.mkdtemp(prefix="ckpt-chaos-"))
    proc, data, env = ch.start_s3s(work)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.setdefault("CKPT_BIN", str(Path(__file__).resolve().parents[2] / "target/release/ckpt"))
    c = ch.Chaos(work, env)
    c.s3data = data  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.close()
        proc.kill()
        proc.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)


def _run(chaos, spec: ch.RunSpec) -> ch.Stats:
    st = chaos.run(spec)
    print(f"\nseed {spec.seed} mode {spec.mode}: {st.line()}")
    return st


# ---- the checks themselves can fail ---------------------------------------------------------


def test_checks_catch_a_wrong_state_a_flipped_bit_and_leftovers(chaos, tmp_path):
    spec = ch.RunSpec("local", SEED, 0, steps=9)
    chaos.prepare(spec)
    base = chaos.bases[(False, 9)]
    with torch.random.fork_rng():
        model = tr.make_model()
        opt, sched = tr.make_optim(model)
        for _ in range(3):
            tr.train_step(model, opt, sched)
        ct.save(tmp_path / "s3", model, opt, extra=tr.extra_of(sched))
        final = tr.final_state(model, opt)
    ch.check_step_state(str(tmp_path / "s3"), 3, base)
    with pytest.raises(ch.ChaosFailure, match="committed step 6 .* does not hold the baseline's state"):
        ch.check_step_state(str(tmp_path / "s3"), 6, base)
    flipped = {k: v.clone() for k, v in final.items()}
    flipped["model/0.weight"].view(torch.int32)[0, 0] ^= 1
    assert ch.bitwise_equal(final, flipped) == ["model/0.weight"]
    assert ch.bitwise_equal(final, {k: v.clone() for k, v in final.items()}) == []

    root = tmp_path / "root"
    mgr = ckptstore.CheckpointManager(root, keep_last=2)
    mgr.save(3, {"w": torch.zeros(4).numpy()})
    assert ch.root_leftovers(root, [3]) == []
    (root / ".tmp-step-6-00ff").mkdir()
    (root / "step-00000003" / ".ckpt-tmp-0123456789abcdef0123456789abcdef-manifest").write_bytes(b"")
    assert ch.root_leftovers(root, [3]) == [
        str(root / ".tmp-step-6-00ff"),
        str(root / "step-00000003" / ".ckpt-tmp-0123456789abcdef0123456789abcdef-manifest"),
    ]
    assert ch.root_leftovers(root, [3, 6])[-1] == f"{root / 'step-00000006'} (missing)"


def test_the_fault_seam_is_inert_unset_and_refuses_a_malformed_spec(monkeypatch, tmp_path):
    """The package's one fault seam (ckptstore._faults): a manager reads it when made;
    unset it asks for nothing; a spec that does not parse or names no point is refused
    naming the variable (a fault that could never fire would make a test that cannot fail)."""
    from ckptstore import _faults as f

    monkeypatch.delenv("CKPTSTORE_FAULT", raising=False)
    ct.CheckpointManager(tmp_path / "a")
    assert f._fault is None and not f.armed("manager.snapshot")
    for bad in ("snapshot", "manager.snapshot#0", "manager.snapshot:x", "manager.write#-1", "tiers.typo",
                "manager.restore@", "deepspeed.save:1:2"):
        monkeypatch.setenv("CKPTSTORE_FAULT", bad)
        with pytest.raises(ckptstore.InvalidArgumentError, match="CKPTSTORE_FAULT"):
            ct.CheckpointManager(tmp_path / "b")
    monkeypatch.setenv("CKPTSTORE_FAULT", "manager.restore#1000")
    ct.CheckpointManager(tmp_path / "c")
    assert f._fault == f.Fault("manager.restore", None, None, 1000) and f.armed("manager.restore")
    assert f.parse("tiers.record:4@1") == f.Fault("tiers.record", 4, 1, 1)
    # Points that do not match (another point, step or rank) are passed without a count.
    monkeypatch.setenv("CKPTSTORE_FAULT", "tiers.record:4@1#2")
    f.arm()
    for point, step, rank in (("tiers.replicate", 4, 1), ("tiers.record", 3, 1), ("tiers.record", 4, 0)):
        f.fault_point(point, step, rank)
    assert f._hits == 0
    monkeypatch.delenv("CKPTSTORE_FAULT")
    ct.CheckpointManager(tmp_path / "d")  # each manager re-reads the variable
    assert f._fault is None


def test_every_fault_point_in_the_source_exists():
    """Each ``fault_point("...")`` / ``armed("...")`` call names a point of POINTS (a typo
    would never fire), and each point is reached from somewhere."""
    import re
    from pathlib import Path

    from ckptstore import _faults as f

    pkg = Path(f.__file__).parent
    used = set()
    for p in pkg.rglob("*.py"):
        used |= set(re.findall(r'(?:fault_point|armed)\(\s*"([^"]+)"', p.read_text()))
        used |= {f"tiers.{m}" for m in re.findall(r'fault_point\(f?"tiers\.([a-z-]+)"', p.read_text())}
    assert used == set(f.POINTS), (used ^ set(f.POINTS))
    envs = set()
    for p in pkg.rglob("*.py"):
        envs |= set(re.findall(r'"(CKPTSTORE_[A-Z_]*(?:KILL|FAULT)[A-Z_]*)"', p.read_text()))
    assert envs == {"CKPTSTORE_FAULT"}, envs


# ---- every named point, with its known outcome ------------------------------------------------


def _tmp_steps(root: Path) -> list:
    return sorted(n for n in os.listdir(root) if n.startswith(".tmp-step-"))


# point -> (kill schedule, committed steps after the last kill, what the kill leaves: a
# ".tmp-step-6-" directory without / with its own manifest, or nothing in flight)
LOCAL_CASES = {
    "snapshot": ([{"point": "snapshot", "n": ch.TENSORS_PER_SAVE + 3}], [3], None),
    "write": ([{"point": "write", "n": 2}], [3], None),
    "before-shards": ([{"point": "before-shards", "n": 2}], [3], "no manifest"),
    "before-manifest-rename": ([{"point": "before-manifest-rename", "n": 2}], [3], "no manifest"),
    "after-manifest-rename": ([{"point": "after-manifest-rename", "n": 2}], [3], "manifest"),
    "before-cleanup": ([{"point": "before-cleanup", "n": 2}], [3], "manifest"),
    "retention": ([{"point": "retention", "n": 1}], [6, 9], "step 3 half-deleted"),
    "restore": ([{"point": "write", "n": 2}, {"point": "restore", "n": 1}], [3], None),
}


@pytest.mark.parametrize("point", sorted(LOCAL_CASES))
def test_local_kill_at_each_named_point_then_resume(chaos, point):
    """A fresh 9-step run (saves at 3, 6, 9; keep_last=2) killed at ``point``: the kill
    happens exactly there (the pause seam's announcement; the steps committed and the
    directories in flight that point implies), and the resumed run ends bit-identical to
    the baseline with nothing left after gc."""
    schedule, committed, inflight = LOCAL_CASES[point]
    seen = []

    def on_kill(life, kill, root, life_dir):
        seen.append(kill["point"])
        if kill["point"] in tr.PAUSE_POINTS:
            assert (life_dir / "pause" / kill["point"]).is_file(), "the kill was not at the pause point"
        if life < len(schedule):
            return
        steps = ckptstore.CheckpointManager(root).steps()
        assert steps == committed, f"{point}: committed {steps}, expected {committed}"
        tmp = _tmp_steps(root)
        if inflight in ("manifest", "no manifest"):
            assert len(tmp) == 1 and tmp[0].startswith(".tmp-step-6-"), tmp
            has = (root / tmp[0] / "ckpt-manifest.json").is_file()
            assert has == (inflight == "manifest"), f"{point}: manifest in {tmp[0]}: {has}"
        else:
            assert tmp == [], f"{point}: {tmp}"
        if inflight == "step 3 half-deleted":
            d = root / "step-00000003"
            assert d.is_dir() and not (d / "ckpt-manifest.json").exists()

    spec = ch.RunSpec("local", SEED, len(schedule), steps=9, schedule=schedule, on_kill=on_kill)
    st = _run(chaos, spec)
    assert seen == [k["point"] for k in schedule]
    assert st.kills == len(schedule) and st.lives == len(schedule) + 1 and st.leftovers == 0


# ---- seeded chaos -----------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1])
def test_local_chaos_named_points_reproducible(chaos, offset):
    """Named-point kills only (timer=0): the whole run is a function of its seed."""
    st = _run(chaos, ch.RunSpec("local", SEED + offset, 12, timer=0.0))
    assert st.kills >= 1 and st.leftovers == 0 and st.timer_kills == 0


def test_local_chaos_with_timer_kills(chaos):
    """Timer kills on top of named ones: every invariant holds whenever the kills land. How
    many lives a timer kills depends on the machine's speed (a life that finishes before its
    timer ends the run), so only the invariants are asserted here; the named-point tests
    above make sure kills happen."""
    st = _run(chaos, ch.RunSpec("local", SEED + 2, 12, timer=0.6))
    assert st.leftovers == 0 and st.lives == st.kills + 1


def test_s3_chaos(chaos):
    spec = ch._spec("s3", SEED, 12, 0.5, chaos.s3data)
    st = _run(chaos, spec)
    assert st.kills >= 1 and st.leftovers == 0


def test_dist_chaos_random_rank_killed(chaos):
    st = _run(chaos, ch.RunSpec("dist", SEED, 8, timer=0.3))
    assert st.kills >= 1 and st.leftovers == 0


def test_dist_commit_killed_after_its_commit_point_leaves_nothing_after_gc(chaos):
    """The last save's multi-rank commit is killed just after its manifest rename (the
    commit point): the step is committed, and gc leaves only what its manifest names (the
    manager's gc sweeps kept steps of their ranks' part descriptors and of the files of
    earlier dead attempts at that step; before, they stayed for as long as the step was
    kept)."""
    kill = {"point": "after-manifest-rename", "n": 2, "rank": 0}
    spec = ch.RunSpec("dist", SEED, 1, steps=6, schedule=[kill])
    st = _run(chaos, spec)
    assert st.kills == 1
    assert st.leftovers == 0, f"{st.leftovers} files left after gc in the committed step"
