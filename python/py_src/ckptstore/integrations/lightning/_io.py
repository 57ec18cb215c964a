"""The ``CheckpointIO`` plug-in: save, load and remove one committed ckptstore checkpoint per
Lightning checkpoint (the package docs), and ``torch.save`` files of Lightning's default
format loaded as plain data."""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import lightning.fabric.plugins.io as _lio
from lightning.fabric.utilities.rank_zero import rank_zero_info as _rank_zero_info

from ... import atomic
from ... import open as _open
from ... import wait_for_cleanup as _wait_for_cleanup
from ...errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, PickleNotAllowedError
from .._common import MANIFEST, remove_leftovers, staging_name
from .._stock import UNREADABLE, WeightsOnlyRefusal, torch_load
from .._tree import TreeSaver, check_max_in_flight, save_tree
from ._base import _is_remote, _key, _load_ckptstore, _local, _location
from ._load_from_checkpoint import patch_load_from_checkpoint


class CheckpointIO(_lio.CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores each checkpoint as one committed ckptstore
    checkpoint (see the package docs).

    ``allow_pickle``: store (and load) values only pickle can hold; off by default.
    ``async_save``: non-blocking saves with reused snapshot buffers; ``max_in_flight``
    bounds the saves (and buffer sets) in flight. ``max_shard_size``: most bytes of tensor
    data per shard file (default: the engine's). ``cleanup``: when a replaced checkpoint's
    files go (``"inline"``, the default, or ``"background"``: see :func:`ckptstore.save`).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        async_save: bool = False,
        max_in_flight: int = 1,
        max_shard_size: Optional[int] = None,
        cleanup: str = "inline",
    ) -> None:
        check_max_in_flight(max_in_flight)
        if max_shard_size is not None and max_shard_size <= 0:
            raise InvalidArgumentError("max_shard_size must be positive")
        if cleanup not in ("inline", "background"):
            raise InvalidArgumentError(f"cleanup must be 'inline' or 'background', got {cleanup!r}")
        self.allow_pickle = bool(allow_pickle)
        self.async_save = bool(async_save)
        self.max_in_flight = max_in_flight
        self.max_shard_size = max_shard_size
        self.cleanup = cleanup
        self._saver: Optional[TreeSaver] = None
        self._pending: Dict[str, Any] = {}  # location -> handle of its latest background save
        self._lock = threading.Lock()
        #: Saves made (a test and benchmark counter).
        self.saves = 0
        patch_load_from_checkpoint()

    # ---- pickling (torch.save(trainer), spawn launches) --------------------------------

    def __getstate__(self) -> Dict[str, Any]:
        """The plug-in's settings, without its lock, background thread, snapshot buffers
        and in-flight saves: the copy starts with none (a new thread and buffers at its
        first non-blocking save). Saves in flight are waited for first, so that none is
        lost with the copy, and a background save's error not yet reported is raised here
        (pickling fails with it)."""
        self.wait()
        state = self.__dict__.copy()
        del state["_lock"]
        state["_saver"] = None
        state["_pending"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._saver = None
        self._pending = {}
        patch_load_from_checkpoint()

    # ---- saving ------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint`` as one committed ckptstore checkpoint at ``path``,
        atomically replacing a checkpoint there. Raises ``TypeError`` for
        ``storage_options`` (as ``TorchCheckpointIO`` does), :class:`PickleNotAllowedError`
        (nothing written) for a value only pickle can store without ``allow_pickle``, and
        the engine's :class:`ckptstore.errors.CheckpointError` otherwise. With
        ``async_save``: returns once the tensors are copied; an earlier background save's
        error is raised here."""
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"{type(self).__name__}"
            )
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        location = _location(path)
        if not _is_remote(location):
            local = os.path.abspath(_local(location))
            parent = os.path.dirname(local)
            atomic.make_dirs(parent)
            if os.path.lexists(local) and not os.path.isdir(local) and _is_torch_file(Path(local)):
                # Lightning's own checkpoint file where this one goes (``last.ckpt`` of the run
                # before its switch to ckptstore): the checkpoint is made beside it and put in
                # its place in one step (a save killed first leaves the file as it was). Any
                # other file in the way fails the save, as before.
                self._wait_for(location)
                self.saves += 1
                self._replace_file(local, checkpoint)
                return
        self.saves += 1
        if not self.async_save:
            save_tree(
                location,
                checkpoint,
                allow_pickle=self.allow_pickle,
                max_shard_size=self.max_shard_size,
                cleanup=self.cleanup,
            )
            return
        saver = self._ensure_saver()
        handle = saver.save(location, checkpoint)
        with self._lock:
            self._pending = {k: h for k, h in self._pending.items() if not h.done()}
            self._pending[_key(location)] = handle

    def _replace_file(self, local: str, checkpoint: Dict[str, Any]) -> None:
        """Save ``checkpoint`` into a staging directory beside the file ``local`` and publish
        it over the file (:func:`ckptstore.atomic.publish_dir`); blocking, also with
        ``async_save`` (once per file: the first save over each after the switch)."""
        parent = os.path.dirname(local)
        remove_leftovers(parent)  # stagings of killed processes
        stage = os.path.join(parent, staging_name(os.path.basename(local)))
        try:
            save_tree(stage, checkpoint, allow_pickle=self.allow_pickle, max_shard_size=self.max_shard_size,
                      cleanup="inline")
            atomic.publish_dir(stage, local)
        except BaseException:
            if os.path.isdir(stage):
                atomic.remove_dir(stage)
            raise

    def _ensure_saver(self) -> TreeSaver:
        if self._saver is None:
            self._saver = TreeSaver(
                self.max_in_flight,
                allow_pickle=self.allow_pickle,
                max_shard_size=self.max_shard_size,
                cleanup=self.cleanup,
            )
        return self._saver

    def _wait_for(self, location: str) -> None:
        """Wait for the background save to ``location``, if one is in flight (its error is
        raised)."""
        with self._lock:
            h = self._pending.pop(_key(location), None)
        if h is not None:
            h.wait()

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by idle snapshot buffers of the non-blocking saves."""
        return 0 if self._saver is None else self._saver.snapshot_bytes

    @property
    def snapshot_allocations(self) -> int:
        """Snapshot buffers allocated over the life of the idle buffer sets (one per stored
        tensor after the first save; later saves of the same structure add none)."""
        saver = self._saver
        if saver is None:
            return 0
        return saver.allocations

    # ---- loading -----------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """The checkpoint dict saved at ``path``, every tensor fresh and CRC-checked before
        anything is returned. ``weights_only=True`` refuses pickled values even with
        ``allow_pickle``. ``map_location`` as ``torch.load`` takes it; a callable returning
        ``None`` leaves the tensor on the device it was saved from (``torch.load``'s
        default). Raises ``FileNotFoundError`` (a
        :class:`ckptstore.errors.CheckpointNotFoundError`) when nothing is there,
        :class:`ckptstore.errors.ChecksumError` naming a damaged tensor, and
        :class:`PickleNotAllowedError` for a pickled value without the opt-in.

        A regular file at ``path`` is a ``torch.save`` file (Lightning's default format: a
        run begun with ``TorchCheckpointIO``, a pretrained state dict for
        ``fabric.load_raw``): loaded as ``TorchCheckpointIO`` loads it (``map_location=None``
        keeps every tensor on the CPU), with ``torch.load(weights_only=True)``, or
        ``weights_only=False`` under the same opt-in as a pickled value (``allow_pickle``,
        and Lightning not asking for ``weights_only=True``); a file ``weights_only=True``
        refuses raises :class:`PickleNotAllowedError` saying so. The load is logged (rank
        zero, info)."""
        location = _location(path)
        self._wait_for(location)
        allow = self.allow_pickle and weights_only is not True
        if not _is_remote(location) and os.path.isfile(_local(location)):
            # A torch.save file (Lightning's default format: a run begun with the stock IO,
            # a pretrained state dict for fabric.load_raw).
            if allow:
                hint = ""
            elif self.allow_pickle:
                hint = "Lightning asked for weights_only=True"
            else:
                hint = (
                    f"to load it with torch.load(weights_only=False) pass "
                    f"{type(self).__name__}(allow_pickle=True), only if you trust the file as "
                    "much as code you run"
                )
            return _load_torch_file(location, map_location, allow, hint)
        return _load_ckptstore(location, map_location, allow)

    # ---- removing ----------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the committed ckptstore checkpoint at ``path`` (see the package docs); a
        missing path is a no-op. Refuses (``InvalidArgumentError``) anything that is not a
        committed ckptstore checkpoint."""
        location = _location(path)
        self._wait_for(location)
        if _is_remote(location):
            self._remove_remote(location)
            return
        d = Path(_local(location))
        if not d.exists() and not d.is_symlink():
            return
        if d.is_symlink():
            # ModelCheckpoint(save_last="link") points last.ckpt at a checkpoint: drop the link.
            d.unlink()
            return
        if d.is_file() and _is_torch_file(d):
            # Lightning's own checkpoint file, written before the switch to ckptstore (top-k
            # rotation counts it as Lightning's CheckpointIO would, and removes it likewise).
            d.unlink()
            atomic.fsync_dir(d.parent)
            return
        manifest = d / MANIFEST
        if not d.is_dir() or not manifest.is_file():
            raise InvalidArgumentError(
                f"refusing to remove {location!r}: it is neither a committed ckptstore checkpoint "
                f"(no {MANIFEST}) nor a checkpoint file torch.save wrote"
            )
        if self.cleanup == "background":
            _wait_for_cleanup()  # a background cleanup may still be removing files there
        # Whole or not at all: renamed out of Lightning's names (durably), then deleted;
        # what an earlier removal killed half-way left beside it goes too.
        atomic.remove_dir(d)
        atomic.sweep_leftovers(d.parent)

    def _remove_remote(self, location: str) -> None:
        from lightning.fabric.utilities.cloud_io import get_filesystem

        try:
            # Lazy: the manifest and shard headers are read, no tensor is downloaded.
            _open(location, lazy=True).close()
        except CheckpointNotFoundError:
            return  # nothing there (or nothing committed: nothing to uncommit)
        except CheckpointError as e:
            raise InvalidArgumentError(
                f"refusing to remove {location!r}: it is not a committed ckptstore checkpoint ({e})"
            ) from e
        try:
            fs = get_filesystem(location)
        except (ImportError, ValueError) as e:
            # fsspec needs s3fs for s3://: keep the checkpoint (space, not data, is lost).
            warnings.warn(
                f"ckptstore: {location!r} was not removed: deleting objects needs fsspec's S3 "
                f"support (pip install s3fs): {e}",
                stacklevel=2,
            )
            return
        manifest = location.rstrip("/") + "/" + MANIFEST
        fs.rm(manifest)
        fs.rm(location, recursive=True)

    # ---- lifetime ----------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for every background save in flight; raise the first error not yet
        reported."""
        if self._saver is not None:
            self._saver.wait()
        with self._lock:
            self._pending.clear()

    def teardown(self) -> None:
        """Wait for the background saves in flight, free the snapshot buffers, and raise
        the first error of a background save not yet reported."""
        saver, self._saver = self._saver, None
        with self._lock:
            self._pending.clear()
        if saver is not None:
            saver.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(async_save={self.async_save}, allow_pickle={self.allow_pickle})"
        )


def _load_torch_file(location: str, map_location: Any, allow_pickle: bool, hint: str) -> Any:
    """A ``torch.save`` file, as ``TorchCheckpointIO`` loads it (``map_location=None``:
    every tensor on the CPU), with ``weights_only=True`` unless ``allow_pickle``."""
    ml = (lambda storage, loc: storage) if map_location is None else map_location
    path = _local(location)
    try:
        obj = torch_load(path, map_location=ml, allow_pickle=allow_pickle)
    except WeightsOnlyRefusal as e:
        raise PickleNotAllowedError(
            f"{location!r} is not a ckptstore checkpoint but a file that "
            f"torch.load(weights_only=True) refuses ({e.reason}): {hint}"
        ) from None
    except UNREADABLE as e:
        what = str(e) if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {e}"
        raise InvalidArgumentError(
            f"{location!r} is neither a ckptstore checkpoint (a directory) nor a torch.save "
            f"file torch.load can read: {what}"
        ) from e
    _rank_zero_info(
        f"ckptstore: {location} is a torch.save file (Lightning's default checkpoint format), "
        f"loaded with torch.load(weights_only={not allow_pickle}); checkpoints saved from now "
        "on are ckptstore checkpoints"
    )
    return obj


def _is_torch_file(path: Path) -> bool:
    """Whether ``path`` begins as a file ``torch.save`` writes (its zip archive format, the
    default since torch 1.6: Lightning's own checkpoint files)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False
