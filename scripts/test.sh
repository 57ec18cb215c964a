#!/usr/bin/env bash
# The whole test suite: Rust unit, integration, property and doc tests, then the Python
# tests (stock safetensors + numpy interop, JSON Schema, the ckptstore bindings with numpy
# and torch) in a project-local venv.
# Works on a fresh machine with Rust and Python 3 installed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
# The Python bindings (python/): built from source by maturin, the PEP 517 backend pip
# fetches from PyPI, into this workspace's target/ directory.
.venv/bin/python -m pip install -q --disable-pip-version-check ./python

cargo build --release --bin ckpt
cargo test --release
CKPT_BIN="$PWD/target/release/ckpt" .venv/bin/python -m pytest -q tests/python
