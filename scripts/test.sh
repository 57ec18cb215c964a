#!/usr/bin/env bash
# The whole test suite: Rust unit, integration, property and doc tests, then the Python
# interop tests (stock safetensors + numpy, JSON Schema) in a project-local venv.
# Works on a fresh machine with Rust and Python 3 installed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt

cargo build --release --bin ckpt
cargo test --release
CKPT_BIN="$PWD/target/release/ckpt" .venv/bin/python -m pytest -q tests/python
