"""The tiered manager's fault mix: a training job on hosts made of network namespaces
(3 hosts, 1 rank each, FSDP2 on CPU with Adam, gloo), killed at seeded random moments and
restarted until it has trained every step; then the final state must be bit-identical to an
uninterrupted run's, every restore on the way must have returned a state bit-identical to
the uninterrupted run's at that step (no mixed step), and after ``gc`` every tier must hold
only what its retention keeps (the persistent tier: committed steps only).

A fault is one of:

- ``kill POINT:STEP@RANK``: that rank SIGKILLs itself at a point of the save or restore
  path (``CKPTSTORE_FAULT=tiers.<point>``, :mod:`ckptstore._faults`: ``snapshot``,
  ``local-write``, ``replicate``, ``record``, ``persist-upload``, ``persist-commit``,
  ``restore``); the peers then fail at their next exchange with it;
- ``lose HOST after SECONDS``: the host's link goes down and its processes are killed (no
  FIN reaches the peers: they fail after the manager's timeout), its local disk wiped or
  kept, then a fresh host takes its place.

Run the long mix as a script (it prints each round's seed and faults, so that a failure is
replayed with ``--seed``)::

    sudo .venv/bin/python tests/python/tiers_faults.py --rounds 20            # seeds 1..20
    sudo .venv/bin/python tests/python/tiers_faults.py --seed 7 --rounds 1    # replay one

tests/python/test_tiers.py runs one fixed round of it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import netns_cluster as nc  # noqa: E402

STEPS = 6  # steps trained per round
PERSIST_EVERY = 2
KEEP = 2
TIMEOUT_S = 8  # the manager's timeout: how long survivors wait for a lost host
JOB_S = 300  # a failure bound for one job on a loaded machine
POINTS = ("snapshot", "local-write", "replicate", "record", "persist-upload", "persist-commit", "restore")


def draw_faults(rng: random.Random, hosts: int, n: int) -> list:
    """``n`` faults; a ``restore`` kill only from the second attempt on (the first has
    nothing to restore)."""
    out = []
    for i in range(n):
        if rng.random() < 0.75:
            point = rng.choice(POINTS if i else POINTS[:-1])
            step = rng.randint(1, STEPS) if point != "restore" else 0
            if point.startswith("persist"):
                step = rng.choice([s for s in range(1, STEPS + 1) if s % PERSIST_EVERY == 0])
            rank = 0 if point == "persist-commit" else rng.randrange(hosts)
            out.append(("kill", f"{point}:{step}@{rank}" if step else f"{point}@{rank}"))
        else:
            out.append(("lose", rng.randrange(hosts), round(rng.uniform(2.0, 12.0), 1), rng.random() < 0.5))
    return out


def _job(c, name: str, env=None):
    return c.start([sys.executable, str(HERE), "job", name, str(c.shared)], env=env)


def _outputs(j) -> list:
    return [nc.job_result(j.output(r)) for r in range(j.world)]


def reference(c) -> None:
    """The uninterrupted run: expect-<s>.pt for every step, then the tiers emptied."""
    j = _job(c, "reference")
    j.check(timeout=JOB_S)
    wipe(c)


def wipe(c) -> None:
    for i in range(len(c.hosts)):
        for p in c.local_dir(i).iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(c.shared / "persistent", ignore_errors=True)
    for p in c.shared.glob("restored-*"):
        p.unlink()


def run_round(c, seed: int, n_faults: int = 2, log=print, faults=None) -> dict:
    """One round on cluster ``c`` (whose shared dir holds the reference's expect files):
    the faults of ``seed`` (or ``faults``), then restarts until the job finishes. Raises
    AssertionError on a violated guarantee."""
    rng = random.Random(seed)
    faults = list(faults) if faults is not None else draw_faults(rng, len(c.hosts), n_faults)
    n_faults = len(faults)
    log(f"seed {seed}: faults {faults}")
    wipe(c)
    attempts = 0
    wiped: set = set()  # hosts whose local disk a fault wiped
    unindexed: dict = {}  # host -> steps whose record a kill may have kept out of its index
    while True:
        attempts += 1
        if attempts > n_faults + 3:
            raise AssertionError(f"seed {seed}: not done after {attempts - 1} attempts")
        fault = faults.pop(0) if faults else None
        env = {"CKPTSTORE_FAULT": f"tiers.{fault[1]}"} if fault and fault[0] == "kill" else None
        if fault and fault[0] == "kill" and fault[1].startswith("record:"):  # 1 rank per host
            at, _, rank = fault[1].split(":", 1)[1].partition("@")
            unindexed.setdefault(int(rank), set()).add(int(at))
        j = _job(c, "train", env)
        if fault and fault[0] == "lose":
            _, host, after, wipe_local = fault
            deadline = time.monotonic() + after
            while time.monotonic() < deadline and all(code is None for code in j.poll()):
                time.sleep(0.1)
            if all(code is None for code in j.poll()):
                c.lose_host(host, wipe_local=wipe_local)
                if wipe_local:
                    wiped.add(host)
            j.wait(timeout=JOB_S, ranks=[r for r in range(j.world) if r != host])
            if c.hosts[host].lost:
                c.replace_host(host)
        else:
            j.wait(timeout=JOB_S)
        codes = j.poll()
        outs = [o for o in _outputs(j) if o]
        for o in outs:  # every restore that returned, in every attempt
            assert o.get("restore_ok", True), f"seed {seed}: attempt {attempts}: {o}"
        log(f"  attempt {attempts}: fault {fault}: exit codes {codes}; restored "
            f"{sorted({o.get('restored') for o in outs}, key=str)}")
        if codes == [0] * j.world and len(outs) == j.world and all(o.get("done") for o in outs):
            break
        assert fault is not None, f"seed {seed}: attempt {attempts} failed without a fault:\n{j.tails()}"
    for o in outs:
        assert o["final_ok"], f"seed {seed}: final state differs: {o}"
    check_tiers(c, seed, wiped, unindexed)
    return {"seed": seed, "attempts": attempts}


def check_tiers(c, seed: int, wiped: set, unindexed: dict) -> None:
    """After the job's gc: each local tier holds index.json and KEEP steps (or nothing: a
    replacement host that joined after the last save; a restore does not copy the step onto
    it; or, on a host whose disk was wiped, the steps saved since it joined), the last step
    among them on some host; the persistent tier holds committed steps only. ``unindexed``:
    per host, the steps a kill at ``record`` may have kept out of its index (the step then
    restored from the other hosts and the next ones saved: a gap there)."""
    newest: list = []
    for i in range(len(c.hosts)):
        d = c.local_dir(i)
        if not (d / "index.json").exists():  # a fresh host that joined after the last save
            assert list(d.iterdir()) == [], (seed, i, list(d.iterdir()))
            continue
        idx = json.loads((d / "index.json").read_text())
        steps = sorted(int(s) for s in idx["steps"])
        # KEEP consecutive steps (fewer on a wiped host that joined later), the newest of
        # them STEPS, or STEPS - 1 where a kill came between writing a step's record and
        # indexing it there and a restore then took that step from the other hosts; such a
        # step may also be missing between two held ones.
        gaps = {g for g in unindexed.get(i, ()) if steps and steps[0] < g < steps[-1]}
        full = sorted(set(steps) | gaps)
        assert steps and full == list(range(steps[0], steps[-1] + 1)) and steps[-1] in (STEPS, STEPS - 1), (seed, i, steps)
        assert len(steps) == KEEP or (i in wiped and len(steps) < KEEP), (seed, i, steps)
        newest.append(steps[-1])
        assert sorted(p.name for p in d.iterdir()) == ["index.json"] + [f"step-{s:08d}" for s in steps], (seed, i)
        for s in steps:
            for p in (d / f"step-{s:08d}").iterdir():
                assert p.name == "commit.json" or p.name.startswith("src-"), (seed, i, p)
    assert STEPS in newest, (seed, newest)
    # Persisted: the last step (the finishing job's wait() saw its persist through) and the
    # multiples of PERSIST_EVERY whose persist no fault interrupted (a step restored from the
    # fast tier is not persisted again), each committed, nothing else.
    pers = c.shared / "persistent"
    names = sorted(p.name for p in pers.iterdir() if p.name != ".ckpt-manager-lock")
    due = {f"step-{s:08d}" for s in range(PERSIST_EVERY, STEPS + 1, PERSIST_EVERY)}
    assert f"step-{STEPS:08d}" in names and set(names) <= due, (seed, names)
    for n in names:
        assert (pers / n / "ckpt-manifest.json").is_file(), (seed, n)
        left = [p.name for p in (pers / n).iterdir() if p.name.startswith(".ckpt-tmp")]
        assert not left, (seed, n, left)


# ---- the job (run in the hosts) -------------------------------------------------------------


def _same(got: dict, want: dict) -> list:
    import torch

    differ = sorted(set(got) ^ set(want))
    return differ + sorted(
        k for k in set(got) & set(want)
        if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
        or not torch.equal(nc._bits(got[k]), nc._bits(want[k]))
    )


def _job_main(name: str, shared: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ckptstore.torch.distributed import CheckpointManager

    import faulthandler

    faulthandler.dump_traceback_later(120)  # a rank stuck 2 minutes says where (a diagnostic)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    d = Path(shared)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    m, o = nc._fsdp_model(world, seed=0)
    mgr = CheckpointManager(os.environ["CLUSTER_LOCAL"], d / "persistent", persist_every=PERSIST_EVERY,
                            replicas=1, keep_last=KEEP, timeout=TIMEOUT_S)
    out: dict = {"rank": rank}
    start = 0
    if name == "train":
        restored = mgr.restore_latest(m, o)
        out["restored"] = restored
        if restored:
            got = nc._fsdp_gather(m, o)
            differ = _same(got, torch.load(d / f"expect-{restored}.pt"))
            out["restore_ok"] = not differ
            out["differ"] = differ[:5]
            nc._result(out)  # reported now: a later fault must not hide a mixed restore
            start = restored
    for s in range(start + 1, STEPS + 1):
        nc._fsdp_train(m, o, s, 1, rank)
        mgr.save(s, m, o, extra={"step": s})
        if name == "reference":
            full = nc._fsdp_gather(m, o)
            if rank == 0:
                torch.save(full, d / f"expect-{s}.pt.tmp")
                os.replace(d / f"expect-{s}.pt.tmp", d / f"expect-{s}.pt")
    mgr.wait()
    mgr.gc()
    final = nc._fsdp_gather(m, o)
    if name == "train":
        out["final_ok"] = not _same(final, torch.load(d / f"expect-{STEPS}.pt"))
    mgr.close()
    out["done"] = True
    nc._result(out)
    nc.exit_together(rank, world)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--faults", type=int, default=2, help="faults per round (default 2)")
    a = ap.parse_args()
    why = nc.skip_reason()
    if why:
        sys.exit(f"cannot make hosts from network namespaces here: {why}")
    with nc.Cluster(3) as c:
        reference(c)
        for seed in range(a.seed, a.seed + a.rounds):
            t0 = time.monotonic()
            r = run_round(c, seed, a.faults)
            print(f"seed {seed}: ok after {r['attempts']} attempts ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"all {a.rounds} rounds passed (seeds {a.seed}..{a.seed + a.rounds - 1})")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "job":
        try:
            _job_main(sys.argv[2], sys.argv[3])
        except BaseException:  # a failed rank ends now, as a launcher ends a failed worker:
            import traceback  # interpreter exit with a broken gloo group can block for good

            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    else:
        main()
