"""Interop between ckptstore (through the `ckpt` CLI) and the stock Python safetensors/numpy
stack: Python -> ckptstore, Hugging Face sharded directories, ckptstore -> Python, damage
detection, diff and atomic replacement. Byte layouts follow format-spec/."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import ckpt_helpers as h

MAX_SHARD = h.MAX_SHARD


def tensors_by_name(m: dict) -> dict[str, dict]:
    return {t["name"]: t for t in m["tensors"]}


def shard_path(d: Path, m: dict, i: int) -> Path:
    return Path(d) / m["shards"][i]["file"]


def output(r) -> str:
    return r.stdout + r.stderr


# --------------------------------------------------------------------------------------
# Python -> ckptstore: a plain safetensors file written by safetensors.numpy
# --------------------------------------------------------------------------------------


def test_source_covers_every_shared_dtype(source_arrays):
    """Guard for the fixtures: every dtype both sides support, 0-dim and zero-size arrays."""
    assert {a.dtype for a in source_arrays.values()} == set(h.ST_DTYPE)
    assert any(a.ndim == 0 for a in source_arrays.values())
    assert any(a.size == 0 and a.ndim >= 2 for a in source_arrays.values())
    assert source_arrays["big"].nbytes > MAX_SHARD


def test_inspect_plain_safetensors(ckpt, source_file, source_arrays):
    info = json.loads(ckpt("inspect", source_file, "--json", expect=0).stdout)
    assert info["kind"] == "safetensors"
    assert info["checkpoint_id"] is None
    assert info["optimizer"] is None
    assert info["metadata"] == h.SOURCE_METADATA
    assert info["shards"] == [{"file": str(source_file), "size": source_file.stat().st_size}]
    assert info["total_tensors"] == len(source_arrays) == len(info["tensors"])
    assert info["total_bytes"] == sum(a.nbytes for a in source_arrays.values())
    got = {t["name"]: t for t in info["tensors"]}
    assert set(got) == set(source_arrays)
    for name, a in source_arrays.items():
        t = got[name]
        assert t["dtype"] == h.ST_DTYPE[a.dtype], name
        assert t["shape"] == list(a.shape), name
        assert t["bytes"] == a.nbytes, name
        assert (t["shard"], t["file"], t["crc32"]) == (0, str(source_file), None), name


def test_verify_plain_safetensors_has_no_checksums(ckpt, source_file):
    r = ckpt("verify", source_file, expect=0)
    assert "no checksums to check" in r.stdout
    v = json.loads(ckpt("verify", source_file, "--json", expect=0).stdout)
    assert v["ok"] is True and v["checksummed"] is False and v["error"] is None


# --------------------------------------------------------------------------------------
# ckpt pack of that file: the manifest and shards, read with Python only
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(packed_dir):
    return packed_dir, h.read_manifest(packed_dir)


def test_packed_manifest_top_level(packed, ckpt, source_file):
    d, m = packed
    raw = (d / h.MANIFEST).read_bytes()
    assert m["format"] == "ckptstore" and m["version"] == 1
    assert "features" not in m and "optimizer" not in m
    assert re.fullmatch(r"[0-9a-f]{32}", m["checkpoint_id"])
    assert m["metadata"] == h.SOURCE_METADATA
    # Compact JSON, members in spec order: an independent encoder reproduces the bytes.
    assert h.encode_manifest(m) == raw
    # Tensors in the caller's order: the order of the input file's header.
    src = json.loads(ckpt("inspect", source_file, "--json", expect=0).stdout)
    assert [t["name"] for t in m["tensors"]] == [t["name"] for t in src["tensors"]]
    for i, s in enumerate(m["shards"]):
        assert s["file"] == f"shard-{m['checkpoint_id']}-{i:05d}.safetensors"
        assert (d / s["file"]).stat().st_size == s["size"]


def test_packed_shard_split(packed, source_arrays):
    """Several shards; greedy split in caller order under --max-shard-size; the tensor
    larger than the maximum alone in its shard."""
    _, m = packed
    n = len(m["shards"])
    assert n >= 4, n
    idx = [t["shard"] for t in m["tensors"]]
    assert idx == sorted(idx) and set(idx) == set(range(n))
    data = [0] * n
    members = [[] for _ in range(n)]
    for t in m["tensors"]:
        data[t["shard"]] += t["offsets"][1] - t["offsets"][0]
        members[t["shard"]].append(t["name"])
    for i in range(n):
        assert data[i] <= MAX_SHARD or len(members[i]) == 1, (i, members[i], data[i])
        if i + 1 < n:  # the next shard's first tensor did not fit into this one
            first = source_arrays[members[i + 1][0]].nbytes
            assert data[i] + first > MAX_SHARD, (i, members[i], members[i + 1][0])
    big = tensors_by_name(m)["big"]["shard"]
    assert members[big] == ["big"]


def test_packed_bytes_offsets_and_crcs(packed, source_arrays):
    """Per shard: header length, padding, header CRC, shard metadata, exact layout. Per
    tensor: header data_offsets + 8 + N == manifest offsets, alignment, CRC of the bytes
    at the absolute offsets, bytes equal to the source array's."""
    d, m = packed
    by_shard = {}
    for t in m["tensors"]:
        by_shard.setdefault(t["shard"], []).append(t)
    for i, s in enumerate(m["shards"]):
        path = shard_path(d, m, i)
        blob = path.read_bytes()
        n, hdr, raw = h.shard_header(path)
        assert n == s["header_size"] and (8 + n) % 8 == 0
        assert zlib.crc32(raw) == s["header_crc32"] == zlib.crc32(blob[8 : 8 + n])
        assert raw.rstrip(b" ").endswith(b"}") and set(raw[len(raw.rstrip(b" ")) :]) <= {0x20}
        assert hdr["__metadata__"] == {"ckptstore.checkpoint_id": m["checkpoint_id"], "ckptstore.shard": str(i)}
        ts = by_shard[i]
        assert set(hdr) - {"__metadata__"} == {t["name"] for t in ts}
        # Layout (format-spec/shard.md §Alignment): element size descending, ties in caller
        # order, back to back from the start of the data section, no trailing bytes.
        pos = 8 + n
        for t in sorted(ts, key=lambda t: -h.NP_DTYPE[t["dtype"]].itemsize):  # stable
            nb = source_arrays[t["name"]].nbytes
            assert t["offsets"] == [pos, pos + nb], t["name"]
            pos += nb
        assert pos == s["size"] == len(blob)
        for t in ts:
            a = source_arrays[t["name"]]
            e = hdr[t["name"]]
            b, end = t["offsets"]
            assert (t["dtype"], t["shape"]) == (h.ST_DTYPE[a.dtype], list(a.shape)), t["name"]
            assert (e["dtype"], e["shape"]) == (t["dtype"], t["shape"]), t["name"]
            assert [o + 8 + n for o in e["data_offsets"]] == [b, end], t["name"]
            assert b % a.dtype.itemsize == 0, t["name"]
            assert blob[b:end] == h.bits(a), t["name"]
            assert zlib.crc32(blob[b:end]) == t["crc32"], t["name"]


def test_packed_values_via_safe_open(packed, source_arrays):
    d, m = packed
    for t in m["tensors"]:
        with safe_open(str(shard_path(d, m, t["shard"])), framework="np") as f:
            assert f.metadata()["ckptstore.checkpoint_id"] == m["checkpoint_id"]
            h.assert_bit_equal(f.get_tensor(t["name"]), source_arrays[t["name"]], t["name"])
    assert len(m["tensors"]) == len(source_arrays)


def test_packed_shards_load_whole_with_load_file(packed, source_arrays):
    d, m = packed
    seen = {}
    for i in range(len(m["shards"])):
        for name, a in load_file(str(shard_path(d, m, i))).items():
            assert name not in seen, f"{name} in two shards"
            seen[name] = a
    assert set(seen) == set(source_arrays)
    for name, a in source_arrays.items():
        h.assert_bit_equal(seen[name], a, name)


def test_inspect_and_verify_packed(packed, ckpt):
    d, m = packed
    info = json.loads(ckpt("inspect", d, "--json", expect=0).stdout)
    assert info["kind"] == "ckptstore"
    assert info["checkpoint_id"] == m["checkpoint_id"]
    assert info["metadata"] == m["metadata"]
    assert info["optimizer"] is None
    assert info["shards"] == [{"file": s["file"], "size": s["size"]} for s in m["shards"]]
    want = [
        {
            "name": t["name"],
            "dtype": t["dtype"],
            "shape": t["shape"],
            "bytes": t["offsets"][1] - t["offsets"][0],
            "shard": t["shard"],
            "file": m["shards"][t["shard"]]["file"],
            "crc32": t["crc32"],
        }
        for t in m["tensors"]
    ]
    assert info["tensors"] == want
    total = sum(t["bytes"] for t in want)
    assert (info["total_tensors"], info["total_bytes"]) == (len(want), total)
    r = ckpt("verify", d, expect=0)
    assert r.stdout.startswith(f"ok: {len(want)} tensors")
    v = json.loads(ckpt("verify", d, "--json", expect=0).stdout)
    assert (v["ok"], v["checksummed"], v["tensors"], v["bytes"]) == (True, True, len(want), total)


def test_repack_checkpoint_dir(packed, ckpt, tmp_path, source_arrays):
    d, m = packed
    out = tmp_path / "re"
    ckpt("pack", d, "--out", out, "--max-shard-size", "64KiB", expect=0)
    m2 = h.read_manifest(out)
    assert m2["checkpoint_id"] != m["checkpoint_id"]
    assert len(m2["shards"]) == 1  # everything fits into 64 KiB
    assert m2["metadata"] == m["metadata"]
    assert [t["name"] for t in m2["tensors"]] == [t["name"] for t in m["tensors"]]
    ckpt("diff", d, out, expect=0)
    loaded = load_file(str(out / m2["shards"][0]["file"]))
    for name, a in source_arrays.items():
        h.assert_bit_equal(loaded[name], a, name)


def test_pack_several_inputs_merges_tensors_and_metadata(ckpt, tmp_path, source_file, source_arrays):
    extra = {"extra.w": np.arange(12, dtype=np.int16).reshape(3, 4)}
    xfile = tmp_path / "extra.safetensors"
    save_file(extra, str(xfile), metadata={"origin": "second file"})
    out = tmp_path / "out"
    ckpt("pack", source_file, xfile, "--out", out, expect=0)
    m = h.read_manifest(out)
    assert m["metadata"] == {**h.SOURCE_METADATA, "origin": "second file"}
    assert {t["name"] for t in m["tensors"]} == set(source_arrays) | set(extra)
    with safe_open(str(out / m["shards"][tensors_by_name(m)["extra.w"]["shard"]]["file"]), "np") as f:
        h.assert_bit_equal(f.get_tensor("extra.w"), extra["extra.w"])


def test_pack_duplicate_tensor_name_fails_before_writing(ckpt, tmp_path, source_file):
    dup = tmp_path / "dup.safetensors"
    save_file({"mid.a": np.zeros(3, np.float32)}, str(dup))
    out = tmp_path / "out"
    r = ckpt("pack", source_file, dup, "--out", out, expect=1)
    assert '"mid.a"' in r.stderr and "dup.safetensors" in r.stderr
    assert not out.exists()


def test_pack_empty_safetensors(empty_dir, ckpt):
    m = h.read_manifest(empty_dir)
    assert (m["shards"], m["tensors"], m["metadata"]) == ([], [], {})
    assert sorted(os.listdir(empty_dir)) == [h.LOCK_FILE, h.MANIFEST]
    r = ckpt("verify", empty_dir, expect=0)
    assert r.stdout.startswith("ok: 0 tensors")
    info = json.loads(ckpt("inspect", empty_dir, "--json", expect=0).stdout)
    assert (info["total_tensors"], info["tensors"], info["shards"]) == (0, [], [])


# --------------------------------------------------------------------------------------
# An independent (Python) manifest writer: accepted when right, refused when wrong
# --------------------------------------------------------------------------------------


@pytest.fixture
def fresh(ckpt, tmp_path, source_file):
    """A private packed checkpoint that the test may damage."""
    d = tmp_path / "ckpt"
    ckpt("pack", source_file, "--out", d, "--max-shard-size", str(MAX_SHARD), expect=0)
    return d, h.read_manifest(d)


def test_python_written_manifest_is_accepted(fresh, ckpt, tmp_path):
    """Indented JSON (any whitespace is allowed) with a correct trailer and new metadata:
    verify passes, and inspect and pack keep the metadata and its key order."""
    d, _ = fresh
    meta = {"zeta": 1, "alpha": {"nested": [1, 2.5, None, True]}, "ünï": "✓"}
    h.rewrite_manifest(d, lambda m: m.__setitem__("metadata", meta), indent=2)
    assert b"\n  " in (d / h.MANIFEST).read_bytes()
    ckpt("verify", d, expect=0)
    info = json.loads(ckpt("inspect", d, "--json", expect=0).stdout)
    assert info["metadata"] == meta and list(info["metadata"]) == list(meta)
    out = tmp_path / "re"
    ckpt("pack", d, "--out", out, expect=0)
    m2 = h.read_manifest(out)
    assert m2["metadata"] == meta and list(m2["metadata"]) == list(meta)


def _t(m, name):
    return tensors_by_name(m)[name]


MANIFEST_EDITS = {
    # id: (mutation, command that must fail, substrings of the message)
    "version 2": (lambda m: m.__setitem__("version", 2), "inspect", ["unsupported format version 2"]),
    "unknown feature": (lambda m: m.__setitem__("features", ["ranks"]), "inspect", ['feature "ranks"']),
    "format name": (lambda m: m.__setitem__("format", "other"), "inspect", ["invalid manifest", "format"]),
    "shard file ../": (
        lambda m: m["shards"][0].__setitem__("file", "../" + m["shards"][0]["file"]),
        "inspect",
        ["plain file name"],
    ),
    "header crc": (
        lambda m: m["shards"][1].__setitem__("header_crc32", m["shards"][1]["header_crc32"] ^ 1),
        "inspect",
        ["checksum mismatch in shard header", "shard 1"],
    ),
    "checkpoint id": (
        lambda m: m.__setitem__("checkpoint_id", "0" * 32),
        "verify",
        ["belongs to checkpoint"],
    ),
    "tensor moved to another shard": (
        lambda m: _t(m, "big").__setitem__("shard", (_t(m, "big")["shard"] + 1) % len(m["shards"])),
        "inspect",
        ['"big"'],
    ),
    "misaligned offsets": (
        lambda m: _t(m, "mid.b").__setitem__("offsets", [o + 4 for o in _t(m, "mid.b")["offsets"]]),
        "inspect",
        ['"mid.b"'],
    ),
    "tensor crc": (
        lambda m: _t(m, "mid.c").__setitem__("crc32", _t(m, "mid.c")["crc32"] ^ 0x10),
        "verify",
        ['checksum mismatch in tensor "mid.c"'],
    ),
    # open trusts a header whose CRC matches the manifest's record; verify parses every
    # header and cross-checks it (format-spec/integrity.md), so these lies surface there.
    # (absmax dropped too: an F32-only member on an I32 tensor is refused at open already.)
    "dtype": (
        lambda m: (_t(m, "mid.a").__setitem__("dtype", "I32"), _t(m, "mid.a").pop("absmax", None)),
        "verify",
        ['"mid.a"', "header says"],
    ),
    "absmax on a non-F32 tensor": (
        lambda m: _t(m, "mid.a").__setitem__("dtype", "I32"),
        "inspect",
        ['"mid.a"', "absmax is recorded only for F32 tensors"],
    ),
    "absmax disagrees with the data": (
        lambda m: _t(m, "mid.a").__setitem__("absmax", _t(m, "mid.a")["absmax"] * 2),
        "verify",
        ['"mid.a"', "absmax"],
    ),
}


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_python_written_bad_manifest_is_refused(edit, fresh, ckpt):
    """Manifests with a correct CRC but wrong content: ckptstore checks more than the CRC."""
    d, _ = fresh
    mutate, cmd, needles = MANIFEST_EDITS[edit]
    h.rewrite_manifest(d, mutate)
    r = ckpt(cmd, d, expect=1)
    for s in needles:
        assert s in r.stderr, (s, r.stderr)
    ckpt("verify", d, expect=1)


# --------------------------------------------------------------------------------------
# Hugging Face sharded directories
# --------------------------------------------------------------------------------------

HF_FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def make_hf_dir(d: Path, seed: int = 7) -> tuple[dict[str, np.ndarray], dict]:
    rng = np.random.default_rng(seed)
    parts = [
        {
            "model.embed.weight": rng.standard_normal((10, 4)).astype(np.float32),
            "model.norm.weight": rng.standard_normal(4).astype(np.float16),
        },
        {
            "lm_head.weight": rng.standard_normal((4, 10)).astype(np.float32),
            "model.step": np.array(1234, np.int64),
            "model.mask": np.array([True, False, True]),
        },
    ]
    d.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, part in zip(HF_FILES, parts):
        save_file(part, str(d / fname), metadata={"format": "np"})
        weight_map.update({k: fname for k in part})
    arrays = {k: v for p in parts for k, v in p.items()}
    index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return arrays, index


def test_hf_sharded_inspect_verify_pack(ckpt, tmp_path):
    hf = tmp_path / "hf"
    arrays, index = make_hf_dir(hf)
    info = json.loads(ckpt("inspect", hf, "--json", expect=0).stdout)
    assert info["kind"] == "hf-sharded"
    assert info["metadata"] == index["metadata"]
    assert sorted(s["file"] for s in info["shards"]) == list(HF_FILES)
    got = {t["name"]: t for t in info["tensors"]}
    assert set(got) == set(arrays)
    for name, a in arrays.items():
        t = got[name]
        assert (t["dtype"], t["shape"], t["bytes"]) == (h.ST_DTYPE[a.dtype], list(a.shape), a.nbytes)
        assert t["file"] == index["weight_map"][name] and t["crc32"] is None
    assert "no checksums to check" in ckpt("verify", hf, expect=0).stdout

    out = tmp_path / "packed"
    ckpt("pack", hf, "--out", out, expect=0)
    m = h.read_manifest(out)
    assert m["metadata"] == index["metadata"]
    assert {t["name"] for t in m["tensors"]} == set(arrays)
    for t in m["tensors"]:
        blob = (out / m["shards"][t["shard"]]["file"]).read_bytes()
        b, e = t["offsets"]
        assert zlib.crc32(blob[b:e]) == t["crc32"]
        with safe_open(str(out / m["shards"][t["shard"]]["file"]), "np") as f:
            h.assert_bit_equal(f.get_tensor(t["name"]), arrays[t["name"]], t["name"])
    ckpt("verify", out, expect=0)
    ckpt("diff", hf, out, expect=0)


def _index_edit(fn):
    def apply(d: Path):
        p = d / "model.safetensors.index.json"
        idx = json.loads(p.read_text())
        fn(idx["weight_map"], d)
        p.write_text(json.dumps(idx))

    return apply


def _dotdot(wm, d):
    # A real file exists at the escaped path, so only the name check can refuse it.
    shutil.copy(d / HF_FILES[1], d.parent / HF_FILES[1])
    wm["lm_head.weight"] = "../" + HF_FILES[1]


def _rename(wm, old, new):
    wm[new] = wm.pop(old)


BROKEN_INDEXES = {
    # weight_map names a tensor that its file does not hold (count unchanged)
    "tensor not in its file": (
        _index_edit(lambda wm, d: _rename(wm, "lm_head.weight", "ghost.weight")),
        ['"ghost.weight"', "does not hold it"],
    ),
    "tensor in the wrong file": (
        _index_edit(lambda wm, d: wm.__setitem__("lm_head.weight", HF_FILES[0])),
        ['"lm_head.weight"', HF_FILES[0]],
    ),
    "extra tensor": (
        _index_edit(lambda wm, d: wm.__setitem__("extra.weight", HF_FILES[0])),
        ["weight_map names 6 tensors but the shard files hold 5"],
    ),
    "file name with ../": (_index_edit(_dotdot), ["../" + HF_FILES[1], "plain file name"]),
    "absolute file name": (
        _index_edit(lambda wm, d: wm.__setitem__("lm_head.weight", str(d / HF_FILES[1]))),
        ["plain file name"],
    ),
    "missing file": (
        _index_edit(lambda wm, d: wm.__setitem__("lm_head.weight", "model-00003-of-00003.safetensors")),
        ["model-00003-of-00003.safetensors"],
    ),
    "not JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {'),
        ["JSON"],
    ),
    "no weight_map": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        ["weight_map"],
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_INDEXES))
def test_hf_broken_index_is_refused(case, ckpt, tmp_path):
    hf = tmp_path / "sub" / "hf"
    make_hf_dir(hf)
    breaker, needles = BROKEN_INDEXES[case]
    breaker(hf)
    for cmd in ("inspect", "verify"):
        r = ckpt(cmd, hf, expect=1)
        assert r.stderr.startswith("error: "), r.stderr
        for s in needles:
            assert s in r.stderr, (cmd, s, r.stderr)
    out = tmp_path / "out"
    ckpt("pack", hf, "--out", out, expect=1)
    assert not out.exists()


# --------------------------------------------------------------------------------------
# ckptstore -> Python: the demo checkpoint (optimizer section, FP16-scaled Adam moments)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(demo_dir):
    d, stdout = demo_dir
    m = h.read_manifest(d)
    loaded = {}
    for s in m["shards"]:
        for name, a in load_file(str(d / s["file"])).items():
            assert name not in loaded
            loaded[name] = a
    return d, stdout, m, loaded


def test_demo_shards_read_with_stock_safetensors(demo, ckpt):
    d, stdout, m, loaded = demo
    assert "all checks passed" in stdout and "FAIL" not in stdout
    assert m["features"] == ["optimizer"]
    assert m["metadata"] == {"demo": True, "step": 2}
    assert len(m["shards"]) > 1
    assert set(loaded) == {t["name"] for t in m["tensors"]}
    for t in m["tensors"]:
        a = loaded[t["name"]]
        assert h.ST_DTYPE[a.dtype] == t["dtype"] and list(a.shape) == t["shape"], t["name"]
        assert a.nbytes == t["offsets"][1] - t["offsets"][0]
        assert zlib.crc32(h.bits(a)) == t["crc32"], t["name"]
        assert t["offsets"][0] % a.dtype.itemsize == 0
    ckpt("verify", d, expect=0)
    info = json.loads(ckpt("inspect", d, "--json", expect=0).stdout)
    assert info["optimizer"] == m["optimizer"]


def test_demo_optimizer_section_semantics(demo):
    """Cross-references of format-spec/optimizer.md §Rules, and the f16_scaled arithmetic:
    value = f32(q) * s with s = absmax / 32752, so max |q| is exactly 32752."""
    _, _, m, loaded = demo
    opt = m["optimizer"]
    tensors = tensors_by_name(m)
    grouped = [p for g in opt["groups"] for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(opt["params"])
    assert set(grouped) == {p["name"] for p in opt["params"]}
    referenced = []
    for p in opt["params"]:
        assert tensors[p["name"]]["shape"] == p["shape"], p["name"]  # the parameter itself
        states = {s["name"]: s for s in p["state"]}
        assert set(states) == {"exp_avg", "exp_avg_sq", "step"}, p["name"]
        assert states["step"]["encoding"] == "plain" and "scale" not in states["step"]
        step = loaded[states["step"]["tensor"]]
        assert step.size == 1 and float(step.reshape(())) == 2.0
        referenced.append(states["step"]["tensor"])
        for sname in ("exp_avg", "exp_avg_sq"):
            s = states[sname]
            assert s["encoding"] == "f16_scaled"
            q, scale = loaded[s["tensor"]], loaded[s["scale"]]
            referenced += [s["tensor"], s["scale"]]
            assert q.dtype == np.float16 and list(q.shape) == p["shape"], s["tensor"]
            assert scale.dtype == np.float32 and scale.shape in ((), (1,)), s["scale"]
            sc = np.float32(scale.reshape(()))
            assert np.isfinite(sc) and sc >= 0
            values = q.astype(np.float32) * sc
            assert np.all(np.isfinite(values)), s["tensor"]
            if sname == "exp_avg_sq":
                assert np.all(values >= 0), f"negative second moment in {s['tensor']}"
            if q.size and sc > 0:
                assert np.max(np.abs(q.astype(np.float32))) == 32752.0, s["tensor"]
    assert len(referenced) == len(set(referenced))
    assert set(referenced) <= set(tensors)


def test_repack_keeps_optimizer_section(demo, ckpt, tmp_path):
    d, _, m, _ = demo
    out = tmp_path / "re"
    ckpt("pack", d, "--out", out, expect=0)
    m2 = h.read_manifest(out)
    assert {t["name"] for t in m2["tensors"]} == {t["name"] for t in m["tensors"]}
    assert m2.get("features") == ["optimizer"]
    assert m2.get("optimizer") == m["optimizer"]


# --------------------------------------------------------------------------------------
# Damage detection through the CLI
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,where",
    [("big", "middle"), ("scalar.i64", "first"), ("mask", "last"), ("layers.0/wëight", "middle"), ("f64", "first")],
)
def test_flipped_tensor_byte(name, where, fresh, ckpt, tmp_path):
    d, m = fresh
    t = tensors_by_name(m)[name]
    b, e = t["offsets"]
    off = {"first": b, "middle": (b + e) // 2, "last": e - 1}[where]
    path = shard_path(d, m, t["shard"])
    h.flip_byte(path, off)
    got = zlib.crc32(path.read_bytes()[b:e])
    r = ckpt("verify", d, expect=1)
    for s in (
        f'checksum mismatch in tensor "{name}"',
        f"shard {t['shard']}",
        path.name,
        f"expected crc32 {t['crc32']:#010x}",
        f"got {got:#010x}",
    ):
        assert s in r.stderr, (s, r.stderr)
    v = json.loads(ckpt("verify", d, "--json", expect=1).stdout)
    assert v["ok"] is False and f'"{name}"' in v["error"] and path.name in v["error"]
    # Opening reads no tensor data; copying out of the damaged checkpoint is refused.
    ckpt("inspect", d, expect=0)
    out = tmp_path / "copy"
    r = ckpt("pack", d, "--out", out, expect=1)
    assert f'"{name}"' in r.stderr
    assert not (out / h.MANIFEST).exists()


@pytest.mark.parametrize(
    "where,mask,needle",
    [
        ("json", 0x04, "checksum mismatch in shard header"),
        ("last header byte", 0x01, "checksum mismatch in shard header"),
        ("length prefix, low bit", 0x01, "header length prefix differs"),
        ("length prefix, high byte", 0x80, "header length prefix differs"),
    ],
)
def test_damaged_shard_header(where, mask, needle, fresh, ckpt):
    d, m = fresh
    i = 1
    path = shard_path(d, m, i)
    n = m["shards"][i]["header_size"]
    off = {"json": 8 + n // 2, "last header byte": 8 + n - 1, "length prefix, low bit": 0, "length prefix, high byte": 7}[
        where
    ]
    h.flip_byte(path, off, mask)
    for cmd in ("verify", "inspect"):
        r = ckpt(cmd, d, expect=1)
        assert needle in r.stderr and path.name in r.stderr, r.stderr
        if needle.startswith("checksum"):
            assert f"(shard {i}, file {path.name})" in r.stderr


@pytest.mark.parametrize("how", ["cut one byte", "cut to 4 bytes", "empty", "append one byte"])
def test_truncated_or_extended_shard(how, fresh, ckpt):
    d, m = fresh
    i = 2
    path = shard_path(d, m, i)
    size = m["shards"][i]["size"]
    new = {"cut one byte": size - 1, "cut to 4 bytes": 4, "empty": 0, "append one byte": size + 1}[how]
    with open(path, "r+b") as f:
        f.truncate(new)
    r = ckpt("verify", d, expect=1)
    assert f"shard {i} ({path.name}): the file is {new} bytes but the manifest records {size}" in r.stderr


def test_deleted_shard(fresh, ckpt):
    d, m = fresh
    path = shard_path(d, m, 0)
    path.unlink()
    r = ckpt("verify", d, expect=1)
    assert f"shard 0 ({path.name}): the file is missing" in r.stderr


def test_shard_replaced_by_symlink(fresh, ckpt, tmp_path):
    d, m = fresh
    path = shard_path(d, m, 0)
    target = tmp_path / "elsewhere.safetensors"
    shutil.move(path, target)
    os.symlink(target, path)
    r = ckpt("verify", d, expect=1)
    assert f"shard 0 ({path.name})" in r.stderr and "not a regular file" in r.stderr


def _uppercase_trailer(d: Path):
    # Add metadata until the CRC has a hex letter, then write that letter uppercase.
    for k in range(64):
        raw = h.encode_manifest({**h.read_manifest(d), "metadata": {"pad": k}})
        hexdigits = raw[-11:-3]
        if any(c in b"abcdef" for c in hexdigits):
            (d / h.MANIFEST).write_bytes(raw[:-11] + hexdigits.upper() + raw[-3:])
            return
    raise AssertionError("no CRC with a hex letter in 64 tries")


def _flip_manifest(offset_of):
    def apply(d: Path):
        size = (d / h.MANIFEST).stat().st_size
        h.flip_byte(d / h.MANIFEST, offset_of(size), 0x01)

    return apply


MANIFEST_DAMAGE = {
    "flip a body byte": (_flip_manifest(lambda n: n // 2), "checksum mismatch in manifest"),
    "flip the first byte": (_flip_manifest(lambda n: 0), "checksum mismatch in manifest"),
    "flip a trailer digit": (_flip_manifest(lambda n: n - 4), "manifest"),
    "uppercase trailer": (_uppercase_trailer, "invalid manifest ckpt-manifest.json"),
    "no final LF": (
        lambda d: (d / h.MANIFEST).write_bytes((d / h.MANIFEST).read_bytes()[:-1]),
        "invalid manifest ckpt-manifest.json",
    ),
    "empty": (lambda d: (d / h.MANIFEST).write_bytes(b""), "invalid manifest ckpt-manifest.json"),
    "garbage": (
        lambda d: (d / h.MANIFEST).write_bytes(np.random.default_rng(3).bytes(4000)),
        "invalid manifest ckpt-manifest.json",
    ),
    "deleted": (lambda d: (d / h.MANIFEST).unlink(), "no checkpoint at"),
}


@pytest.mark.parametrize("case", list(MANIFEST_DAMAGE))
def test_damaged_manifest(case, fresh, ckpt):
    d, _ = fresh
    damage, needle = MANIFEST_DAMAGE[case]
    damage(d)
    for cmd in ("verify", "inspect"):
        r = ckpt(cmd, d, expect=1)
        assert needle in r.stderr and "ckpt-manifest.json" in r.stderr, r.stderr


def test_verify_nonexistent_path(ckpt, tmp_path):
    r = ckpt("verify", tmp_path / "nope", expect=1)
    assert "no checkpoint at" in r.stderr and "nope" in r.stderr and "does not exist" in r.stderr


def test_verify_empty_directory(ckpt, tmp_path):
    r = ckpt("verify", tmp_path, expect=1)
    assert "no checkpoint at" in r.stderr and "ckpt-manifest.json" in r.stderr


@pytest.mark.parametrize("args", [["verify"], ["verify", "--bogus", "x"], ["pack", "x"], ["frobnicate"]])
def test_usage_errors_exit_2(args, ckpt):
    r = ckpt(*args, expect=2)
    assert "Usage" in r.stderr or "usage" in r.stderr


def _c64(p):
    save_file({"z": np.ones(3, np.complex64)}, str(p))


def _raw(header: bytes, data: bytes):
    def write(p):
        p.write_bytes(len(header).to_bytes(8, "little") + header + data)

    return write


FOREIGN_DAMAGE = {
    "complex64 dtype": (_c64, "unknown dtype"),
    "random bytes": (lambda p: p.write_bytes(np.random.default_rng(5).bytes(500)), "invalid shard header"),
    "shorter than 8 bytes": (lambda p: p.write_bytes(b"\x01\x02"), "shorter than the 8-byte"),
    "huge header length": (lambda p: p.write_bytes((2**63).to_bytes(8, "little") + b"{}"), "cap"),
    "overlapping tensors": (
        _raw(
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            bytes(8),
        ),
        "overlap",
    ),
    "shape overflow": (
        _raw(b'{"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}', bytes(8)),
        "overflows",
    ),
    "trailing bytes": (_raw(b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', bytes(3)), "trailing"),
    "duplicate key": (
        _raw(
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
            bytes(2),
        ),
        "duplicate",
    ),
    "__metadata__ not strings": (
        _raw(b'{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', bytes(1)),
        "invalid shard header",
    ),
}


@pytest.mark.parametrize("case", list(FOREIGN_DAMAGE))
def test_malformed_safetensors_input(case, ckpt, tmp_path):
    p = tmp_path / "bad.safetensors"
    write, needle = FOREIGN_DAMAGE[case]
    write(p)
    for cmd in ("inspect", "verify"):
        r = ckpt(cmd, p, expect=1)
        assert needle in r.stderr and "bad.safetensors" in r.stderr, r.stderr
    out = tmp_path / "out"
    ckpt("pack", p, "--out", out, expect=1)
    assert not out.exists()


# --------------------------------------------------------------------------------------
# ckpt diff
# --------------------------------------------------------------------------------------


def test_diff_two_packs_of_the_same_input(packed, ckpt, tmp_path, source_file):
    d, m = packed
    other = tmp_path / "other"
    ckpt("pack", source_file, "--out", other, "--max-shard-size", "1MiB", expect=0)
    assert h.read_manifest(other)["checkpoint_id"] != m["checkpoint_id"]
    r = ckpt("diff", d, other, expect=0)
    assert r.stdout.startswith(f"same: {len(m['tensors'])} tensors")
    assert json.loads(ckpt("diff", d, other, "--json", expect=0).stdout) == {"same": True, "difference": None}
    ckpt("diff", source_file, d, expect=0)


def _bump(arrays):
    a = arrays["mid.c"].copy()
    a[123] = a[123] ^ 1  # changes the lowest byte only
    return {**arrays, "mid.c": a}


DIFF_CASES = {
    "one value": (_bump, 'tensor "mid.c": bytes differ, first at byte 492 (element 123)'),
    "dtype": (lambda a: {**a, "mid.c": a["mid.c"].astype(np.int64)}, 'tensor "mid.c": dtype I32 vs I64'),
    "shape": (lambda a: {**a, "mid.c": a["mid.c"].reshape(20, 25)}, 'tensor "mid.c": shape [500] vs [20, 25]'),
    "missing tensor": (lambda a: {k: v for k, v in a.items() if k != "u16"}, 'tensor "u16" is only in A'),
    "extra tensor": (lambda a: {**a, "new": np.zeros(1, np.uint8)}, 'tensor "new" is only in B'),
}


@pytest.mark.parametrize("case", list(DIFF_CASES))
def test_diff_after_a_change(case, packed, ckpt, tmp_path, source_arrays):
    d, _ = packed
    change, want = DIFF_CASES[case]
    src = tmp_path / "changed.safetensors"
    save_file(change(source_arrays), str(src), metadata=h.SOURCE_METADATA)
    out = tmp_path / "changed"
    ckpt("pack", src, "--out", out, "--max-shard-size", str(MAX_SHARD), expect=0)
    r = ckpt("diff", d, out, expect=1)
    assert r.stdout.strip() == f"differ: {want}"
    assert json.loads(ckpt("diff", d, out, "--json", expect=1).stdout) == {"same": False, "difference": want}


# --------------------------------------------------------------------------------------
# Atomic replacement, seen from outside
# --------------------------------------------------------------------------------------


def _shard_files(m):
    return {s["file"] for s in m["shards"]}


def test_pack_replaces_checkpoint_without_leftovers(ckpt, tmp_path, source_file):
    d = tmp_path / "ckpt"
    ckpt("pack", source_file, "--out", d, "--max-shard-size", str(MAX_SHARD), expect=0)
    a = h.read_manifest(d)
    b_src = tmp_path / "b.safetensors"
    b_arrays = {"only.w": np.arange(3000, dtype=np.float32), "only.b": np.arange(5, dtype=np.int8)}
    save_file(b_arrays, str(b_src))
    ckpt("pack", b_src, "--out", d, "--max-shard-size", "8KiB", expect=0)
    b = h.read_manifest(d)
    assert b["checkpoint_id"] != a["checkpoint_id"] and len(b["shards"]) == 2
    assert set(os.listdir(d)) == {h.MANIFEST, h.LOCK_FILE} | _shard_files(b)
    assert not _shard_files(a) & set(os.listdir(d))
    ckpt("verify", d, expect=0)
    assert {t["name"] for t in b["tensors"]} == set(b_arrays)


def test_pack_replace_removes_only_engine_files(ckpt, tmp_path, source_file):
    """Stale temporaries and unreferenced engine-named shards go; anything else stays."""
    d = tmp_path / "ckpt"
    ckpt("pack", source_file, "--out", d, expect=0)
    foreign = ["notes.txt", "shard-mine.safetensors", "model.safetensors.bak"]
    stale = [".ckpt-tmp-shard-" + "a" * 32 + "-00000.safetensors", "shard-" + "b" * 32 + "-00003.safetensors"]
    for f in foreign + stale:
        (d / f).write_bytes(b"x")
    ckpt("pack", source_file, "--out", d, "--max-shard-size", str(MAX_SHARD), expect=0)
    m = h.read_manifest(d)
    assert set(os.listdir(d)) == {h.MANIFEST, h.LOCK_FILE} | _shard_files(m) | set(foreign)
    assert all((d / f).read_bytes() == b"x" for f in foreign)
    ckpt("verify", d, expect=0)


def test_pack_in_place(ckpt, tmp_path, source_file, source_arrays):
    """Repacking a checkpoint into its own directory: the source stays readable while the
    new one is written, and the old shards are removed after the commit."""
    d = tmp_path / "ckpt"
    ckpt("pack", source_file, "--out", d, "--max-shard-size", str(MAX_SHARD), expect=0)
    old = h.read_manifest(d)
    ckpt("pack", d, "--out", d, "--max-shard-size", "1MiB", expect=0)
    new = h.read_manifest(d)
    assert len(new["shards"]) == 1 and new["metadata"] == old["metadata"]
    assert set(os.listdir(d)) == {h.MANIFEST, h.LOCK_FILE} | _shard_files(new)
    ckpt("verify", d, expect=0)
    loaded = load_file(str(d / new["shards"][0]["file"]))
    for name, a in source_arrays.items():
        h.assert_bit_equal(loaded[name], a, name)


def test_pack_refused_while_lock_is_held(ckpt, fresh, source_file):
    """Another process holding .ckpt-lock (flock, as a running save does) blocks a save,
    which fails at once and leaves the committed checkpoint alone."""
    import fcntl

    d, m = fresh
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    fd = os.open(d / h.LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = ckpt("pack", source_file, "--out", d, expect=1)
    finally:
        os.close(fd)
    assert h.LOCK_FILE in r.stderr and "another save" in r.stderr
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    ckpt("pack", source_file, "--out", d, expect=0)  # and works once the lock is released


def test_verify_reports_first_damaged_tensor_in_manifest_order(fresh, ckpt):
    d, m = fresh
    nonempty = [t for t in m["tensors"] if t["offsets"][1] > t["offsets"][0]]
    first, later = nonempty[1], nonempty[-1]
    assert first["shard"] != later["shard"]
    for t in (later, first):  # damage the later one first: order of damage must not matter
        h.flip_byte(shard_path(d, m, t["shard"]), t["offsets"][0])
    r = ckpt("verify", d, expect=1)
    assert f'tensor "{first["name"]}"' in r.stderr and f'"{later["name"]}"' not in r.stderr


# --------------------------------------------------------------------------------------
# Forward compatibility and the feature rule (format-spec/README.md §Versioning)
# --------------------------------------------------------------------------------------


def _add_unknown_members(m):
    m["org.example.future"] = {"a": [1, 2]}
    for s in m["shards"]:
        s["org.example.future"] = 1
    for t in m["tensors"]:
        t["org.example.future"] = "x"
    o = m["optimizer"]
    o["org.example.future"] = None
    for g in o["groups"]:
        g["org.example.future"] = 2
    for p in o["params"]:
        p["org.example.future"] = 3
        for s in p["state"]:
            s["org.example.future"] = 4


def test_unknown_members_are_ignored(demo, ckpt, tmp_path):
    d, _, m, _ = demo
    c = tmp_path / "ckpt"
    h.clone_checkpoint(d, c)
    h.rewrite_manifest(c, _add_unknown_members)
    ckpt("verify", c, expect=0)
    info = json.loads(ckpt("inspect", c, "--json", expect=0).stdout)
    assert info["optimizer"] == m["optimizer"]


def test_duplicated_known_member_is_refused(fresh, ckpt):
    d, _ = fresh
    body, _ = h.split_manifest((d / h.MANIFEST).read_bytes())
    body += b',"metadata":{"again":1}'
    (d / h.MANIFEST).write_bytes(body + h.TRAILER_HEAD + f"{zlib.crc32(body):08x}".encode() + b'"}\n')
    r = ckpt("verify", d, expect=1)
    assert "invalid manifest ckpt-manifest.json" in r.stderr and "metadata" in r.stderr


@pytest.mark.parametrize("edit", ["section without feature", "feature without section"])
def test_feature_and_section_must_agree(edit, demo, ckpt, tmp_path):
    """format-spec/optimizer.md: a manifest has the optimizer section if and only if it lists
    the feature "optimizer"; a reader must refuse it otherwise (README.md §Conformance)."""
    d, _, _, _ = demo
    c = tmp_path / "ckpt"
    h.clone_checkpoint(d, c)
    h.rewrite_manifest(c, lambda m: m.pop("features" if edit == "section without feature" else "optimizer"))
    r = ckpt("verify", c, expect=1)
    assert "invalid manifest ckpt-manifest.json" in r.stderr and "optimizer" in r.stderr


# --------------------------------------------------------------------------------------
# More foreign layouts
# --------------------------------------------------------------------------------------


def test_odd_tensor_names_round_trip(ckpt, tmp_path):
    names = ['q"uote', "back\\slash", "tab\tnl\n", "emoji🙂/x", "x" * 4096, "ctl\x01\x1f\x7f", "é", "e\u0301"]
    arrays = {n: np.arange(i + 1, dtype=np.int16) for i, n in enumerate(names)}
    src = tmp_path / "names.safetensors"
    save_file(arrays, str(src))
    out = tmp_path / "ckpt"
    ckpt("pack", src, "--out", out, expect=0)
    m = h.read_manifest(out)
    assert h.encode_manifest(m) == (out / h.MANIFEST).read_bytes()
    assert sorted(t["name"] for t in m["tensors"]) == sorted(names)
    loaded = load_file(str(out / m["shards"][0]["file"]))
    for n, a in arrays.items():
        h.assert_bit_equal(loaded[n], a, repr(n))
    ckpt("verify", out, expect=0)
    info = json.loads(ckpt("inspect", out, "--json", expect=0).stdout)
    assert sorted(t["name"] for t in info["tensors"]) == sorted(names)


@pytest.mark.parametrize(
    "name,needle", [(b"a\\u0000b", "NUL"), (b"x" * 4097, "4096"), (b"", "empty tensor name")]
)
def test_bad_tensor_names_in_foreign_file(name, needle, ckpt, tmp_path):
    p = tmp_path / "bad.safetensors"
    header = b'{"' + name + b'":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    _raw(header, b"\x00")(p)
    r = ckpt("inspect", p, expect=1)
    assert "invalid shard header in" in r.stderr and needle in r.stderr, r.stderr


def test_foreign_header_unknown_members_and_padding(ckpt, tmp_path):
    p = tmp_path / "odd.safetensors"
    header = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"org.example":"x"}}' + b" " * 5
    _raw(header, b"\x01\x02")(p)
    assert load_file(str(p))["a"].tolist() == [1, 2]
    info = json.loads(ckpt("inspect", p, "--json", expect=0).stdout)
    assert [(t["name"], t["dtype"], t["shape"]) for t in info["tensors"]] == [("a", "U8", [2])]


def test_directory_with_model_safetensors(ckpt, tmp_path, source_file, source_arrays):
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(source_file, d / "model.safetensors")
    info = json.loads(ckpt("inspect", d, "--json", expect=0).stdout)
    assert info["kind"] == "safetensors" and info["total_tensors"] == len(source_arrays)


def test_hf_files_may_be_symlinks_to_blobs(ckpt, tmp_path):
    """As in the Hugging Face cache: the index names links to content-addressed blobs."""
    hf = tmp_path / "snapshot"
    arrays, _ = make_hf_dir(hf)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for i, f in enumerate(HF_FILES):
        shutil.move(hf / f, blobs / f"blob{i}")
        os.symlink(blobs / f"blob{i}", hf / f)
    info = json.loads(ckpt("inspect", hf, "--json", expect=0).stdout)
    assert info["kind"] == "hf-sharded" and {t["name"] for t in info["tensors"]} == set(arrays)
    out = tmp_path / "packed"
    ckpt("pack", hf, "--out", out, expect=0)
    ckpt("diff", hf, out, expect=0)


def test_readers_during_repeated_saves_see_old_or_new(ckpt, tmp_path, source_file):
    """format-spec/durability.md §Readers: a reader that opens while saves commit into the
    directory sees one whole checkpoint, the old or the new, never a mix or an error."""
    import threading
    import time

    b_src = tmp_path / "b.safetensors"
    save_file({"b.w": np.arange(64, dtype=np.float32), "b.s": np.array(5, np.int64)}, str(b_src))
    want = {
        frozenset(t["name"] for t in json.loads(ckpt("inspect", p, "--json", expect=0).stdout)["tensors"])
        for p in (source_file, b_src)
    }
    d = tmp_path / "ckpt"
    ckpt("pack", source_file, "--out", d, "--max-shard-size", "2KiB", expect=0)
    stop = threading.Event()
    saves = []

    def writer():
        i = 0
        while not stop.is_set():
            src = (b_src, source_file)[i % 2]
            saves.append(ckpt("pack", src, "--out", d, "--max-shard-size", "2KiB").returncode)
            i += 1

    th = threading.Thread(target=writer)
    th.start()
    seen, deadline = set(), time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            r = ckpt("inspect", d, "--json", expect=0)
            seen.add(frozenset(t["name"] for t in json.loads(r.stdout)["tensors"]))
            ckpt("verify", d, expect=0)
    finally:
        stop.set()
        th.join()
    assert set(saves) == {0} and len(saves) >= 10, saves
    assert seen <= want, seen - want
    assert len(seen) == 2, "the reader never saw both checkpoints: no overlap was tested"
