"""A/B of the moments' layout in ``ckptstore.torch.distributed.load`` (one engine under every
Python path): the engine's conversion (``_sharded._apply_layout``: ``state_target``,
``state_absbits``, ``convert_state``, ``F16Scaled.to_float32``) against the torch arithmetic
the package used before (the same FP16-scaled and BF16 rounding written with torch ops, which
skipped the engine's underflow check), on the same fresh tensors, in alternated rounds, beside
a plain copy of the same bytes (``torch.Tensor.copy_``) as the floor.

    python python/benches/bench_layout.py [--mib 256] [--tensors 16] [--rounds 7]

Prints the median of each way per layout and the ratios new / old and new / copy, then the
same for ``F16Scaled.to_float32`` on a quarter of the bytes in FP16 codes. One
process, no torch.distributed (the global absmax all-reduce is not timed: one integer
all-reduce for all states, where the old path made one per state).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckptstore.torch import _sharded

F16_RANGE = 32752.0  # the baseline's copy of the engine's range, as the old path had it


def old_layout(tgt_o: dict, target: str) -> None:
    """What ``_apply_layout`` computed before (torch arithmetic, no underflow check)."""
    for pname in sorted(tgt_o):
        for k in sorted(tgt_o[pname]):
            local = tgt_o[pname][k]
            if target == "bf16":
                local.copy_(local.to(torch.bfloat16).to(local.dtype))
            else:
                amax = local.abs().max().float().reshape(1)
                s = amax / F16_RANGE
                if float(s) > 0:
                    r = 1.0 / s
                    q = (local.float() * r).to(torch.float16)
                    local.copy_((q.float() * s).to(local.dtype))
                else:
                    local.zero_()


class _Opt:
    def __init__(self, params: list) -> None:
        self.param_groups = [{"params": params}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes of moments in all (MiB)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(2)
    n = a.mib * (1 << 20) // 4 // a.tensors // 2  # elements per state (exp_avg, exp_avg_sq)
    g = torch.Generator().manual_seed(0)
    params = [torch.empty(n) for _ in range(a.tensors)]
    names = [f"layer{i}.weight" for i in range(a.tensors)]
    source = {nm: {"exp_avg": torch.randn(n, generator=g) * 1e-3, "exp_avg_sq": torch.rand(n, generator=g) * 1e-6}
              for nm in names}
    opt = _Opt(params)

    def fresh() -> dict:
        return {nm: {k: v.clone() for k, v in st.items()} for nm, st in source.items()}

    for target in ("f16_scaled", "bf16"):
        times: dict[str, list[float]] = {"new": [], "old": [], "copy": []}
        for r in range(a.rounds):
            ways = ["new", "old", "copy"] if r % 2 == 0 else ["copy", "old", "new"]
            for way in ways:
                t = fresh()
                dst = {nm: {k: torch.empty_like(v) for k, v in st.items()} for nm, st in t.items()}
                t0 = time.perf_counter()
                if way == "new":
                    _sharded._apply_layout(t, names, opt, target, "bench", None)
                elif way == "old":
                    old_layout(t, target)
                else:
                    for nm in t:
                        for k in t[nm]:
                            dst[nm][k].copy_(t[nm][k])
                times[way].append(time.perf_counter() - t0)
        # Same values both ways (the engine's arithmetic is the one the old path copied).
        t_new, t_old = fresh(), fresh()
        _sharded._apply_layout(t_new, names, opt, target, "bench", None)
        old_layout(t_old, target)
        same = all(torch.equal(t_new[nm][k], t_old[nm][k]) for nm in names for k in t_new[nm])
        med = {w: statistics.median(v) for w, v in times.items()}
        print(f"{target:10s} {a.mib} MiB in {2 * a.tensors} states, {a.rounds} alternated rounds: "
              f"new (engine) {med['new'] * 1e3:.1f} ms, old (torch ops) {med['old'] * 1e3:.1f} ms, "
              f"copy {med['copy'] * 1e3:.1f} ms; new/old {med['new'] / med['old']:.2f}, "
              f"new/copy {med['new'] / med['copy']:.2f}; bit-identical to the old values: {same}")
    bench_to_float32(a.mib // 4, a.rounds)


def bench_to_float32(mib: int, rounds: int) -> None:
    """``F16Scaled.to_float32`` (the engine, into a fresh array) against numpy's ``astype``
    and multiply (what it computed before), beside a plain copy of the float32 result."""
    import numpy as np

    from ckptstore import F16Scaled

    q = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 2).astype(np.float16)
    s = np.array([3e-5], np.float32)
    f32 = q.astype(np.float32)

    def old() -> np.ndarray:
        out = q.astype(np.float32)
        out *= np.float32(s[0])
        return out

    ways = {"new": lambda: F16Scaled(q, s).to_float32(), "old": old, "copy": f32.copy}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for w in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            t0 = time.perf_counter()
            ways[w]()
            times[w].append(time.perf_counter() - t0)
    med = {w: statistics.median(v) for w, v in times.items()}
    same = np.array_equal(ways["new"]().view(np.uint32), old().view(np.uint32))
    print(f"to_float32 {mib} MiB of FP16 codes, {rounds} alternated rounds: new (engine) {med['new'] * 1e3:.1f} ms, "
          f"old (numpy) {med['old'] * 1e3:.1f} ms, copy {med['copy'] * 1e3:.1f} ms; "
          f"new/old {med['new'] / med['old']:.2f}, new/copy {med['new'] / med['copy']:.2f}; bit-identical: {same}")


if __name__ == "__main__":
    main()
