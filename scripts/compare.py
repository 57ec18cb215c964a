#!/usr/bin/env python3
"""Same workload through torch, safetensors and ckptstore, in one run (issue 5).

FP32 optimizer state (default 1 GiB in 64 tensors), hot page cache:
  torch:        torch.save + fsync;  torch.load(mmap=True) + TE-style FP16 scaling, + a BF16
                cast, + a clone (F32 copy)
  safetensors:  save_file + fsync;   load_file + the same scaling
  ckptstore:    `ckpt bench --json` (save, open, verify, loads into F16-scaled / BF16 / F32,
                each with CRC checks, through a warm BufferPool and into fresh memory, beside
                its own same-run baselines)
Every measurement is the best of --reps repetitions, so torch reuses the memory its allocator
(glibc malloc) got back from the previous repetition, as ckptstore's pooled loads do.
TE-style scaling per tensor: s = absmax / 32752; q = fp16(x * (1/s)) (0 when s == 0).

Usage: .venv/bin/python scripts/compare.py [--size-mib 1024] [--tensors 64] [--ckpt target/release/ckpt]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np
import torch
from safetensors.numpy import load_file, save_file


def te_scale(t: torch.Tensor):
    amax = t.abs().max()
    s = amax / 32752.0
    r = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return (t * r).to(torch.float16), s


def best(reps, f):
    b = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ckpt", default="target/release/ckpt")
    a = ap.parse_args()
    per = a.size_mib * (1 << 20) // 4 // a.tensors
    gib = per * a.tensors * 4 / (1 << 30)
    rng = np.random.default_rng(0)
    arrays = {f"p{k:04}.exp_avg": (rng.standard_normal(per, dtype=np.float32) * 1e-3) for k in range(a.tensors)}
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tp = os.path.join(d, "state.pt")
        sp = os.path.join(d, "state.safetensors")

        def torch_save():
            torch.save(tensors, tp)
            fsync(tp)

        def torch_load_scale():
            sd = torch.load(tp, mmap=True)
            return [te_scale(t) for t in sd.values()]

        def torch_load_bf16():
            sd = torch.load(tp, mmap=True)
            return [t.to(torch.bfloat16) for t in sd.values()]

        def torch_load_copy():
            sd = torch.load(tp, mmap=True)
            return [t.clone() for t in sd.values()]

        def st_save():
            save_file(arrays, sp)
            fsync(sp)

        def st_load_scale():
            sd = load_file(sp)
            return [te_scale(torch.from_numpy(v)) for v in sd.values()]

        rows.append(("torch.save + fsync", gib / best(a.reps, torch_save)))
        rows.append(("torch.load(mmap) + FP16 scaling", gib / best(a.reps, torch_load_scale)))
        rows.append(("torch.load(mmap) + BF16 cast", gib / best(a.reps, torch_load_bf16)))
        rows.append(("torch.load(mmap) + clone (F32)", gib / best(a.reps, torch_load_copy)))
        rows.append(("safetensors save_file + fsync", gib / best(a.reps, st_save)))
        rows.append(("safetensors load_file + FP16 scaling", gib / best(a.reps, st_load_scale)))
        out = subprocess.run(
            [a.ckpt, "bench", "--size", f"{a.size_mib}MiB", "--tensors", str(a.tensors), "--dir", d, "--json", "--reps", str(a.reps)],
            check=True, capture_output=True, text=True,
        )
        b = json.loads(out.stdout)
    rows += [
        ("ckptstore save (fsync, commit)", b["save_gibps"]),
        ("ckptstore load -> F16-scaled (CRC, pooled)", b["load_f16_scaled_gibps"]),
        ("ckptstore load -> BF16 (CRC, pooled)", b["load_bf16_gibps"]),
        ("ckptstore load -> F32 (CRC, pooled)", b["load_f32_gibps"]),
        ("ckptstore load -> F16-scaled (CRC, fresh)", b["load_f16_scaled_fresh_gibps"]),
        ("ckptstore load -> BF16 (CRC, fresh)", b["load_bf16_fresh_gibps"]),
        ("ckptstore load -> F32 (CRC, fresh)", b["load_f32_fresh_gibps"]),
        ("ckptstore verify", b["verify_gibps"]),
    ]
    base = dict(rows)
    print(f"{gib:.2f} GiB of FP32 state in {a.tensors} tensors, best of {a.reps}, one run")
    print(f"{'path':<44} {'GiB/s':>8}")
    for name, v in rows:
        print(f"{name:<44} {v:>8.2f}")
    print()
    t16, tb, t32 = (base[k] for k in ("torch.load(mmap) + FP16 scaling", "torch.load(mmap) + BF16 cast", "torch.load(mmap) + clone (F32)"))
    print("ratios (same run):")
    print(f"  ckptstore load F16-scaled / torch.load(mmap)+scaling: {b['load_f16_scaled_gibps'] / t16:.2f} pooled, {b['load_f16_scaled_fresh_gibps'] / t16:.2f} fresh")
    print(f"  ckptstore load BF16 / torch.load(mmap)+BF16 cast:     {b['load_bf16_gibps'] / tb:.2f} pooled, {b['load_bf16_fresh_gibps'] / tb:.2f} fresh")
    print(f"  ckptstore load F32 / torch.load(mmap)+clone:          {b['load_f32_gibps'] / t32:.2f} pooled, {b['load_f32_fresh_gibps'] / t32:.2f} fresh")
    print(f"  ckptstore load F16-scaled / plain f32->f16 kernel:    {b['load_f16_scaled_ratio']:.2f}")
    print(f"  ckptstore load BF16 / plain f32->bf16 kernel:         {b['load_bf16_ratio']:.2f}")
    print(f"  ckptstore load F32 / memcpy:                          {b['load_f32_ratio']:.2f}")
    print(f"  ckptstore save / raw write+fsync:                     {b['save_ratio']:.2f}")
    print(f"  ckptstore save / safetensors save_file+fsync:         {b['save_gibps'] / base['safetensors save_file + fsync']:.2f}")
    print(f"  ckptstore verify / crc32fast:                         {b['verify_ratio']:.2f}")


if __name__ == "__main__":
    main()
