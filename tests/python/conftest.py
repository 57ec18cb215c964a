"""Shared fixtures for the Python interop tests of ckptstore.

The tests drive the `ckpt` CLI as a subprocess. The binary is taken from the environment
variable CKPT_BIN, falling back to target/release/ckpt in the repository; if neither exists
the tests fail (they are never skipped) with a message saying how to build it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.numpy import save_file

import ckpt_helpers as h

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO / "target" / "release" / "ckpt"

MAX_SHARD = h.MAX_SHARD


@pytest.fixture(scope="session")
def ckpt_bin() -> Path:
    env = os.environ.get("CKPT_BIN")
    path = Path(env) if env else DEFAULT_BIN
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(
            f"ckpt binary not found or not executable at {path} "
            f"({'from CKPT_BIN' if env else 'CKPT_BIN unset, default path'}); "
            "build it with `cargo build --release --bin ckpt` and/or set CKPT_BIN",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def ckpt(ckpt_bin):
    """Call the CLI: ckpt("verify", path, expect=1) -> CompletedProcess (text)."""

    def call(*args, expect=None, timeout=60):
        return h.run_ckpt(ckpt_bin, *args, expect=expect, timeout=timeout)

    return call


@pytest.fixture(scope="session")
def source_arrays():
    return h.make_arrays(seed=20240611)


@pytest.fixture(scope="session")
def source_file(tmp_path_factory, source_arrays) -> Path:
    """The arrays saved with stock safetensors.numpy, with user metadata."""
    path = tmp_path_factory.mktemp("src") / "model.safetensors"
    save_file(source_arrays, str(path), metadata=h.SOURCE_METADATA)
    return path


@pytest.fixture(scope="session")
def packed_dir(tmp_path_factory, ckpt, source_file) -> Path:
    """source_file packed into several shards. Read-only for the tests that use it."""
    out = tmp_path_factory.mktemp("packed") / "ckpt"
    ckpt("pack", source_file, "--out", out, "--max-shard-size", str(MAX_SHARD), expect=0)
    return out


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory, ckpt) -> tuple[Path, str]:
    """`ckpt demo --size 4MiB`: a checkpoint with an optimizer section. Returns (dir, stdout)."""
    out = tmp_path_factory.mktemp("demo") / "ckpt"
    r = ckpt("demo", "--dir", out, "--size", "4MiB", expect=0, timeout=120)
    return out, r.stdout


@pytest.fixture(scope="session")
def empty_dir(tmp_path_factory, ckpt) -> Path:
    """A checkpoint with no tensors, packed from a safetensors file holding none."""
    base = tmp_path_factory.mktemp("empty")
    src = base / "empty.safetensors"
    save_file({}, str(src))
    out = base / "ckpt"
    ckpt("pack", src, "--out", out, expect=0)
    return out
