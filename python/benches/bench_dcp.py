"""dcp.save / dcp.load of a model + Adam state across 2 ranks (gloo, CPU): ckptstore's
Writer/Reader against torch's FileSystemWriter/Reader and HuggingFaceStorageWriter/Reader,
measured in one run, ratios printed.

    .venv/bin/python python/benches/bench_dcp.py [--gib 1.0] [--reps 3] [--dir /tmp/bench-dcp]

The state: ``--gib`` GiB in total of FP32 tensors: 8 "layers", each a weight and its Adam
``exp_avg`` / ``exp_avg_sq``, every one a DTensor sharded ``Shard(0)`` over 2 ranks, plus
a 0-dim ``step`` per layer (tensors only, so that every storage layer takes the same state).
Every writer fsyncs its files (torch's ``sync_files=True`` default; ckptstore always).
Each repetition saves with each writer in turn, then loads with each reader in turn (the
order rotated by one place per repetition) into
preallocated DTensors of the same placements (faulted in before the clock starts), and checks the loaded bytes equal the saved
ones; the time of an operation is rank 0's wall time between two barriers (so the slower
rank counts). Medians over the repetitions; the page cache is left as the saves left it
(warm), unless ``--cold`` (every checkpoint's files fsynced and evicted with
``posix_fadvise(DONTNEED)`` before each load; no root needed) or ``--drop-caches`` (root).

The device's limit in the same run: ``raw`` is a plain read of ckptstore's checkpoint files
(the ranks each ``pread`` their share of the files in 8 MiB blocks, evicted first under
``--cold``); every load is also printed as a ratio to it.

Issue 24's floors, measured in the same run (each rank's time between barriers):

* load floor = ``raw`` + ``copy``: the plain read of the files, plus one ``copy_`` of each
  rank's bytes into destination tensors that are already faulted in (the least a loader
  that checks what it reads must do: get the bytes off the device once, write them once);
* save floor = a raw ``write`` + ``fsync`` of each rank's bytes into one file of its own
  (the least any durable save does).

Readers timed besides the default ``ckptstore`` (every byte checked, every rank agreed,
before any destination is written): ``ckptstore-fresh`` (``Reader(fresh_destinations=True)``,
what ``ckptstore.torch.distributed.load`` uses: each block checked as it is copied into the
fresh destinations, then the ranks agree) and ``ckptstore-stream`` (``Reader(streaming=True)``:
checked while copied, no agreement). Both read ckptstore's checkpoint; they save nothing.
``--world 1`` runs one process (no second rank).

``--cold --throttle 600MiB`` (root; cgroup v2 ``io.max`` or v1 blkio) holds every rank's
reads from the disk under ``--dir`` to that rate, so that cold readers are compared at one
fixed device speed rather than at whatever a shared disk gives each in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from datetime import timedelta

# Import the installed ckptstore, not the source tree next to this script (no native module).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import ReadThrottle, evict, files_of, fsync_file, parse_size, raw_read  # noqa: E402  (stdlib only, so imported first)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

LAYERS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_state(gib, mesh):
    import torch
    total = int(gib * (1 << 30)) // 4  # FP32 elements
    per = total // (3 * LAYERS)
    cols = 1024
    rows = max(2, per // cols)
    sd = {}
    g = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        for k in ("weight", "exp_avg", "exp_avg_sq"):
            full = torch.randn(rows, cols, generator=g)
            # Each rank keeps its own rows (no scatter of the state through gloo).
            sd[f"{'model' if k == 'weight' else 'optim'}.layer{i}.{k}"] = _shard(full, mesh)
        sd[f"optim.layer{i}.step"] = torch.tensor(float(i))
    return sd


def _shard(full, mesh):
    from torch.distributed.tensor import DTensor, Shard

    rank = mesh.get_local_rank()
    n = mesh.size()
    chunk = full.tensor_split(n, dim=0)[rank].contiguous()
    return DTensor.from_local(chunk, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def worker(rank, world, port, args, q, throttle=None):
    if throttle is not None:
        throttle.enter()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import (
        FileSystemReader,
        FileSystemWriter,
        HuggingFaceStorageReader,
        HuggingFaceStorageWriter,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore.torch.dcp import Reader, Writer

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    sd = make_state(args.gib, mesh)
    nbytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in sd.values())
    tot = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(tot)
    methods = {
        "ckptstore": (lambda p: Writer(p), lambda p: Reader(p)),
        # Readers of ckptstore's checkpoint (no writer: the path is ckptstore's).
        "ckptstore-fresh": (None, lambda p: Reader(p, fresh_destinations=True)),
        "ckptstore-stream": (None, lambda p: Reader(p, streaming=True)),
        "FileSystem": (lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p)),
        "HuggingFace": (
            lambda p: HuggingFaceStorageWriter(p, save_distributed=True),
            lambda p: HuggingFaceStorageReader(p),
        ),
    }
    times = {m: {"save": [], "load": []} for m in methods}
    for m in ("raw", "copy"):
        times[m] = {"save": [], "load": []}
    local = [v.to_local() if hasattr(v, "to_local") else v for v in sd.values()]
    # The copy floor's destinations, faulted in once (reused every repetition).
    floor_dst = [torch.empty_like(t).fill_(0) for t in local]
    raw_file = os.path.join(args.dir, f"raw-write-{rank}.bin")

    def path_of(m):
        return os.path.join(args.dir, "ckptstore" if m.startswith("ckptstore") else m)
    dropped = None

    def make_cold():
        dist.barrier()
        if rank == 0:
            if args.cold:
                for m in methods:
                    evict(path_of(m))
            if args.drop_caches:
                nonlocal dropped
                dropped = drop_caches()
        dist.barrier()

    def save_with(m):
        path = path_of(m)
        if rank == 0 and os.path.exists(path) and m != "ckptstore":
            shutil.rmtree(path)  # torch's writers do not replace a checkpoint atomically
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=methods[m][0](path))
        dist.barrier()
        times[m]["save"].append(time.perf_counter() - t0)

    def save_floor():
        # Each rank's bytes written into a file of its own, fsynced.
        dist.barrier()
        t0 = time.perf_counter()
        with open(raw_file, "wb", buffering=0) as f:
            for t in local:
                f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)
            os.fsync(f.fileno())
        fsync_file(args.dir)
        dist.barrier()
        times["raw"]["save"].append(time.perf_counter() - t0)
        os.remove(raw_file)

    def load_with(m):
        # Destinations faulted in before the clock starts, as the floor's are (a resumed
        # job's model and state exist before it loads).
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        for v in dst.values():
            (v.to_local() if hasattr(v, "to_local") else v).fill_(0)
        make_cold()
        t0 = time.perf_counter()
        dcp.load(dst, storage_reader=methods[m][1](path_of(m)))
        dist.barrier()
        times[m]["load"].append(time.perf_counter() - t0)
        for k, v in sd.items():
            a = v.to_local() if hasattr(v, "to_local") else v
            b = dst[k].to_local() if hasattr(dst[k], "to_local") else dst[k]
            if not torch.equal(a, b):
                raise AssertionError(f"{m}: {k} differs after load")

    def load_floor():
        # A plain read of the same bytes (ckptstore's files, a share per rank), then one
        # copy of this rank's bytes into destinations already faulted in.
        mine = files_of(os.path.join(args.dir, "ckptstore"))[rank::world]
        make_cold()
        t0 = time.perf_counter()
        for f in mine:
            raw_read(f)
        dist.barrier()
        times["raw"]["load"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for d, t in zip(floor_dst, local):
            d.copy_(t)
        dist.barrier()
        times["copy"]["load"].append(time.perf_counter() - t0)

    # Each repetition runs the saves, then the loads, each list rotated by one place per
    # repetition: no way always follows the same neighbour (the disk's state after a large
    # write, or the page cache after a large read, would otherwise favour one position).
    saves = [(lambda m=m: save_with(m)) for m, (w, _) in methods.items() if w is not None]
    saves.append(save_floor)
    loads = [(lambda m=m: load_with(m)) for m in methods] + [load_floor]
    if not os.path.exists(path_of("ckptstore")) or not args.load_only:
        save_with("ckptstore")  # the checkpoint the ckptstore readers and the floor read
        times["ckptstore"]["save"].clear()
    for rep in range(args.reps):
        if not args.load_only:
            for op in saves[rep % len(saves):] + saves[: rep % len(saves)]:
                op()
        for op in loads[rep % len(loads):] + loads[: rep % len(loads)]:
            op()
    if rank == 0:
        q.put({"times": times, "bytes": int(tot.item()), "dropped": dropped})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="total state size (GiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench-dcp")
    ap.add_argument("--cold", action="store_true", help="evict the files before each load")
    ap.add_argument("--drop-caches", action="store_true", help="drop all caches (root)")
    ap.add_argument("--world", type=int, default=2, help="ranks (processes), 1 or more")
    ap.add_argument("--load-only", action="store_true",
                    help="time loads only, of the checkpoints an earlier run left in --dir")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    ap.add_argument("--throttle", default=None,
                    help="hold every rank's reads from --dir's disk to this rate, e.g. 600MiB "
                         "(a cgroup read throttle, root only)")
    args = ap.parse_args()
    import atexit
    import multiprocessing as mp

    os.makedirs(args.dir, exist_ok=True)
    throttle = ReadThrottle(args.dir, parse_size(args.throttle)) if args.throttle else None
    if throttle:
        atexit.register(throttle.close)  # after the ranks have exited, also on failure
        print(f"every rank's reads throttled: {throttle.rule}", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, q, throttle))
             for r in range(args.world)]
    for p in procs:
        p.start()
    import queue

    while True:
        try:
            res = q.get(timeout=5)
            break
        except queue.Empty:
            if not all(p.is_alive() for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("a rank died (see its traceback above)")
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit("a rank failed")
    gib = res["bytes"] / (1 << 30)
    print(f"dcp.save / dcp.load, {args.world} rank(s), {gib:.2f} GiB of model + Adam state, "
          f"median of {args.reps}, page cache "
          f"{'evicted' if args.cold else 'dropped' if res['dropped'] else 'warm'}, "
          f"{'reads held to ' + args.throttle + '/s, ' if args.throttle else ''}"
          f"load average {os.getloadavg()[0]:.2f}")
    med = {
        m: {op: (statistics.median(v) if v else float("nan")) for op, v in d.items()}
        for m, d in res["times"].items()
    }
    raw, copy = med["raw"]["load"], med["copy"]["load"]
    floor = raw + copy
    wfloor = med["raw"]["save"]
    print(f"  {'raw read':16s} {'':24s}  read {raw:7.2f} s ({gib / raw:5.2f} GiB/s)")
    print(f"  {'load floor':16s} {'':24s}  raw read + copy into faulted destinations "
          f"{raw:.2f} + {copy:.2f} = {floor:.2f} s")
    print(f"  {'save floor':16s} raw write+fsync {wfloor:7.2f} s ({gib / wfloor:5.2f} GiB/s)")
    for m, d in med.items():
        if m in ("raw", "copy"):
            continue
        sv = "" if d["save"] != d["save"] else (
            f"save {d['save']:7.2f} s ({gib / d['save']:5.2f} GiB/s, {wfloor / d['save']:.2f}x floor)")
        print(f"  {m:16s} {sv:44s} load {d['load']:7.2f} s ({gib / d['load']:5.2f} GiB/s, "
              f"{floor / d['load']:.2f}x floor, {raw / d['load']:.2f}x raw)")
    for ours in ("ckptstore", "ckptstore-fresh", "ckptstore-stream"):
        for m in ("FileSystem", "HuggingFace"):
            sv = med[m]["save"] / med[ours]["save"] if ours == "ckptstore" else float("nan")
            print(f"  {ours:16s} vs {m:11s}: "
                  + (f"save {sv:.2f}x   " if sv == sv else "")
                  + f"load {med[m]['load'] / med[ours]['load']:.2f}x")
    if args.json:
        print(json.dumps({"gib": gib, "median": med, "raw_read_s": raw, "load_floor_s": floor,
                          "save_floor_s": wfloor, "all": res["times"]}))


if __name__ == "__main__":
    main()
