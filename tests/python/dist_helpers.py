"""Real torch.distributed jobs for the tests: ``world`` fresh processes, a gloo process
group on a free loopback port, each running ``fn(rank, world, *args)``.

The processes come from multiprocessing's "forkserver" context with torch preloaded: each
rank is a new process forked from a clean server that only imported torch (never from the
pytest process, and without paying torch's import once per rank, which on a loaded 2-core
machine costs over ten seconds).

The process-group timeout bounds every collective: a rank that dies makes its peers' next
collective fail (gloo sees the closed connection), and never hang past the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from datetime import timedelta

PG_TIMEOUT_S = 60


_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "ckptstore.torch.dcp",
    "ckptstore.torch.distributed",
    "dist_helpers",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S)
        )
        res = fn(rank, world, *args)
        # Plain pickle (tensors by value): torch's queue reducers would share memory by
        # file descriptor, which dies with this process.
        q.put((rank, True, pickle.dumps(res)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def exit_together(rank: int, world: int, code: int = 0) -> None:
    """End every rank of a finished job (a process of its own, the default group's
    TCPStore up) without a teardown race, and exit with ``code``. A rank that exits closes
    its gloo sockets, which a peer still in the tail of the last collective may see; and
    interpreter finalization with gloo's threads alive and no ``destroy_process_group`` can
    abort with SIGABRT, `terminate called without an active exception` (seen here, in the
    namespace jobs and once in a Lightning FSDP2 job in CI; pytorch/pytorch#190489). So: a
    barrier; each rank says it is out of it through the TCPStore; rank 0 (the store's
    server) releases the others once all are out and exits last, after they have
    acknowledged; nobody runs finalizers (``os._exit``, after flushing stdout and stderr)."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"exit/out/{rank}", "1")
    if rank == 0:
        store.wait([f"exit/out/{r}" for r in range(world)])
        store.set("exit/release", "1")
        if world > 1:
            store.wait([f"exit/done/{r}" for r in range(1, world)])
    else:
        store.wait(["exit/release"])
        store.set(f"exit/done/{rank}", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_process(code: int = 0) -> None:
    """Exit a job's process with ``code``: through :func:`exit_together` where a process
    group is initialized (every rank must get here), else plainly."""
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        exit_together(dist.get_rank(), dist.get_world_size(), code)
    sys.exit(code)


def run(world: int, fn, *args, allow_dead=(), join_timeout=PG_TIMEOUT_S * 3):
    """Run ``fn`` on ``world`` ranks; return ``{rank: (ok, result or traceback)}`` and the
    exit codes. Raises if a rank not in ``allow_dead`` failed or exited without reporting."""
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    # Results first (a full queue would block a child's exit), then the exits.
    alive = set(range(world))
    import queue as _q

    while len(out) < world - len(allow_dead) or any(p.is_alive() for p in procs):
        try:
            rank, ok, val = q.get(timeout=1.0)
            if ok:
                val = pickle.loads(val)
            out[rank] = (ok, val)
            alive.discard(rank)
        except _q.Empty:
            if not any(p.is_alive() for p in procs):
                break
            join_timeout -= 1
            if join_timeout <= 0:
                for p in procs:
                    p.kill()
                raise AssertionError(f"distributed job hung; results so far: {out}")
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    bad = [r for r in range(world) if r not in allow_dead and not (r in out and out[r][0])]
    if bad:
        msgs = "\n".join(
            f"--- rank {r} (exit {codes[r]}):\n{out[r][1] if r in out else 'no report'}" for r in bad
        )
        raise AssertionError(f"ranks {bad} failed:\n{msgs}")
    return out, codes


def results(world: int, fn, *args):
    """``run`` for jobs where every rank succeeds: the results in rank order."""
    out, _ = run(world, fn, *args)
    return [out[r][1] for r in range(world)]
