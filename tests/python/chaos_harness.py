"""The driver of the chaos-resume runs (test_chaos.py runs a small budget, scripts/chaos.sh
the long version): a training run (chaos_train.py) is SIGKILLed again and again, at seeded
named points and at random moments, and restarted from its newest committed checkpoint until
it reaches its last step. Checked after every life:

* the life's first state (restored, or fresh) and its state after every step it trained are
  bit-identical to the uninterrupted baseline's at that step (SHA-256 of every parameter,
  optimizer state tensor, hyperparameter, the scheduler and the RNG state): a restore can
  never yield a mixed state, and a resumed run never drifts;
* every committed checkpoint (local and s3 modes) loads with every CRC checked, into a fresh
  model, and holds exactly the baseline's state of its step;
* a life either completes or dies of SIGKILL: any other end (an exception, a hang past
  ``LIFE_TIMEOUT_S``) is a failure;

and at the end: the final parameters and optimizer state are bitwise equal to the
baseline's, and after ``gc`` the tree holds exactly the kept steps, each with its manifest,
its lock file and the shards its manifest names: no temporary file or directory.

Every life draws its kill from ``random.Random(f"{seed}:{life}")``; a run of named-point
kills only (``timer=0``) is fully reproduced by its seed. Failures raise ``ChaosFailure``
naming the mode, seed, life and kill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
LIFE_TIMEOUT_S = 120.0
#: Tensors one save copies into its snapshot (4 model + 4 x 3 Adam states + the RNG state).
TENSORS_PER_SAVE = 17
LOCAL_POINTS = (
    "snapshot",
    "write",
    "restore",
    "before-shards",
    "before-manifest-rename",
    "after-manifest-rename",
    "before-cleanup",
    "retention",
)
#: The s3 mode's: the local ones but ``retention`` (the s3s-fs server removes the objects, in
#: a process the unlink interposer is not in).
S3_POINTS = tuple(p for p in LOCAL_POINTS if p != "retention")
DIST_POINTS = (
    "before-part",
    "retention",
    "before-manifest-rename",
    "after-manifest-rename",
    "before-cleanup",
    "restore",
)
#: Points only the coordinator (rank 0) reaches.
COORDINATOR_POINTS = ("before-manifest-rename", "after-manifest-rename", "before-cleanup", "retention")

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* chaos_harness.py: CKPT_CHAOS_UNLINK_KILL=N SIGKILLs the process right after its N-th
   successful unlink() of a file inside a "step-" directory (the retention sweep).
   Inert when the variable is unset. */
static int (*real_unlink)(const char *);
static int count;
int unlink(const char *path) {
    if (!real_unlink) real_unlink = (int (*)(const char *))dlsym(RTLD_NEXT, "unlink");
    int r = real_unlink(path);
    const char *spec = getenv("CKPT_CHAOS_UNLINK_KILL");
    if (spec && r == 0 && strstr(path, "/step-")) {
        if (++count >= atoi(spec)) kill(getpid(), SIGKILL);
    }
    return r;
}
"""


class ChaosFailure(AssertionError):
    pass


def build_shim(cache: Path) -> Path:
    """Compile the ``unlink`` interposer (needs a C compiler: ``cc``, as the Rust build)."""
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / "chaos_unlink.so"
    if so.exists():
        return so
    src = cache / "chaos_unlink.c"
    src.write_text(SHIM_C)
    cc = os.environ.get("CC", "cc")
    r = subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(so) + ".tmp", str(src), "-ldl"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise ChaosFailure(f"cannot build the unlink interposer with {cc}: {r.stderr}")
    os.replace(str(so) + ".tmp", so)
    return so


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The fork server (chaos_train.py --serve), with the unlink interposer preloaded."""

    def __init__(self, work: Path, env: Optional[Dict[str, str]] = None) -> None:
        shim = build_shim(work / "shim")
        e = dict(os.environ)
        e.update(env or {})
        e["LD_PRELOAD"] = f"{shim} {e['LD_PRELOAD']}" if e.get("LD_PRELOAD") else str(shim)
        e["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), e.get("PYTHONPATH")) if p)
        e.pop("CKPTSTORE_FAULT", None)
        e.pop("CKPT_CHAOS_UNLINK_KILL", None)
        self._buf = b""
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "chaos_train.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=e,
        )

    def _line(self, timeout: float) -> Optional[dict]:
        """The server's next message, or ``None`` after ``timeout`` seconds. Reads the pipe
        unbuffered: a buffered reader could swallow a second line that select then never
        reports."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + max(timeout, 0)
        while b"\n" not in self._buf:
            r, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ChaosFailure(f"the fork server died (exit {self.proc.wait()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def life(self, cfg: dict, timer: Optional[Tuple[float, int]] = None) -> Tuple[List[int], bool]:
        """Run one life; ``timer=(seconds, index)``: SIGKILL process ``index`` of the life
        (its rank) that many seconds after start if it is still running. Returns the wait
        statuses and whether the timer fired."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        started = self._line(60)
        if started is None:
            raise ChaosFailure("the fork server did not start a life within 60 s")
        pids = started["pids"]
        t0 = time.monotonic()
        fired = False
        while True:
            now = time.monotonic() - t0
            wait = LIFE_TIMEOUT_S - now
            if timer is not None and not fired:
                wait = min(wait, timer[0] - now)
            msg = self._line(wait)
            if msg is not None:
                return msg["status"], fired
            now = time.monotonic() - t0
            if timer is not None and not fired and now >= timer[0]:
                fired = True
                _killpg(pids[timer[1]])
                continue
            for p in pids:
                _killpg(p)
            self._line(30)
            raise ChaosFailure(f"a life hung past {LIFE_TIMEOUT_S:.0f} s (killed)")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def killed(st: int) -> bool:
    return os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL


def completed(st: int) -> bool:
    return os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0


def read_log(path: Path) -> List[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


# ---- the baseline -------------------------------------------------------------------------


@dataclass
class Baseline:
    digests: Dict[int, List[str]]  # step -> digest per rank
    finals: List[Dict[str, Any]]  # per rank


def baseline(server: Server, work: Path, steps: int, world: Optional[int]) -> Baseline:
    import torch

    d = work / (f"ref-{steps}" if world is None else f"ref-dist{world}-{steps}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg: Dict[str, Any] = {
        "mode": "ref" if world is None else "dist-ref",
        "steps": steps,
        "log": str(d / "log-{rank}.jsonl"),
        "final": str(d / "final-{rank}.pt"),
        "out": str(d / "out.txt"),
    }
    if world is not None:
        cfg.update(world=world, port=free_port())
    st, _ = server.life(cfg)
    if not all(completed(s) for s in st):
        raise ChaosFailure(f"the baseline run failed: {st}\n{_tail(d / 'out.txt')}")
    ranks = 1 if world is None else world
    digests: Dict[int, List[str]] = {}
    finals = []
    for r in range(ranks):
        suffix = "None" if world is None else str(r)
        for ev in read_log(d / f"log-{suffix}.jsonl"):
            digests.setdefault(ev["step"], [""] * ranks)[r] = ev["digest"]
        finals.append(torch.load(d / f"final-{suffix}.pt"))
    return Baseline(digests, finals)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return "(no output)"


# ---- checks -------------------------------------------------------------------------------


def check_step_state(ck_path: str, step: int, base: Baseline) -> None:
    """The committed checkpoint at ``ck_path`` loads (every CRC checked) into a fresh
    model and holds exactly the baseline's state of ``step``."""
    import torch

    import ckptstore.torch as ct
    import chaos_train as tr

    with torch.random.fork_rng():
        model = tr.make_model()
        opt, sched = tr.make_optim(model)
        extra = ct.load(ck_path, model, opt)
        tr.apply_extra(extra, sched)
        d = tr.state_digest(model, opt, sched)
    if d != base.digests[step][0]:
        raise ChaosFailure(f"committed step {step} ({ck_path}) does not hold the baseline's state")


def bitwise_equal(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Names whose tensors differ in any bit (or dtype, shape, presence)."""
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(k)
        elif not torch.equal(
            x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)
        ):
            bad.append(k)
    return bad


def step_tree_leftovers(step_dir: Path) -> List[str]:
    """Anything in a committed step directory but its manifest, lock file and the shards
    its manifest names."""
    man = step_dir / "ckpt-manifest.json"
    if not man.is_file():
        return [f"{step_dir} (no manifest)"]
    files = {s["file"] for s in json.loads(man.read_text())["shards"]}
    allowed = files | {"ckpt-manifest.json", ".ckpt-lock"}
    out = [str(step_dir / n) for n in sorted(os.listdir(step_dir)) if n not in allowed]
    out += [f"{step_dir / f} (missing)" for f in sorted(files) if not (step_dir / f).is_file()]
    return out


def root_leftovers(root: Path, keep: List[int], lock: bool = True) -> List[str]:
    """Anything under a manager root but the kept steps (each as ``step_tree_leftovers``)
    and the root's lock file."""
    out = []
    names = set(os.listdir(root)) if root.exists() else set()
    want = {f"step-{s:08d}" for s in keep}
    for n in sorted(names):
        if n in want:
            out += step_tree_leftovers(root / n)
        elif not (lock and n == ".ckpt-manager-lock"):
            out.append(str(root / n))
    out += [f"{root / n} (missing)" for n in sorted(want - names)]
    return out


def s3_leftovers(prefix_dir: Path, keep: List[int]) -> List[str]:
    """``root_leftovers`` for the objects under an ``s3://`` manager root, read from the
    s3s-fs server's directory (an object is a file there; directories are not objects, and
    s3s-fs leaves the empty ones of deleted keys behind)."""
    out = []
    want = {f"step-{s:08d}" for s in keep}
    seen = set()
    for dirpath, _dirs, files in os.walk(prefix_dir):
        rel = Path(dirpath).relative_to(prefix_dir)
        for n in files:
            parts = rel.parts
            if len(parts) == 1 and parts[0] in want:
                seen.add(parts[0])
            else:
                out.append(str(Path(dirpath) / n))
    for d in sorted(seen):
        out += step_tree_leftovers(prefix_dir / d)
    out += [f"{prefix_dir / n} (missing)" for n in sorted(want - seen)]
    return out


# ---- one run ------------------------------------------------------------------------------


@dataclass
class Stats:
    lives: int = 0
    kills: int = 0
    point_kills: Dict[str, int] = field(default_factory=dict)
    timer_kills: int = 0
    not_reached: int = 0
    steps_replayed: int = 0
    leftovers: int = 0
    runs: int = 0
    seconds: float = 0.0
    life_max_s: float = 0.0  # the longest life's wall time

    def add(self, o: "Stats") -> None:
        for k in ("lives", "kills", "timer_kills", "not_reached", "steps_replayed", "leftovers", "runs"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.seconds += o.seconds
        for k, v in o.point_kills.items():
            self.point_kills[k] = self.point_kills.get(k, 0) + v

    def line(self) -> str:
        pts = ", ".join(f"{k} {v}" for k, v in sorted(self.point_kills.items()))
        return (
            f"runs {self.runs}, lives {self.lives}, kills survived {self.kills} "
            f"(named points: {pts or 'none'}; timer {self.timer_kills}), named kills not reached "
            f"{self.not_reached}, steps replayed {self.steps_replayed}, leftovers after gc "
            f"{self.leftovers}, {self.seconds:.1f} s"
        )


@dataclass
class RunSpec:
    mode: str  # local | s3 | dist
    seed: int
    kills: int  # the kill budget of this run (lives that are told to die)
    steps: int = 24
    every: int = 3
    keep_last: int = 2
    timer: float = 0.3  # probability that a life is killed by a timer instead of a point
    s3_root: Optional[str] = None  # s3://bucket/prefix (s3 mode)
    s3_dir: Optional[Path] = None  # that prefix's directory on the s3s-fs server (s3 mode)
    #: The kills of the first lives, in order, instead of drawn ones (then none).
    schedule: Optional[List[dict]] = None
    #: Called after each killed life with ``(life, kill, root, life_dir)``.
    on_kill: Optional[Callable[[int, Optional[dict], Path, Path], None]] = None


def save_steps(after: int, spec: RunSpec) -> List[int]:
    return [s for s in range(after + 1, spec.steps + 1) if s % spec.every == 0 or s == spec.steps]


def draw_kill(rnd: random.Random, spec: RunSpec, latest: int, life_s: float) -> Tuple[Optional[dict], Optional[Tuple[float, int]]]:
    """The kill of one life: a named point and count, or a timer ``(seconds, rank)``."""
    remaining = len(save_steps(latest, spec))
    world = 2 if spec.mode == "dist" else 1
    # A timer within the time the rest of the run takes (at least 0.3 of a full life).
    timer_s = life_s * max(0.3, remaining / max(1, len(save_steps(0, spec))))
    if rnd.random() < spec.timer:
        return None, (rnd.uniform(0.0, timer_s), rnd.randrange(world))
    points = list({"local": LOCAL_POINTS, "s3": S3_POINTS}.get(spec.mode, DIST_POINTS))
    if latest == 0:
        points.remove("restore")
    point = rnd.choice(points)
    near = max(1, min(remaining, 3))  # kills in the next few saves: more kills, less replay
    if point == "restore":
        n = 1
    elif point == "snapshot":
        n = rnd.randint(1, near * TENSORS_PER_SAVE)
    elif point == "retention":
        n = rnd.randint(1, 3 * near)
    else:
        n = rnd.randint(1, near)
    kill = {"point": point, "n": n}
    if spec.mode == "dist":
        kill["rank"] = 0 if point in COORDINATOR_POINTS else rnd.randrange(world)
    return kill, None


def latest_committed(spec: RunSpec, root: Path) -> int:
    import ckptstore
    import chaos_train as tr

    if spec.mode == "s3":
        assert spec.s3_root is not None
        return tr.s3_latest(spec.s3_root) or 0
    return ckptstore.CheckpointManager(root).latest() or 0


def check_committed(spec: RunSpec, root: Path, base: Baseline) -> None:
    import ckptstore
    import chaos_train as tr

    if spec.mode == "local":
        for s in ckptstore.CheckpointManager(root).steps():
            check_step_state(str(root / f"step-{s:08d}"), s, base)
    elif spec.mode == "s3":
        assert spec.s3_root is not None
        r = tr._ckpt("ls", spec.s3_root, "--json")
        for e in json.loads(r.stdout)["steps"]:
            if e["committed"]:
                check_step_state(f"{spec.s3_root}/step-{e['step']:08d}", e["step"], base)
    else:
        # The sharded state is checked where the next life restores it (every rank's state
        # against the baseline); here: every committed step verifies and is the step it says.
        for s in ckptstore.CheckpointManager(root).steps():
            ck = ckptstore.open(root / f"step-{s:08d}")
            ck.verify()
            got = ck.metadata["ckptstore.torch.distributed"]["extra"]["step"]
            if got != s:
                raise ChaosFailure(f"committed step {s} holds the state of step {got}")


def final_gc_and_leftovers(spec: RunSpec, root: Path) -> List[str]:
    import ckptstore
    import chaos_train as tr

    keep = save_steps(0, spec)[-spec.keep_last:]
    if spec.mode in ("local", "dist"):
        mgr = ckptstore.CheckpointManager(root, keep_last=spec.keep_last)
        mgr.gc()
        if mgr.steps() != keep:
            return [f"{root}: committed steps {mgr.steps()} after gc, expected {keep}"]
        return root_leftovers(root, keep)
    if spec.mode == "s3":
        assert spec.s3_root is not None and spec.s3_dir is not None
        tr.s3_gc(spec.s3_root, spec.keep_last)
        return s3_leftovers(spec.s3_dir, keep)
    raise ValueError(spec.mode)


def run(spec: RunSpec, server: Server, work: Path, base: Baseline, life_s: float, verbose: bool = False) -> Stats:
    """One chaos run: lives until the training reaches its last step (the last life, once
    the kill budget is spent, is not told to die). Any failure is a ``ChaosFailure`` naming
    the mode, seed, life and kill (an error of a check, e.g. a ``ckptstore.ChecksumError``
    of a committed step, is wrapped in one)."""
    ctx = {"where": f"mode {spec.mode}, seed {spec.seed}, kills {spec.kills}, timer {spec.timer}"}
    try:
        return _lives(spec, server, work, base, life_s, verbose, ctx)
    except ChaosFailure:
        raise
    except Exception as e:  # noqa: BLE001 - named with the seed
        raise ChaosFailure(f"{ctx['where']}: {type(e).__name__}: {e}") from e


def _lives(
    spec: RunSpec,
    server: Server,
    work: Path,
    base: Baseline,
    life_s: float,
    verbose: bool,
    ctx: Dict[str, str],
) -> Stats:
    import chaos_train as tr

    stats = Stats(runs=1)
    t0 = time.monotonic()
    rd = work / f"{spec.mode}-{spec.seed}"
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir(parents=True)
    root = rd / "root"
    root.mkdir()
    world = 2 if spec.mode == "dist" else None
    budget = spec.kills
    prev_reached: Optional[int] = None
    life = 0
    while True:
        life += 1
        where = f"mode {spec.mode}, seed {spec.seed}, kills {spec.kills}, timer {spec.timer}, life {life}"
        ctx["where"] = where
        if life > spec.kills + 50:
            raise ChaosFailure(f"{where}: no end after {life - 1} lives")
        latest = latest_committed(spec, root)
        rnd = random.Random(f"{spec.seed}:{life}")
        if spec.schedule is not None:
            kill, timer = (spec.schedule[life - 1] if life <= len(spec.schedule) else None), None
        else:
            kill, timer = draw_kill(rnd, spec, latest, life_s) if budget > 0 else (None, None)
        life_dir = rd / f"life-{life}"
        life_dir.mkdir()
        cfg: Dict[str, Any] = {
            "mode": spec.mode,
            "root": spec.s3_root if spec.mode == "s3" else str(root),
            "steps": spec.steps,
            "every": spec.every,
            "keep_last": spec.keep_last,
            "life_dir": str(life_dir),
            "log": str(life_dir / "log-{rank}.jsonl"),
            "final": str(life_dir / "final-{rank}.pt"),
            "out": str(rd / "out.txt"),
            "kill": kill,
        }
        if world is not None:
            cfg.update(world=world, port=free_port(), kill_rank=(kill or {}).get("rank"))
        what = json.dumps(kill) if kill else (f"timer {timer[0]:.3f} s, rank {timer[1]}" if timer else "none")
        where += f", kill {what}"
        ctx["where"] = where
        with open(rd / "out.txt", "a") as f:
            f.write(f"==== {where}\n")
        t_life = time.monotonic()
        status, fired = server.life(cfg, timer)
        stats.life_max_s = max(stats.life_max_s, time.monotonic() - t_life)
        stats.lives += 1
        died = [killed(s) for s in status]
        ok = [completed(s) for s in status]
        # A survivor of a killed rank may fail on the closed connection (and nothing else).
        lost = [any(died) and os.WIFEXITED(s) and os.WEXITSTATUS(s) == tr.PEER_LOST for s in status]
        if not all(d or o or x for d, o, x in zip(died, ok, lost)):
            raise ChaosFailure(f"{where}: a process failed (wait statuses {status}):\n{_tail(rd / 'out.txt')}")
        # The events of this life, on every rank: a bit-exact trajectory from the restore on.
        ranks = [None] if world is None else list(range(world))
        restored = None
        reached = 0
        for i, r in enumerate(ranks):
            evs = read_log(life_dir / f"log-{r}.jsonl")
            for ev in evs:
                ref = base.digests.get(ev["step"])
                if ref is None or ev["digest"] != ref[i]:
                    raise ChaosFailure(
                        f"{where}: rank {r}: {ev['ev']} step {ev['step']} differs from the baseline "
                        f"(a mixed or wrong state)"
                    )
            rs = [ev["step"] for ev in evs if ev["ev"] == "restored"]
            if rs:
                if restored is not None and rs[0] != restored:
                    raise ChaosFailure(f"{where}: ranks restored different steps")
                restored = rs[0]
                if rs[0] != latest:
                    raise ChaosFailure(f"{where}: restored step {rs[0]}, the latest committed was {latest}")
            reached = max([reached] + [ev["step"] for ev in evs])
        # Steps replayed: those the previous life trained past the step this one restored
        # (a life killed before its restore trained nothing: the count waits for the next).
        if restored is not None:
            if prev_reached is not None:
                stats.steps_replayed += max(0, prev_reached - restored)
            prev_reached = reached
        check_committed(spec, root, base)
        if all(ok):
            if kill is not None:
                stats.not_reached += 1
            # The end: the final state is the baseline's, bit for bit, and gc leaves no trace.
            for i, r in enumerate(ranks):
                import torch

                got = torch.load(life_dir / f"final-{r}.pt")
                bad = bitwise_equal(got, base.finals[i])
                if bad:
                    raise ChaosFailure(f"{where}: rank {r}: final state differs from the baseline in {bad}")
            left = final_gc_and_leftovers(spec, root)
            stats.leftovers += len(left)
            if left:
                raise ChaosFailure(f"{where}: left after gc: {left}")
            break
        budget -= 1
        stats.kills += 1
        if fired:
            stats.timer_kills += 1
        else:
            assert kill is not None
            stats.point_kills[kill["point"]] = stats.point_kills.get(kill["point"], 0) + 1
        if spec.on_kill is not None:
            spec.on_kill(life, kill, root, life_dir)
        if verbose:
            print(f"  {where}: killed (restored {restored}, reached {reached})", flush=True)
    stats.seconds = time.monotonic() - t0
    shutil.rmtree(rd, ignore_errors=True)
    return stats


class Chaos:
    """A fork server, the baselines and the measured length of a life, for many runs."""

    def __init__(self, work: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.work = work
        self.server = Server(work, env)
        self.bases: Dict[Tuple[bool, int], Baseline] = {}
        self.life_s: Dict[Tuple[str, int], float] = {}

    def prepare(self, spec: RunSpec) -> None:
        """The baseline of ``spec``'s kind of run, and one uninterrupted life of it, timed
        (the range of its timer kills)."""
        key = (spec.mode == "dist", spec.steps)
        if key not in self.bases:
            self.bases[key] = baseline(self.server, self.work, spec.steps, 2 if key[0] else None)
        if (spec.mode, spec.steps) not in self.life_s:
            probe = RunSpec(**{**spec.__dict__, "kills": 0, "seed": -1, "schedule": None, "on_kill": None})
            if probe.mode == "s3":
                assert probe.s3_root is not None and probe.s3_dir is not None
                probe.s3_root += "-probe"
                probe.s3_dir = probe.s3_dir.with_name(probe.s3_dir.name + "-probe")
            st = run(probe, self.server, self.work, self.bases[key], 1.0)
            self.life_s[(spec.mode, spec.steps)] = st.life_max_s

    def run(self, spec: RunSpec, verbose: bool = False) -> Stats:
        self.prepare(spec)
        base = self.bases[(spec.mode == "dist", spec.steps)]
        return run(spec, self.server, self.work, base, self.life_s[(spec.mode, spec.steps)], verbose)

    def close(self) -> None:
        self.server.close()


# ---- the long version (scripts/chaos.sh) --------------------------------------------------


def start_s3s(work: Path) -> Tuple[subprocess.Popen, Path, Dict[str, str]]:
    """An s3s-fs server on a free loopback port (as tests/python/test_s3.py starts it)."""
    import ckpt_helpers

    data = work / "s3data"
    shutil.rmtree(data, ignore_errors=True)
    (data / "bkt").mkdir(parents=True)
    key, secret = "ckpttestkey", "ckpttestsecret0123456789"
    try:
        proc, port = ckpt_helpers.start_s3s_fs(str(data), key, secret)
    except ckpt_helpers.S3sFsError as e:
        raise ChaosFailure(str(e)) from e
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "CKPT_S3_MAX_RETRIES": "2",
    }
    return proc, data, env


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="chaos-resume runs (see the module docs)")
    ap.add_argument("--kills", type=int, default=1000, help="total kills over all runs")
    ap.add_argument("--per-run", type=int, default=10, help="kills per run")
    ap.add_argument("--modes", default="local,s3,dist")
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: from the clock)")
    ap.add_argument("--only-seed", type=int, default=None, help="replay this one seed (per mode)")
    ap.add_argument("--timer", type=float, default=0.3, help="share of lives killed by a timer")
    ap.add_argument("--minutes", type=float, default=None, help="stop starting runs after this")
    ap.add_argument("--work", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="ckpt-chaos-"))
    modes = [m for m in a.modes.split(",") if m]
    s3proc = None
    env: Dict[str, str] = {}
    s3data: Optional[Path] = None
    if "s3" in modes:
        s3proc, s3data, env = start_s3s(work)
        os.environ.update(env)
    os.environ.setdefault("CKPT_BIN", str(HERE.parent.parent / "target/release/ckpt"))
    chaos = Chaos(work, env)
    total = Stats()
    per_mode = {m: Stats() for m in modes}
    seed = a.seed if a.seed is not None else int(time.time()) % 1_000_000
    t_end = None if a.minutes is None else time.monotonic() + 60 * a.minutes
    failures = 0
    try:
        for m in modes:
            chaos.prepare(_spec(m, 0, 0, a.timer, s3data))
            life = chaos.life_s[(m, RunSpec.steps)]
            print(f"# {m}: an uninterrupted life takes {life:.2f} s (timer kills within it)", flush=True)
        i = 0
        # (runs that end before their kills, e.g. a kill not reached, count no kill: the
        # number of runs is bounded as well)
        while total.kills < a.kills and i < 2 * a.kills + len(modes) and (t_end is None or time.monotonic() < t_end):
            if a.only_seed is not None and i >= len(modes):
                break  # one run of that seed per mode
            m = modes[i % len(modes)]
            s = a.only_seed if a.only_seed is not None else seed + i
            i += 1
            spec = _spec(m, s, min(a.per_run, a.kills - total.kills), a.timer, s3data)
            try:
                st = chaos.run(spec, a.verbose)
            except ChaosFailure as e:
                failures += 1
                print(f"FAIL seed {s} mode {m} kills {spec.kills}: {e}", flush=True)
                continue
            total.add(st)
            per_mode[m].add(st)
            print(f"seed {s} mode {m} kills {spec.kills}: {st.line()}", flush=True)
    finally:
        chaos.close()
        if s3proc is not None:
            s3proc.kill()
            s3proc.wait()
    for m, st in per_mode.items():
        print(f"# {m}: {st.line()}")
    print(f"# total: {total.line()}; failures {failures}")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def _spec(mode: str, seed: int, kills: int, timer: float, s3data: Optional[Path]) -> RunSpec:
    spec = RunSpec(mode=mode, seed=seed, kills=kills, timer=timer)
    if mode == "s3":
        assert s3data is not None
        spec.s3_root = f"s3://bkt/chaos-{seed}"
        spec.s3_dir = s3data / "bkt" / f"chaos-{seed}"
    return spec


if __name__ == "__main__":
    sys.exit(main())
