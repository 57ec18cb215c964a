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

Usage: python python/benches/bench_torch.py [--size 1GiB] [--repeat 3] [--dir /tmp/x] [--cold]

``--restore`` (issue 16) measures instead the real resume, **one fresh process per
measurement**: the child imports torch, builds the model (``--layers`` x
``Linear(--width, --width)``, default five 4096 x 4096 layers, 0.94 GiB with Adam's state) and
an Adam optimizer without state, gives every parameter a gradient, then times (a) the restore
and (b) the restore plus one ``optimizer.step()`` ("first step": the lazily loaded ways pay
their reads there), and reports its peak RSS (``resource.getrusage``) after the restore against
its RSS before it. Ways: ckptstore.torch.load; ``ckptstore_prev`` (its restore before the single
pass, see ``prev_load``); torch.load (plain, and mmap=True) +
load_state_dict; safetensors.torch.load_file + load_state_dict; DCP (FileSystemReader,
``dcp.load`` + ``set_state_dict``); and a raw pread of the same files (baseline). ``cold``:
the files are evicted from the page cache before each child (posix_fadvise DONTNEED, checked
with ``fincore`` where present); ``hot``: read once before. Best of ``--repeat`` for each,
the order of the ways rotated each repetition. ``--throttle 600MiB`` runs every child in a
cgroup that holds its reads from the disk to that rate (root only): on a shared VM whose disk
speed swings 3x between runs, the cold ratios then compare like with like.

    python python/benches/bench_torch.py --restore [--layers 5 --width 4096] [--repeat 2] [--dir DIR]
                                 [--throttle 600MiB]
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
sys.path.insert(0, _here)
from bench_util import (  # noqa: E402  (the shared helpers; stdlib only, so imported first)
    evict,
    evict_checked,
    files_of,
    fsync_path,
    keep_best,
    parse_size,
    ReadThrottle,
    raw_read,
    remove,
    state_bytes,
    status_kib,
)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402


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


# ---- --restore: fresh process per measurement -------------------------------------------


def mlp(layers: int, width: int):
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def prev_load(path, model, opt) -> None:
    """The restore of ``ckptstore.torch.load`` before its single pass (kept to measure the
    change in the same run): the model's CRCs checked (one pass), the optimizer state loaded
    into engine-owned buffers in a second parallel phase and handed to torch through numpy,
    then the model copied in place; CPU, default layout only."""
    ck = ckptstore.open(path)
    live = model.state_dict(keep_vars=True)
    ck.verify_tensors(list(live), release=True)
    st = ck.load_optimizer(None, release=True)
    sd = ct._build_state_dict(model, opt, st, (ck.metadata.get(ct.META_KEY) or {}).get("optimizer") or {})
    opt.load_state_dict(sd)
    with torch.no_grad():
        ck.copy_into([(n, t.detach().reshape(-1).view(torch.uint8).numpy()) for n, t in live.items()],
                     release=True)


def fresh_opt_state(model) -> list:
    """Adam's two state tensors per parameter in new memory, every page written once."""
    return [(torch.empty_like(p).fill_(0), torch.empty_like(p).fill_(0)) for p in model.parameters()]


def child(way: str, path: str, layers: int, width: int) -> None:
    def rss_kib() -> int:
        return status_kib("VmRSS")

    torch.set_num_threads(os.cpu_count() or 1)
    model = mlp(layers, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    gc.collect()
    before = rss_kib()
    t0 = time.perf_counter()
    if way == "ckptstore":
        ct.load(path, model, opt)
    elif way == "ckptstore_prev":
        prev_load(path, model, opt)
    elif way == "torch":
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        del sd
    elif way == "torch_mmap":
        sd = torch.load(path, mmap=True, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        del sd
    elif way == "safetensors":
        st_load(path, model, opt)
    elif way == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = dcp_state(model, opt)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        del sd
    elif way == "raw":
        raw_read(path)
    elif way == "fresh_fill":
        # The floor of any restore into new memory: create the optimizer state's memory
        # (two tensors per parameter, every page written once), nothing read.
        st = fresh_opt_state(model)  # noqa: F841  (held until the timing ends)
    elif way == "floor":
        # Issue 24's floor of a restore: the optimizer state's memory created (as
        # fresh_fill) plus the model's bytes copied from the checkpoint's files into the
        # tensors that already hold the model (from the page cache when it is hot).
        st = fresh_opt_state(model)  # noqa: F841  (held until the timing ends)
        views = [memoryview(p.detach().reshape(-1).view(torch.uint8).numpy()) for p in model.parameters()]
        shards = [f for f in files_of(path) if f.endswith(".safetensors")] or files_of(path)
        fi, fd, off = 0, os.open(shards[0], os.O_RDONLY), 0
        try:
            for v in views:
                got = 0
                while got < len(v):
                    n = os.preadv(fd, [v[got:]], off)
                    if n == 0:
                        os.close(fd)
                        fd = -1
                        fi += 1
                        if fi == len(shards):
                            raise SystemExit("floor: the files hold fewer bytes than the model")
                        fd, off = os.open(shards[fi], os.O_RDONLY), 0
                        continue
                    got += n
                    off += n
        finally:
            if fd >= 0:
                os.close(fd)
    else:
        raise SystemExit(f"unknown way {way}")
    t1 = time.perf_counter()
    peak = status_kib("VmHWM")
    if way not in ("raw", "fresh_fill", "floor"):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3) if p.grad is None else p.grad
        opt.step()
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "first_step_s": t2 - t0, "rss_before_kib": before,
                      "peak_after_load_kib": peak}))


def restore_bench(args) -> None:
    import subprocess

    layers, width = args.layers, args.width
    torch.manual_seed(0)
    model = mlp(layers, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    nbytes = state_bytes(model, opt)
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-restore-")
    os.makedirs(base, exist_ok=True)
    paths = {
        "ckptstore": os.path.join(base, "ckpt"),
        "torch": os.path.join(base, "ckpt.pt"),
        "safetensors": os.path.join(base, "ckpt.safetensors"),
        "dcp": os.path.join(base, "dcp"),
    }
    for p in paths.values():
        remove(p)
    ct.save(paths["ckptstore"], model, opt)
    torch_save(paths["torch"], model, opt)
    st_save(paths["safetensors"], model, opt)
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state(model, opt), storage_writer=dcp.FileSystemWriter(paths["dcp"]))
    for p in paths.values():
        fsync_path(p) if os.path.isfile(p) else [fsync_path(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs]
    del model, opt
    gc.collect()
    ways = [("raw", "ckptstore"), ("fresh_fill", "ckptstore"), ("floor", "ckptstore"),
            ("ckptstore", "ckptstore"),
            ("ckptstore_prev", "ckptstore"), ("torch", "torch"), ("torch_mmap", "torch"),
            ("safetensors", "safetensors"), ("dcp", "dcp")]
    if args.ways:
        keep = args.ways.split(",")
        ways = [w for w in ways if w[0] in keep]
    print(f"restore: {layers} x Linear({width}, {width}) + Adam state, {nbytes / 2**30:.3f} GiB; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}; fresh process per run; "
          f"order rotated each repetition; best of {args.repeat}",
          flush=True)
    throttle = ReadThrottle(base, parse_size(args.throttle)) if args.throttle else None
    if throttle:
        import atexit

        atexit.register(throttle.close)  # also when a run fails part-way
        print(f"every child's reads throttled: {throttle.rule}", flush=True)
    res: dict = {}
    runs: dict = {}  # (cache, way) -> {repetition: restore seconds}
    for cache in ("cold", "hot"):
        for rep in range(args.repeat):
            # The order rotated each repetition, so that no way always runs right after the
            # same other way (what a child leaves behind, freed memory or evicted pages,
            # moved the cold figures by 0.4 s in session 19).
            k = rep % len(ways)
            for way, kind in ways[k:] + ways[:k]:
                path = paths[kind]
                if cache == "cold":
                    evict_checked(path, nbytes)
                else:
                    raw_read(path)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", way, path,
                                      "--layers", str(layers), "--width", str(width)],
                                     capture_output=True, text=True,
                                     preexec_fn=throttle.enter if throttle else None)
                if out.returncode != 0:
                    print(f"{way} ({cache}) failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"  run {cache} {way}: {json.dumps(r)}", flush=True)
                runs.setdefault((cache, way), {})[rep] = r["load_s"]
                # rss_before_kib: the first run's.
                keep_best(res, (cache, way), r, ("load_s", "first_step_s", "peak_after_load_kib"))
    gib = nbytes / 2**30
    opt_bytes = nbytes * 2 / 3
    for cache in ("cold", "hot"):
        ck = res.get((cache, "ckptstore"))
        print(f"\n{cache} page cache   {'restore s':>10} {'GiB/s':>6} {'first step s':>13} "
              f"{'x ckptstore':>11} {'peak RSS MiB':>13} {'+ over before':>13} {'/ new state':>11}")
        for way, _ in ways:
            r = res.get((cache, way))
            if r is None:
                continue
            inc = (r["peak_after_load_kib"] - r["rss_before_kib"]) * 1024
            rel = r["first_step_s"] / ck["first_step_s"] if ck else float("nan")
            if way in ("raw", "fresh_fill", "floor"):
                rel = r["load_s"] / ck["load_s"] if ck else float("nan")
            print(f"{way:<20} {r['load_s']:>10.3f} {gib / r['load_s']:>6.2f} {r['first_step_s']:>13.3f} "
                  f"{rel:>11.2f} {r['peak_after_load_kib'] / 1024:>13.0f} {inc / 2**20:>13.0f} "
                  f"{inc / opt_bytes:>11.2f}")
    print("\nx ckptstore: the way's time to the first step / ckptstore's (> 1: ckptstore faster); "
          "for raw (a pread of the files), fresh_fill (creating the optimizer state's memory, "
          "nothing read) and floor (fresh_fill plus the model's bytes read from the files into "
          "its tensors), their time / ckptstore's restore time.\n"
          "+ over before: peak RSS after the restore minus RSS before it (the model and its "
          "gradients exist before); / new state: that over the optimizer state's bytes, the "
          "memory a restore must create.")
    hot, floor = res.get(("hot", "ckptstore")), res.get(("hot", "floor"))
    if hot and floor:
        print(f"hot restore / its floor (fresh optimizer state + the model copied into its "
              f"tensors): {hot['load_s'] / floor['load_s']:.2f}x ({hot['load_s']:.3f} s / "
              f"{floor['load_s']:.3f} s; issue 24's goal <= 1.25x)")
        # The two runs of one repetition share that moment's load: the median of the
        # per-repetition ratios moves less with this machine's noise than a ratio of bests.
        ours, its = runs[("hot", "ckptstore")], runs[("hot", "floor")]
        pairs = [ours[k] / its[k] for k in sorted(ours) if k in its]
        if pairs:
            print(f"hot restore / its floor, each repetition's pair: "
                  f"{', '.join(f'{x:.2f}' for x in pairs)}; median {statistics.median(pairs):.2f}x")
    cold, raw = res.get(("cold", "ckptstore")), res.get(("cold", "raw"))
    if cold and raw:
        print(f"cold: raw read of the files / ckptstore's restore: "
              f"{raw['load_s'] / cold['load_s']:.2f}x ({raw['load_s']:.3f} s / {cold['load_s']:.3f} s)")
    print("JSON " + json.dumps({f"{c}_{w}": v for (c, w), v in res.items()}))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


def save_compare(args) -> None:
    """1 GiB (``--size``) of FP32 in 64 tensors: ckptstore.save (durable: shards, fsyncs,
    manifest) against safetensors.torch.save_file + fsync of the file and its directory,
    alternating, best of ``--repeat``, two ways:

    * ``fresh``: each writes where its previous copy was removed, outside the timing, and
      ``sync`` has settled the file system: the write itself;
    * ``replace``: each replaces its previous copy inside the timing, as a training loop
      does: safetensors ``save_file`` over the old file (truncating it), ckptstore with its
      cleanup ``inline`` (the old shards removed before ``save`` returns) and
      ``background`` (``save`` returns at the commit point; the removal is waited for
      outside the timing, before the next measurement).
    """
    from safetensors.torch import save_file

    n = 64
    per = parse_size(args.size) // 4 // n
    g = torch.Generator().manual_seed(0)
    ts = {f"t{i:02d}": torch.rand(per, generator=g) for i in range(n)}
    arrays = {k: v.numpy() for k, v in ts.items()}
    nbytes = per * 4 * n
    base = args.dir or tempfile.mkdtemp(prefix="ckptstore-save-")
    os.makedirs(base, exist_ok=True)
    ckp, stp = os.path.join(base, "ck"), os.path.join(base, "st.safetensors")

    def ck(cleanup):
        return lambda: ckptstore.save(ckp, arrays, max_shard_size=256 << 20, cleanup=cleanup)

    def st():
        save_file(ts, stp)
        fsync_path(stp)

    def clear(name):
        # Only this way's own copy: the other tool's stays, for its "replace" way.
        if "ckptstore" in name:
            shutil.rmtree(ckp, ignore_errors=True)
        elif os.path.exists(stp):
            os.remove(stp)
        os.sync()

    # Every "replace" way finds the copy the way before it left (asserted below).
    ways = [("fresh ckptstore", True, ck("inline")), ("fresh safetensors", True, st),
            ("replace ckptstore inline", False, ck("inline")),
            ("replace ckptstore background", False, ck("background")),
            ("replace safetensors", False, st)]
    best = {name: float("inf") for name, _, _ in ways}
    for _ in range(args.repeat):
        for name, fresh, run in ways:
            if fresh:
                clear(name)
            else:
                assert os.path.exists(os.path.join(ckp, "ckpt-manifest.json") if "ckptstore" in name else stp), name
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
            ckptstore.wait_for_cleanup()
            os.sync()
    gib = nbytes / 2**30
    for k, v in best.items():
        print(f"save {k:<30} {v:8.3f} s {gib / v:6.2f} GiB/s")
    print(f"fresh:   ckptstore / safetensors save_file+fsync: {best['fresh safetensors'] / best['fresh ckptstore']:.2f}x")
    for c in ("inline", "background"):
        print(f"replace: ckptstore ({c}) / safetensors save_file+fsync over its file: "
              f"{best['replace safetensors'] / best[f'replace ckptstore {c}']:.2f}x")
    print("JSON " + json.dumps({k.replace(" ", "_") + "_save_gibps": gib / v for k, v in best.items()}))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


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
    ap.add_argument("--size", default="1GiB", help="model + optimizer state size (default 1GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is shown")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--cold", action="store_true", help="evict the files from the page cache before loads")
    ap.add_argument("--restore", action="store_true", help="fresh-process restore + first step, cold and hot")
    ap.add_argument("--layers", type=int, default=5, help="--restore: Linear layers (default 5)")
    ap.add_argument("--width", type=int, default=4096, help="--restore: layer width (default 4096)")
    ap.add_argument("--ways", default=None, help="--restore: comma-separated subset of the ways")
    ap.add_argument("--throttle", default=None,
                    help="--restore: hold every child's reads from the disk to this rate, e.g. "
                         "600MiB (a cgroup read throttle, root only): cold figures that do not "
                         "move with a shared disk's load")
    ap.add_argument("--save-compare", action="store_true",
                    help="ckptstore.save against safetensors save_file + fsync, 64 FP32 tensors")
    args = ap.parse_args()
    if args.save_compare:
        save_compare(args)
        return
    if args.restore:
        restore_bench(args)
        return

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
            remove(path)
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
        remove(path)

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
