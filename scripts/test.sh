#!/usr/bin/env bash
# The whole test suite: Rust unit, integration, property and doc tests, then the Python
# tests (stock safetensors + numpy interop, JSON Schema, the ckptstore bindings with numpy
# and torch) in a project-local venv.
# Works on a fresh machine with Rust and Python 3 installed. Prints one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "venv: creating .venv"
  python3 -m venv .venv
else
  step "venv: using .venv"
fi
step "Python packages: tests/python/requirements.txt (torch is large: minutes on a fresh machine)"
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
step "Python packages: tests/python/requirements-frameworks.txt (Lightning, Accelerate, DeepSpeed, TorchTitan)"
# DeepSpeed is an sdist: build none of its CUDA ops (its CPU comm op is JIT-built at run time
# with ninja, which the venv's bin/ provides; tests put it on PATH).
# Both files in one resolve: installed alone, the frameworks' file downgraded a package the
# first file's need (2026-12-03: huggingface-hub to 1.33 for TorchTitan's datasets 4.7, under
# the >= 2.4 that transformers 5.25 requires), and pip only warned.
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check \
  -r tests/python/requirements.txt -r tests/python/requirements-frameworks.txt
# The Python bindings (python/): built from source by maturin, the PEP 517 backend pip
# fetches from PyPI, into this workspace's target/ directory.
step "bindings: building python/ with maturin (release)"
.venv/bin/python -m pip install -q --disable-pip-version-check ./python
# Fail here, naming any conflict between the installed packages, not in a test's import.
.venv/bin/python -m pip check --disable-pip-version-check

step "Python lint and types: ruff check (the package and python/examples), mypy (the package; settings in python/pyproject.toml)"
(cd python && ../.venv/bin/ruff check py_src/ckptstore examples && ../.venv/bin/mypy)

# The S3 server the object-storage tests start on loopback (tests/s3.rs,
# tests/python/test_s3.py): installed once into ~/.cargo/bin, skipped when the pinned version
# is already there (0.15 and later need a newer rustc). The tests fail without it.
if cargo install --list | grep -q '^s3s-fs v0.14.1:'; then
  step "s3s-fs 0.14.1: already installed"
else
  step "s3s-fs 0.14.1: cargo install (about 2 minutes)"
  cargo install s3s-fs@0.14.1 --locked --features binary
fi
export PATH="$HOME/.cargo/bin:$PATH"

step "Rust build: ckpt (release)"
cargo build --release --bin ckpt
step "Rust tests: cargo test --release"
cargo test --release
step "Python tests: pytest tests/python"
CKPT_BIN="$PWD/target/release/ckpt" .venv/bin/python -m pytest -q tests/python
step "all tests passed"
