"""dcp.save / dcp.load of a model + Adam state across 2 ranks (gloo, CPU): ckptstore's
Writer/Reader against torch's FileSystemWriter/Reader and HuggingFaceStorageWriter/Reader,
measured in one run, ratios printed.

    .venv/bin/python python/bench_dcp.py [--gib 1.0] [--reps 3] [--dir /tmp/bench-dcp]

The state: ``--gib`` GiB in total of FP32 tensors: 8 "layers", each a weight and its Adam
``exp_avg`` / ``exp_avg_sq``, every one a DTensor sharded ``Shard(0)`` over 2 ranks, plus
a 0-dim ``step`` per layer (tensors only, so that every storage layer takes the same state).
Every writer fsyncs its files (torch's ``sync_files=True`` default; ckptstore always).
Each repetition saves with each writer in turn, then loads with each reader in turn into
preallocated DTensors of the same placements, and checks the loaded bytes equal the saved
ones; the time of an operation is rank 0's wall time between two barriers (so the slower
rank counts). Medians over the repetitions; the page cache is left as the saves left it
(warm), unless ``--cold`` (every checkpoint's files fsynced and evicted with
``posix_fadvise(DONTNEED)`` before each load; no root needed) or ``--drop-caches`` (root).

The device's limit in the same run: ``raw`` is a plain read of ckptstore's checkpoint files
(the two ranks each ``pread`` half of the files in 8 MiB blocks, evicted first under
``--cold``); every load is also printed as a ratio to it.
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
from bench_util import evict, files_of, raw_read  # noqa: E402  (stdlib only, so imported first)
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


def worker(rank, world, port, args, q):
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
        "FileSystem": (lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p)),
        "HuggingFace": (
            lambda p: HuggingFaceStorageWriter(p, save_distributed=True),
            lambda p: HuggingFaceStorageReader(p),
        ),
    }
    times = {m: {"save": [], "load": []} for m in methods}
    times["raw"] = {"save": [], "load": []}
    dropped = None

    def make_cold():
        dist.barrier()
        if rank == 0:
            if args.cold:
                for m in methods:
                    evict(os.path.join(args.dir, m))
            if args.drop_caches:
                nonlocal dropped
                dropped = drop_caches()
        dist.barrier()

    for rep in range(args.reps):
        for m, (mk_w, _) in methods.items():
            path = os.path.join(args.dir, m)
            if rank == 0 and os.path.exists(path) and m != "ckptstore":
                shutil.rmtree(path)  # torch's writers do not replace a checkpoint atomically
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=mk_w(path))
            dist.barrier()
            times[m]["save"].append(time.perf_counter() - t0)
        for m, (_, mk_r) in methods.items():
            path = os.path.join(args.dir, m)
            dst = {
                k: (torch.empty_like(v) if hasattr(v, "to_local") else torch.empty_like(v))
                for k, v in sd.items()
            }
            make_cold()
            t0 = time.perf_counter()
            dcp.load(dst, storage_reader=mk_r(path))
            dist.barrier()
            times[m]["load"].append(time.perf_counter() - t0)
            for k, v in sd.items():
                a = v.to_local() if hasattr(v, "to_local") else v
                b = dst[k].to_local() if hasattr(dst[k], "to_local") else dst[k]
                if not torch.equal(a, b):
                    raise AssertionError(f"{m}: {k} differs after load")
            del dst
        # The device's limit: plain reads of the same bytes (ckptstore's files), half per rank.
        mine = files_of(os.path.join(args.dir, "ckptstore"))[rank::world]
        make_cold()
        t0 = time.perf_counter()
        for f in mine:
            raw_read(f)
        dist.barrier()
        times["raw"]["load"].append(time.perf_counter() - t0)
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
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = ap.parse_args()
    import multiprocessing as mp

    os.makedirs(args.dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, q)) for r in range(2)]
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
    print(f"dcp.save / dcp.load, 2 ranks, {gib:.2f} GiB of model + Adam state, "
          f"median of {args.reps}, page cache "
          f"{'evicted' if args.cold else 'dropped' if res['dropped'] else 'warm'}")
    raw = statistics.median(res["times"]["raw"]["load"])
    med = {
        m: {op: statistics.median(v) for op, v in d.items()}
        for m, d in res["times"].items()
        if m != "raw"
    }
    print(f"  {'raw read':12s} {'':24s}  read {raw:7.2f} s ({gib / raw:5.2f} GiB/s)")
    for m, d in med.items():
        print(f"  {m:12s} save {d['save']:7.2f} s ({gib / d['save']:5.2f} GiB/s)   "
              f"load {d['load']:7.2f} s ({gib / d['load']:5.2f} GiB/s, {raw / d['load']:.2f}x raw)")
    ours = med["ckptstore"]
    for m in ("FileSystem", "HuggingFace"):
        print(f"  ckptstore vs {m:11s}: save {med[m]['save'] / ours['save']:.2f}x   "
              f"load {med[m]['load'] / ours['load']:.2f}x")
    if args.json:
        print(json.dumps({"gib": gib, "median": med, "raw_read_s": raw, "all": res["times"]}))


if __name__ == "__main__":
    main()
