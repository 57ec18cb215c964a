"""format-spec/manifest.schema.json against real manifests written by ckptstore, against
broken manifests (which it must reject), and against ckptstore's own reader (which must
refuse what the schema rejects)."""

from __future__ import annotations

import copy
import json
import re
import zlib
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from safetensors.numpy import save_file

import ckpt_helpers as h

SPEC = Path(__file__).resolve().parents[2] / "format-spec"
SCHEMA_PATH = SPEC / "manifest.schema.json"


@pytest.fixture(scope="module")
def validator():
    assert SCHEMA_PATH.is_file(), f"{SCHEMA_PATH} is missing"
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema.get("$schema") == "https://json-schema.org/draft/2020-12/schema"
    return jsonschema.Draft202012Validator(schema)


def assert_valid(validator, m, what):
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(m)]
    assert not errors, f"{what}: {errors}"


# --------------------------------------------------------------------------------------
# Real manifests are valid
# --------------------------------------------------------------------------------------


def test_packed_manifest_is_valid(validator, packed_dir):
    m = h.read_manifest(packed_dir)
    assert len(m["shards"]) >= 4
    assert_valid(validator, m, "pack with several shards")


def test_demo_manifest_with_optimizer_is_valid(validator, demo_dir):
    m = h.read_manifest(demo_dir[0])
    assert m["optimizer"]["params"] and m["features"] == ["optimizer"]
    assert_valid(validator, m, "demo checkpoint")


def test_empty_manifest_is_valid(validator, empty_dir):
    m = h.read_manifest(empty_dir)
    assert m["tensors"] == [] and m["shards"] == []
    assert_valid(validator, m, "empty checkpoint")


def test_manifest_with_odd_names_is_valid(validator, ckpt, tmp_path):
    src = tmp_path / "names.safetensors"
    names = ['q"uote', "back\\slash", "tab\tnl\n", "emoji🙂/x", "x" * 4096, "ctl\x01\x7f"]
    save_file({n: np.arange(i + 1, dtype=np.int16) for i, n in enumerate(names)}, str(src))
    out = tmp_path / "ckpt"
    ckpt("pack", src, "--out", out, expect=0)
    m = h.read_manifest(out)
    assert sorted(t["name"] for t in m["tensors"]) == sorted(names)
    assert_valid(validator, m, "odd tensor names")


def test_spec_example_is_valid(validator):
    """The worked example of format-spec/manifest.md: its trailer CRC and the schema."""
    text = (SPEC / "manifest.md").read_text()
    match = re.search(r"^## Example\n.*?^```\n(\{.*?\n)```", text, re.S | re.M)
    assert match, "no example manifest block under '## Example' in format-spec/manifest.md"
    raw = match.group(1).encode()
    body, crc = h.split_manifest(raw)
    assert zlib.crc32(body) == crc
    assert_valid(validator, json.loads(raw), "manifest.md example")


# --------------------------------------------------------------------------------------
# Broken manifests are rejected
# --------------------------------------------------------------------------------------


def _tensor(m, i=0):
    return m["tensors"][i]


def _state(m, kind):
    for p in m["optimizer"]["params"]:
        for s in p["state"]:
            if s["encoding"] == kind:
                return s
    raise AssertionError(f"no {kind} state")


# id: (base manifest, mutation, also refused by ckptstore's reader at open?). False: the
# optimizer cross-reference rules (format-spec/optimizer.md §Rules) are checked when the
# section is used (verify, load, restore), not at open; None: the trailer, not a JSON member, to a reader.
BROKEN = {
    "missing checkpoint_id": ("packed", lambda m: m.pop("checkpoint_id"), True),
    "uppercase checkpoint_id": ("packed", lambda m: m.__setitem__("checkpoint_id", m["checkpoint_id"].upper()), True),
    "short checkpoint_id": ("packed", lambda m: m.__setitem__("checkpoint_id", m["checkpoint_id"][:31]), True),
    "bad dtype": ("packed", lambda m: _tensor(m).__setitem__("dtype", "F8_E4M3"), True),
    "lowercase dtype": ("packed", lambda m: _tensor(m).__setitem__("dtype", "f32"), True),
    "offsets of 3 items": ("packed", lambda m: _tensor(m)["offsets"].append(_tensor(m)["offsets"][1]), True),
    "offsets of 1 item": ("packed", lambda m: _tensor(m)["offsets"].pop(), True),
    "negative offset": ("packed", lambda m: _tensor(m)["offsets"].__setitem__(0, -8), True),
    "crc32 above u32": ("packed", lambda m: _tensor(m).__setitem__("crc32", 2**32), True),
    "crc32 as hex string": ("packed", lambda m: _tensor(m).__setitem__("crc32", f"{_tensor(m)['crc32']:08x}"), True),
    "negative dim": ("packed", lambda m: _tensor(m).__setitem__("shape", [-1]), True),
    "tensor named __metadata__": ("packed", lambda m: _tensor(m).__setitem__("name", "__metadata__"), True),
    "empty tensor name": ("packed", lambda m: _tensor(m).__setitem__("name", ""), True),
    "NUL in tensor name": ("packed", lambda m: _tensor(m).__setitem__("name", "a\x00b"), True),
    "tensor missing crc32": ("packed", lambda m: _tensor(m).pop("crc32"), True),
    "shard file ../": ("packed", lambda m: m["shards"][0].__setitem__("file", "../x.safetensors"), True),
    "shard file hidden": ("packed", lambda m: m["shards"][0].__setitem__("file", ".ckpt-tmp-x"), True),
    "shard file is the manifest": ("packed", lambda m: m["shards"][0].__setitem__("file", h.MANIFEST), True),
    "negative shard size": ("packed", lambda m: m["shards"][0].__setitem__("size", -1), True),
    "format": ("packed", lambda m: m.__setitem__("format", "safetensors"), True),
    "version 2": ("packed", lambda m: m.__setitem__("version", 2), True),
    "metadata is a list": ("packed", lambda m: m.__setitem__("metadata", []), True),
    "features not strings": ("packed", lambda m: m.__setitem__("features", [1]), True),
    "manifest_crc32 missing": ("packed", lambda m: m.pop("manifest_crc32"), None),
    "manifest_crc32 uppercase": ("packed", lambda m: m.__setitem__("manifest_crc32", "ABCDEF01"), None),
    "bad encoding": ("demo", lambda m: _state(m, "f16_scaled").__setitem__("encoding", "int8"), True),
    "f16_scaled without scale": ("demo", lambda m: _state(m, "f16_scaled").pop("scale"), False),
    "plain with scale": ("demo", lambda m: _state(m, "plain").__setitem__("scale", "optim/x.scale"), False),
    "group without params": ("demo", lambda m: m["optimizer"]["groups"][0].pop("params"), True),
    "param missing shape": ("demo", lambda m: m["optimizer"]["params"][0].pop("shape"), True),
    # format-spec/optimizer.md: section present <=> feature listed.
    "optimizer without feature": ("demo", lambda m: m.pop("features"), True),
    "feature without optimizer": ("demo", lambda m: m.pop("optimizer"), True),
    # format-spec/global.md §Root rules (P1-P5) of a two-level root.
    "parts without the parts feature": ("two_level", lambda m: m.__setitem__("features", ["global"]), True),
    "parts feature without global": ("two_level", lambda m: m.__setitem__("features", ["parts"]), True),
    "unknown feature": ("two_level", lambda m: m["features"].append("ranks"), True),
    "empty parts list": ("two_level", lambda m: m.__setitem__("parts", []), True),
    "part crc32 as hex string": ("two_level", lambda m: m["parts"][0].__setitem__("crc32", f"{m['parts'][0]['crc32']:08x}"), True),
    "part crc32 above u32": ("two_level", lambda m: m["parts"][0].__setitem__("crc32", 2**32), True),
    "part file ../": ("two_level", lambda m: m["parts"][0].__setitem__("file", "../x.json"), True),
    "part size over the cap": ("two_level", lambda m: m["parts"][0].__setitem__("size", 2**30 + 1), True),
    "splits not from 0": ("two_level", lambda m: m["grids"][0]["splits"][0].__setitem__(0, 1), True),
    "cell above 2^20": ("two_level", lambda m: m["grids"][0]["cells"].__setitem__(0, 2**20), True),
    "chunks in the root": ("two_level", lambda m: m["globals"][0].__setitem__("chunks", [{"offsets": [0, 0], "shape": [1, 1], "tensor": "x"}]), True),
    "flat global with a grid": ("flat_global", lambda m: m["globals"][0].__setitem__("grid", 0), True),
}


def _multi_rank(path: Path, layout: str) -> Path:
    """Two ranks' rows of a [4, 3] F32 global and a whole tensor, committed with `layout`."""
    import ckptstore

    path.mkdir(parents=True)
    cid = ckptstore.new_checkpoint_id()
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    parts = []
    for r in range(2):
        items = {"w": ckptstore.Chunk(w[2 * r : 2 * r + 2], w.shape, (2 * r, 0))}
        if r == 0:
            items["lr"] = np.array([0.5], np.float32)
        parts.append(ckptstore.write_part(path, cid, r, items))
    ckptstore.commit(path, cid, parts=parts, layout=layout)
    return path


@pytest.fixture(scope="module")
def two_level_dir(tmp_path_factory) -> Path:
    return _multi_rank(tmp_path_factory.mktemp("two_level") / "ckpt", "two_level")


@pytest.fixture(scope="module")
def flat_global_dir(tmp_path_factory) -> Path:
    return _multi_rank(tmp_path_factory.mktemp("flat_global") / "ckpt", "flat")


def test_two_level_and_flat_multi_rank_manifests_are_valid(validator, two_level_dir, flat_global_dir):
    m = h.read_manifest(two_level_dir)
    assert m["features"] == ["global", "parts"] and len(m["parts"]) == 2 and m["grids"]
    assert_valid(validator, m, "two-level root")
    m = h.read_manifest(flat_global_dir)
    assert m["features"] == ["global"] and "parts" not in m
    assert_valid(validator, m, "flat multi-rank manifest")


@pytest.fixture(scope="module")
def bases(packed_dir, demo_dir, two_level_dir, flat_global_dir):
    return {
        "packed": (packed_dir, h.read_manifest(packed_dir)),
        "demo": (demo_dir[0], h.read_manifest(demo_dir[0])),
        "two_level": (two_level_dir, h.read_manifest(two_level_dir)),
        "flat_global": (flat_global_dir, h.read_manifest(flat_global_dir)),
    }


@pytest.mark.parametrize("case", list(BROKEN))
def test_schema_rejects_broken_manifest(case, validator, bases):
    base, mutate, _ = BROKEN[case]
    m = copy.deepcopy(bases[base][1])
    assert_valid(validator, m, base)  # the mutation is what breaks it
    mutate(m)
    assert not validator.is_valid(m), f"schema accepts a manifest with {case}"


@pytest.mark.parametrize("case", [c for c, (_, _, refused) in BROKEN.items() if refused])
def test_reader_refuses_what_schema_rejects(case, bases, ckpt, tmp_path):
    """Written with a correct CRC, each such manifest is refused by `ckpt inspect` too."""
    base, mutate, _ = BROKEN[case]
    d = tmp_path / "ckpt"
    h.clone_checkpoint(bases[base][0], d)
    ckpt("inspect", d, expect=0)
    h.rewrite_manifest(d, mutate)
    r = ckpt("inspect", d, expect=1)
    assert h.MANIFEST in r.stderr, r.stderr
