"""TorchTitan: ckptstore's checkpoint manager against TorchTitan's stock one, same run.

::

    python python/benches/bench_torchtitan.py --gib 1 --dir DIR [--saves 3] [--modes disabled,async]
    python python/benches/bench_torchtitan.py --gib 0.0625 --dir DIR --rss-saves 50   # host memory

The model: ``--layers`` bias-free ``Linear(width, width)`` layers (``--gib`` sets the width)
with TorchTitan's ``OptimizersContainer`` (AdamW, foreach) and ``LRSchedulersContainer``, a
train state, in one gloo process (world size 1, as TorchTitan's trainer runs it). Both managers
are built from their ``Config`` with the same fields (``interval=1``, ``keep_latest_k=2``,
``async_mode``) and driven as the trainer drives them: a training step, then ``save(step)``.

* **blocked**: how long ``save`` keeps the training loop (median over saves 2..N; the
  first save, which allocates the async snapshot buffers, apart). ``disabled``: the whole
  durable save (TorchTitan's ``FileSystemWriter`` fsyncs its files too); ``async``: the
  snapshot copy, the write going on in the background; ``until durable``: ``save`` plus
  ``maybe_wait_for_saving``.
* **copy once**: copying every tensor of the state once into preallocated buffers (the
  floor of any snapshot).
* **resume**: a fresh process (``--child``) builds the model and optimizer and times
  ``load()`` and ``load()`` + the first training step; ``cold``: the checkpoint's files
  evicted from the page cache first (``posix_fadvise(DONTNEED)``), ``warm``: read once first.
* ``--rss-saves N``: N async saves of each manager; peak RSS (``VmHWM``) after save 2 and
  after save N, each manager in its own fresh process.

Ratios: stock / ckptstore (> 1: ckptstore faster), all from this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import copy_seconds, evict, raw_read, status_kib  # noqa: E402  (shared helpers)
# Import the installed ckptstore, not the source tree beside this script (no native module).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def build(way: str, folder: str, mode: str, layers: int, width: int):
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpointer import CheckpointManager as Stock
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckptstore.integrations.torchtitan import CheckpointManager as Ours

    class TS(TrainState, Stateful):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})],
        implementation="foreach",
    ).build(model_parts=[model])
    lrs = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=1000)
    cls = Stock if way == "stock" else Ours
    ts = TS()
    mgr = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=2, async_mode=mode).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=lrs,
        states={"train_state": ts}, sd_adapter=None, base_folder="",
    )
    x = torch.randn(8, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        mgr.maybe_wait_for_staging()
        opt.step()
        lrs.step()
        ts.step += 1

    return model, opt, mgr, step, ts


def init_dist() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def state_bytes(model, opt) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for o in opt.optimizers:
        for st in o.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def copy_once(model, opt) -> float:
    ts = [p.detach() for p in model.parameters()]
    for o in opt.optimizers:
        for st in o.state.values():
            ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return copy_seconds(ts, repeat=1)  # buffers faulted in first: a reused snapshot's floor


def child(args) -> None:
    _quiet()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    init_dist()
    if args.rss_saves:
        model, opt, mgr, step, ts = build(args.child, args.folder, "async", args.layers, args.width)
        peaks = {}
        for i in range(1, args.rss_saves + 1):
            step()
            mgr.save(ts.step)
            mgr.maybe_wait_for_saving()
            if i in (2, args.rss_saves):
                peaks[i] = status_kib("VmHWM")
        mgr.close()
        print(json.dumps({"hwm_2": peaks[2], "hwm_n": peaks[args.rss_saves]}))
        return
    model, opt, mgr, step, ts = build(args.child, args.folder, "disabled", args.layers, args.width)
    t0 = time.perf_counter()
    assert mgr.load(), "nothing to resume"
    t1 = time.perf_counter()
    step()
    t2 = time.perf_counter()
    mgr.close()
    print(json.dumps({"load": t1 - t0, "first_step": t2 - t0, "step": ts.step}))


def spawn(args, way: str, folder: str, extra: list) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", way, "--folder", folder,
           "--layers", str(args.layers), "--width", str(args.width)] + extra
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"child {way} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="model + AdamW state, GiB")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=0, help="(default: from --gib)")
    ap.add_argument("--dir", required=False, default=None)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--modes", default="disabled,async")
    ap.add_argument("--rss-saves", type=int, default=0)
    ap.add_argument("--child", default=None)
    ap.add_argument("--folder", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not args.width:
        # model (4 B) + exp_avg + exp_avg_sq (8 B) per parameter
        args.width = int(((args.gib * (1 << 30)) / 12 / args.layers) ** 0.5)
    if args.child:
        child(args)
        return
    _quiet()
    base = args.dir or os.path.join(os.getcwd(), "bench_torchtitan_tmp")
    os.makedirs(base, exist_ok=True)
    results: dict = {"layers": args.layers, "width": args.width}

    if args.rss_saves:
        for way in ("stock", "ckptstore"):
            folder = os.path.join(base, f"rss-{way}")
            shutil.rmtree(folder, ignore_errors=True)
            r = spawn(args, way, folder, ["--rss-saves", str(args.rss_saves)])
            results[f"rss_{way}"] = r
            print(f"{way:9s} async x{args.rss_saves}: VmHWM after save 2 {r['hwm_2'] / 1024:.0f} MiB, "
                  f"after save {args.rss_saves} {r['hwm_n'] / 1024:.0f} MiB "
                  f"(ratio {r['hwm_n'] / r['hwm_2']:.3f})")
            shutil.rmtree(folder, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return

    init_dist()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for mode in args.modes.split(","):
        for way in ("stock", "ckptstore"):
            folder = os.path.join(base, f"{mode}-{way}")
            shutil.rmtree(folder, ignore_errors=True)
            model, opt, mgr, step, ts = build(way, folder, mode, args.layers, args.width)
            step()
            nbytes = state_bytes(model, opt)
            results["state_gib"] = nbytes / (1 << 30)
            blocked, durable = [], []
            for _ in range(args.saves):
                step()
                t0 = time.perf_counter()
                mgr.save(ts.step)
                t1 = time.perf_counter()
                mgr.maybe_wait_for_saving()
                t2 = time.perf_counter()
                blocked.append(t1 - t0)
                durable.append(t2 - t0)
            mgr.close()
            r = {
                "blocked_first": blocked[0],
                "blocked": statistics.median(blocked[1:] or blocked),
                "durable": statistics.median(durable[1:] or durable),
            }
            if way == "ckptstore":  # the floor, measured beside this mode's saves
                r["copy_once"] = statistics.median(copy_once(model, opt) for _ in range(3))
            del model, opt, mgr
            for cache in ("cold", "warm"):
                (evict if cache == "cold" else raw_read)(folder)
                r[f"resume_{cache}"] = spawn(args, way, folder, [])
            results[f"{mode}_{way}"] = r
            floor = f"; copy once {r['copy_once']:.3f} s" if "copy_once" in r else ""
            print(f"{mode:9s} {way:9s} blocked {r['blocked']:.3f} s (first {r['blocked_first']:.3f}){floor}, "
                  f"until durable {r['durable']:.3f} s; resume cold {r['resume_cold']['load']:.3f} s "
                  f"(+step {r['resume_cold']['first_step']:.3f}), warm {r['resume_warm']['load']:.3f} s "
                  f"(+step {r['resume_warm']['first_step']:.3f})", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    print(f"state: {results['state_gib']:.3f} GiB")
    modes = args.modes.split(",")
    for mode in modes:
        s, c = results[f"{mode}_stock"], results[f"{mode}_ckptstore"]
        print(f"ratios {mode}: blocked {s['blocked'] / c['blocked']:.2f}x, until durable "
              f"{s['durable'] / c['durable']:.2f}x, resume cold {s['resume_cold']['load'] / c['resume_cold']['load']:.2f}x "
              f"(first step {s['resume_cold']['first_step'] / c['resume_cold']['first_step']:.2f}x), warm "
              f"{s['resume_warm']['load'] / c['resume_warm']['load']:.2f}x "
              f"(first step {s['resume_warm']['first_step'] / c['resume_warm']['first_step']:.2f}x)")
    if "disabled" in modes and "async" in modes:
        sync_stock = results["disabled_stock"]["blocked"]
        ours = results["async_ckptstore"]["blocked"]
        print(f"ckptstore async blocked / stock synchronous save: {ours / sync_stock:.3f}; "
              f"/ copying the state once (same mode, median of 3, "
              f"{results['async_ckptstore']['copy_once']:.3f} s): "
              f"{ours / results['async_ckptstore']['copy_once']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
