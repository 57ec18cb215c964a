"""A nested Python object (a framework's checkpoint dict) as one committed ckptstore checkpoint.

The frameworks hand their checkpoint engines one object: a dict of model and optimizer state
dicts, scheduler and loop state, RNG states, hyperparameters. ``torch.save`` pickles it
whole; :func:`save_tree` stores it as a ckptstore checkpoint instead:

* every tensor (torch, any device; numpy arrays) as a ckptstore tensor named by its path in
  the object (``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``), so
  ``ckpt inspect`` shows what it is and every byte has a CRC32; the same tensor object met
  twice (tied weights) is stored once and comes back as one object;
* the rest as a JSON skeleton in the manifest's metadata (key ``ckptstore.tree``), in the
  package's one value codec (:mod:`ckptstore._codec`, format-spec/values.md): JSON values
  as they are, and tagged forms for what JSON lacks (tuples, dicts whose keys are not
  strings, non-finite floats, integers beyond 64 bits, bytes, sets, numpy scalars,
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

:class:`TreeSaver` saves without blocking, through the package's one background saver
(:class:`ckptstore.torch.internal.AsyncSaver`): it copies every tensor into snapshot buffers
that the next save of the same structure reuses (no allocation after the first save), and
writes and commits on a background thread, saves in the order they were made.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .. import _ckptstore
from .. import open as _open
from .._codec import Decoder, Encoder, has_pickle
from .._dtypes import numpy_dtype as _np_dtype
from .._prep import prepare as _prepare
from ..errors import CorruptCheckpointError, InvalidArgumentError, PickleNotAllowedError
from ..torch.internal import (
    AsyncSaver,
    Handle,
    bytes_of,
    check_max_in_flight,
    empty_for,
    to_numpy,
    torch_module,
)

__all__ = ["save_tree", "load_tree", "TreeSaver", "TreeSaveHandle", "PickleNotAllowedError", "TREE_KEY",
           "has_pickle", "check_max_in_flight", "Flattener", "Loader", "flatten", "prepare_any"]

#: Metadata key of the skeleton.
TREE_KEY = "ckptstore.tree"
_VERSION = 1


def _torch():
    return torch_module()


class Flattener:
    """Walks an object once with the value codec: tensors (torch and numpy) out to
    ``prepare`` under their paths' names (the same object met twice stored once), the rest
    into a JSON skeleton."""

    def __init__(
        self, prepare: Callable[[str, Any], Tuple[str, str, np.ndarray]], allow_pickle: bool
    ) -> None:
        self.prepare = prepare
        self.entries: List[Tuple[str, str, np.ndarray]] = []
        self.names: set = set()
        self.by_id: Dict[int, str] = {}
        try:
            import torch  # noqa: F401 - only whether it is installed
        except ImportError:
            pass  # numpy-only trees
        else:
            _torch()
        self.encoder = Encoder(allow_pickle=allow_pickle, tensor=self._tensor, arrays=True)

    def _name(self, path: str) -> str:
        name = path or "."
        n = 2
        while name in self.names or name == "__metadata__":
            name = f"{path}#{n}"
            n += 1
        self.names.add(name)
        return name

    def _tensor(self, v: Any, path: str) -> str:
        known = self.by_id.get(id(v))
        if known is not None:
            return known
        name = self._name(path)
        self.entries.append(self.prepare(name, v))
        self.by_id[id(v)] = name
        return name

    def walk(self, v: Any, path: str) -> Any:
        return self.encoder.encode(v, path)


def flatten(obj: Any, prepare, allow_pickle: bool) -> Tuple[List[Tuple[str, str, np.ndarray]], str]:
    import json

    f = Flattener(prepare, allow_pickle)
    skeleton = f.walk(obj, "")
    metadata = json.dumps({TREE_KEY: {"version": _VERSION, "tree": skeleton}}, allow_nan=False)
    return f.entries, metadata


def prepare_any(name: str, v: Any) -> Tuple[str, str, np.ndarray]:
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
    entries, metadata = flatten(obj, prepare_any, allow_pickle)
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


class Loader:
    """Rebuilds the object from its skeleton in two passes: :meth:`collect` makes a fresh
    CPU buffer for every stored tensor (filled and CRC-checked in one engine pass), then
    :meth:`build` decodes the object over the filled buffers."""

    def __init__(self, ck: Any, location: Any, allow_pickle: bool, map_location: Any) -> None:
        self.ck = ck
        self.location = os.fspath(location)
        self.map_location = map_location
        self.fresh: Dict[Tuple[str, str], Any] = {}  # (kind, name) -> fresh CPU buffer
        self.fills: List[Tuple[str, np.ndarray]] = []
        self.placed: Dict[Tuple[str, str, Any], Any] = {}  # one object per stored tensor use
        self.decoder = Decoder(allow_pickle=allow_pickle, tensor=self._place, where=repr(self.location))

    def _alloc(self, kind: str, name: str) -> None:
        if name not in self.ck:
            raise CorruptCheckpointError(
                f"{self.location!r}: the stored tree names a tensor {name!r} the checkpoint "
                "does not hold"
            )
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
        for kind, name, _ in self.decoder.scan(v):
            self._alloc(kind, name)

    def _place(self, kind: str, name: str, fields: dict) -> Any:
        if kind == "$ndarray":
            return self.fresh[(kind, name)]
        saved = fields.get("device", "cpu")
        key = (name, saved, fields.get("parameter"))
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
        if "parameter" in fields:
            t = _torch().nn.Parameter(t, requires_grad=bool(fields["parameter"]))
        self.placed[key] = t
        return t

    def build(self, v: Any) -> Any:
        """Pass 2: the object, over the filled buffers."""
        return self.decoder.decode(v)


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
        loader = Loader(ck, location, allow_pickle, map_location)
        loader.collect(tree)
        ck.fill_and_verify(loader.fills, [], release=True)
    return loader.build(tree)


# ---- non-blocking saves ------------------------------------------------------------------


class TreeSaveHandle(Handle):
    """A save started by :meth:`TreeSaver.save` (``done()``, ``wait(timeout)``)."""

    def __init__(self, location: str) -> None:
        super().__init__(repr(location))
        self.location = location


class TreeSaver:
    """Non-blocking :func:`save_tree` over the package's one background saver
    (:class:`ckptstore.torch.internal.AsyncSaver`): :meth:`save` copies the tensors into
    snapshot buffers (reused by the next save of the same structure; CUDA tensors into
    pinned buffers) and returns; the writer thread writes and commits, saves in the order
    they were made. At most ``max_in_flight`` saves (and buffer sets) exist at once;
    :meth:`save` blocks while that many are in flight. :meth:`wait` and :meth:`close` raise
    the first error no handle has reported yet."""

    def __init__(self, max_in_flight: int = 1, *, allow_pickle: bool = False,
                 max_shard_size: Optional[int] = None, cleanup: str = "inline") -> None:
        self._saver = AsyncSaver(max_in_flight, name="ckptstore-tree-save", what="the TreeSaver")
        self.allow_pickle = allow_pickle
        self.max_shard_size = max_shard_size
        self.cleanup = cleanup

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by idle snapshot buffer sets."""
        return self._saver.snapshot_bytes

    @property
    def allocations(self) -> int:
        """Snapshot buffers allocated over the life of the idle buffer sets: flat from the
        second save of an unchanged structure on."""
        return self._saver.allocations

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
        target = os.fspath(location)

        def write(job: Tuple[Any, str]) -> dict:
            entries, metadata = job
            return _ckptstore.save(target, entries, metadata, self.max_shard_size, None, self.cleanup)

        build = lambda copy: flatten(obj, copy, self.allow_pickle)  # noqa: E731
        return self._saver.save(TreeSaveHandle(target), build, write, after=after)  # type: ignore[return-value]

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error not yet reported."""
        self._saver.wait()

    def close(self) -> None:
        """Refuse further saves, wait (as :meth:`wait`) and drop the buffers."""
        self._saver.close()

    def __enter__(self) -> "TreeSaver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
