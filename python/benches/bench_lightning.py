#!/usr/bin/env python3
"""Benchmark (not a test): Lightning checkpointing through ckptstore's CheckpointIO against
Lightning's default TorchCheckpointIO (``torch.save`` into memory, then one file write) and
its AsyncCheckpointIO, on the same model in the same run.

The model: ``--layers`` x ``Linear(--width, --width)`` in a LightningModule trained with Adam
for one step (so that every optimizer state exists): parameters + Adam's two states, about
0.56 GiB with the defaults (3 x 4096).

Measured:

* **blocked**: how long ``trainer.save_checkpoint(path)`` keeps the training loop, i.e. the
  step that saves, waiting (Lightning's ``dump_checkpoint`` included, the same for every
  way). ``torch``: TorchCheckpointIO (not durable: no fsync); ``torch+fsync``: the same plus an
  fsync of the file (what ckptstore's commit does before it returns); ``ckptstore``: the
  synchronous CheckpointIO (durable: shards, manifest and directory fsynced);
  ``lightning_async``: Lightning's AsyncCheckpointIO around TorchCheckpointIO (clones every
  tensor, then saves on a thread); ``ckptstore_async``: ``CheckpointIO(async_save=True)``
  (copies into reused snapshot buffers, writes on a thread). The background part of the
  async ways is waited for (and timed: ``done``) before the next measurement.
  ``copy_once``: one ``copy_`` of every tensor into preallocated buffers (memory speed),
  the floor of any snapshot.
* **host memory over ``--saves`` async saves** (back to back, at most one in flight: for
  Lightning's, whose executor queues without bound, each save first waits for the one
  before): RSS when save 2 and when the last returned, and the highest, for both ways.
* **resume**: a fresh process per run imports Lightning, builds the model and a Trainer and
  calls ``fit(ckpt_path=...)``; timed from the ``fit`` call to the end of the first resumed
  training step (``resume``), and the whole process from its start to its exit
  (``process``: Lightning's import included). ``cold``: the checkpoint files are evicted from the
  page cache first (posix_fadvise DONTNEED, python/benches/bench_util.py's ``evict``); ``warm``: read
  once before. Best of ``--repeat``.

Ratios are the default's time over ckptstore's (> 1: ckptstore faster), or for memory
ckptstore's over its own.

    python python/benches/bench_lightning.py [--layers 3 --width 4096] [--repeat 2] [--saves 50] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import (  # noqa: E402  (the shared file and timing helpers)
    copy_seconds,
    evict,
    files_of,
    fsync_file,
    keep_best,
    raw_read,
    remove,
    run_json,
    state_bytes,
    status_kib,
)
# Import the installed ckptstore, not the source tree beside this script (no native module).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import warnings  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import lightning as L  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from ckptstore.integrations.lightning import CheckpointIO  # noqa: E402



class Net(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def data(width: int, n: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, width, generator=g)), batch_size=2)


def trainer(max_steps: int, io=None, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, plugins=[io] if io is not None else [],
        callbacks=list(callbacks), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


# ---- the resume child --------------------------------------------------------------------


def child(kind: str, path: str, layers: int, width: int) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    marks: dict = {}

    class Mark(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.setdefault("first_step", time.perf_counter())

    io = CheckpointIO() if kind == "ckptstore" else TorchCheckpointIO()
    inner = io.load_checkpoint

    def timed_load(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        marks["load_s"] = time.perf_counter() - t
        return out

    io.load_checkpoint = timed_load  # type: ignore[method-assign]
    torch.manual_seed(1)
    model = Net(layers, width)
    t = trainer(2, io, [Mark()])
    t0 = time.perf_counter()
    t.fit(model, data(width), ckpt_path=path)
    print(json.dumps({"resume_s": marks["first_step"] - t0, "load_s": marks["load_s"], "global_step": t.global_step,
                      "peak_rss_kib": status_kib("VmHWM")}))


def resume_bench(paths: dict, args, nbytes: int) -> dict:
    res: dict = {}
    for cache in ("cold", "warm"):
        for _ in range(args.repeat):
            for kind, path in paths.items():
                if cache == "cold":
                    for f in files_of(path):
                        evict(f)
                else:
                    raw_read(path)
                t0 = time.perf_counter()
                r = run_json(
                    [sys.executable, os.path.abspath(__file__), "--child", kind, path,
                     "--layers", str(args.layers), "--width", str(args.width)],
                    f"resume child {kind} failed",
                )
                wall = time.perf_counter() - t0
                assert r["global_step"] == 2, r
                r["wall_s"] = wall
                print(f"  resume {cache} {kind}: {json.dumps(r)}", flush=True)
                keep_best(res, (cache, kind), r, ("resume_s", "load_s", "wall_s"))
    return res


# ---- main --------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        cp = argparse.ArgumentParser()
        cp.add_argument("--child", nargs=2)
        cp.add_argument("--layers", type=int)
        cp.add_argument("--width", type=int)
        a = cp.parse_args()
        child(a.child[0], a.child[1], a.layers, a.width)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement (best shown)")
    ap.add_argument("--saves", type=int, default=50, help="async saves for the memory measurement")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--resume-only", action="store_true", help="only the fresh-process resume")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-bench-lightning-")
    os.makedirs(base, exist_ok=True)

    torch.manual_seed(0)
    model = Net(args.layers, args.width)
    tr = trainer(1)
    tr.fit(model, data(args.width))
    opt = tr.optimizers[0]
    nbytes = state_bytes(model, opt)
    gib = nbytes / 2**30
    print(f"lightning {L.__version__}, torch {torch.__version__}; {args.layers} x Linear({args.width}, "
          f"{args.width}) + Adam: {gib:.3f} GiB; {os.cpu_count()} CPUs; best of {args.repeat}", flush=True)

    # -- blocked time ------------------------------------------------------------------
    ways = {
        "torch": (TorchCheckpointIO, os.path.join(base, "torch.ckpt")),
        "torch+fsync": (TorchCheckpointIO, os.path.join(base, "torch_fsync.ckpt")),
        "ckptstore": (CheckpointIO, os.path.join(base, "ckptstore.ckpt")),
        "lightning_async": (lambda: AsyncCheckpointIO(TorchCheckpointIO()), os.path.join(base, "lasync.ckpt")),
        "ckptstore_async": (lambda: CheckpointIO(async_save=True), os.path.join(base, "casync.ckpt")),
    }
    blocked: dict = {}
    memory: dict = {}
    if args.resume_only:
        for way in ("torch+fsync", "ckptstore"):
            make, path = ways[way]
            remove(path)
            tr.strategy.checkpoint_io = make()
            tr.save_checkpoint(path)
    for _ in range(0 if args.resume_only else args.repeat):
        for way, (make, path) in ways.items():
            remove(path)
            io = make()
            tr.strategy.checkpoint_io = io
            gc.collect()
            t0 = time.perf_counter()
            tr.save_checkpoint(path)
            if way == "torch+fsync":
                fsync_file(path)
            t1 = time.perf_counter()
            if way.endswith("async"):
                if isinstance(io, CheckpointIO):
                    io.wait()
                else:
                    io._executor.shutdown(wait=True)  # noqa: SLF001 - wait without teardown's reset
                    io._executor = None
            t2 = time.perf_counter()
            io.teardown()
            r = blocked.setdefault(way, {"blocked_s": t1 - t0, "done_s": t2 - t0})
            r["blocked_s"] = min(r["blocked_s"], t1 - t0)
            r["done_s"] = min(r["done_s"], t2 - t0)
            print(f"  save {way}: blocked {t1 - t0:.3f} s, done {t2 - t0:.3f} s", flush=True)
    if args.resume_only:
        resume_and_report(tr, model, opt, ways, args, nbytes, gib, base, blocked, memory, None)
        return
    # A second async save into the same path reuses the buffers: the steady state.
    io = CheckpointIO(async_save=True)
    tr.strategy.checkpoint_io = io
    steady = []
    for i in range(args.repeat + 1):
        t0 = time.perf_counter()
        tr.save_checkpoint(ways["ckptstore_async"][1])
        steady.append(time.perf_counter() - t0)
        io.wait()
    io.teardown()
    blocked["ckptstore_async_reused"] = {"blocked_s": min(steady[1:]), "done_s": float("nan")}
    # One copy of the state at memory speed (preallocated buffers: no page faults).
    tensors = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    blocked["copy_once"] = {"blocked_s": copy_seconds(tensors), "done_s": float("nan")}

    # -- host memory over many async saves ----------------------------------------------
    for way in ("ckptstore_async", "lightning_async"):
        make, path = ways[way]
        io = make()
        tr.strategy.checkpoint_io = io
        gc.collect()
        rss = []
        for i in range(args.saves):
            if not isinstance(io, CheckpointIO) and io._executor is not None:
                # At most one save in flight, as CheckpointIO(max_in_flight=1) does (Lightning's
                # executor queues without bound: back-to-back saves would pile up clones).
                io._executor.shutdown(wait=True)  # noqa: SLF001
                io._executor = None
            tr.save_checkpoint(path)
            rss.append(status_kib("VmRSS"))
        if isinstance(io, CheckpointIO):
            io.wait()
        io.teardown()
        memory[way] = {"rss_after_2_mib": rss[1] / 1024, "rss_after_last_mib": rss[-1] / 1024,
                       "max_rss_mib": max(rss) / 1024, "ratio_last_over_2": rss[-1] / rss[1]}
        print(f"  memory {way}: {json.dumps(memory[way])}", flush=True)
        gc.collect()

    resume_and_report(tr, model, opt, ways, args, nbytes, gib, base, blocked, memory, tensors)


def resume_and_report(tr, model, opt, ways, args, nbytes, gib, base, blocked, memory, tensors) -> None:
    # -- resume in a fresh process -----------------------------------------------------
    paths = {"torch": ways["torch+fsync"][1], "ckptstore": ways["ckptstore"][1]}
    for p in paths.values():
        for f in files_of(p):
            fsync_file(f)
    del tr, model, opt, tensors
    gc.collect()
    resume = resume_bench(paths, args, nbytes)
    report(blocked, memory, resume, args, gib)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


def report(blocked, memory, resume, args, gib) -> None:
    if blocked:
        _report_saves(blocked, memory, args, gib)
    _report_resume(resume)
    print("JSON " + json.dumps({"gib": gib, "blocked": blocked, "memory": memory,
                               "resume": {f"{c}_{k}": v for (c, k), v in resume.items()}}))


def _report_saves(blocked, memory, args, gib) -> None:
    b0 = blocked["torch"]["blocked_s"]
    print(f"\nblocked by a save ({gib:.3f} GiB)   blocked s   GiB/s   done s   default/this")
    for way, r in blocked.items():
        print(f"{way:<28} {r['blocked_s']:>9.3f} {gib / r['blocked_s']:>7.2f} {r['done_s']:>8.3f} {b0 / r['blocked_s']:>13.2f}")
    print(f"ckptstore_async_reused / copy_once: {blocked['ckptstore_async_reused']['blocked_s'] / blocked['copy_once']['blocked_s']:.2f}")
    print(f"ckptstore / torch+fsync (both durable): {blocked['ckptstore']['blocked_s'] / blocked['torch+fsync']['blocked_s']:.2f}")
    print(f"\nhost memory over {args.saves} async saves: {json.dumps(memory)}")


def _report_resume(resume) -> None:
    print("\nresume: fit() to the end of the first step, and the whole process (imports included)")
    print("load: the CheckpointIO's load_checkpoint alone (read + deserialize / CRC-check)")
    print("                   load s   resume s  process s   torch/ckptstore: load  resume  process   peak RSS MiB")
    for cache in ("cold", "warm"):
        t, c = resume[(cache, "torch")], resume[(cache, "ckptstore")]
        print(f"{cache:<6} torch     {t['load_s']:>8.3f} {t['resume_s']:>9.3f} {t['wall_s']:>9.3f} {'':>32} {t['peak_rss_kib'] / 1024:>8.0f}")
        print(f"{cache:<6} ckptstore {c['load_s']:>8.3f} {c['resume_s']:>9.3f} {c['wall_s']:>9.3f} "
              f"{t['load_s'] / c['load_s']:>21.2f} {t['resume_s'] / c['resume_s']:>7.2f} {t['wall_s'] / c['wall_s']:>8.2f}"
              f" {c['peak_rss_kib'] / 1024:>10.0f}")


if __name__ == "__main__":
    main()
