#!/usr/bin/env python3
"""Benchmark (not a test), issue 16 "On a GPU": restore a model + Adam optimizer that live in
CUDA memory, in one process, with

* ``ckptstore.torch.load(dir, model, optimizer)``;
* the same with the pinned staging of CUDA tensors off (``ck unstaged``: ``copy_`` from
  pageable memory, one tensor at a time), to show what the staging gains;
* ``torch.load(file, map_location="cuda", weights_only=True)`` + ``load_state_dict``;
* ``safetensors.torch.load_file(file, device="cuda")`` + ``load_state_dict`` (optimizer state
  flattened to tensors, parameter groups as JSON metadata; skipped if safetensors is absent);

against two baselines measured in the same run:

* ``h2d pinned``: one ``cuda_tensor.copy_(pinned_host_tensor, non_blocking=True)`` of the same
  byte count (the host-to-device bandwidth; the goal is >= 0.8x of it);
* ``read``: a plain ``pread`` of the ckptstore files into one reused 8 MiB buffer (what the
  disk or page cache gives; a cold restore cannot beat it).

The model is ``--layers`` x ``Linear(--width, --width)`` (default 5 x 4096: 0.94 GiB with
Adam's exp_avg and exp_avg_sq after one step). Before every restore the live parameters and
optimizer state are zeroed, so every way must really write them; the first restore of each
way is compared bit for bit with the saved state. ``torch.cuda.synchronize()`` runs before
each clock stops. ``cold``: every file is fsynced and evicted from the page cache
(``posix_fadvise(DONTNEED)``, no root needed) before each restore; ``hot``: the files are read
once before. Best of ``--repeat``.

Usage (ratios > 1 mean ckptstore is faster; ``--json`` also writes every figure)::

    python python/benches/bench_gpu.py [--layers 5 --width 4096] [--repeat 3] [--dir DIR] [--json F]
    python python/benches/bench_gpu.py --device cpu --layers 2 --width 256   # the script runs on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

# Run from a checkout, this script's folder holds the package *source* (without the built
# extension): import the installed package instead (`pip install ./python`).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import evict, files_of, raw_read  # noqa: E402  (stdlib only, so imported first)
from bench_util import fsync_path as fsync_all  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402

import ckptstore.torch as ct  # noqa: E402

try:
    import safetensors.torch as st  # noqa: E402
    from safetensors import safe_open  # noqa: E402
except ImportError:  # reported, and that way skipped
    st = None


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(layers: int, width: int, dev: torch.device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def live_tensors(model, opt) -> list:
    out = [t for t in model.state_dict().values()]
    for s in opt.state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def state_bytes(model, opt) -> int:
    return sum(t.numel() * t.element_size() for t in live_tensors(model, opt))


def snapshot(model, opt):
    return (
        [t.detach().clone() for t in model.state_dict().values()],
        [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
         for p in model.parameters()],
    )


def zero(model, opt) -> None:
    with torch.no_grad():
        for t in live_tensors(model, opt):
            t.zero_()


def check(model, opt, ref, way: str) -> None:
    mref, oref = ref
    for (k, a), b in zip(model.state_dict().items(), mref):
        if a.device != b.device or not torch.equal(a, b):
            raise SystemExit(f"{way}: model tensor {k!r} differs after restore")
    for p, s in zip(model.parameters(), oref):
        got = opt.state[p]
        for k, v in s.items():
            g = got.get(k)
            if isinstance(v, torch.Tensor):
                # Adam keeps "step" on the CPU unless capturable/fused; compare values.
                if g is None or not torch.equal(g.to(v.device), v):
                    raise SystemExit(f"{way}: optimizer state {k!r} differs after restore")
                if k != "step" and g.device != p.device:
                    raise SystemExit(f"{way}: optimizer state {k!r} restored on {g.device}")


# ---- the ways ---------------------------------------------------------------------------


def st_save(path, model, opt) -> None:
    sd = opt.state_dict()
    flat = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i, s in sd["state"].items():
        for k, v in s.items():
            flat[f"optim/{i}/{k}"] = v
    st.save_file(flat, path, metadata={"param_groups": json.dumps(sd["param_groups"])})


def st_load(path, model, opt, dev) -> None:
    flat = st.load_file(path, device=str(dev))
    with safe_open(path, framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    for g in groups:
        g["betas"] = tuple(g["betas"])
    state: dict = {}
    msd = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            _, i, name = k.split("/", 2)
            state.setdefault(int(i), {})[name] = v
        else:
            msd[k] = v
    model.load_state_dict(msd)
    opt.load_state_dict({"state": state, "param_groups": groups})


def torch_load(path, model, opt, dev) -> None:
    sd = torch.load(path, map_location=str(dev), weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def ck_load(path, model, opt, dev) -> None:
    ct.load(path, model, opt)


def ck_load_unstaged(path, model, opt, dev) -> None:
    """ckptstore.torch.load with the pinned staging off (every CUDA tensor by ``copy_``
    from pageable memory, as before it existed): what the staging gains."""
    staging = ct._staging  # the module that owns and reads the setting
    saved = staging._STAGE_BYTES
    staging._STAGE_BYTES = 0
    try:
        ct.load(path, model, opt)
    finally:
        staging._STAGE_BYTES = saved


def h2d(nbytes: int, dev: torch.device, repeat: int) -> dict:
    """Best seconds of one pinned and one pageable host -> device copy of ``nbytes``."""
    out = {}
    if dev.type != "cuda":
        return out
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for kind, pin in (("h2d pinned", True), ("h2d pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        dst.copy_(src, non_blocking=pin)  # warm-up (allocation, driver)
        sync(dev)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        out[kind] = best
        del src
    del dst
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (to try the script)")
    ap.add_argument("--modes", default="hot,cold")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    args = ap.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu to try the script on the CPU")
    base = tempfile.mkdtemp(prefix="ckgpu-", dir=args.dir)
    info = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "safetensors": None if st is None else __import__("safetensors").__version__,
        "layers": args.layers,
        "width": args.width,
        "repeat": args.repeat,
    }
    try:
        model, opt = build(args.layers, args.width, dev)
        nbytes = state_bytes(model, opt)
        info["state_bytes"] = nbytes
        ref = snapshot(model, opt)
        paths = {"ckptstore": os.path.join(base, "ck"), "torch.load": os.path.join(base, "ckpt.pt")}
        ct.save(paths["ckptstore"], model, opt)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, paths["torch.load"])
        ways = [("ckptstore", ck_load), ("torch.load", torch_load)]
        if dev.type == "cuda" and hasattr(getattr(ct, "_staging", None), "_STAGE_BYTES"):
            paths["ck unstaged"] = paths["ckptstore"]
            ways.append(("ck unstaged", ck_load_unstaged))
        if st is not None:
            paths["safetensors"] = os.path.join(base, "ckpt.safetensors")
            st_save(paths["safetensors"], model, opt)
            ways.append(("safetensors", st_load))
        for p in paths.values():
            fsync_all(p)
        info["file_bytes"] = {w: sum(os.path.getsize(f) for f in files_of(p)) for w, p in paths.items()}

        res: dict = {"h2d": h2d(nbytes, dev, args.repeat)}
        for mode in args.modes.split(","):
            best = {w: float("inf") for w, _ in ways}
            best["read"] = float("inf")
            for rep in range(args.repeat):
                # Plain read of the ckptstore files (the disk / page cache baseline).
                if mode == "cold":
                    evict(paths["ckptstore"])
                else:
                    raw_read(paths["ckptstore"])
                t0 = time.perf_counter()
                raw_read(paths["ckptstore"])
                best["read"] = min(best["read"], time.perf_counter() - t0)
                for w, fn in ways:
                    zero(model, opt)
                    sync(dev)
                    if mode == "cold":
                        evict(paths[w])
                    else:
                        raw_read(paths[w])
                    t0 = time.perf_counter()
                    fn(paths[w], model, opt, dev)
                    sync(dev)
                    best[w] = min(best[w], time.perf_counter() - t0)
                    if rep == 0:
                        check(model, opt, ref, w)
            res[mode] = best
    finally:
        shutil.rmtree(base, ignore_errors=True)

    gib = nbytes / (1 << 30)
    print(f"{info['device']}, torch {info['torch']}, safetensors {info['safetensors']}: "
          f"{args.layers} x Linear({args.width}, {args.width}) + Adam = {gib:.2f} GiB of state, "
          f"best of {args.repeat}")
    for k, s in res["h2d"].items():
        print(f"  {k:<14} {s:8.3f} s  {gib / s:6.2f} GiB/s")
    ratios: dict = {}
    for mode in args.modes.split(","):
        best = res[mode]
        ours = best["ckptstore"]
        print(f"{mode}:")
        for w, s in best.items():
            print(f"  {w:<14} {s:8.3f} s  {gib / s:6.2f} GiB/s")
        r = {f"ckptstore vs {w}": best[w] / ours for w, _ in ways if w != "ckptstore"}
        if "h2d pinned" in res["h2d"]:
            r["ckptstore / h2d pinned bandwidth"] = res["h2d"]["h2d pinned"] / ours
        r["ckptstore / read bandwidth"] = best["read"] / ours
        for k, v in r.items():
            print(f"  {k}: {v:.2f}x")
        ratios[mode] = r
    out = {"info": info, "seconds": res, "ratios": ratios}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
