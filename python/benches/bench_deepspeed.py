#!/usr/bin/env python3
"""Benchmark (not a test): DeepSpeed checkpointing through ckptstore's CheckpointEngine
against DeepSpeed's default TorchCheckpointEngine, on the same model in the same run.

One CPU process (``DS_ACCELERATOR=cpu``, gloo, world size 1), ``--layers`` x
``Linear(--width, --width)`` trained with DeepSpeed's AdamW (``torch_adam``) under ZeRO
``--stage`` (default 1), FP32, one step first so that every optimizer state exists. With the
defaults (5 x 4096) parameters + Adam's two states are 0.94 GiB; a tag holds 1.25 GiB (the
model file, and the ZeRO file with the FP32 partition and both Adam states).

Measured:

* **blocked**: how long ``engine.save_checkpoint(dir)`` keeps the training loop waiting.
  ``torch``: the default engine (``torch.save`` per file; not durable: no fsync);
  ``torch+fsync``: the same plus an fsync of its files (the durability ckptstore's commit
  has before it returns); ``ckptstore``: ``install(engine)`` (each file a committed
  checkpoint, the tag published by one rename, ``latest`` after); ``ckptstore_nb``:
  ``install(engine, non_blocking=True)`` (tensors copied into reused snapshot buffers; the
  write and the publish on threads; ``done``: until published, waited for before the next
  measurement; its first save allocates the snapshot buffers, later ones reuse them).
  ``copy_once``: one ``copy_`` of every parameter and optimizer state tensor
  into preallocated buffers (memory speed), the floor of any snapshot. Best of ``--repeat``.
* **host memory over ``--saves`` non-blocking saves**, one training step between saves:
  RSS after save 2 and after the last, and the peak (``VmHWM``).
* **resume**: a fresh process per run imports DeepSpeed, builds the engine (``initialize``)
  and calls ``load_checkpoint(dir)`` then one training step; ``load``: the
  ``load_checkpoint`` call, ``first step``: load + that step, ``process``: from the spawn to
  the end of the step. ``cold``: the tag's files evicted from the page cache first
  (posix_fadvise DONTNEED after an fsync, checked with ``fincore``); ``warm``: read once
  before. Best of ``--repeat``.

Ratios: the default's time over ckptstore's (> 1: ckptstore faster).

    python python/benches/bench_deepspeed.py [--layers 5 --width 4096] [--repeat 2] [--saves 50] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import (  # noqa: E402  (the shared file and timing helpers)
    evict_checked,
    fsync_path,
    keep_best,
    raw_read,
    run_json,
    status_kib,
)
# Import the installed ckptstore, not the source tree beside this script (no native module).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds its CPU comm op with ninja: the interpreter's bin dir on PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(layers: int, width: int, stage: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
                      RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train_step(engine, width: int) -> None:
    import torch

    g = torch.Generator().manual_seed(int(engine.global_steps))
    x = torch.randn(2, width, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def state_tensors(engine) -> list:
    import torch

    out = [p.data for p in engine.module.parameters()]

    def walk(o) -> None:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(engine.optimizer.state_dict())
    return out


def use_default(engine) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)


def child(args) -> None:
    """A fresh process: initialize, load_checkpoint, one step; prints one JSON line."""
    t_spawn = float(args.spawn_time)
    engine = build(args.layers, args.width, args.stage)
    if args.child == "ckptstore":
        from ckptstore.integrations import deepspeed as ckds

        ckds.install(engine)
    else:
        use_default(engine)
    t0 = time.perf_counter()
    w0 = time.time()
    path, _ = engine.load_checkpoint(args.load_dir)
    assert path is not None, "nothing loaded"
    t1 = time.perf_counter()
    train_step(engine, args.width)
    t2 = time.perf_counter()
    w2 = w0 + (t2 - t0)
    print(json.dumps({"load_s": t1 - t0, "first_step_s": t2 - t0, "process_s": w2 - t_spawn}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--load-dir", default=None)
    ap.add_argument("--spawn-time", default=None)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch

    from ckptstore.integrations import deepspeed as ckds

    base = args.dir or tempfile.mkdtemp(prefix="bench_deepspeed_")
    os.makedirs(base, exist_ok=True)
    engine = build(args.layers, args.width, args.stage)
    train_step(engine, args.width)
    tensors = state_tensors(engine)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    model_adam = sum(p.numel() * 4 * 3 for p in engine.module.parameters())
    print(f"deepspeed ZeRO-{args.stage}: {args.layers} x Linear({args.width}, {args.width}), "
          f"parameters + Adam state {model_adam / 2**30:.3f} GiB, saved state {nbytes / 2**30:.3f} GiB; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}; best of {args.repeat}", flush=True)

    # ---- blocked -------------------------------------------------------------------------
    bufs = [torch.empty_like(t) for t in tensors]
    res: dict = {}

    def best(key: str, v: float) -> None:
        res[key] = min(res.get(key, float("inf")), v)

    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engines = {"torch": TorchCheckpointEngine(engine._config), "ckptstore": ckds.install(engine),
               "ckptstore_nb": ckds.CheckpointEngine(engine._config, non_blocking=True)}
    # The share of the non-blocking save's blocked time spent in our engine's save() (the
    # snapshot copy); the rest is DeepSpeed's own work in save_checkpoint.
    inner = {"t": 0.0}
    nb_save = engines["ckptstore_nb"].save

    def timed_save(state_dict, path):
        t = time.perf_counter()
        try:
            nb_save(state_dict, path)
        finally:
            inner["t"] += time.perf_counter() - t

    engines["ckptstore_nb"].save = timed_save
    for r in range(args.repeat):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        best("copy_once", time.perf_counter() - t0)
        for way in ("torch", "ckptstore", "ckptstore_nb"):
            d = os.path.join(base, f"blocked_{way}")
            shutil.rmtree(d, ignore_errors=True)
            engine.checkpoint_engine = engines[way]  # install()'s wrappers serve both of ours
            train_step(engine, args.width)
            inner["t"] = 0.0
            t0 = time.perf_counter()
            engine.save_checkpoint(d)
            t1 = time.perf_counter()
            best(way, t1 - t0)
            if way == "ckptstore_nb":
                best("ckptstore_nb_engine_save", inner["t"])
            if way == "torch":
                fsync_path(d)
                best("torch+fsync", time.perf_counter() - t0)
            if way == "ckptstore_nb":
                engine.checkpoint_engine.wait()
                best("ckptstore_nb_done", time.perf_counter() - t0)
            print(f"  run {r} {way}: {t1 - t0:.3f} s"
                  + (f" (published after {time.perf_counter() - t0:.3f} s)" if way == "ckptstore_nb" else ""),
                  flush=True)
    del bufs
    print("blocked by a save (s): " + json.dumps({k: round(v, 3) for k, v in res.items()}))
    for way in ("ckptstore", "ckptstore_nb"):
        print(f"  {way}: {res[way] / res['torch']:.3f}x torch's blocking, "
              f"{res[way] / res['torch+fsync']:.3f}x torch+fsync, {res[way] / res['copy_once']:.2f}x copy_once")
    print(f"  ckptstore_nb until published: {res['ckptstore_nb_done'] / res['torch+fsync']:.3f}x torch+fsync")
    print(f"  ckptstore_nb blocked in CheckpointEngine.save (the snapshot): "
          f"{res['ckptstore_nb_engine_save']:.3f} s = {res['ckptstore_nb_engine_save'] / res['copy_once']:.2f}x "
          f"copy_once; the rest of save_checkpoint (DeepSpeed's own): "
          f"{res['ckptstore_nb'] - res['ckptstore_nb_engine_save']:.3f} s")

    # ---- host memory over many non-blocking saves ----------------------------------------
    engines["ckptstore_nb"].cleanup()  # its snapshot buffers go
    del engines
    if args.saves >= 2:
        engine.checkpoint_engine = ckds.CheckpointEngine(engine._config, non_blocking=True)
        d = os.path.join(base, "rss")
        shutil.rmtree(d, ignore_errors=True)
        rss = []
        for _i in range(args.saves):
            train_step(engine, args.width)
            engine.save_checkpoint(d, tag="rss")
            rss.append(status_kib("VmRSS"))
        engine.checkpoint_engine.wait()
        hwm = status_kib("VmHWM")
        print(f"host memory over {args.saves} non-blocking saves: RSS after save 2 {rss[1] / 2**20:.3f} GiB, "
              f"after save {args.saves} {rss[-1] / 2**20:.3f} GiB ({rss[-1] / rss[1]:.3f}x), "
              f"peak {hwm / 2**20:.3f} GiB", flush=True)
        shutil.rmtree(d, ignore_errors=True)

    # ---- resume in a fresh process ---------------------------------------------------------
    dirs = {"torch": os.path.join(base, "blocked_torch"), "ckptstore": os.path.join(base, "blocked_ckptstore")}
    engine.checkpoint_engine.cleanup()
    del engine, tensors
    out: dict = {}
    child_env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # ours is in use
    for cache in ("cold", "warm"):
        for _r in range(args.repeat):
            for way, d in dirs.items():
                if cache == "cold":
                    evict_checked(d, nbytes)
                else:
                    raw_read(d)
                r = run_json([sys.executable, os.path.abspath(__file__), "--child", way, "--load-dir", d,
                              "--layers", str(args.layers), "--width", str(args.width),
                              "--stage", str(args.stage), "--spawn-time", repr(time.time())],
                             f"{way} ({cache}) failed", env=child_env)
                print(f"  resume {cache} {way}: {json.dumps({k: round(v, 3) for k, v in r.items()})}", flush=True)
                keep_best(out, (cache, way), r)
    for cache in ("cold", "warm"):
        t, c = out[(cache, "torch")], out[(cache, "ckptstore")]
        print(f"resume {cache}: " + ", ".join(
            f"{k[:-2]} torch {t[k]:.3f} s / ckptstore {c[k]:.3f} s = {t[k] / c[k]:.2f}x"
            for k in ("load_s", "first_step_s", "process_s")))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
