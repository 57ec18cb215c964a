"""DeepSpeed's checkpoint engine on ckptstore (tested with DeepSpeed 0.19.8, ZeRO stages 0-2, CPU;
ZeRO-3 is refused).

::

    import deepspeed
    from ckptstore.integrations import deepspeed as ckds

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    ckds.install(engine)                        # the one line
    engine.save_checkpoint("run/ckpt")          # tag global_step<N>, then `latest`
    engine.load_checkpoint("run/ckpt")          # the tag `latest` names

DeepSpeed has no configuration key that selects a checkpoint engine class, so
:func:`install` sets ``engine.checkpoint_engine`` after ``deepspeed.initialize`` (and wraps
the engine's ``save_checkpoint`` / ``load_checkpoint``, see below).

**Files.** DeepSpeed's save writes one object per file of a tag through
``CheckpointEngine.save(state_dict, path)``: ``<tag>/mp_rank_00_model_states.pt`` (module
weights, scheduler, step counters, client state, and under ZeRO-0 the optimizer) and under
ZeRO 1-2 one ``<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
(the flat FP32 partition and the base optimizer's state). Here each such path is **one
committed ckptstore checkpoint directory** of that name, holding the object as
:func:`ckptstore.integrations._tree.save_tree` stores it (every tensor a CRC-checked tensor
named by its path in the object, ``module/0.weight``,
``optimizer_state_dict/base_optimizer_state/state/0/exp_avg``; the rest as JSON in the
manifest). DeepSpeed's loader finds its files by name (``glob`` of
``<tag>/mp_rank_*_model_states.pt``), so keeping its names keeps its loader unchanged, and
``ckpt verify`` / ``ckpt inspect`` open each file's checkpoint at the path DeepSpeed names.
One checkpoint per file (rather than one per tag) also lets every rank write its own files
with no cross-rank commit.

**Commit.** Nothing of a tag is visible, and ``latest`` does not move, until its commit:

* ``create(info)`` opens the tag; the files are written (each a committed checkpoint) into
  a hidden staging directory ``<save_dir>/.<tag>.ckptstore-staging`` (``makedirs`` and
  ``save`` of paths under ``<save_dir>/<tag>`` are redirected there);
* ``commit(info)`` waits for every rank (a barrier), then the global rank 0 makes the staged
  tag visible in one ``rename(2)`` to ``<save_dir>/<tag>`` (an existing tag of the same name
  is swapped atomically with ``renameat2(RENAME_EXCHANGE)`` on Linux, then removed), fsyncs
  the directory (:func:`ckptstore.atomic.publish_dir`), and only then writes ``latest`` (to
  a temporary file, fsynced, renamed over ``latest``: :func:`ckptstore.atomic.write_file`). DeepSpeed itself rewrites ``latest`` after ``commit`` returns with a plain
  ``open(..., "w")``, which a kill can leave empty; :func:`install` makes the engine skip
  that write (it passes ``save_latest=False`` and hands the real flag to this engine).

A process killed anywhere before the rename leaves the previous tags and ``latest`` as they
were (its staging directory is removed by the next save into ``save_dir``); killed after it,
the new tag is complete and ``latest`` names the previous tag or the new one.

**Load.** ``load(path, map_location)`` returns the object ``save`` was given: tensors as
fresh CRC-checked tensors, equal bit for bit, dicts, lists, tuples, ``OrderedDict``,
``torch.Size`` and the DeepSpeed values below with their types. DeepSpeed loads a tag's files
one after the other and applies each as it comes (the module weights first, then the ZeRO
partition), so a damaged optimizer file would fail after the model was already changed. The
``load_checkpoint`` that :func:`install` wraps therefore first loads every file of the tag
that this rank reads (a file of another data-parallel rank's ZeRO partition is skipped),
each CRC-checked, before DeepSpeed's loader runs; DeepSpeed's loader then gets those objects
from memory. A damaged tensor raises :class:`ckptstore.errors.ChecksumError` naming the file
and the tensor, and the live model, optimizer, scheduler and step counters are unchanged.
The cost: the model file's objects stay in memory while the ZeRO partition loads (DeepSpeed
frees them first).

**A change of optimizer class** (a tag saved by AdamW, loaded into an engine whose optimizer
is ``SGD``): DeepSpeed's files do not name the optimizer class, so the ``save_checkpoint``
that :func:`install` wraps records it (``type(optimizer).__name__`` of the base optimizer,
``engine.basic_optimizer``, the torch optimizer under ZeRO's or FP16's wrapper, as
:func:`ckptstore.torch.save` records it) in every file of the tag (the top-level key
``$deepspeed.optimizer_class`` of the stored object, JSON in the file's manifest; tensor names
are unchanged and ``load`` returns the object without it). The ``load_checkpoint`` that
:func:`install` wraps, when it loads optimizer states (not with ``load_optimizer_states=False``
or ``load_module_only=True``), checks it when DeepSpeed takes the first file (the model
states, before DeepSpeed applies anything) by rule F1 of the one rule,
:func:`ckptstore.check_optimizer_fit`: another class raises
:class:`ckptstore.IncompatibleStateError` naming both classes (and the file), and the live
model, optimizer, scheduler and step counters are unchanged. ``install(engine,
allow_optimizer_change=True)`` (or ``engine.checkpoint_engine.allow_optimizer_change =
True``) lets a deliberate change through: DeepSpeed loads the checkpoint's optimizer state as
stored, and each parameter group gets the checkpoint's hyperparameters plus the live group's
own for the settings the checkpoint's lacks (an ``SGD`` loaded from AdamW keeps its
``momentum``), as :func:`ckptstore.torch.load` does. A tag saved without the class (before
this, or by an engine not installed with :func:`install`) is loaded unchecked.

**Non-tensor values.** JSON values are stored as JSON; tuples, ``OrderedDict``,
``torch.Size``, ``torch.dtype``, non-string keys, non-finite floats and bytes in the tagged
forms of ``_tree``. DeepSpeed's own values in its state dicts are stored structurally, without
pickle, and rebuilt as the same types: ``ZeroStageEnum``, the ZeRO optimizer's
``LossScaler`` / ``DynamicLossScaler`` (their attributes) and ``fragment_address``, and an
``argparse.Namespace`` (its attributes) in the client state; only these classes are rebuilt,
looked up in a fixed table, never imported by a name read from the checkpoint. Any other
object (a custom class in ``client_state``) raises
:class:`ckptstore.integrations._tree.PickleNotAllowedError` naming its path (nothing of the
tag becomes visible), unless the engine is made with ``allow_pickle=True``: then it is
pickled, and loading it needs ``allow_pickle=True`` too. Unpickling runs code chosen by
whoever wrote the checkpoint: opt in only for checkpoints you trust as much as the code you
run.

**A run begun with DeepSpeed's default engine** (switched to ckptstore later): a tag of
``torch.save`` files loads as DeepSpeed loads it, except that each file is read with
``torch.load(weights_only=True)`` allowing only the DeepSpeed classes of the table above and
``argparse.Namespace`` (DeepSpeed's own engine uses ``weights_only=False``); a warning in the
log names the tag. Such files have no CRCs. A file that needs more than that raises
:class:`PickleNotAllowedError` unless the engine is made with ``allow_pickle=True``, which
reads it with ``weights_only=False`` (the same trust as above). The next tags saved are
ckptstore checkpoints.

**Non-blocking saves** (``install(engine, non_blocking=True)``): ``save_checkpoint``
returns once every tensor is copied into snapshot buffers (one set per file name, reused by
the next tag); the files are written and the tag published (the same rename, then
``latest``) on background threads while training goes on. The next save, a load and
``engine.checkpoint_engine.wait()`` wait for it and raise its error; the interpreter's exit
waits for it too (the threads are not daemons). One tag is in flight at a time.

Test seam: ``CKPTSTORE_DEEPSPEED_KILL_AT=<point>`` makes the process SIGKILL itself at
``save`` (after a file of a tag has been committed into the staging directory, or handed to
its background writer), ``publish`` (every file written, before the rename) or ``latest``
(after the rename, before ``latest`` is written). Unset, a point costs one environment
lookup.

ZeRO-3 is refused by :func:`install` (``InvalidArgumentError``): DeepSpeed reads a ZeRO-3
tag's files itself where no checkpoint engine is asked (a load without optimizer states
rebuilds the module with ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, which
reads every rank's files with ``torch.load``), so its checkpoints stay DeepSpeed's own. Not covered:
NVMe offload is untested (it copies its swap files into the tag directory with
``shutil.copytree``, bypassing the engine). Several processes: a
shared file system is assumed (every rank writes its files into the one staging directory,
barriers around rank 0's publish); tested with two (ZeRO-1). Node-local storage is not
supported.
``save_16bit_model`` goes through the engine too: its ``pytorch_model.bin`` becomes a
ckptstore checkpoint directory of that name (committed on its own), not a file
``from_pretrained`` reads. The ``zero_to_fp32.py`` script DeepSpeed copies into
``save_dir`` reads ``torch.save`` files, not these.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import functools
import logging
import os
import re
import shutil
import signal
import threading
from typing import Any, Dict, List, Optional

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
)
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointEngine as _DSCheckpointEngine,
)

from .. import atomic
from ..errors import CheckpointError, CheckpointIOError, IncompatibleStateError, InvalidArgumentError
from ..torch._state import _check_class, _group_hyper, _optimizer_class
from ._tree import PickleNotAllowedError, TreeSaver, load_tree, save_tree

_log = logging.getLogger(__name__)

__all__ = ["CheckpointEngine", "install", "KILL_ENV", "KILL_POINTS", "PickleNotAllowedError"]

#: The test seam's environment variable and its points (module docstring).
KILL_ENV = "CKPTSTORE_DEEPSPEED_KILL_AT"
KILL_POINTS = ("save", "publish", "latest")

_STAGING = ".ckptstore-staging"
#: What a `latest` write killed before its rename leaves (ckptstore.atomic.write_file).
_LATEST_TMP = ".ckpt-tmp-latest"
_MARK = "$deepspeed"
#: Top-level key of a tag's files: the optimizer class of the save.
_CLASS_KEY = _MARK + ".optimizer_class"
_ZERO_RANK = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


def _seam(point: str) -> None:
    if os.environ.get(KILL_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- DeepSpeed's values, stored without pickle ------------------------------------------


def _known_types() -> Dict[str, type]:
    """The classes rebuilt on load, by a fixed name (never imported from the checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "ZeroStageEnum": ZeroStageEnum,
        "LossScaler": LossScaler,
        "DynamicLossScaler": DynamicLossScaler,
        "fragment_address": fragment_address,
    }


@functools.lru_cache(maxsize=1)
def _types() -> Dict[str, type]:
    return _known_types()


def _name_of(v: Any) -> Optional[str]:
    for name, cls in _types().items():
        if type(v) is cls:
            return name
    return None


def _encode(v: Any) -> Any:
    """``v`` with DeepSpeed's own objects replaced by marked dicts (tensors kept as they are,
    so that ``save_tree`` stores an object met twice once)."""
    if isinstance(v, (str, bytes, bool, int, float)) or v is None:
        name = _name_of(v) if isinstance(v, int) else None
        if name is not None:  # ZeroStageEnum is an int
            return {_MARK: "enum", "class": name, "value": int(v)}
        return v
    if isinstance(v, dict):
        items = {k: _encode(x) for k, x in v.items()}
        if any(isinstance(k, str) and k.startswith(_MARK) for k in v):  # our keys: escaped
            return {_MARK: "dict", "items": [[k, x] for k, x in items.items()],
                    "ordered": isinstance(v, collections.OrderedDict)}
        return collections.OrderedDict(items) if isinstance(v, collections.OrderedDict) else items
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if type(v) is tuple:
        return tuple(_encode(x) for x in v)
    if isinstance(v, argparse.Namespace):
        return {_MARK: "namespace", "vars": _encode(dict(vars(v)))}
    name = _name_of(v)
    if name is not None:
        if dataclasses.is_dataclass(v):
            fields = {f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(v)}
            return {_MARK: "dataclass", "class": name, "fields": fields}
        return {_MARK: "object", "class": name, "state": _encode(dict(vars(v)))}
    return v  # tensors, torch.Size, sets, numpy, ... and what only pickle can store


def _decode(v: Any, where: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, where) for x in v]
    if type(v) is tuple:
        return tuple(_decode(x, where) for x in v)
    if not isinstance(v, dict):
        return v
    if _MARK not in v:
        items = {k: _decode(x, where) for k, x in v.items()}
        return collections.OrderedDict(items) if isinstance(v, collections.OrderedDict) else items
    kind = v[_MARK]
    try:
        if kind == "dict":
            pairs = [(k, _decode(x, where)) for k, x in v["items"]]
            return collections.OrderedDict(pairs) if v.get("ordered") else dict(pairs)
        if kind == "namespace":
            return argparse.Namespace(**_decode(v["vars"], where))
        cls = _types()[v["class"]]
        if kind == "enum" and issubclass(cls, enum.Enum):
            return cls(v["value"])
        if kind == "dataclass" and dataclasses.is_dataclass(cls):
            return cls(**_decode(v["fields"], where))
        if kind == "object" and not issubclass(cls, enum.Enum) and not dataclasses.is_dataclass(cls):
            obj = cls.__new__(cls)
            obj.__dict__.update(_decode(v["state"], where))
            return obj
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{where!r}: a stored DeepSpeed value is malformed: {v!r:.200} ({e})") from e
    raise InvalidArgumentError(f"{where!r}: unknown stored DeepSpeed value kind {kind!r}")


# ---- the optimizer class, recorded with every file of a tag --------------------------------


def _with_class(obj: Any, optimizer_class: str) -> Any:
    """A file's (encoded) object with the optimizer class of the save under the top-level key
    ``_CLASS_KEY`` (its tensors keep their names). A caller's dict holding a key that starts
    with ``_MARK`` is escaped by :func:`_encode`, so that key at the top level is only this;
    an object that is not a plain top-level dict records nothing."""
    if not isinstance(obj, dict) or _MARK in obj:
        return obj
    out = type(obj)(obj)
    out[_CLASS_KEY] = optimizer_class
    return out


def _recorded_class(obj: Any, where: str) -> "tuple[Any, Optional[str]]":
    """``(object, recorded optimizer class or None)`` of a stored file's object."""
    if not isinstance(obj, dict) or _MARK in obj or _CLASS_KEY not in obj:
        return obj, None
    cls = obj[_CLASS_KEY]
    if not isinstance(cls, str):
        raise InvalidArgumentError(f"{where!r}: the stored optimizer class is malformed: {cls!r:.200}")
    out = type(obj)((k, v) for k, v in obj.items() if k != _CLASS_KEY)
    return out, cls


def _base_optimizer(engine: Any) -> Any:
    """The torch optimizer that runs under DeepSpeed's wrappers (ZeRO, FP16, BF16)."""
    opt = getattr(engine, "basic_optimizer", None)
    if opt is None:
        opt = getattr(engine, "optimizer", None)
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            opt = inner
    return opt


# ---- file-system helpers -----------------------------------------------------------------


def _sibling(tag_dir: str, suffix: str) -> str:
    return os.path.join(os.path.dirname(tag_dir), f".{os.path.basename(tag_dir)}{suffix}")


def _remove_leftovers(parent: str) -> None:
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".") and name.endswith(_STAGING):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        elif name == _LATEST_TMP:
            try:
                os.remove(os.path.join(parent, name))
            except OSError:
                pass
    atomic.sweep_leftovers(parent)  # an interrupted publish put back, removals finished


def _inside(path: str, root: str) -> Optional[str]:
    """``path`` relative to ``root`` when it is ``root`` or below it, else None."""
    rel = os.path.relpath(path, root)
    if rel == os.curdir:
        return ""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    return rel


def _dist() -> Any:
    """``deepspeed.comm`` when it is initialised with more than one process, else None."""
    from deepspeed import comm as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _global_rank() -> int:
    from deepspeed import comm as dist

    return dist.get_rank() if dist.is_initialized() else 0


# ---- the engine ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Pending:
    tag: str
    save_dir: str
    tag_dir: str
    staging: str
    files: List[str]
    handles: List[Any]
    #: Non-blocking saves: the writes of the tag's files start when this is set (at the
    #: commit, once every file is snapshotted, or when the save is abandoned).
    go: threading.Event = dataclasses.field(default_factory=threading.Event)


class CheckpointEngine(_DSCheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` writing ckptstore checkpoints (module docstring).

    Args:
        config_params: DeepSpeed's config (unused; DeepSpeed's engines take it).
        allow_pickle: store values only pickle can store, and load them (and files of
            DeepSpeed's default engine). Trusts the checkpoint as much as code you run.
        max_shard_size: bytes per shard file of each checkpoint (``None``: the engine's).
        allow_optimizer_change: let :func:`install`'s ``load_checkpoint`` load a tag saved by
            another optimizer class (module docstring); refused by default.
        non_blocking: ``save`` copies the tensors into snapshot buffers (one set per file
            name, reused by the next tag: no allocation after the first save) and returns;
            the files are written on background threads from ``commit`` on (held until
            then, so that no write competes with the copies of the tag's later files), and
            ``commit`` returns at once, a thread publishing the tag and writing ``latest``
            when every file is committed.
            The live model may change as soon as ``save_checkpoint`` returns. The next
            ``create`` (save), any ``load``, :meth:`wait` and :meth:`cleanup` wait for it
            and raise its error. The publish runs in the background only in one process
            and when this engine writes ``latest`` (:func:`install`); otherwise ``commit``
            waits for the writes and publishes, as a blocking save does.
    """

    def __init__(self, config_params: Any = None, *, allow_pickle: bool = False,
                 max_shard_size: Optional[int] = None, non_blocking: bool = False,
                 allow_optimizer_change: bool = False) -> None:
        super().__init__(config_params)
        self.name = "ckptstore"
        self.allow_pickle = allow_pickle
        self.max_shard_size = max_shard_size
        self.non_blocking = non_blocking
        self.allow_optimizer_change = bool(allow_optimizer_change)
        #: Set by :func:`install`'s wrappers: the class recorded in the files of a tag being
        #: saved, and the live class the files of a load are checked against.
        self._optimizer_class: Optional[str] = None
        self._expect_class: Optional[str] = None
        #: Set by a load that found an allowed change of class (the hyperparameter hook).
        self._class_changed = False
        #: The recorded classes of the prefetched files, by absolute path.
        self._prefetched_class: Dict[str, Optional[str]] = {}
        self._pending: Optional[_Pending] = None
        #: Set by :func:`install`'s ``save_checkpoint`` wrapper: the caller's ``save_latest``,
        #: which the engine is told is False (this engine writes ``latest`` atomically).
        self._save_latest: Optional[bool] = None
        #: Objects loaded ahead by :meth:`prefetch`, by absolute path; ``load`` takes them.
        self._prefetched: Dict[str, Any] = {}
        # non_blocking: one TreeSaver per file name (its snapshot buffers reused by the
        # same file of the next tag), the thread publishing the tag in flight, its error.
        self._savers: Dict[str, TreeSaver] = {}
        self._publisher: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    # -- save --------------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        self.wait()  # a tag still being written in the background comes first
        stale, self._pending = self._pending, None
        if stale is not None:  # a save that failed before its commit: let its writers end
            stale.go.set()
            for h in stale.handles:
                try:
                    h.wait()
                except BaseException:  # noqa: BLE001 - that save failed already
                    pass
        tag_dir = os.path.abspath(os.path.join(info.save_dir, str(info.tag)))
        staging = _sibling(tag_dir, _STAGING)
        if _global_rank() == 0:  # leftovers of killed saves: ours by their names
            for parent in {os.path.dirname(tag_dir), os.path.abspath(info.save_dir)}:
                _remove_leftovers(parent)
        dist = _dist()
        if dist is not None:
            dist.barrier()
        self._pending = _Pending(str(info.tag), os.path.abspath(info.save_dir), tag_dir, staging, [], [])

    def _target(self, path: str) -> "tuple[str, Optional[str]]":
        p = self._pending
        if p is not None:
            rel = _inside(os.path.abspath(path), p.tag_dir)
            if rel is not None:
                return (os.path.join(p.staging, rel) if rel else p.staging), rel
        return path, None

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        target, rel = self._target(path)
        os.makedirs(target, exist_ok=exist_ok or rel is not None)

    def save(self, state_dict: Any, path: str) -> None:
        target, rel = self._target(path)
        obj = _encode(state_dict)
        if rel is not None and self._optimizer_class is not None:
            obj = _with_class(obj, self._optimizer_class)
        if rel is None:  # outside a tag (save_16bit_model): its own committed checkpoint
            save_tree(target, obj, allow_pickle=self.allow_pickle, max_shard_size=self.max_shard_size,
                      cleanup="inline")
            return
        p = self._pending
        assert p is not None
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if self.non_blocking:
            saver = self._savers.get(rel)
            if saver is None:
                saver = self._savers[rel] = TreeSaver(1, allow_pickle=self.allow_pickle,
                                                      max_shard_size=self.max_shard_size)
            # Returns once the tensors are copied; the write waits for the commit (`p.go`),
            # so that it does not compete with the copies of the tag's other files.
            p.handles.append(saver.save(target, obj, after=p.go))
        else:
            save_tree(target, obj, allow_pickle=self.allow_pickle, max_shard_size=self.max_shard_size,
                      cleanup="inline")
        p.files.append(rel)
        _seam("save")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        p = self._pending
        if p is None or p.tag != str(info.tag) or p.save_dir != os.path.abspath(info.save_dir):
            raise InvalidArgumentError(
                f"commit of tag {info.tag!r} in {info.save_dir!r} without its create "
                f"(open: {None if p is None else (p.tag, p.save_dir)})")
        self._pending = None
        p.go.set()  # every file of the tag is snapshotted: its writes start
        write_latest = bool(info.save_latest or self._save_latest)
        dist = _dist()
        # In the background only where nothing else depends on the commit having happened:
        # one process (no barrier from a thread), and `latest` ours to write (DeepSpeed
        # writes it itself right after this returns when info.save_latest is set).
        if p.handles and dist is None and not info.save_latest:
            t = threading.Thread(target=self._publish_in_background, args=(p, write_latest),
                                 name="ckptstore-deepspeed-publish")
            self._publisher = t
            t.start()
            return True
        for h in p.handles:
            h.wait()
        self._publish_tag(p, write_latest, dist)
        return True

    def _publish_tag(self, p: _Pending, write_latest: bool, dist: Any) -> None:
        if dist is not None:
            dist.barrier()  # every rank's files are committed into the staging directory
        try:
            if _global_rank() == 0:
                try:
                    if os.path.isdir(p.staging):
                        atomic.fsync_dir(p.staging)
                        _seam("publish")
                        atomic.publish_dir(p.staging, p.tag_dir)
                        _seam("latest")
                    if write_latest:
                        atomic.write_file(p.save_dir, "latest", p.tag)
                except OSError as e:
                    if isinstance(e, CheckpointError) and not isinstance(e, CheckpointIOError):
                        raise
                    raise CheckpointIOError(
                        f"{p.tag_dir}: publishing tag {p.tag!r} (then `latest`) failed: {e}") from e
        finally:
            if dist is not None:  # also when rank 0 failed: its peers return, never hang
                dist.barrier()

    def _publish_in_background(self, p: _Pending, write_latest: bool) -> None:
        try:
            for h in p.handles:
                h.wait()
            self._publish_tag(p, write_latest, None)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            _log.error("ckptstore: the non-blocking save of tag %r in %r failed: %s", p.tag, p.save_dir, e)
            self._error = e

    def wait(self) -> None:
        """Wait until the tag saved in the background (``non_blocking``) is published and
        ``latest`` written; raise its error, once. Returns at once when none is in flight."""
        t = self._publisher
        if t is not None:
            t.join()
            self._publisher = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def cleanup(self) -> None:
        """:meth:`wait`, then drop the snapshot buffers. (DeepSpeed's engine teardown calls
        this hook only for its decoupled engines; :func:`install` calls it on the engine it
        replaces.)"""
        p = self._pending
        if p is not None:  # a save never committed: its held writes may run and end
            p.go.set()
        try:
            self.wait()
        finally:
            savers, self._savers = self._savers, {}
            for saver in savers.values():
                saver.close()

    # -- load --------------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()
        key = os.path.abspath(path)
        if key in self._prefetched:
            obj = self._prefetched.pop(key)
            self._check_class(path, self._prefetched_class.pop(key, None))
            if map_location is not None and not callable(map_location):
                obj = _move(obj, map_location)
            return obj
        obj, saved_class = self._read(path, map_location)
        self._check_class(path, saved_class)
        return obj

    def _check_class(self, path: str, saved_class: Optional[str]) -> None:
        """During a load through :func:`install`'s ``load_checkpoint`` that loads optimizer
        states: refuse a file recorded with another optimizer class (module docstring)."""
        live = self._expect_class
        if live is None:
            return
        try:
            if _check_class(live, saved_class, self.allow_optimizer_change):
                self._class_changed = True
        except IncompatibleStateError as e:
            named = _naming(e, path)
            if named is e:
                raise
            raise named from None

    def _read(self, path: str, map_location: Any) -> "tuple[Any, Optional[str]]":
        """The object stored at ``path`` and the optimizer class recorded with it."""
        if os.path.isfile(path):
            return _read_default_file(path, map_location, self.allow_pickle), None
        try:
            obj = load_tree(path, allow_pickle=self.allow_pickle, map_location=map_location)
        except CheckpointError as e:
            named = _naming(e, path)
            if named is e:
                raise
            raise named from e
        obj, saved_class = _recorded_class(obj, path)
        return _decode(obj, path), saved_class

    def prefetch(self, tag_dir: str, *, dp_rank: Optional[int] = None,
                 optimizer_states: bool = True) -> List[str]:
        """Load every checkpoint file of ``tag_dir`` this rank reads (all CRCs checked)
        and keep it for :meth:`load`; return their names. Skipped: another data-parallel
        rank's ZeRO files (when ``dp_rank`` is given) and, unless ``optimizer_states``,
        the ``*optim_states*`` files. Raises what :meth:`load` raises, keeping nothing."""
        self._prefetched.clear()
        self._prefetched_class.clear()
        if not os.path.isdir(tag_dir):
            return []
        loaded: Dict[str, Any] = {}
        classes: Dict[str, Optional[str]] = {}
        for name in sorted(os.listdir(tag_dir)):
            path = os.path.join(tag_dir, name)
            if not (name.endswith(".pt") or name.endswith(".bin")) or not os.path.isdir(path):
                continue
            if not optimizer_states and "optim_states" in name:
                continue
            m = _ZERO_RANK.search(name)
            if dp_rank is not None and m is not None and int(m.group(1)) != dp_rank:
                continue
            key = os.path.abspath(path)
            loaded[key], classes[key] = self._read(path, lambda t, _dev: t)
        self._prefetched = loaded
        self._prefetched_class = classes
        return sorted(os.path.basename(k) for k in loaded)

    def release(self) -> None:
        """Drop what :meth:`prefetch` kept and :meth:`load` did not take."""
        self._prefetched.clear()
        self._prefetched_class.clear()


def _read_default_file(path: str, map_location: Any, allow_pickle: bool) -> Any:
    """A file of DeepSpeed's default engine (``torch.save``; a run begun without
    :func:`install`): read with ``torch.load(weights_only=True)`` allowing DeepSpeed's own
    classes of the fixed table (and ``argparse.Namespace``), as plain data; what needs more
    is refused (:class:`PickleNotAllowedError`) unless ``allow_pickle``, which reads it as
    DeepSpeed does (``weights_only=False``). The first file of a tag read is logged."""
    import pickle

    import torch

    tag_dir = os.path.dirname(os.path.abspath(path))
    if tag_dir not in _logged_default:
        _logged_default.add(tag_dir)
        _log.warning(
            "ckptstore: %s holds files of DeepSpeed's default checkpoint engine (torch.save), "
            "not ckptstore checkpoints: loading them with torch.load(weights_only=%s), without "
            "CRC checks; the next tags saved are ckptstore checkpoints",
            tag_dir, "False" if allow_pickle else "True",
        )
    if allow_pickle:
        return torch.load(path, map_location=map_location, weights_only=False)
    allowed = [*_types().values(), argparse.Namespace]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise PickleNotAllowedError(
            f"{path!r}: a file of DeepSpeed's default engine (torch.save) that "
            f"torch.load(weights_only=True) refuses ({first}); make the engine with "
            "allow_pickle=True to load it with torch.load(weights_only=False), only if you "
            "trust it as much as code you run") from e
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise InvalidArgumentError(f"{path!r}: not a readable torch.save file: {e}") from e


#: Tag directories whose default-engine files were logged (once each per process).
_logged_default: "set[str]" = set()


def _naming(e: "CheckpointError", path: str) -> "CheckpointError":
    """``e`` again (same class and attributes), its message prefixed with the file's path
    when the engine's message does not name it (it names the shard file and the tensor)."""
    if path in str(e):
        return e
    new = type(e)(f"{path}: {e}")
    for k, v in vars(e).items():
        if k != "message":
            setattr(new, k, v)
    return new


def _move(obj: Any, device: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        dev = device.get(str(obj.device), obj.device) if isinstance(device, dict) else device
        return obj.to(dev)
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, _move(x, device)) for k, x in obj.items())
    if isinstance(obj, dict):
        return {k: _move(x, device) for k, x in obj.items()}
    if isinstance(obj, list):
        return [_move(x, device) for x in obj]
    if type(obj) is tuple:
        return tuple(_move(x, device) for x in obj)
    return obj


# ---- install -------------------------------------------------------------------------------


def _latest_tag(engine: Any, load_dir: str) -> Optional[str]:
    universal = bool(getattr(engine, "load_universal_checkpoint", lambda: False)())
    path = os.path.join(load_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as fd:
        return fd.read().strip()


def install(engine: Any, *, allow_pickle: bool = False, max_shard_size: Optional[int] = None,
            non_blocking: bool = False, prefetch: bool = True,
            allow_optimizer_change: bool = False) -> CheckpointEngine:
    """Make ``engine`` (what ``deepspeed.initialize`` returned) checkpoint through
    ckptstore; return the :class:`CheckpointEngine`.

    ``non_blocking``: see :class:`CheckpointEngine`. Sets ``engine.checkpoint_engine`` and
    wraps, on this engine object only,
    ``save_checkpoint`` (``latest`` is written by the checkpoint engine, atomically, at the
    commit; every file records the optimizer class) and ``load_checkpoint`` (with
    ``prefetch``, every file of the tag this rank reads is loaded and CRC-checked before
    DeepSpeed applies any of them; a tag saved by another optimizer class is refused with
    :class:`ckptstore.IncompatibleStateError` before anything changes, unless
    ``allow_optimizer_change``: module docstring). Installing again replaces the
    checkpoint engine and keeps one wrapper.
    """
    stage_of = getattr(engine, "zero_optimization_stage", None)
    stage = stage_of() if callable(stage_of) else None
    if stage is not None and int(stage) >= 3:
        raise InvalidArgumentError(
            "ckptstore.integrations.deepspeed.install: ZeRO stage 3 is not supported. DeepSpeed "
            "reads the files of a ZeRO-3 tag itself where no checkpoint engine is asked: a "
            "load_checkpoint without optimizer states (load_optimizer_states=False) rebuilds "
            "the module with zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint, which "
            "torch.loads every rank's files (and so does the zero_to_fp32.py script), and these "
            "would be ckptstore checkpoint directories. Keep DeepSpeed's own checkpoint engine "
            "for ZeRO-3 (do not call install), or use ZeRO stage 0, 1 or 2 with install.")
    ce = CheckpointEngine(getattr(engine, "_config", None), allow_pickle=allow_pickle,
                          max_shard_size=max_shard_size, non_blocking=non_blocking,
                          allow_optimizer_change=allow_optimizer_change)
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, CheckpointEngine):
        old.cleanup()
    engine.checkpoint_engine = ce
    save_orig = getattr(engine, "_ckptstore_save_checkpoint", None) or engine.save_checkpoint
    load_orig = getattr(engine, "_ckptstore_load_checkpoint", None) or engine.load_checkpoint
    engine._ckptstore_save_checkpoint = save_orig
    engine._ckptstore_load_checkpoint = load_orig

    @functools.wraps(save_orig)
    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Any:
        cur = engine.checkpoint_engine
        if not isinstance(cur, CheckpointEngine):  # replaced since: DeepSpeed's own way
            return save_orig(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                             save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
        cur._save_latest = bool(save_latest)
        base = _base_optimizer(engine)
        cur._optimizer_class = None if base is None else _optimizer_class(base)
        try:
            return save_orig(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                             save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            cur._save_latest = None
            cur._optimizer_class = None

    @functools.wraps(load_orig)
    def load_checkpoint(load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        cur = engine.checkpoint_engine
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states,
                      load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if not isinstance(cur, CheckpointEngine):
            return load_orig(load_dir, tag=tag, **kwargs)
        cur.wait()  # a save still in flight is published first
        base = _base_optimizer(engine)
        checks = base is not None and load_optimizer_states and not load_module_only
        cur._expect_class = _optimizer_class(base) if checks else None
        cur._class_changed = False
        hook = None
        if checks and cur.allow_optimizer_change and hasattr(base, "register_load_state_dict_pre_hook"):
            hook = base.register_load_state_dict_pre_hook(_keep_live_hyper(cur))
        try:
            return _load_checked(load_dir, tag, kwargs, cur)
        finally:
            cur._expect_class = None
            cur._class_changed = False
            if hook is not None:
                hook.remove()

    def _load_checked(load_dir: str, tag: Any, kwargs: Dict[str, Any], cur: CheckpointEngine) -> Any:
        load_optimizer_states = kwargs["load_optimizer_states"]
        load_module_only = kwargs["load_module_only"]
        if not prefetch:
            return load_orig(load_dir, tag=tag, **kwargs)
        resolved = _latest_tag(engine, load_dir) if tag is None else str(tag)
        if resolved is None:  # DeepSpeed warns and returns (None, None)
            return load_orig(load_dir, tag=tag, **kwargs)
        dp_rank = None
        group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
        elastic = bool(getattr(engine, "zero_elastic_checkpoint", lambda: False)())
        if group is not None and not elastic:
            from deepspeed import comm as dist

            dp_rank = dist.get_rank(group=group)
        try:
            cur.prefetch(os.path.join(load_dir, resolved), dp_rank=dp_rank,
                         optimizer_states=load_optimizer_states and not load_module_only)
            return load_orig(load_dir, tag=resolved, **kwargs)
        finally:
            cur.release()

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    return ce


def _keep_live_hyper(ce: CheckpointEngine) -> Any:
    """A ``register_load_state_dict_pre_hook`` hook for the base optimizer: after an allowed
    change of class (``ce._class_changed``), each group of the state dict DeepSpeed hands
    it gets the live group's hyperparameters for the settings it lacks."""

    def hook(optimizer: Any, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        groups = state_dict.get("param_groups")
        if not ce._class_changed or not isinstance(groups, list):
            return None
        merged = []
        for i, sg in enumerate(groups):
            if i < len(optimizer.param_groups) and isinstance(sg, dict):
                g = _group_hyper(optimizer.param_groups[i], sg, True)
                g["params"] = sg.get("params")
                merged.append(g)
            else:
                merged.append(sg)
        return dict(state_dict, param_groups=merged)

    return hook
