"""DeepSpeed's ``CheckpointEngine`` writing ckptstore checkpoints: a tag's files staged,
then published in one rename and ``latest`` written atomically (the package docs)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import shutil
import threading
from typing import Any, Dict, List, Optional

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
)
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointEngine as _DSCheckpointEngine,
)

from ... import atomic
from ..._faults import fault_point
from ...errors import CheckpointError, CheckpointIOError, InvalidArgumentError
from .._common import check_optimizer_class, name_error
from .._tree import TreeSaver, load_tree, save_tree
from ._values import _decode, _encode, _read_default_file, _recorded_class, _with_class

_log = logging.getLogger(__package__)  # the package's logger

#: The test seam's environment variable and its points (package docstring).
#: Deprecated (kept for one release, CHANGELOG.md): the test seam is ``ckptstore._faults``'s
#: ``CKPTSTORE_FAULT`` with the points ``deepspeed.save``, ``deepspeed.publish`` and
#: ``deepspeed.latest``.
KILL_ENV = "CKPTSTORE_FAULT"
KILL_POINTS = ("save", "publish", "latest")

_STAGING = ".ckptstore-staging"
#: What a `latest` write killed before its rename leaves (ckptstore.atomic.write_file).
_LATEST_TMP = ".ckpt-tmp-latest"
_ZERO_RANK = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


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
    """DeepSpeed's ``CheckpointEngine`` writing ckptstore checkpoints (package docstring).

    Args:
        config_params: DeepSpeed's config (unused; DeepSpeed's engines take it).
        allow_pickle: store values only pickle can store, and load them (and files of
            DeepSpeed's default engine). Trusts the checkpoint as much as code you run.
        max_shard_size: bytes per shard file of each checkpoint (``None``: the engine's).
        allow_optimizer_change: let :func:`install`'s ``load_checkpoint`` load a tag saved by
            another optimizer class (package docstring); refused by default.
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
        if exist_ok or rel is not None:
            atomic.make_dirs(target)  # every rank makes it: on a shared file system too
        else:
            os.makedirs(target)

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
        atomic.make_dirs(os.path.dirname(target))
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
        fault_point("deepspeed.save")

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
                        fault_point("deepspeed.publish")
                        atomic.publish_dir(p.staging, p.tag_dir)
                        fault_point("deepspeed.latest")
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
        states: refuse a file recorded with another optimizer class (package docstring)."""
        live = self._expect_class
        if live is None:
            return
        if check_optimizer_class(live, saved_class, self.allow_optimizer_change, path):
            self._class_changed = True

    def _read(self, path: str, map_location: Any) -> "tuple[Any, Optional[str]]":
        """The object stored at ``path`` and the optimizer class recorded with it."""
        if os.path.isfile(path):
            return _read_default_file(path, map_location, self.allow_pickle), None
        try:
            obj = load_tree(path, allow_pickle=self.allow_pickle, map_location=map_location)
        except CheckpointError as e:
            name_error(e, path)
            raise
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

