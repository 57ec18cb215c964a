"""ckptstore.integrations._tree: a framework's nested checkpoint object as one checkpoint."""

from __future__ import annotations

import collections
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_helpers as h
from ckptstore.errors import ChecksumError, InvalidArgumentError
from ckptstore.integrations._tree import (
    TREE_KEY,
    PickleNotAllowedError,
    TreeSaver,
    load_tree,
    save_tree,
)
import ckptstore


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def _trained():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def _sample():
    m, opt = _trained()
    w = torch.randn(5)
    return {
        "state_dict": m.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "epoch": 3,
        "rng": {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()},
        "tied": [w, w],
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 1 << 70,
        "neg": -(1 << 63),
        "bytes": b"\x00\x01",
        "odict": collections.OrderedDict(b=1, a=2),
        "$dollar": {1: "int key", (1, 2): "tuple key", None: "none key"},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "set": {1, 2},
        "bf16": torch.randn(3).bfloat16(),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "np_scalar": np.float32(1.5),
        "np_array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "param": torch.nn.Parameter(torch.ones(2)),
        "empty": torch.empty(0, 3),
        "nested": {"a": [1, (2.5, "x"), {"b": None}]},
    }


def _assert_same(got, want, path="obj"):
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        h.assert_bit_equal(got.detach().contiguous().view(-1).view(torch.uint8).numpy(),
                           want.detach().contiguous().view(-1).view(torch.uint8).numpy(), path)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        h.assert_bit_equal(got, want, path)
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_round_trip_is_exact(tmp_path: Path):
    obj = _sample()
    save_tree(tmp_path / "c", obj)
    got = load_tree(tmp_path / "c")
    _assert_same(got, obj)
    # The same tensor object saved twice is stored once and comes back as one object.
    assert got["tied"][0] is got["tied"][1]
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    # Loaded tensors are fresh memory, not views of the mapped file: writable, independent.
    got["state_dict"]["weight"].add_(1)
    again = load_tree(tmp_path / "c")
    _assert_same(again["state_dict"], obj["state_dict"])
    # The stored names follow the object's paths.
    names = set(ckptstore.open(tmp_path / "c").keys())
    assert {"state_dict/weight", "optimizer_states/0/state/0/exp_avg", "rng/torch"} <= names
    assert "tied/1" not in names


def test_optimizer_state_dict_loads_into_a_fresh_optimizer(tmp_path: Path):
    m, opt = _trained()
    save_tree(tmp_path / "c", {"opt": opt.state_dict()})
    m2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5.0)
    opt2.load_state_dict(load_tree(tmp_path / "c")["opt"])
    _assert_same(opt2.state_dict(), opt.state_dict())


def test_pickle_needs_the_opt_in_both_ways(tmp_path: Path):
    with pytest.raises(PickleNotAllowedError, match=r"hp/obj: a value of type .*Opaque"):
        save_tree(tmp_path / "x", {"hp": {"obj": Opaque(1)}})
    assert not (tmp_path / "x").exists()
    save_tree(tmp_path / "p", {"hp": {"obj": Opaque(7)}}, allow_pickle=True)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        load_tree(tmp_path / "p")
    assert load_tree(tmp_path / "p", allow_pickle=True)["hp"]["obj"].x == 7
    assert issubclass(PickleNotAllowedError, InvalidArgumentError)


def test_a_damaged_tensor_is_named_and_nothing_is_returned(tmp_path: Path):
    obj = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    save_tree(tmp_path / "c", obj)
    (shard,) = (tmp_path / "c").glob("*.safetensors")
    n, header, _ = h.shard_header(shard)
    h.flip_byte(shard, 8 + n + header["a"]["data_offsets"][0] + 100)
    with pytest.raises(ChecksumError, match='tensor "a"'):
        load_tree(tmp_path / "c")


def test_a_checkpoint_without_a_tree_is_refused(tmp_path: Path):
    ckptstore.save(tmp_path / "c", {"w": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgumentError, match=TREE_KEY):
        load_tree(tmp_path / "c")


def test_tree_saver_reuses_its_buffers_and_commits_in_order(tmp_path: Path):
    obj = _sample()
    with TreeSaver(max_in_flight=1) as saver:
        handles = []
        for i in range(4):
            obj["epoch"] = i
            obj["state_dict"]["weight"].add_(1.0)
            want = obj["state_dict"]["weight"].clone()
            handles.append((saver.save(tmp_path / f"c{i % 2}", obj), i, want))
            # The snapshot was taken: changing the live tensor now changes nothing saved.
            obj["state_dict"]["weight"].add_(100.0)
            obj["state_dict"]["weight"].sub_(100.0)
            if i == 0:
                handles[0][0].wait()
                first = saver.allocations
        for hd, i, want in handles:
            hd.wait()
        held = saver.snapshot_bytes
        # One buffer per stored tensor, allocated by the first save only.
        assert first == saver.allocations > 0
    assert held > 0
    for i in (2, 3):
        got = load_tree(tmp_path / f"c{i % 2}")
        assert got["epoch"] == i
        _assert_same(got["state_dict"]["weight"], handles[i][2])


def test_tree_saver_holds_a_write_until_released(tmp_path: Path):
    """``save(after=event)``: the snapshot is taken at once, nothing is written until the
    event is set (the DeepSpeed engine releases a tag's writes at its commit), then the
    save commits the snapshot."""
    import threading

    obj = _sample()
    want = obj["state_dict"]["weight"].clone()
    go = threading.Event()
    with TreeSaver() as saver:
        hd = saver.save(tmp_path / "c", obj, after=go)
        obj["state_dict"]["weight"].add_(1.0)  # after the snapshot: not saved
        assert not go.wait(0.3)
        assert not hd.done() and not (tmp_path / "c").exists()
        go.set()
        hd.wait()
    _assert_same(load_tree(tmp_path / "c")["state_dict"]["weight"], want)


def test_tree_saver_reports_a_refused_value_at_once(tmp_path: Path):
    with TreeSaver() as saver:
        with pytest.raises(PickleNotAllowedError):
            saver.save(tmp_path / "c", {"x": Opaque(1)})
        saver.save(tmp_path / "c", {"x": 1}).wait()
    assert load_tree(tmp_path / "c") == {"x": 1}
