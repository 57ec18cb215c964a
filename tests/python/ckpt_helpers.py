"""Helpers for the ckptstore interop tests: run the CLI, read and write manifests the way
format-spec/manifest.md describes, read safetensors headers, damage files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

MANIFEST = "ckpt-manifest.json"
LOCK_FILE = ".ckpt-lock"
TEMP_PREFIX = ".ckpt-tmp-"
TRAILER_HEAD = b',"manifest_crc32":"'
TRAILER_LEN = len(TRAILER_HEAD) + 8 + 3  # head, 8 hex digits, '"}', LF

# numpy dtype -> safetensors wire name, for every dtype both safetensors.numpy and ckptstore
# support (ckptstore's BF16 has no numpy dtype; safetensors' C64 is refused by ckptstore).
ST_DTYPE = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
NP_DTYPE = {v: k for k, v in ST_DTYPE.items()}

# --max-shard-size for packing the source arrays: small enough that they pack into several
# shards, and smaller than the "big" tensor so that it gets a shard of its own.
MAX_SHARD = 4096

SOURCE_METADATA = {"framework": "numpy", "step": "1000", "note": "interop ✓ ünïcode"}


def make_arrays(seed: int) -> dict[str, np.ndarray]:
    """Tensors of every shared dtype, with float specials (NaN payloads, ±inf, -0.0,
    subnormals), 0-dim and zero-size arrays, a non-ASCII name and one tensor (`big`, 6400
    bytes) larger than the tests' max shard size."""
    rng = np.random.default_rng(seed)

    def ints(dt, shape):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)

    f64 = rng.standard_normal((3, 5))
    f64.flat[:5] = [np.nan, np.inf, -np.inf, -0.0, 5e-324]
    f32 = rng.standard_normal((4, 6)).astype(np.float32)
    f32.flat[:4] = np.array([0x7FC12345, 0xFFC00001, 0x80000000, 0x00000001], np.uint32).view(np.float32)
    f16 = rng.standard_normal((5, 3, 2)).astype(np.float16)
    f16.flat[:3] = np.array([0x7E01, 0xFC00, 0x0001], np.uint16).view(np.float16)
    return {
        "f64": f64,
        "f32": f32,
        "f16": f16,
        "i64": ints(np.int64, (17,)),
        "i32": ints(np.int32, (3, 3)),
        "i16": ints(np.int16, (2, 7)),
        "i8": ints(np.int8, (33,)),
        "u64": ints(np.uint64, (4,)),
        "u32": ints(np.uint32, (2, 5)),
        "u16": ints(np.uint16, (9,)),
        "u8": ints(np.uint8, (3, 11)),
        "mask": rng.random((3, 5)) < 0.5,
        "scalar.f32": np.array(3.25, np.float32),
        "scalar.i64": np.array(-(2**62) + 7, np.int64),
        "scalar.bool": np.array(True),
        "empty.f32": np.zeros((0, 3), np.float32),
        "empty.i16": np.zeros((2, 0, 4), np.int16),
        "empty.u8": np.zeros((0,), np.uint8),
        "mid.a": rng.standard_normal(300).astype(np.float32),
        "mid.b": rng.standard_normal(200),
        "mid.c": ints(np.int32, (500,)),
        "layers.0/wëight": rng.standard_normal((20, 10)).astype(np.float32),
        "big": rng.standard_normal((40, 40)).astype(np.float32),
    }


def run_ckpt(binary, *args, expect=None, timeout=60) -> subprocess.CompletedProcess:
    """Run the CLI; never accept a Rust panic; check the exit status when `expect` is set."""
    cmd = [str(binary), *(str(a) for a in args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = f"$ {' '.join(cmd)}\n--- exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert "panicked" not in r.stdout + r.stderr, out
    assert r.returncode not in (101, -6, -11), out  # Rust panic exit code, abort, segfault
    if expect is not None:
        assert r.returncode == expect, out
    return r


def split_manifest(raw: bytes) -> tuple[bytes, int]:
    """(body, crc recorded in the trailer); asserts the trailer's exact form."""
    assert len(raw) >= TRAILER_LEN, raw
    body, trailer = raw[:-TRAILER_LEN], raw[-TRAILER_LEN:]
    assert trailer.startswith(TRAILER_HEAD) and trailer.endswith(b'"}\n'), trailer
    hexdigits = trailer[len(TRAILER_HEAD) : len(TRAILER_HEAD) + 8]
    assert all(c in b"0123456789abcdef" for c in hexdigits), trailer
    return body, int(hexdigits, 16)


def read_manifest(d: Path) -> dict:
    """Read ckpt-manifest.json, checking its CRC trailer with zlib.crc32."""
    raw = (Path(d) / MANIFEST).read_bytes()
    body, crc = split_manifest(raw)
    assert zlib.crc32(body) == crc, f"manifest CRC: trailer {crc:08x}, zlib {zlib.crc32(body):08x}"
    m = json.loads(raw)
    assert m["manifest_crc32"] == f"{crc:08x}"
    assert list(m)[-1] == "manifest_crc32"
    return m


def encode_manifest(m: dict, *, indent=None) -> bytes:
    """Encode a manifest as an independent writer would (format-spec/manifest.md §Trailer).
    With indent=None the JSON is compact, as ckptstore writes it."""
    obj = {k: v for k, v in m.items() if k != "manifest_crc32"}
    sep = (",", ":") if indent is None else (",", ": ")
    text = json.dumps(obj, ensure_ascii=False, separators=sep, indent=indent)
    assert text.endswith("}")
    body = text[:-1].encode("utf-8")
    return body + TRAILER_HEAD + f"{zlib.crc32(body):08x}".encode() + b'"}\n'


def rewrite_manifest(d: Path, mutate, *, indent=None) -> dict:
    """Apply `mutate(manifest_dict)` and write the result back with a correct CRC."""
    m = read_manifest(d)
    mutate(m)
    (Path(d) / MANIFEST).write_bytes(encode_manifest(m, indent=indent))
    return m


def clone_checkpoint(src: Path, dst: Path) -> None:
    """Copy a checkpoint's manifest and hard-link its shards (for tests that edit only the
    manifest: no extra disk space)."""
    dst.mkdir()
    for name in os.listdir(src):
        if name == MANIFEST:
            (dst / name).write_bytes((src / name).read_bytes())
        elif not name.startswith("."):
            os.link(src / name, dst / name)


def shard_header(path: Path) -> tuple[int, dict, bytes]:
    """(N, parsed header JSON, the N header bytes) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    assert len(raw) == n
    return n, json.loads(raw), raw


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"offset {offset} past the end of {path}"
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def bits(a: np.ndarray) -> bytes:
    """Little-endian bytes of an array (what safetensors stores)."""
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def assert_bit_equal(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert bits(got) == bits(want), f"{what}: bytes differ"
    if want.dtype.kind in "biu":  # and plainly equal, for readable failures
        assert np.array_equal(got, want), what


def stored_tensor(ckpt_dir: Path, prefix: str) -> tuple[Path, str, int]:
    """``(shard file, stored name, absolute offset of its first data byte)`` of the first
    stored tensor whose name starts with ``prefix``, found in the shard headers: a chunk of
    a multi-rank checkpoint is stored under its own name (``w@0,0~r0``), which the reader's
    catalog does not list (it lists the global tensor ``w``)."""
    for shard in sorted(Path(ckpt_dir).glob("*.safetensors")):
        n, header, _ = shard_header(shard)
        for name, entry in header.items():
            if name != "__metadata__" and name.startswith(prefix):
                return shard, name, 8 + n + entry["data_offsets"][0]
    raise AssertionError(f"no stored tensor starting with {prefix!r} in {ckpt_dir}")


# ---- s3s-fs, the S3 server of the object-storage tests -------------------------------------

S3S_FS_MISSING = (
    "the S3 tests need the s3s-fs server: "
    "`cargo install s3s-fs@0.14.1 --locked --features binary` (scripts/test.sh does)"
)


class S3sFsError(RuntimeError):
    """s3s-fs is not installed, or did not start."""


def start_s3s_fs(data: str, key: str, secret: str, timeout: float = 30.0, host: str = "127.0.0.1"):
    """Start s3s-fs serving the directory ``data`` (a bucket is a subdirectory) on a free
    port of ``host`` (loopback by default; a network-namespace cluster's bridge address for
    its hosts); returns ``(process, port)`` once the port accepts connections. The
    executable is ``$CKPT_S3S_FS``, else ``s3s-fs`` on PATH, else ``~/.cargo/bin/s3s-fs``.
    Raises :class:`S3sFsError` when it is missing or does not listen within ``timeout``."""
    import shutil
    import socket
    import time

    exe = os.environ.get("CKPT_S3S_FS") or shutil.which("s3s-fs") or str(Path.home() / ".cargo/bin/s3s-fs")
    if not os.access(exe, os.X_OK):
        raise S3sFsError(S3S_FS_MISSING)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--host", host, "--port", str(port), "--access-key", key, "--secret-key", secret, str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while True:  # ready when the port accepts connections
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise S3sFsError(f"s3s-fs did not listen on port {port} within {timeout:.0f} s")
            time.sleep(0.02)


def restore_env(old: dict) -> None:
    """Put back environment variables saved as ``{name: value or None}`` (None: unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
