#!/usr/bin/env bash
# Long chaos-resume runs: a small PyTorch training run SIGKILLed again and
# again, at seeded named points (the package's CKPTSTORE_FAULT seam, the Rust writer's
# pause seam, an unlink interposer for the retention sweep) and by random timers, restarted
# from its newest committed checkpoint until done, on a local CheckpointManager, on s3://
# (an s3s-fs server on loopback, started here) and as a 2-rank FSDP2 job through
# ckptstore.torch.distributed. Every resume and every committed step is checked bit for bit
# against an uninterrupted run; after gc nothing but the kept steps may be left.
# The driver is tests/python/chaos_harness.py (its docstring lists the checks); the test
# suite runs a small budget of it (tests/python/test_chaos.py).
#
#   scripts/chaos.sh --kills 1000                 # the long version; one line per run with its seed
#   scripts/chaos.sh --minutes 10 --kills 100000  # as many kills as fit in 10 minutes
#   scripts/chaos.sh --modes local --only-seed 1234 --per-run 10 -v   # replay one failing run
#
# Options: --kills N (total, default 1000), --per-run N (kills per run, default 10),
# --modes local,s3,dist, --seed S (first seed; default from the clock), --only-seed S,
# --timer P (share of lives killed by a timer, default 0.3), --minutes M, --work DIR (kept),
# -v (one line per kill). Exit status 1 if any run failed (each FAIL line names its seed).
# Needs: .venv with torch (scripts/test.sh makes it), the bindings installed in it,
# target/release/ckpt (cargo build --release), a C compiler (cc) and, for s3, s3s-fs
# (cargo install s3s-fs@0.14.1 --locked --features binary).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export CKPT_BIN=${CKPT_BIN:-$PWD/target/release/ckpt}
if [ ! -x "$CKPT_BIN" ]; then
  echo "chaos.sh: $CKPT_BIN is missing (cargo build --release)" >&2
  exit 2
fi
exec "$PY" tests/python/chaos_harness.py "$@"
