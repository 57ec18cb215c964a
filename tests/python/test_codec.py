"""ckptstore._codec: the one codec of the Python values in a checkpoint's metadata
(format-spec/values.md), and ckptstore.torch.internal.AsyncSaver, the one background saver."""

from __future__ import annotations

import collections
import json
import math
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_helpers as h
import ckptstore
import ckptstore.torch as ct
from ckptstore._codec import DROP, INLINE_MAX, Decoder, Encoder
from ckptstore.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    PickleNotAllowedError,
    UnsupportedFormatError,
)
from ckptstore.torch.internal import AsyncSaver, Handle, Snapshot

EVENT_TIMEOUT = 120.0


def _bits(x):
    """A comparable form of ``x`` that tells every bit (floats by their IEEE bytes)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.contiguous().reshape(-1).view(torch.uint8).tolist())
    if isinstance(x, np.generic):
        return ("np", x.dtype.str, x.tobytes())
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else struct.pack("<d", x))
    if isinstance(x, dict):
        return (type(x).__name__, [(_bits(k), _bits(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_bits(v) for v in x])
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, sorted(repr(_bits(v)) for v in x))
    return (type(x).__name__, x)


#: One value per row of values.md (plain values and every tag but the stored tensors and
#: $pickle, which have tests of their own), with the JSON each encodes to.
CASES = [
    ("none", None, None),
    ("bool", True, True),
    ("str", "héllo", "héllo"),
    ("int", -(1 << 63), -(1 << 63)),
    ("u64", (1 << 64) - 1, (1 << 64) - 1),
    ("big int", 1 << 64, {"$int": "18446744073709551616"}),
    ("negative big int", -(1 << 63) - 1, {"$int": "-9223372036854775809"}),
    ("float", 0.1, 0.1),
    ("negative zero", -0.0, -0.0),
    ("tiny float", 5e-324, 5e-324),
    ("nan", math.nan, {"$float": "nan"}),
    ("inf", math.inf, {"$float": "inf"}),
    ("-inf", -math.inf, {"$float": "-inf"}),
    ("bytes", b"\x00\xff\x10", {"$bytes": "AP8Q"}),
    ("tuple", (1, "a", (2.5,)), {"$tuple": [1, "a", {"$tuple": [2.5]}]}),
    ("set", {3}, {"$set": [3]}),
    ("frozenset", frozenset({"x"}), {"$frozenset": ["x"]}),
    ("list", [1, [2]], [1, [2]]),
    ("dict", {"a": 1, "b": {"c": None}}, {"a": 1, "b": {"c": None}}),
    ("escaped dict", {"$tuple": [1], 2: "two"}, {"$dict": [["$tuple", [1]], [2, "two"]]}),
    ("odict", collections.OrderedDict(b=1, a=2), {"$odict": [["b", 1], ["a", 2]]}),
    ("np float32", np.float32(1.5), {"$np": "<f4", "value": 1.5}),
    ("np int64", np.int64(-3), {"$np": "<i8", "value": -3}),
    ("np uint64", np.uint64((1 << 64) - 1), {"$np": "<u8", "value": (1 << 64) - 1}),
    ("np bool", np.bool_(True), {"$np": "|b1", "value": True}),
    ("np bytes", np.bytes_(b"ab"), {"$np": "|S2", "value": {"$bytes": "YWI="}}),
    ("np nan", np.float16("nan"), {"$np": "<f2", "value": {"$float": "nan"}}),
    ("size", torch.Size([2, 0, 3]), {"$size": [2, 0, 3]}),
    ("torch dtype", torch.bfloat16, {"$torch_dtype": "bfloat16"}),
    ("torch device", torch.device("cuda", 1), {"$torch_device": "cuda:1"}),
    ("inline tensor", torch.tensor([1.0, -0.0, float("nan")], dtype=torch.bfloat16),
     {"$inline_tensor": "gD8AgMB/", "dtype": "bfloat16", "shape": [3]}),
    ("inline scalar", torch.tensor(7, dtype=torch.int64),
     {"$inline_tensor": "BwAAAAAAAAA=", "dtype": "int64", "shape": []}),
    ("inline empty", torch.empty(0, 3), {"$inline_tensor": "", "dtype": "float32", "shape": [0, 3]}),
    ("inline bool", torch.tensor([True, False]), {"$inline_tensor": "AQA=", "dtype": "bool", "shape": [2]}),
]


@pytest.mark.parametrize("value, encoded", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_form_encodes_as_specified_and_round_trips_bit_for_bit(tmp_path: Path, value, encoded):
    got = Encoder().encode(value)
    assert json.dumps(got) == json.dumps(encoded)
    # Through a real checkpoint: the engine keeps the metadata JSON exactly.
    ckptstore.save(tmp_path / "c", {"w": np.zeros(1, np.float32)}, metadata={"v": got})
    stored = ckptstore.open(tmp_path / "c").metadata["v"]
    back = Decoder().decode(stored)
    assert _bits(back) == _bits(value)


def test_a_whole_mixed_value_round_trips(tmp_path: Path):
    value = {c[0]: c[1] for c in CASES}
    value["nested"] = [{"k": (1, {2: b"x"})}, collections.OrderedDict(z=frozenset({1}))]
    ckptstore.save(tmp_path / "c", {"w": np.zeros(1, np.float32)}, metadata={"v": Encoder().encode(value)})
    back = Decoder().decode(ckptstore.open(tmp_path / "c").metadata["v"])
    assert _bits(back) == _bits(value)


def test_stored_tensors_go_through_the_callbacks():
    stored = {}

    def store(v, path):
        stored[path] = v
        return path

    w = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    a = np.arange(3)
    enc = Encoder(tensor=store, arrays=True)
    got = enc.encode({"w": w, "a": a, "big": torch.zeros(100)})
    assert got == {"w": {"$tensor": "w", "parameter": False}, "a": {"$ndarray": "a"}, "big": {"$tensor": "big"}}
    assert stored["w"] is w and stored["a"] is a
    seen = []

    def resolve(kind, name, fields):
        seen.append((kind, name, fields))
        return DROP if name == "big" else name.upper()

    assert Decoder(tensor=resolve).decode(got) == {"w": "W", "a": "A"}
    assert seen == [("$tensor", "w", {"parameter": False}), ("$ndarray", "a", {}), ("$tensor", "big", {})]
    assert list(Decoder(tensor=resolve).scan({"x": [got]})) == seen
    # Without a store, arrays are not stored: only pickle could.
    with pytest.raises(PickleNotAllowedError, match="numpy.ndarray"):
        Encoder(tensor=store).encode(a)


def test_a_value_decoded_already_passes_through():
    """What a caller hands back decoded (a live optimizer group: tuples, int keys) decodes to
    itself, as with the older decoders."""
    live = {"betas": (0.9, 0.99), 3: {"lr": 0.1}, "t": torch.ones(2), "n": None}
    got = Decoder().decode(live)
    assert got["t"] is live["t"] and list(got) == list(live)
    assert {k: v for k, v in got.items() if k != "t"} == {k: v for k, v in live.items() if k != "t"}


def test_dropped_tensors_leave_their_entries():
    value = {"l": [1, {"$tensor": "x"}], "t": {"$tuple": [{"$tensor": "x"}, 2]}, "s": {"$set": [{"$t": "x"}]},
             "d": {"$dict": [[1, {"$tensor": "x"}], [2, "kept"]]}, "o": {"k": {"$tensor": "x"}}}
    got = Decoder(tensor=lambda *a: DROP).decode(value)
    assert got == {"l": [1], "t": (2,), "s": set(), "d": {2: "kept"}, "o": {}}


# ---- refused values --------------------------------------------------------------------


Point = collections.namedtuple("Point", "x y")


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


def test_pickle_needs_the_opt_in_at_both_ends():
    with pytest.raises(PickleNotAllowedError, match=r"hp/obj: a value of type .*Opaque can only be stored pickled"):
        Encoder().encode({"hp": {"obj": Opaque(1)}})
    stored = Encoder(allow_pickle=True).encode({"hp": {"obj": Opaque(1)}, "nt": Point(1, 2)})
    assert set(stored["hp"]["obj"]) == {"$pickle"} and set(stored["nt"]) == {"$pickle"}
    with pytest.raises(PickleNotAllowedError, match=r"^C holds a pickled value at '/hp/obj'.*allow_pickle=True"):
        Decoder(where="C").decode(stored)
    with pytest.raises(PickleNotAllowedError):
        list(Decoder().scan(stored))  # refused before anything is built
    back = Decoder(allow_pickle=True).decode(stored)
    assert back["hp"]["obj"] == Opaque(1) and type(back["nt"]) is Point and back["nt"] == (1, 2)
    assert issubclass(PickleNotAllowedError, InvalidArgumentError)


def test_unpicklable_and_oversized_values_are_invalid_arguments():
    with pytest.raises(InvalidArgumentError, match="cannot pickle it") as e:
        Encoder(allow_pickle=True).encode({"f": lambda: 1})
    assert not isinstance(e.value, PickleNotAllowedError)
    Encoder().encode(torch.zeros(INLINE_MAX))
    with pytest.raises(InvalidArgumentError, match=f"at most {INLINE_MAX} elements"):
        Encoder().encode({"t": torch.zeros(INLINE_MAX + 1)})


@pytest.mark.parametrize(
    "bad, error, what",
    [
        ({"$frob": 1}, UnsupportedFormatError, "unknown tag '\\$frob'"),
        ({"$tuple": [], "$set": []}, CorruptCheckpointError, "several tags"),
        ({"$tuple": [], "x": 1}, CorruptCheckpointError, "keys"),
        ({"$np": "<f4"}, CorruptCheckpointError, "keys"),
        ({"$dict": 5}, CorruptCheckpointError, "list of pairs"),
        ({"$dict": [[1, 2, 3]]}, CorruptCheckpointError, "list of pairs"),
        ({"$tuple": "ab"}, CorruptCheckpointError, "no list"),
        ({"$bytes": "not base64!"}, CorruptCheckpointError, "base64"),
        ({"$int": "1e3"}, CorruptCheckpointError, "decimal"),
        ({"$float": "1.5"}, CorruptCheckpointError, "nan, inf or -inf"),
        ({"$np": "|O", "value": 1}, CorruptCheckpointError, "dtype"),
        ({"$np": "<c16", "value": 1}, CorruptCheckpointError, "dtype"),
        ({"$torch_dtype": "load"}, CorruptCheckpointError, "not a torch dtype"),
        ({"$torch_device": "nowhere:x"}, CorruptCheckpointError, "torch_device"),
        ({"$size": [-1]}, CorruptCheckpointError, "sizes"),
        ({"$inline_tensor": "AAAA", "dtype": "float32", "shape": [2]}, CorruptCheckpointError, "3 bytes"),
        ({"$tensor": 5}, CorruptCheckpointError, "names no tensor"),
        ({"$tensor": "w"}, CorruptCheckpointError, "where none is expected"),
    ],
)
def test_malformed_values_are_refused_naming_checkpoint_and_place(bad, error, what):
    with pytest.raises(error, match=what) as e:
        Decoder(where="CK").decode({"a": [bad]})
    assert str(e.value).startswith("CK: ")
    assert "/a/0" in str(e.value)


# ---- older writers ----------------------------------------------------------------------


def test_older_writers_forms_still_decode():
    # TorchTitan's stored tensor name.
    got = Decoder(tensor=lambda kind, name, fields: (kind, name, fields)).decode({"x": {"$t": "l1.weight"}})
    assert got == {"x": ("$tensor", "l1.weight", {})}
    # ckptstore.torch's inline tensor: a nested list with its dtype.
    t = Decoder().decode({"$tensor": [[1.0, 2.5], [3.0, -0.0]], "dtype": "float16"})
    assert t.dtype == torch.float16 and t.tolist() == [[1.0, 2.5], [3.0, -0.0]]
    assert str(t[1, 1].item()) == "-0.0"


def test_a_torch_checkpoint_with_the_old_inline_tensor_form_loads(tmp_path: Path):
    """A ckptstore.torch checkpoint whose metadata holds the old ``$tensor`` list form (what
    the writer of the previous version stored for a small tensor in ``extra``)."""
    model = torch.nn.Linear(2, 2)
    ct.save(tmp_path / "c", model, extra={"sched": {"lr": torch.tensor([1.5, 2.0])}, "pair": (1, 2)})
    meta = ckptstore.open(tmp_path / "c").metadata[ct.META_KEY]
    assert meta["extra"]["sched"]["lr"]["$inline_tensor"]  # written in the new form

    def to_old(m):
        m["metadata"][ct.META_KEY]["extra"]["sched"]["lr"] = {"$tensor": [1.5, 2.0], "dtype": "float32"}

    h.rewrite_manifest(tmp_path / "c", to_old)
    extra = ct.load(tmp_path / "c", torch.nn.Linear(2, 2))
    lr = extra["sched"]["lr"]
    assert lr.dtype == torch.float32 and torch.equal(lr, torch.tensor([1.5, 2.0])) and extra["pair"] == (1, 2)


def test_torch_save_refuses_what_it_would_have_to_pickle(tmp_path: Path):
    with pytest.raises(PickleNotAllowedError, match="extra 'o'.*never pickles"):
        ct.save(tmp_path / "c", torch.nn.Linear(2, 2), extra={"o": Opaque(1)})
    assert not (tmp_path / "c").exists()
    # What the codec stores (once refused by ckptstore.torch) now round-trips.
    extra = {"keys": {1: "a", "$x": 2}, "s": {1, 2}, "big": 1 << 80, "b": b"\x01"}
    ct.save(tmp_path / "c", torch.nn.Linear(2, 2), extra=extra)
    assert ct.load(tmp_path / "c", torch.nn.Linear(2, 2)) == extra


# ---- the one background saver -------------------------------------------------------------


def _arrays(x: float):
    return {"a": np.full(4, x, np.float32), "t": torch.full((3,), x)}


def _saver_job(tmp_path, saver, name, value, *, gate=None, fail=None, after=None, log=None):
    """A save of ``value``'s arrays to ``tmp_path/name`` through ``saver``: ``gate`` holds
    the write until set, ``fail`` raises it in the write."""

    def build(copy):
        return [copy(k, v) for k, v in value.items()]

    def write(entries):
        if gate is not None:
            assert gate.wait(EVENT_TIMEOUT)
        if log is not None:
            log.append(name)
        if fail is not None:
            raise fail
        return ckptstore._ckptstore.save(str(tmp_path / name), entries, None, None, None, "inline")

    return saver.save(Handle(name), build, write, after=after)


def test_saver_snapshots_writes_in_order_and_reuses_buffers(tmp_path: Path):
    saver = AsyncSaver(2)
    live = _arrays(1.0)
    gate, log = threading.Event(), []
    h1 = _saver_job(tmp_path, saver, "c1", live, gate=gate, log=log)
    live["a"] += 1  # after the snapshot: not in c1
    live["t"] += 1
    h2 = _saver_job(tmp_path, saver, "c2", live, log=log)
    assert saver.buffer_sets == 2 and saver.in_flight() == [h1, h2] and not h1.done()
    gate.set()
    assert h2.wait(EVENT_TIMEOUT)["tensors"] == 2 and h1.done()
    assert log == ["c1", "c2"]
    for name, x in (("c1", 1.0), ("c2", 2.0)):
        ck = ckptstore.open(tmp_path / name)
        assert np.array_equal(ck["a"], np.full(4, x, np.float32)) and np.array_equal(ck["t"], np.full(3, x, np.float32))
    first = saver.allocations
    assert first == 4 and saver.snapshot_bytes == 2 * (16 + 12)
    _saver_job(tmp_path, saver, "c3", live).wait()
    assert saver.allocations == first and saver.buffer_sets == 2  # a set reused, nothing allocated
    saver.close()
    assert saver.snapshot_bytes == 0
    with pytest.raises(InvalidArgumentError, match="the saver is closed"):
        _saver_job(tmp_path, saver, "c4", live)


def test_snapshot_copies_every_torch_tensor_in_one_native_call(monkeypatch):
    # One release of the interpreter lock for all of a save's copies: a loop of copy_ calls
    # waits for the lock once per tensor while another Python thread is busy.
    calls = []
    real = torch._foreach_copy_

    def counted(dst, src, **kw):
        calls.append(len(dst))
        return real(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    snap = Snapshot()
    for x in (1.0, 2.0):  # the second save reuses the buffers and refreshes them
        srcs = {"w": torch.arange(6.0).reshape(2, 3).t() * x,  # not contiguous
                "h": torch.full((4,), x, dtype=torch.bfloat16), "step": torch.tensor(int(x))}
        snap.begin()
        bufs = {k: snap.tensor(k, v) for k, v in srcs.items()}
        entry = snap.copy("c", torch.full((2,), 7.0 * x))
        arr = snap.copy("n", np.full(3, x))  # numpy: copied at once
        assert np.array_equal(arr[2], np.full(3, x))
        snap.end()
        for k, v in srcs.items():
            assert bufs[k].is_contiguous() and bufs[k].dtype == v.dtype and torch.equal(bufs[k], v)
        assert np.array_equal(entry[2], np.full(2, 7.0 * x, np.float32))
    assert calls == [4, 4] and snap.allocations == 5


def test_saver_max_in_flight_blocks_the_next_save(tmp_path: Path):
    saver = AsyncSaver(1)
    gate, started, returned = threading.Event(), threading.Event(), threading.Event()
    _saver_job(tmp_path, saver, "c1", _arrays(1.0), gate=gate)

    def second():
        started.set()
        _saver_job(tmp_path, saver, "c2", _arrays(2.0))
        returned.set()

    t = threading.Thread(target=second)
    t.start()
    assert started.wait(EVENT_TIMEOUT)
    assert len(saver.in_flight()) == 1 and not returned.is_set()  # c1's slot is still held
    gate.set()
    assert returned.wait(EVENT_TIMEOUT)
    t.join()
    saver.close()
    assert saver.buffer_sets == 1


def test_saver_raises_a_failed_save_once(tmp_path: Path):
    saver = AsyncSaver(1)
    boom = ckptstore.CheckpointIOError("disk full")
    h1 = _saver_job(tmp_path, saver, "c1", _arrays(1.0), fail=boom)
    with pytest.raises(ckptstore.CheckpointIOError, match="disk full"):
        saver.wait()
    saver.wait()  # reported: not raised again
    with pytest.raises(ckptstore.CheckpointIOError):
        h1.wait()  # the handle still tells its own outcome
    # Unreported, the error is raised by the next save, before anything starts.
    h2 = _saver_job(tmp_path, saver, "c2", _arrays(1.0), fail=boom)
    assert h2._event.wait(EVENT_TIMEOUT)  # finished, its error not yet seen by anyone
    with pytest.raises(ckptstore.CheckpointIOError):
        _saver_job(tmp_path, saver, "c3", _arrays(3.0))
    assert not (tmp_path / "c3").exists()
    _saver_job(tmp_path, saver, "c3", _arrays(3.0)).wait()
    # And by close, after the saves in flight finished.
    _saver_job(tmp_path, saver, "c4", _arrays(4.0), fail=boom)
    with pytest.raises(ckptstore.CheckpointIOError):
        saver.close()
    assert saver.closed


def test_saver_after_holds_the_write_and_build_errors_start_nothing(tmp_path: Path):
    saver = AsyncSaver(1)
    go = threading.Event()
    hd = _saver_job(tmp_path, saver, "c1", _arrays(1.0), after=go)
    assert not hd.done() and not (tmp_path / "c1").exists()
    go.set()
    hd.wait(EVENT_TIMEOUT)
    assert (tmp_path / "c1").exists()

    def bad_build(copy):
        copy("a", np.zeros(2))
        raise PickleNotAllowedError("refused")

    with pytest.raises(PickleNotAllowedError):
        saver.save(Handle("x"), bad_build, lambda job: None)
    assert saver.in_flight() == [] and saver.buffer_sets == 1  # the set is back, reusable
    _saver_job(tmp_path, saver, "c2", _arrays(2.0)).wait()
    saver.close()
    with pytest.raises(InvalidArgumentError, match="max_in_flight"):
        AsyncSaver(0)
