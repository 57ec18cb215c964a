"""A nested Python object (a framework's checkpoint dict) as one committed ckptstore checkpoint.

The frameworks hand their checkpoint engines one object: a dict of model and optimizer state
dicts, scheduler and loop state, RNG states, hyperparameters. ``torch.save`` pickles it
whole; :func:`save_tree` stores it as a ckptstore checkpoint instead:

* every tensor (torch, any device; numpy arrays) as a ckptstore tensor named by its path in
  the object (``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``), so
  ``ckpt inspect`` shows what it is and every byte has a CRC32; the same tensor object met
  twice (tied weights) is stored once and comes back as one object;
* the rest as a JSON skeleton in the manifest's metadata (key ``ckptstore.tree``): JSON
  values as they are, and a few tagged forms for what JSON lacks (tuples, dicts whose keys
  are not strings, non-finite floats, integers beyond 64 bits, bytes, sets, numpy scalars,
  ``torch.dtype`` / ``torch.device`` / ``torch.Size``, ``OrderedDict``);
* anything else only with ``allow_pickle=True``, pickled into the skeleton. Loading a
  pickled value needs ``allow_pickle=True`` again: unpickling runs code chosen by whoever
  wrote the checkpoint, so opt in only for checkpoints you trust as much as the code you
  run. Without the opt-in such a value is refused at save (:class:`PickleNotAllowedError`,
  naming its path and type) and at load.

:func:`load_tree` rebuilds the object: every tensor a fresh tensor, filled from the mapped
shard with its CRC32 checked on the way (one parallel pass, interpreter released), all of
them before the object is returned, so a damaged checkpoint raises
:class:`ckptstore.errors.ChecksumError` naming the tensor and hands back nothing.

Dict subclasses other than ``OrderedDict`` come back as plain dicts (Lightning's
``AttributeDict`` and the like); list and tuple subclasses as lists and tuples, except
``torch.Size``; subclasses of ``int``, ``float`` and ``str`` (``IntEnum`` and ``str`` enum
members among them) as their plain values: rebuilding them would mean importing a class
named by the checkpoint.

:class:`TreeSaver` saves without blocking: it copies every tensor into snapshot buffers that
the next save of the same structure reuses (no allocation after the first save), and writes
and commits on a background thread, saves in the order they were made.
"""

from __future__ import annotations

import base64
import collections
import math
import os
import pickle
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from .. import _WIRE, _ckptstore, _prepare, open as _open
from ..errors import InvalidArgumentError, PickleNotAllowedError
from ..torch.internal import Handle, Snapshot, bytes_of, empty_for, to_numpy, torch_module

__all__ = ["save_tree", "load_tree", "TreeSaver", "TreeSaveHandle", "PickleNotAllowedError", "TREE_KEY"]

#: Metadata key of the skeleton.
TREE_KEY = "ckptstore.tree"
_VERSION = 1
_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1


def _torch():
    return torch_module()


def _escape(key: str) -> str:
    """A path component: ``~`` and ``/`` escaped as in JSON Pointer (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _key_text(k: Any) -> str:
    if isinstance(k, str):
        return _escape(k)
    if isinstance(k, (bool, int, float)) or k is None:
        return repr(k)
    return _escape(repr(k))


class _Flattener:
    """Walks an object once: tensors out to ``prepare``, the rest into a JSON skeleton."""

    def __init__(
        self, prepare: Callable[[str, Any], Tuple[str, str, np.ndarray]], allow_pickle: bool
    ) -> None:
        self.prepare = prepare
        self.allow_pickle = allow_pickle
        self.entries: List[Tuple[str, str, np.ndarray]] = []
        self.names: set = set()
        self.by_id: Dict[int, str] = {}
        self.torch = None
        try:
            import torch  # noqa: F401 - only whether it is installed
        except ImportError:
            pass  # numpy-only trees
        else:
            self.torch = _torch()

    def _name(self, path: str) -> str:
        name = path or "."
        n = 2
        while name in self.names or name == "__metadata__":
            name = f"{path}#{n}"
            n += 1
        self.names.add(name)
        return name

    def _tensor(self, v: Any, path: str, tag: str) -> dict:
        known = self.by_id.get(id(v))
        if known is not None:
            return {tag: known}
        name = self._name(path)
        self.entries.append(self.prepare(name, v))
        self.by_id[id(v)] = name
        return {tag: name}

    def walk(self, v: Any, path: str) -> Any:
        torch = self.torch
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v if _I64_MIN <= v <= _U64_MAX else {"$int": str(v)}
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if torch is not None:
            if isinstance(v, torch.Tensor):
                out = self._tensor(v, path, "$tensor")
                dev = v.device.type if v.device.index is None else f"{v.device.type}:{v.device.index}"
                if dev != "cpu":
                    out["device"] = dev
                if isinstance(v, torch.nn.Parameter):
                    out["parameter"] = bool(v.requires_grad)
                return out
            if isinstance(v, torch.Size):
                return {"$size": list(v)}
            if isinstance(v, torch.dtype):
                return {"$torch_dtype": str(v).replace("torch.", "")}
            if isinstance(v, torch.device):
                return {"$torch_device": str(v)}
        if isinstance(v, np.ndarray):
            return self._tensor(v, path, "$ndarray")
        if isinstance(v, np.generic) and not isinstance(v, (np.void, np.object_)):
            return {"$np": v.dtype.str, "value": self.walk(v.item(), path)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$tuple": [self.walk(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.walk(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            tag = "$frozenset" if isinstance(v, frozenset) else "$set"
            return {tag: [self.walk(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            items = [(k, x, f"{path}/{_key_text(k)}" if path else _key_text(k)) for k, x in v.items()]
            plain = all(isinstance(k, str) and not k.startswith("$") for k in v)
            if plain and not isinstance(v, collections.OrderedDict):
                return {k: self.walk(x, p) for k, x, p in items}
            tag = "$odict" if isinstance(v, collections.OrderedDict) else "$dict"
            return {tag: [[self.walk(k, p + "#key"), self.walk(x, p)] for k, x, p in items]}
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"{path or 'the object'}: a value of type {type(v).__module__}.{type(v).__qualname__} "
                "can only be stored pickled; pass allow_pickle=True to store it (and to load it: "
                "unpickling runs code chosen by whoever wrote the checkpoint)"
            )
        try:
            blob = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's value
            raise InvalidArgumentError(f"{path or 'the object'}: cannot pickle it: {e}") from e
        return {"$pickle": base64.b64encode(blob).decode("ascii")}


def _flatten(obj: Any, prepare, allow_pickle: bool) -> Tuple[List[Tuple[str, str, np.ndarray]], str]:
    import json

    f = _Flattener(prepare, allow_pickle)
    skeleton = f.walk(obj, "")
    metadata = json.dumps({TREE_KEY: {"version": _VERSION, "tree": skeleton}}, allow_nan=False)
    return f.entries, metadata


def _prepare_any(name: str, v: Any) -> Tuple[str, str, np.ndarray]:
    if isinstance(v, np.ndarray):
        return _prepare(name, v)
    return to_numpy(name, v)


def save_tree(
    location: "str | os.PathLike[str]",
    obj: Any,
    *,
    allow_pickle: bool = False,
    max_shard_size: Optional[int] = None,
    cleanup: str = "inline",
) -> dict:
    """Save ``obj`` as one committed checkpoint at ``location`` (a directory or an
    ``s3://`` URL), atomically replacing any checkpoint there. Returns the commit info of
    :func:`ckptstore.save`.

    CPU tensors are written from their own memory: keep them unchanged until this returns
    (it releases the interpreter while writing).

    Raises:
        PickleNotAllowedError: ``obj`` holds a value only pickle can store, and
            ``allow_pickle`` is false (nothing is written).
        ckptstore.errors.CheckpointError: the engine's errors (I/O, invalid tensors).
    """
    entries, metadata = _flatten(obj, _prepare_any, allow_pickle)
    return _ckptstore.save(os.fspath(location), entries, metadata, max_shard_size, None, cleanup)


def _tree_of(ck: Any, location: Any) -> Any:
    meta = ck.metadata.get(TREE_KEY)
    if not isinstance(meta, dict) or "tree" not in meta:
        raise InvalidArgumentError(
            f"{os.fspath(location)!r} is a checkpoint, but not one written by save_tree "
            f"(its metadata has no {TREE_KEY!r} entry)"
        )
    if meta.get("version") != _VERSION:
        raise InvalidArgumentError(
            f"{os.fspath(location)!r}: tree version {meta.get('version')!r} is not supported "
            f"(this ckptstore reads version {_VERSION})"
        )
    return meta["tree"]


def has_pickle(skeleton: Any) -> bool:
    """Whether a stored skeleton holds a pickled value (loading it needs ``allow_pickle``)."""
    if isinstance(skeleton, list):
        return any(has_pickle(x) for x in skeleton)
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and "$pickle" in skeleton:
            return True
        return any(has_pickle(x) for x in skeleton.values())
    return False


_NP_OF = {wire: dt for dt, wire in _WIRE.items()}


def _np_dtype(wire: str) -> np.dtype:
    if wire == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return _NP_OF[wire]
    except KeyError:
        raise InvalidArgumentError(f"dtype {wire} has no numpy dtype here") from None


class _Loader:
    """Rebuilds the object from its skeleton in two passes: :meth:`collect` makes a fresh
    CPU buffer for every stored tensor (filled and CRC-checked in one engine pass), then
    :meth:`build` assembles the object over the filled buffers."""

    def __init__(self, ck: Any, location: Any, allow_pickle: bool, map_location: Any) -> None:
        self.ck = ck
        self.location = os.fspath(location)
        self.allow_pickle = allow_pickle
        self.map_location = map_location
        self.fresh: Dict[Tuple[str, str], Any] = {}  # (kind, name) -> fresh CPU buffer
        self.fills: List[Tuple[str, np.ndarray]] = []
        self.placed: Dict[Tuple[str, str, Any], Any] = {}  # one object per stored tensor use

    def _bad(self, what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.location!r}: the stored tree is malformed ({what})")

    def _alloc(self, kind: str, name: Any) -> None:
        if not isinstance(name, str) or name not in self.ck:
            raise self._bad(f"it names a tensor {name!r} the checkpoint does not hold")
        if (kind, name) in self.fresh:
            return
        info = self.ck.info(name)
        if kind == "$tensor":
            t = empty_for(info)
            self.fills.append((name, bytes_of(t)))
        else:
            t = np.empty(tuple(info["shape"]), dtype=_np_dtype(info["dtype"]))
            self.fills.append((name, t.reshape(-1).view(np.uint8)))
        self.fresh[(kind, name)] = t

    def collect(self, v: Any) -> None:
        """Pass 1: allocate every tensor's buffer; refuse pickles without the opt-in."""
        if isinstance(v, list):
            for x in v:
                self.collect(x)
        elif isinstance(v, dict):
            if "$tensor" in v:
                self._alloc("$tensor", v["$tensor"])
            elif len(v) == 1 and "$ndarray" in v:
                self._alloc("$ndarray", v["$ndarray"])
            elif len(v) == 1 and "$pickle" in v and not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.location!r} holds a pickled value; pass allow_pickle=True to load "
                    "it, only if you trust the checkpoint as much as code you run"
                )
            else:
                for x in v.values():
                    self.collect(x)

    def _place(self, v: dict) -> Any:
        name = v["$tensor"]
        saved = v.get("device", "cpu")
        key = (name, saved, v.get("parameter"))
        if key in self.placed:
            return self.placed[key]
        t = self.fresh[("$tensor", name)]
        m = self.map_location
        if callable(m) and not isinstance(m, dict):
            t = m(t, saved)
        else:
            dev = m.get(saved, saved) if isinstance(m, dict) else (saved if m is None else m)
            if str(dev) != "cpu":
                t = t.to(dev)
        if "parameter" in v:
            t = _torch().nn.Parameter(t, requires_grad=bool(v["parameter"]))
        self.placed[key] = t
        return t

    def build(self, v: Any) -> Any:
        """Pass 2: the object, over the filled buffers."""
        if isinstance(v, list):
            return [self.build(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$tensor" in v:
            return self._place(v)
        if "$np" in v and "value" in v and len(v) == 2:
            return np.dtype(v["$np"]).type(self.build(v["value"]))
        if len(v) == 1:
            ((tag, x),) = v.items()
            if tag == "$tuple":
                return tuple(self.build(y) for y in self._list(x, tag))
            if tag == "$float":
                return float(x)
            if tag == "$int":
                return int(x)
            if tag == "$size":
                return _torch().Size(self._list(x, tag))
            if tag == "$torch_dtype":
                return getattr(_torch(), x)
            if tag == "$torch_device":
                return _torch().device(x)
            if tag == "$bytes":
                return base64.b64decode(x)
            if tag in ("$set", "$frozenset"):
                items = [self.build(y) for y in self._list(x, tag)]
                return frozenset(items) if tag == "$frozenset" else set(items)
            if tag in ("$dict", "$odict"):
                pairs = [(self.build(k), self.build(y)) for k, y in self._pairs(x, tag)]
                return collections.OrderedDict(pairs) if tag == "$odict" else dict(pairs)
            if tag == "$ndarray":
                return self.fresh[("$ndarray", x)]
            if tag == "$pickle":
                return pickle.loads(base64.b64decode(x))  # noqa: S301 - opted in (collect)
        return {k: self.build(x) for k, x in v.items()}

    def _list(self, x: Any, tag: str) -> list:
        if not isinstance(x, list):
            raise self._bad(f"{tag} holds no list")
        return x

    def _pairs(self, x: Any, tag: str) -> list:
        if not isinstance(x, list) or not all(isinstance(p, list) and len(p) == 2 for p in x):
            raise self._bad(f"{tag} holds no list of pairs")
        return x


def load_tree(
    location: "str | os.PathLike[str]",
    *,
    allow_pickle: bool = False,
    map_location: Any = None,
) -> Any:
    """Load the object :func:`save_tree` stored at ``location``.

    Every tensor is a fresh tensor (never a view of the mapped file), filled with its
    CRC32 checked, all before anything is returned; a tensor stored once (the same object
    saved twice) comes back as one object. ``map_location`` places torch tensors: ``None``
    puts each on the device it was saved from; a device or string puts all there; a dict
    maps saved device strings to devices; a callable ``f(tensor, saved_device)`` returns
    the tensor to use (given the fresh CPU tensor).

    Raises:
        ckptstore.errors.ChecksumError: a damaged tensor (named), before anything is returned.
        PickleNotAllowedError: the checkpoint holds a pickled value and ``allow_pickle`` is
            false (refused before any tensor is read).
        InvalidArgumentError: the checkpoint was not written by :func:`save_tree`.
        ckptstore.errors.CheckpointError: the checkpoint does not open.
    """
    with _open(location) as ck:
        tree = _tree_of(ck, location)
        loader = _Loader(ck, location, allow_pickle, map_location)
        loader.collect(tree)
        ck.fill_and_verify(loader.fills, [], release=True)
    return loader.build(tree)


# ---- non-blocking saves ------------------------------------------------------------------


def check_max_in_flight(max_in_flight: Any) -> int:
    """``max_in_flight`` of a :class:`TreeSaver`: an integer >= 1, else
    :class:`InvalidArgumentError` (for a caller that makes its saver later, at once)."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidArgumentError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    return max_in_flight


class TreeSaveHandle(Handle):
    """A save started by :meth:`TreeSaver.save` (``done()``, ``wait(timeout)``)."""

    def __init__(self, location: str) -> None:
        super().__init__(repr(location))
        self.location = location


class TreeSaver:
    """Non-blocking :func:`save_tree`: :meth:`save` copies the tensors into snapshot buffers
    (reused by the next save of the same structure; CUDA tensors into pinned buffers) and
    returns; a background thread writes and commits, saves in the order they were made.
    At most ``max_in_flight`` saves (and buffer sets) exist at once; :meth:`save` blocks
    while that many are in flight. :meth:`wait` and :meth:`close` raise the first error
    no handle has reported yet."""

    def __init__(self, max_in_flight: int = 1, *, allow_pickle: bool = False,
                 max_shard_size: Optional[int] = None, cleanup: str = "inline") -> None:
        check_max_in_flight(max_in_flight)
        self.allow_pickle = allow_pickle
        self.max_shard_size = max_shard_size
        self.cleanup = cleanup
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._free: List[Any] = []
        self._queue: Deque[Tuple[TreeSaveHandle, Any, Any, str, Any]] = deque()
        self._worker: Optional[threading.Thread] = None
        self._handles: List[TreeSaveHandle] = []
        self._closed = False

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by idle snapshot buffer sets."""
        with self._lock:
            return sum(s.nbytes for s in self._free)

    @property
    def allocations(self) -> int:
        """Snapshot buffers allocated over the life of the idle buffer sets: flat from the
        second save of an unchanged structure on."""
        with self._lock:
            return sum(s.allocations for s in self._free)

    def save(
        self, location: "str | os.PathLike[str]", obj: Any, *, after: Any = None
    ) -> TreeSaveHandle:
        """Snapshot ``obj`` and save it to ``location`` in the background; the live tensors
        may change as soon as this returns. Raises an earlier save's unreported error, and
        :class:`PickleNotAllowedError` (nothing saved) as :func:`save_tree` does.

        ``after``: a ``threading.Event`` the background write waits for before it starts
        (the caller sets it, also on failure): a caller snapshotting several objects for
        one checkpoint holds the writes until every snapshot is taken, so that no write
        competes with the copies for the cores."""
        if self._closed:
            raise InvalidArgumentError("the TreeSaver is closed")
        self._slots.acquire()
        try:
            self._raise_unreported()
            with self._lock:
                snap = self._free.pop() if self._free else Snapshot()
            try:
                snap.begin()
                entries, metadata = _flatten(obj, snap.copy, self.allow_pickle)
                snap.end()
            except BaseException:
                with self._lock:
                    self._free.append(snap)
                raise
        except BaseException:
            self._slots.release()
            raise
        h = TreeSaveHandle(os.fspath(location))
        with self._lock:
            self._handles.append(h)
            self._queue.append((h, snap, entries, metadata, after))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="ckptstore-tree-save")
                self._worker.start()
        return h

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                h, snap, entries, metadata, after = self._queue.popleft()
            info, err = None, None
            # Held until `after` is set, or the interpreter is shutting down (its main
            # thread has stopped: a save abandoned before its release must not hang exit).
            while after is not None and not after.wait(0.25):
                if not threading.main_thread().is_alive():
                    break
            try:
                info = _ckptstore.save(h.location, entries, metadata, self.max_shard_size, None, self.cleanup)
            except BaseException as e:  # noqa: BLE001 - handed to the handle
                err = e
            with self._lock:
                self._free.append(snap)
            self._slots.release()
            h._finish(info, err)

    def _raise_unreported(self) -> None:
        with self._lock:
            done = [h for h in self._handles if h.done()]
            self._handles = [h for h in self._handles if not h.done()]
        for h in done:
            if h._error is not None and not h._reported:
                h._reported = True
                raise h._error

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error not yet reported."""
        with self._lock:
            pending = list(self._handles)
        for h in pending:
            h._event.wait()
        self._raise_unreported()

    def close(self) -> None:
        """Wait (as :meth:`wait`), then refuse further saves and drop the buffers."""
        try:
            self.wait()
        finally:
            self._closed = True
            with self._lock:
                self._free.clear()

    def __enter__(self) -> "TreeSaver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
