"""The child side of the chaos-resume tests (test_chaos.py, scripts/chaos.sh): a small real
PyTorch training run (Adam, a StepLR scheduler, dropout drawing on the global RNG, whose
state travels in ``extra``) that checkpoints every few steps, resumes from the newest
committed checkpoint at start, and may be told to SIGKILL itself at a named point.

It runs under a fork server (``python chaos_train.py --serve``): the server imports torch and
ckptstore once, then forks one process per *life* (one per rank for a distributed life) on a
JSON command line from its stdin, answering ``{"pids": [...]}`` at once and ``{"status":
[...]}`` (``os.waitpid`` statuses) when the life is over (a life that raised exits 3; a
rank whose collective failed because a peer died exits ``PEER_LOST``). A life is its own process group
(killing the group also kills a ``ckpt gc`` it started). When one rank of a distributed life
dies, the server kills the others, as ``torchrun`` does. A life's stdout and stderr go to the
file its command names; its events go as JSON lines to its ``log``:
``{"ev": "restored", "step", "digest"}``, ``{"ev": "step", "step", "digest"}`` after every
training step, ``{"ev": "done", "step", "digest"}`` at the end (then the final state is in
``final``, written with ``torch.save``).

Kill points (``kill = {"point": P, "n": N}``):

* ``snapshot``, ``write``, ``restore``: the manager's points of the package's fault seam, ``CKPTSTORE_FAULT=manager.P#N``
  (python/py_src/ckptstore/torch/manager.py): the N-th tensor copied into a snapshot, before the
  N-th background write, inside the lease before the load.
* ``before-shards``, ``before-manifest-rename``, ``after-manifest-rename``, ``before-cleanup``,
  ``before-part``: the Rust writer's pause seam (src/write/pause.rs) during the N-th save of
  this life. The pause directory does not exist until just before that save (the seam then
  says it cannot announce and carries on); the save stops at the point, announces it there,
  and a watcher thread SIGKILLs the process as soon as the announcement appears.
* ``retention``: the N-th file removed from a ``step-`` directory (the retention sweep
  after a save), through the ``unlink`` interposer the harness preloads into the server
  (chaos_harness.py: ``CKPT_CHAOS_UNLINK_KILL=N``, the kill right after the removal).
* ``restore`` in the dist mode: before the load, in this script. The s3 mode has every
  point of the local one but ``retention`` (the objects are removed by the s3s-fs server, a
  process the interposer is not in); timers kill it inside uploads and retention too.

Modes: ``local`` (``ckptstore.torch.CheckpointManager``, non-blocking saves, ``keep_last``),
``s3`` (the same on an ``s3://`` root: the one manager over an object store; the harness
reads the latest step and runs the final ``gc`` through ``ckpt ls`` / ``ckpt gc``),
``dist`` (2-rank FSDP2 through
``ckptstore.torch.distributed`` into the step directories of a ``ckptstore.CheckpointManager``
root: the latest step restored under a lease on every rank, retention by rank 0's ``gc``
after each save), and
``ref`` (the same training with no checkpoint at all: the uninterrupted baseline).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch

import ckptstore
import ckptstore.torch as ct

PAUSE_POINTS = (
    "before-shards",
    "before-manifest-rename",
    "after-manifest-rename",
    "before-cleanup",
    "before-part",
)
MANAGER_POINTS = ("snapshot", "write", "restore")
BATCH = 16


# ---- the training run ---------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(16, 4),
    )


def make_optim(model: torch.nn.Module):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    return opt, sched


def train_step(model, opt, sched, gen: Optional[torch.Generator] = None) -> None:
    x = torch.randn(BATCH, 8, generator=gen)
    y = torch.randn(BATCH, 4, generator=gen)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_digest(model, opt, sched, rng: bool = True) -> str:
    """SHA-256 of everything the run's future depends on: every parameter and optimizer
    state tensor's bytes (this rank's shard of DTensors), dtypes and shapes, the optimizer's
    hyperparameters, the scheduler's state and the global RNG state."""
    h = hashlib.sha256()

    def tensor(name: str, t: Any) -> None:
        t = _local(t).detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    for n, p in model.state_dict().items():
        tensor(f"model/{n}", p)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor):
                tensor(f"optim/{names[id(p)]}/{k}", v)
            else:
                h.update(f"optim/{names[id(p)]}/{k}={v!r}|".encode())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    h.update(repr(sorted(sorted(g.items()) for g in groups)).encode())
    h.update(repr(sorted(sched.state_dict().items())).encode())
    if rng:
        h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def final_state(model, opt) -> Dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor (local shards), by name, for the bitwise
    comparison of the last state."""
    out = {f"model/{n}": _local(p).detach().clone() for n, p in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = _local(v).detach().clone()
    return out


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)
        self.t0 = time.monotonic()

    def ev(self, **kw: Any) -> None:
        kw["t"] = round(time.monotonic() - self.t0, 4)  # seconds into the life
        self.f.write(json.dumps(kw) + "\n")
        self.f.flush()


# ---- kill points --------------------------------------------------------------------------


class PauseKill:
    """The Rust pause seam armed for the ``n``-th save of this life (see the module docs)."""

    def __init__(self, point: str, n: int, life_dir: str) -> None:
        self.n = n
        self.saves = 0
        self.dir = os.path.join(life_dir, "pause")
        os.environ["CKPTSTORE_TEST_PAUSE"] = point
        os.environ["CKPTSTORE_TEST_PAUSE_DIR"] = self.dir
        marker = os.path.join(self.dir, point)

        def watch() -> None:
            while not os.path.exists(marker):
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()

    def before_save(self, _step: int = 0) -> None:
        self.saves += 1
        if self.saves == self.n:
            os.mkdir(self.dir)


def arm(kill: Optional[dict], life_dir: str) -> Optional[PauseKill]:
    if not kill:
        return None
    point, n = kill["point"], int(kill["n"])
    if point in PAUSE_POINTS:
        return PauseKill(point, n, life_dir)
    if point == "retention":
        os.environ["CKPT_CHAOS_UNLINK_KILL"] = str(n)
    elif point in MANAGER_POINTS:
        os.environ["CKPTSTORE_FAULT"] = f"manager.{point}#{n}"
    else:
        raise ValueError(f"unknown kill point {point!r}")
    return None


def self_kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---- lives --------------------------------------------------------------------------------


def life_ref(cfg: dict) -> None:
    """The uninterrupted baseline: the same training, no checkpoint."""
    log = Log(cfg["log"])
    model = make_model()
    opt, sched = make_optim(model)
    log.ev(ev="restored", step=0, digest=state_digest(model, opt, sched))
    for s in range(1, cfg["steps"] + 1):
        train_step(model, opt, sched)
        log.ev(ev="step", step=s, digest=state_digest(model, opt, sched))
    torch.save(final_state(model, opt), cfg["final"])
    log.ev(ev="done", step=cfg["steps"], digest=state_digest(model, opt, sched))


def extra_of(sched) -> dict:
    return {"rng": torch.get_rng_state(), "sched": sched.state_dict()}


def apply_extra(extra: dict, sched) -> None:
    torch.set_rng_state(extra["rng"])
    sched.load_state_dict(extra["sched"])


def life_local(cfg: dict) -> None:
    log = Log(cfg["log"])
    pause = arm(cfg.get("kill"), cfg["life_dir"])
    model = make_model()
    opt, sched = make_optim(model)
    mgr = ct.CheckpointManager(cfg["root"], keep_last=cfg["keep_last"])
    if pause is not None:
        mgr._before_write = pause.before_save
    step, extra = mgr.restore_latest(model, opt, return_extra=True)
    if step is None:
        step = 0
    else:
        apply_extra(extra, sched)
    log.ev(ev="restored", step=step, digest=state_digest(model, opt, sched))
    every, n = cfg["every"], cfg["steps"]
    for s in range(step + 1, n + 1):
        train_step(model, opt, sched)
        log.ev(ev="step", step=s, digest=state_digest(model, opt, sched))
        if s % every == 0 or s == n:
            mgr.save(s, model, opt, extra=extra_of(sched))
    mgr.close()  # the last save is durable (and retention applied)
    torch.save(final_state(model, opt), cfg["final"])
    log.ev(ev="done", step=n, digest=state_digest(model, opt, sched))


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.environ.get("CKPT_BIN", "ckpt"), *args], capture_output=True, text=True, check=False
    )


def s3_latest(root: str) -> Optional[int]:
    """The newest committed step under an ``s3://`` manager root (``ckpt ls --json``)."""
    r = _ckpt("ls", root, "--json")
    if r.returncode != 0:
        raise RuntimeError(f"ckpt ls {root} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout).get("latest")


def s3_gc(root: str, keep: int) -> None:
    r = _ckpt("gc", root, "--keep", str(keep), "--json")
    if r.returncode != 0:
        raise RuntimeError(f"ckpt gc {root} failed ({r.returncode}): {r.stderr}")


def dist_build(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    return model, opt, sched


def life_dist(cfg: dict, rank: int) -> None:
    """One rank of a 2-rank FSDP2 life. The data of step ``s`` on rank ``r`` comes from a
    generator seeded with ``(s, r)`` (dropout still draws on the global RNG, which is the
    same on every rank and travels in ``extra`` from rank 0)."""
    import torch.distributed as dist

    import ckptstore.torch.distributed as ctd

    world = cfg["world"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    log = Log(cfg["log"])
    kill = cfg.get("kill") if cfg.get("kill_rank") == rank else None
    pause = arm(kill, cfg["life_dir"]) if kill and kill["point"] != "restore" else None
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.get("pg_timeout", 60))
    )
    model, opt, sched = dist_build(world)
    mgr = ckptstore.CheckpointManager(cfg["root"], keep_last=cfg["keep_last"])
    latest = [mgr.latest() if rank == 0 else None]
    dist.broadcast_object_list(latest, src=0)
    step = latest[0] or 0
    if step:
        if kill and kill["point"] == "restore":
            self_kill()
        with mgr.lease(step) as lease:  # every rank holds the step against retention
            extra = ctd.load(lease.path, model, opt)
        if int(extra["step"]) != step:
            raise RuntimeError(f"step {step} holds the state of step {extra['step']}")
        apply_extra(extra, sched)
    log.ev(ev="restored", step=step, digest=state_digest(model, opt, sched))
    every, n = cfg["every"], cfg["steps"]
    for s in range(step + 1, n + 1):
        gen = torch.Generator().manual_seed(1000 * s + rank)
        train_step(model, opt, sched, gen)
        log.ev(ev="step", step=s, digest=state_digest(model, opt, sched))
        if s % every == 0 or s == n:
            if pause is not None:
                pause.before_save()
            ctd.save(mgr.step_dir(s), model, opt, extra={"step": s, **extra_of(sched)})
            if rank == 0:
                mgr.gc()  # retention, from the one writer, while no rank writes
            dist.barrier()
    dist.barrier()
    torch.save(final_state(model, opt), cfg["final"])
    log.ev(ev="done", step=n, digest=state_digest(model, opt, sched))
    dist.destroy_process_group()


def life_dist_ref(cfg: dict, rank: int) -> None:
    """The uninterrupted 2-rank baseline: the same training, no checkpoint."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    log = Log(cfg["log"])
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"])
    model, opt, sched = dist_build(cfg["world"])
    log.ev(ev="restored", step=0, digest=state_digest(model, opt, sched))
    for s in range(1, cfg["steps"] + 1):
        gen = torch.Generator().manual_seed(1000 * s + rank)
        train_step(model, opt, sched, gen)
        log.ev(ev="step", step=s, digest=state_digest(model, opt, sched))
    torch.save(final_state(model, opt), cfg["final"])
    log.ev(ev="done", step=cfg["steps"], digest=state_digest(model, opt, sched))
    dist.destroy_process_group()


# The s3 life is the local one on an s3:// root: the same manager, the same seams.
LIVES = {"ref": life_ref, "local": life_local, "s3": life_local}
DIST_LIVES = {"dist": life_dist, "dist-ref": life_dist_ref}


# ---- the fork server ----------------------------------------------------------------------


def _child(cfg: dict, rank: Optional[int]) -> None:
    """In the forked process: never returns."""
    code = 0
    try:
        os.setpgid(0, 0)
        fd = os.open(cfg["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.update(cfg.get("env") or {})
        for k in ("log", "final"):
            if k in cfg:
                cfg[k] = cfg[k].replace("{rank}", str(rank))
        torch.set_num_threads(1)
        if rank is None:
            LIVES[cfg["mode"]](cfg)
        else:
            DIST_LIVES[cfg["mode"]](cfg, rank)
    except BaseException as e:  # noqa: BLE001 - the parent reads the output file
        traceback.print_exc()
        code = PEER_LOST if rank is not None and _peer_lost(e) else 3
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


#: Exit status of a rank whose peer died under it (a collective failed on a closed
#: connection): expected of the survivors of a killed rank; any other failure exits 3.
PEER_LOST = 4


def _peer_lost(e: BaseException) -> bool:
    """``e`` is torch.distributed's error for a peer that went away (gloo's closed or reset
    connection), not an error of the code under test."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", RuntimeError)
    if not isinstance(e, (dist_error, RuntimeError)) or type(e).__module__.startswith("ckptstore"):
        return False
    msg = str(e)
    return "gloo" in msg and ("Connection closed by peer" in msg or "Connection reset by peer" in msg)


def serve() -> None:
    """Read one JSON command a line; run each life to its end (see the module docs)."""
    import torch._dynamo  # noqa: F401 - imported once, before the forks (the first
    import torch.distributed.checkpoint  # noqa: F401 - optimizer imports dynamo: seconds)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import ckptstore.torch.distributed  # noqa: F401

    out = sys.stdout
    for line in sys.stdin:
        cfg = json.loads(line)
        world = cfg.get("world")
        ranks: List[Optional[int]] = [None] if world is None else list(range(world))
        pids = []
        for r in ranks:
            pid = os.fork()
            if pid == 0:
                _child(cfg, r)
            try:
                os.setpgid(pid, pid)  # (the child does it too: whichever runs first)
            except OSError:
                pass
            pids.append(pid)
        out.write(json.dumps({"pids": pids}) + "\n")
        out.flush()
        status: Dict[int, int] = {}
        while len(status) < len(pids):
            pid, st = os.waitpid(-1, 0)
            if pid not in pids:
                continue
            status[pid] = st
            if not (os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0):
                for p in pids:  # a rank died: the job is over (as under torchrun)
                    if p not in status:
                        try:
                            os.killpg(p, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        out.write(json.dumps({"status": [status[p] for p in pids]}) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit("usage: chaos_train.py --serve (started by chaos_harness.py)")
