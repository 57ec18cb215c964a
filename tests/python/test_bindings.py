"""The ckptstore Python bindings (numpy API): round trips of every dtype, zero-copy reads
that keep the mapping alive, errors, the FusedAdam scenario through Python, and interop with
stock safetensors in both directions.

Needs the bindings installed in the venv (`pip install ./python`, done by scripts/test.sh)."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import ckptstore
import ckpt_helpers as h

BF16 = np.dtype(ml_dtypes.bfloat16)


def all_dtypes(seed: int = 7) -> dict[str, np.ndarray]:
    """The interop arrays (every numpy dtype, specials, 0-dim, zero-size) plus BF16 ones."""
    arrays = h.make_arrays(seed)
    rng = np.random.default_rng(seed)
    arrays["bf16"] = rng.standard_normal((6, 5)).astype(np.float32).astype(BF16)
    arrays["scalar.bf16"] = np.array(-1.5, np.float32).astype(BF16)
    return arrays


def hash_files(paths) -> dict[str, str]:
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


# ------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------


def test_round_trip_every_dtype(tmp_path):
    arrays = all_dtypes()
    info = ckptstore.save(tmp_path / "ck", arrays, metadata={"run": "r1", "n": [1, 2.5]})
    assert info["tensors"] == len(arrays) and info["shards"] == 1
    ck = ckptstore.open(tmp_path / "ck")
    assert ck.kind == "ckptstore" and ck.checkpoint_id == info["checkpoint_id"]
    assert ck.keys() == list(arrays) and len(ck) == len(arrays) and list(ck) == list(arrays)
    assert "f32" in ck and "nope" not in ck
    assert ck.metadata == {"run": "r1", "n": [1, 2.5]}
    for name, want in arrays.items():
        got = ck[name]
        h.assert_bit_equal(got, want, name)
        assert ck.info(name)["shape"] == want.shape
    assert ck["scalar.f32"].shape == () and ck["scalar.bool"].dtype == np.bool_
    assert ck["bf16"].dtype == BF16
    assert ck.verify() == {"tensors": len(arrays), "bytes": info["data_bytes"], "checksummed": True}


def test_non_contiguous_arrays_are_gathered(tmp_path):
    base = np.arange(6 * 8, dtype=np.float64).reshape(6, 8)
    arrays = {
        "transposed": base.T,  # strided, read in place
        "step": base[::2, 1::3],  # strided with an offset
        "reversed": base[::-1],  # negative strides: copied first
        "broadcast": np.broadcast_to(np.arange(4, dtype=np.int32), (3, 4)),  # zero strides
        "fortran": np.asfortranarray(base.astype(np.float32)),
        "big_endian": base.astype(">f4"),  # stored little-endian
        "bf16_view": base.astype(np.float32).astype(BF16)[:, ::2],
        "from_list": [[1, 2], [3, 4]],
        "python_scalar": 2.5,
    }
    # Strided arrays go to the writer as they are (it gathers them through their strides);
    # only negative strides and foreign byte order are copied first.
    for name in ("transposed", "step", "broadcast", "fortran", "bf16_view"):
        assert ckptstore._prepare(name, arrays[name])[2] is arrays[name], name
    assert ckptstore._prepare("r", arrays["reversed"])[2] is not arrays["reversed"]
    ckptstore.save(tmp_path, arrays)
    ck = ckptstore.open(tmp_path)
    for name, want in arrays.items():
        want = np.asarray(want)
        got = ck[name]
        assert got.flags.c_contiguous
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=name)
    assert ck["big_endian"].dtype == np.dtype("<f4")
    assert ck["python_scalar"].shape == () and ck["python_scalar"].dtype == np.float64
    ck.verify()


def test_sharding_and_replacement(tmp_path):
    arrays = {f"t{i}": np.full((256,), i, np.float32) for i in range(8)}  # 1 KiB each
    info = ckptstore.save(tmp_path, arrays, max_shard_size=2048)
    assert info["shards"] == 4
    ck = ckptstore.open(tmp_path)
    assert len(ck.shard_files) == 4 and {ck.info(n)["shard"] for n in arrays} == {0, 1, 2, 3}
    old = ck["t3"]
    # Replace the checkpoint while arrays of the old one are alive: they keep the old bytes.
    info2 = ckptstore.save(tmp_path, {"t3": np.zeros(4, np.int8)})
    assert info2["removed"] == 4
    assert np.all(old == 3)
    ck2 = ckptstore.open(tmp_path)
    assert ck2.keys() == ["t3"] and ck2["t3"].dtype == np.int8
    assert not any(Path(p).exists() for p in ck.shard_files)


def test_background_cleanup(tmp_path):
    """``cleanup="background"``: the save returns committed, the previous checkpoint's files
    go on a background thread; ``wait_for_cleanup`` waits for it and counts them."""
    arrays = {f"t{i}": np.full((256,), i, np.float32) for i in range(8)}
    ckptstore.save(tmp_path, arrays, max_shard_size=2048)
    old = ckptstore.open(tmp_path).shard_files
    new = {"t3": np.arange(16, dtype=np.float32)}
    info = ckptstore.save(tmp_path, new, cleanup="background")
    assert info["removed"] == 0
    ck = ckptstore.open(tmp_path)  # committed before the cleanup
    np.testing.assert_array_equal(ck["t3"], new["t3"])
    assert ckptstore.wait_for_cleanup() == 4
    assert not any(Path(p).exists() for p in old)
    assert ckptstore.wait_for_cleanup() == 0
    ckptstore.open(tmp_path).verify()
    with pytest.raises(ckptstore.InvalidArgumentError, match="cleanup"):
        ckptstore.save(tmp_path, new, cleanup="later")


# ------------------------------------------------------------------------------------
# Zero copy
# ------------------------------------------------------------------------------------


def test_zero_copy_views_are_read_only_and_shared(tmp_path):
    ckptstore.save(tmp_path, {"w": np.arange(1024, dtype=np.float32), "s": np.int64(5)})
    ck = ckptstore.open(tmp_path)
    a, b = ck["w"], ck["w"]
    assert not a.flags.writeable and not a.flags.owndata
    with pytest.raises(ValueError):
        a[0] = 1.0
    with pytest.raises(ValueError):
        a.setflags(write=True)  # the base is no writable buffer: cannot be forced
    with pytest.raises(ValueError):
        ck["s"][()] = 3
    # Two reads are two views of the same mapped bytes: no copy was made.
    assert np.shares_memory(a, b)
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert type(a.base).__name__ == "MappedCheckpoint" and a.base is b.base
    # Views through get/read share that memory too; verify=True checks the CRC first.
    assert np.shares_memory(ck.get("w", verify=True), a)
    assert np.shares_memory(ck.read(["w"])["w"], a)
    raw = ck.get("w", raw=True)
    assert raw.dtype == np.uint8 and raw.shape == (4096,) and np.shares_memory(raw, a)


def test_views_outlive_the_checkpoint(tmp_path):
    want = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    ckptstore.save(tmp_path, {"w": want})
    ck = ckptstore.open(tmp_path)
    a = ck["w"]
    view = a[3:5, ::2]
    del ck
    gc.collect()
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(view, want[3:5, ::2])
    # close() drops the object's own hold; arrays keep theirs; the object refuses reads.
    with ckptstore.open(tmp_path) as ck2:
        b = ck2["w"]
    assert ck2.closed
    with pytest.raises(ValueError, match="closed"):
        ck2["w"]
    gc.collect()
    assert float(b.sum()) == float(want.sum())
    # Even after the directory is gone: the map holds the (unlinked) file.
    shutil.rmtree(tmp_path)
    np.testing.assert_array_equal(b, want)


# ------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------


def test_errors_map_to_exception_classes(tmp_path):
    with pytest.raises(ckptstore.CheckpointNotFoundError) as e:
        ckptstore.open(tmp_path / "missing")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ckptstore.CheckpointError)
    assert "no checkpoint at" in str(e.value)

    ckptstore.save(tmp_path / "ck", {"w": np.ones(4, np.float32)})
    ck = ckptstore.open(tmp_path / "ck")
    with pytest.raises(KeyError) as e:
        ck["nope"]
    assert isinstance(e.value, ckptstore.TensorNotFoundError)
    assert str(e.value) == 'no tensor named "nope" in the checkpoint'

    with pytest.raises(ckptstore.InvalidTensorError):
        ckptstore.save(tmp_path / "c2", {"c": np.zeros(3, np.complex64)})
    with pytest.raises(ckptstore.InvalidTensorError, match="reserved"):
        ckptstore.save(tmp_path / "c2", {"__metadata__": np.zeros(3)})
    with pytest.raises(ckptstore.InvalidArgumentError):
        ckptstore.save(tmp_path / "c2", {"a": np.zeros(3)}, metadata=["not", "a", "dict"])
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
        ckptstore.save(tmp_path / "c2", {"a": np.zeros(3)}, max_shard_size=0)
    assert not (tmp_path / "c2").exists() or not (tmp_path / "c2" / h.MANIFEST).exists()


def test_damage_is_reported_with_its_location(tmp_path):
    ckptstore.save(tmp_path, {"a": np.ones(100, np.float32), "b": np.arange(50, dtype=np.int64)})
    m = h.read_manifest(tmp_path)
    t = next(t for t in m["tensors"] if t["name"] == "b")
    shard = tmp_path / m["shards"][t["shard"]]["file"]
    h.flip_byte(shard, t["offsets"][0] + 3, 0x10)
    ck = ckptstore.open(tmp_path)  # open reads no tensor data
    np.testing.assert_array_equal(ck["a"], np.ones(100, np.float32))
    with pytest.raises(ckptstore.ChecksumError) as e:
        ck.verify()
    assert 'tensor "b"' in str(e.value) and e.value.file == shard.name and e.value.shard == 0
    assert isinstance(e.value, ckptstore.CorruptCheckpointError)
    with pytest.raises(ckptstore.ChecksumError):
        ck.get("b", verify=True)
    with pytest.raises(ckptstore.ChecksumError):
        ck.read()
    ck.get("b")  # unverified view: allowed
    # A damaged manifest fails at open.
    h.flip_byte(tmp_path / h.MANIFEST, 20, 0x01)
    with pytest.raises(ckptstore.CorruptCheckpointError):
        ckptstore.open(tmp_path)


# ------------------------------------------------------------------------------------
# Optimizer state
# ------------------------------------------------------------------------------------


def fp32_optimizer(seed: int = 3):
    """Model tensors and an FP32 Adam-like optimizer state with a 0-dim parameter."""
    rng = np.random.default_rng(seed)
    model = {
        "w": rng.standard_normal((16, 8)).astype(np.float32),
        "b": rng.standard_normal((8,)).astype(np.float32),
        "temp": np.array(0.7, np.float32),  # 0-dim parameter
    }
    state = {
        n: {
            "step": np.array(12.0, np.float32),
            "exp_avg": (rng.standard_normal(p.shape) * 1e-3).astype(np.float32),
            "exp_avg_sq": (rng.random(p.shape) * 1e-6).astype(np.float32),
        }
        for n, p in model.items()
    }
    opt = {
        "param_groups": [
            {"params": ["w", "b"], "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8},
            {"params": ["temp"], "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8},
        ],
        "param_shapes": {n: p.shape for n, p in model.items()},
        "state": state,
    }
    return model, opt


FUSED = {"exp_avg": "f16_scaled", "exp_avg_sq": "f16_scaled"}


def test_fused_adam_scenario(tmp_path):
    """TransformerEngine FusedAdam (PR #3854): an FP32 checkpoint loaded twice into FP16
    scaled states gives identical results, the checkpoint is never modified, and 0-dim
    shapes stay 0-dim."""
    model, opt = fp32_optimizer()
    ckptstore.save(tmp_path, model, optimizer=opt)
    ck = ckptstore.open(tmp_path)
    before = hash_files(ck.shard_files)

    first = ck.load_optimizer(FUSED)
    # What the buggy loader did: scale the loaded values in place. Fresh buffers make that
    # harmless for the next load.
    for st in first["state"].values():
        for v in st.values():
            if isinstance(v, ckptstore.F16Scaled):
                np.multiply(v.q, 0.5, out=v.q)
                v.scale[...] = 0
    second = ck.load_optimizer(FUSED)
    third = ckptstore.open(tmp_path).load_optimizer(FUSED)
    assert hash_files(ck.shard_files) == before
    ck.verify()

    for st_a, st_b in ((second, third),):
        assert st_a["param_groups"] == st_b["param_groups"]
        for p in model:
            for k in ("exp_avg", "exp_avg_sq"):
                a, b = st_a["state"][p][k], st_b["state"][p][k]
                assert isinstance(a, ckptstore.F16Scaled)
                h.assert_bit_equal(a.q, b.q, f"{p}/{k} q")
                h.assert_bit_equal(a.scale, b.scale, f"{p}/{k} scale")
                assert a.q.dtype == np.float16 and a.scale.dtype == np.float32
                assert a.q.shape == model[p].shape  # () for the 0-dim parameter
                assert a.scale.shape == (1,)  # FusedAdam's scale shape
                assert a.q.flags.writeable and not np.shares_memory(a.q, b.q)
                # FP16 codes times the scale approximate the FP32 values.
                want = opt["state"][p][k]
                np.testing.assert_allclose(a.to_float32(), want, rtol=2e-3, atol=1e-3 * np.abs(want).max())
            step = st_a["state"][p]["step"]
            assert step.shape == () and step.dtype == np.float32 and step == 12.0  # counter: as stored

    assert second["param_shapes"]["temp"] == ()
    assert second["state"]["temp"]["exp_avg"].q.shape == ()
    # A 0-dim scale on request; hyperparameters come back as saved.
    scalar = ck.load_optimizer({"exp_avg": "f16_scaled_scalar"})
    assert scalar["state"]["w"]["exp_avg"].scale.shape == ()
    assert scalar["param_groups"][1] == {"params": ["temp"], "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8}


def test_optimizer_layouts_and_exact_round_trip(tmp_path):
    model, opt = fp32_optimizer(seed=5)
    ckptstore.save(tmp_path / "a", model, optimizer=opt)
    ck = ckptstore.open(tmp_path / "a")
    assert ck.has_optimizer
    stored = ck.load_optimizer()
    for p in model:
        for k, want in opt["state"][p].items():
            got = stored["state"][p][k]
            h.assert_bit_equal(got, want, f"{p}/{k}")
            assert got.flags.writeable
    bf = ck.load_optimizer("bf16")
    assert bf["state"]["w"]["exp_avg"].dtype == BF16
    assert bf["state"]["w"]["step"].dtype == np.float32  # counters never take the default
    mixed = ck.load_optimizer({"*": "bf16", "exp_avg": "f32", ("b", "exp_avg_sq"): "f16_scaled"})
    assert mixed["state"]["w"]["exp_avg"].dtype == np.float32
    assert mixed["state"]["w"]["exp_avg_sq"].dtype == BF16
    assert isinstance(mixed["state"]["b"]["exp_avg_sq"], ckptstore.F16Scaled)

    # F16-scaled state saved as such comes back bit-exact as stored.
    fused = ck.load_optimizer(FUSED)
    ckptstore.save(tmp_path / "b", model, optimizer=fused)
    again = ckptstore.open(tmp_path / "b").load_optimizer()
    for p in model:
        a, b = fused["state"][p]["exp_avg"], again["state"][p]["exp_avg"]
        h.assert_bit_equal(a.q, b.q)
        h.assert_bit_equal(a.scale, b.scale)

    with pytest.raises(ckptstore.InvalidArgumentError, match="unknown layout target"):
        ck.load_optimizer("fp8")
    ckptstore.save(tmp_path / "c", model)
    with pytest.raises(ckptstore.OptimizerStateError, match="no optimizer state"):
        ckptstore.open(tmp_path / "c").load_optimizer()


def test_bad_optimizer_state_is_refused_before_writing(tmp_path):
    model, opt = fp32_optimizer()
    bad = dict(opt, state=dict(opt["state"], w=dict(opt["state"]["w"], exp_avg=np.zeros((3, 3), np.float32))))
    with pytest.raises(ckptstore.OptimizerStateError, match="fits neither"):
        ckptstore.save(tmp_path, model, optimizer=bad)
    stray = dict(opt, state=dict(opt["state"], ghost={"m": np.zeros(1)}))
    with pytest.raises(ckptstore.OptimizerStateError, match="ghost"):
        ckptstore.save(tmp_path, model, optimizer=stray)
    twice = dict(opt, param_groups=opt["param_groups"] + [{"params": ["w"]}])
    with pytest.raises(ckptstore.OptimizerStateError, match="twice"):
        ckptstore.save(tmp_path, model, optimizer=twice)
    clash = dict(model, **{"optim/w/step": np.zeros(())})
    with pytest.raises(ckptstore.InvalidTensorError, match="given twice"):
        ckptstore.save(tmp_path, clash, optimizer=opt)
    assert not (tmp_path / h.MANIFEST).exists()


# ------------------------------------------------------------------------------------
# Interop with stock safetensors
# ------------------------------------------------------------------------------------


def test_shards_open_with_stock_safetensors(tmp_path):
    import torch  # safetensors' numpy backend has no bfloat16: read BF16 through torch

    arrays = all_dtypes(seed=11)
    info = ckptstore.save(tmp_path, arrays, max_shard_size=h.MAX_SHARD)
    assert info["shards"] > 1
    ck = ckptstore.open(tmp_path)
    seen = {}
    for shard in ck.shard_files:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                seen[name] = f.get_tensor(name)
    assert set(seen) == set(arrays)
    for name, want in arrays.items():
        got = seen[name]
        if want.dtype == BF16:
            got = got.view(torch.int16).numpy().view(BF16)
        else:
            got = got.numpy()
        h.assert_bit_equal(got, want, name)
    numpy_side = {}
    for shard in ck.shard_files:
        if not any(ck.info(n)["dtype"] == "BF16" and ck.info(n)["file"] == Path(shard).name for n in ck):
            numpy_side.update(load_file(str(shard)))
    for name, got in numpy_side.items():
        h.assert_bit_equal(got, arrays[name], name)


def test_stock_safetensors_files_open_read_only(tmp_path):
    arrays = h.make_arrays(seed=2)
    path = tmp_path / "model.safetensors"
    save_file(arrays, str(path), metadata=h.SOURCE_METADATA)
    ck = ckptstore.open(path)
    assert ck.kind == "safetensors" and ck.checkpoint_id is None
    assert ck.metadata == h.SOURCE_METADATA
    assert set(ck.keys()) == set(arrays)
    for name, want in arrays.items():
        got = ck[name]
        h.assert_bit_equal(got, want, name)
        assert not got.flags.writeable
        assert ck.info(name)["crc32"] is None
    assert ck.verify() == {"tensors": 0, "bytes": 0, "checksummed": False}
    assert ckptstore.open(tmp_path).keys() == ck.keys()  # a directory holding model.safetensors

    # A Hugging Face sharded directory: two files and an index.
    hf = tmp_path / "hf"
    hf.mkdir()
    names = list(arrays)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, ns in parts.items():
        save_file({n: arrays[n] for n in ns}, str(hf / file))
        weight_map.update({n: file for n in ns})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    ck = ckptstore.open(hf)
    assert ck.kind == "hf-sharded" and len(ck) == len(arrays)
    for name, want in arrays.items():
        h.assert_bit_equal(ck[name], want, name)
    # ckptstore.save copies a foreign store into a native checkpoint, from the mapped views.
    ckptstore.save(tmp_path / "native", {n: ck[n] for n in ck})
    native = ckptstore.open(tmp_path / "native")
    native.verify()
    for name, want in arrays.items():
        h.assert_bit_equal(native[name], want, name)


def test_verify_received_checks_bytes_from_elsewhere_against_the_stored_crcs(tmp_path):
    """``Checkpoint.verify_received``: bytes that arrived from a peer's copy straight into a
    destination are judged by the stored CRC32s (the stored bytes are not read); a changed
    byte is a ChecksumError naming the tensor, a box that is not one stored chunk a
    ValueError."""
    from ckptstore import _ckptstore

    w = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    ckptstore.save(tmp_path / "c", {"w": w, "b": np.ones(7, np.float32)})
    rr = _ckptstore.Checkpoint(str(tmp_path / "c"), lazy=True)
    got = [("w", [0, 0], [512, 512], w.reshape(-1).view(np.uint8).copy()),
           ("b", [0], [7], np.ones(7, np.float32).view(np.uint8).copy())]
    rr.verify_received(got)
    got[0][3][100_000] ^= 0x20
    with pytest.raises(ckptstore.ChecksumError, match='"w", block 0'):
        rr.verify_received(got)
    with pytest.raises(ValueError, match="not one whole stored chunk"):
        rr.verify_received([("w", [0, 0], [256, 512], w[:256].reshape(-1).view(np.uint8).copy())])
