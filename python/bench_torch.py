#!/usr/bin/env python3
"""Benchmark (not a test): save and restore one model + Adam optimizer with

* ckptstore.torch.save / ckptstore.torch.load,
* torch.save / torch.load(mmap=True) + load_state_dict,
* safetensors.torch.save_file / load_file + load_state_dict (state flattened to tensors,
  parameter groups as JSON metadata),

and print seconds, GiB/s and ratios (baseline time / ckptstore time: > 1 means ckptstore is
faster).

What each column measures:

* ``save``: the call that writes the checkpoint. ckptstore fsyncs every shard and the
  directory (its save is durable when it returns); ``save+fsync`` adds an fsync of the
  written file to the others, for a like-for-like durable save.
* ``load``: from nothing to a restored model and optimizer (``load_state_dict`` done).
  ``torch.load(mmap=True)`` and safetensors defer work: the optimizer state they restore
  stays mapped (copy-on-write) and is read, and copied, when first used. ``load+write``
  therefore adds one in-place pass over every restored tensor (``t.mul_(1)``), the memory
  traffic of the first optimizer step, which writes every state tensor. ckptstore has
  already read, CRC-checked and copied everything into fresh memory when ``load``
  returns.
* ``--cold`` evicts the checkpoint files from the page cache before each load
  (``posix_fadvise(DONTNEED)``), so loads read the disk; otherwise they read the page cache.

Usage: python python/bench_torch.py [--size 1GiB] [--repeat 3] [--dir /tmp/x] [--cold]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# Run from a checkout, this script's folder holds the package *source* (without the built
# extension): import the installed package instead (`pip install ./python`).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402


def parse_size(s: str) -> int:
    s = s.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def build(total_bytes: int, seed: int = 0):
    """An MLP whose float32 parameters plus Adam's exp_avg and exp_avg_sq come to about
    ``total_bytes``, with one Adam step taken so that every state exists."""
    torch.manual_seed(seed)
    width = 2048
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(total_bytes / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_like(model, opt):
    """A model and optimizer of the same structure with different values and no state."""
    m = type(model)(*[torch.nn.Linear(l.in_features, l.out_features) for l in model])
    return m, torch.optim.Adam(m.parameters(), lr=0.5)


def state_bytes(model, opt) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
    return n


@torch.no_grad()
def touch(model, opt) -> None:
    """Write every restored tensor once, in place (as the first optimizer step does):
    mapped copy-on-write state gets its private copy here."""
    for t in model.parameters():
        t.mul_(1)
    for s in opt.state.values():
        for t in s.values():
            if torch.is_tensor(t) and t.dtype != torch.bool:
                t.mul_(1)


def fsync_path(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    d = path if os.path.isdir(path) else os.path.dirname(path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    for p in paths:
        if not os.path.isfile(p):
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- the three ways --------------------------------------------------------------------


def ck_save(path, model, opt):
    ct.save(path, model, opt)


def ck_load(path, model, opt):
    ct.load(path, model, opt)


def torch_save(path, model, opt):
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)


def torch_load(path, model, opt):
    sd = torch.load(path, mmap=True, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def st_save(path, model, opt):
    from safetensors.torch import save_file

    sd = opt.state_dict()
    flat = dict(model.state_dict())
    for i, s in sd["state"].items():
        for k, v in s.items():
            flat[f"optim/{i}/{k}"] = v
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    save_file(flat, path, metadata={"param_groups": json.dumps(groups)})


def st_load(path, model, opt):
    from safetensors import safe_open
    from safetensors.torch import load_file

    flat = load_file(path)
    with safe_open(path, framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    for g in groups:
        g["betas"] = tuple(g["betas"])
    state: dict[int, dict] = {}
    msd = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            _, i, name = k.split("/", 2)
            state.setdefault(int(i), {})[name] = v
        else:
            msd[k] = v
    model.load_state_dict(msd)
    opt.load_state_dict({"state": state, "param_groups": groups})


METHODS = [
    ("ckptstore", ck_save, ck_load, "ckpt"),
    ("torch (mmap load)", torch_save, torch_load, "ckpt.pt"),
    ("safetensors", st_save, st_load, "ckpt.safetensors"),
]


def check_equal(model, opt, model2, opt2) -> None:
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    for p, q in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="model + optimizer state size (default 1GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is shown")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--cold", action="store_true", help="evict the files from the page cache before loads")
    args = ap.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    model, opt = build(parse_size(args.size))
    nbytes = state_bytes(model, opt)
    gib = nbytes / (1 << 30)
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-bench-")
    os.makedirs(base, exist_ok=True)
    print(
        f"model: {len(model)} x Linear(2048, 2048), Adam; state {nbytes / (1 << 20):.0f} MiB "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params); "
        f"{os.cpu_count()} CPUs; torch {torch.__version__}; ckptstore {ckptstore.__version__}; "
        f"{'cold' if args.cold else 'warm'} page cache; median of {args.repeat}; dir {base}"
    )

    results = {}
    for name, save, load, fname in METHODS:
        path = os.path.join(base, fname)
        t_save, t_sync, t_load, t_touch = [], [], [], []
        for _ in range(args.repeat):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
            gc.collect()
            t0 = time.perf_counter()
            save(path, model, opt)
            t1 = time.perf_counter()
            fsync_path(path)
            t2 = time.perf_counter()
            t_save.append(t1 - t0)
            t_sync.append(t2 - t0)

            model2, opt2 = fresh_like(model, opt)
            if args.cold:
                evict(path)
            gc.collect()
            t0 = time.perf_counter()
            load(path, model2, opt2)
            t1 = time.perf_counter()
            touch(model2, opt2)
            t2 = time.perf_counter()
            t_load.append(t1 - t0)
            t_touch.append(t2 - t0)
            check_equal(model, opt, model2, opt2)
            del model2, opt2
        results[name] = {k: statistics.median(v) for k, v in
                         (("save", t_save), ("save+fsync", t_sync), ("load", t_load), ("load+write", t_touch))}
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    cols = ["save", "save+fsync", "load", "load+write"]
    ref = results["ckptstore"]
    print()
    print(f"{'method':<20}" + "".join(f"{c + ' s':>14}{'GiB/s':>8}{'ratio':>7}" for c in cols))
    for name, r in results.items():
        row = f"{name:<20}"
        for c in cols:
            row += f"{r[c]:>14.3f}{gib / r[c]:>8.2f}{r[c] / ref[c]:>7.2f}"
        print(row)
    print("\nratio = method's time / ckptstore's time (> 1: ckptstore faster).")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
