"""ckptstore for PyTorch Lightning 2.6 and Fabric: every checkpoint one committed ckptstore
checkpoint.

::

    from ckptstore.integrations.lightning import CheckpointIO

    trainer = lightning.Trainer(plugins=[CheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")                       # resumes as with torch.save
    fabric = lightning.Fabric(plugins=[CheckpointIO(async_save=True)])

:class:`CheckpointIO` is a ``lightning.fabric.plugins.io.CheckpointIO``. Each
``save_checkpoint(checkpoint, path)`` writes Lightning's checkpoint dict as ONE ckptstore
checkpoint, a directory at ``path`` (``epoch=3-step=40.ckpt/``, ``last.ckpt/``) or an
``s3://`` URL, committed atomically: a save that dies half way leaves the checkpoint that
was there before (``last.ckpt`` included), never a torn one. What is stored
(:mod:`ckptstore.integrations._tree`): every tensor (model ``state_dict``, optimizer
states, tensors in callback state) as a ckptstore tensor named by its path in the dict
(``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``), CRC-checked and
visible to ``ckpt inspect`` / ``ckpt verify``; the rest as JSON in the manifest metadata.

``load_checkpoint`` returns the dict as saved, bit for bit: tensors with their dtype,
shape and device (``map_location`` as ``torch.load`` takes it: a device, a dict of device
strings, or ``f(tensor, saved_device)``); ``None``, bools, ints (any size), floats (NaN and
infinities kept), strings and bytes as they were. Round trips where JSON has no form:

* **tuples come back as tuples** and lists as lists (Adam's ``betas`` stays a tuple);
* **dicts with non-string keys keep their keys** (the optimizer ``state`` dict keyed by
  parameter index ``0, 1, ...`` comes back with ``int`` keys, in the same order), and
  ``OrderedDict`` (a model ``state_dict``) comes back as ``OrderedDict``;
* ``torch.Size``, ``torch.dtype``, ``torch.device``, sets and numpy scalars are kept; other
  dict subclasses (Lightning's ``AttributeDict`` of ``hyper_parameters``) come back as plain
  dicts, list and tuple subclasses as lists and tuples;
* a tensor object held twice (tied weights) is stored once and comes back as one object.

Every tensor is read into fresh memory and its CRC32 checked before ``load_checkpoint``
returns: a damaged checkpoint raises :class:`ckptstore.errors.ChecksumError` naming the
tensor (and the checkpoint), and Lightning, which loads the dict first and applies it
after, leaves the live model and optimizer untouched. Lightning applies optimizer state with
``optimizer.load_state_dict``, which replaces the state whole: state the live optimizer
holds for parameters the checkpoint does not name is gone after a resume (no merge).

**Pickle.** Anything else (an arbitrary Python object a callback or ``save_hyperparameters``
put in the checkpoint) is refused at save with
:class:`ckptstore.integrations._tree.PickleNotAllowedError` naming its path in the dict,
unless ``CheckpointIO(allow_pickle=True)``: then it is pickled into the metadata. Loading
such a checkpoint needs ``allow_pickle=True`` as well (and is refused whenever Lightning
asks for ``weights_only=True``): unpickling runs code chosen by whoever wrote the
checkpoint, so opt in only for checkpoints you trust as much as the code you run. The CRCs
detect damage, not malice. Without the opt-in nothing is ever unpickled.

**torch.save files** (Lightning's default format) load: a regular file at the path is read
with ``torch.load(weights_only=True)`` as ``TorchCheckpointIO`` reads it (every tensor on the
CPU unless ``map_location`` says otherwise), so that ``fabric.load_raw("pretrained.pt",
model)`` works and a run begun with the default IO resumes after the switch (the load is
logged; later saves are ckptstore checkpoints). A file that needs pickle is refused with
:class:`PickleNotAllowedError` unless ``allow_pickle=True`` (then ``weights_only=False``,
unless Lightning asks for ``weights_only=True``).

**LightningModule.load_from_checkpoint** reads the path with ``torch.load`` itself, which
fails on a directory. Constructing a :class:`CheckpointIO` installs
:func:`patch_load_from_checkpoint`, which routes a committed ckptstore checkpoint (and only
that: files, open files and URLs go to Lightning's loader unchanged) through the load
above; pickled values only with ``load_from_checkpoint(..., weights_only=False)``. Scripts
that never build a ``CheckpointIO`` call :func:`load_from_checkpoint` (``load_from_checkpoint(
MyModule, path, **kwargs)``) or :func:`patch_load_from_checkpoint` first.

``map_location``: a callable returning ``None`` means ``torch.load``'s default placement,
the device the tensor was saved from (Lightning's ``_default_map_location`` returns ``None``
for every tensor it leaves where it is).

**Pickling** (``torch.save(trainer)``, ``strategy="ddp_spawn"`` and other spawn launches
pickle the Trainer with its plug-ins): a :class:`CheckpointIO` pickles its settings only;
saves in flight are waited for first (a background save's error is raised there), and the
copy starts a thread and buffers of its own at its first non-blocking save.

**Non-blocking saves.** ``CheckpointIO(async_save=True)``: ``save_checkpoint`` copies every
tensor into snapshot buffers and returns; a background thread writes and commits, saves in
the order they were made (:class:`ckptstore.integrations._tree.TreeSaver`). Unlike
Lightning's ``AsyncCheckpointIO``, which clones every tensor on every save, the buffers are
reused by the next save of the same structure, so host memory stays flat over any number
of saves (``max_in_flight`` buffer sets at most, each as large as the tensors saved).
``teardown()`` (Lightning calls it at the end of ``fit``) waits for the saves in flight,
frees the buffers and raises the first error of a background save; a later save raises an
earlier save's error too. ``load_checkpoint`` and ``remove_checkpoint`` of a path with a
save in flight wait for that save first.

**remove_checkpoint** (``ModelCheckpoint``'s top-k and ``last``) removes only a committed
ckptstore checkpoint: a directory holding ``ckpt-manifest.json`` (its manifest is removed
first, so an interruption leaves no half checkpoint that still opens), or an ``s3://``
checkpoint that opens (removed with fsspec, which needs ``s3fs`` for that; without it the
checkpoint is kept and a warning says so). A missing path is a no-op, as with
``TorchCheckpointIO``; anything else (a ``torch.save`` file, a directory that is not a
checkpoint) raises :class:`ckptstore.errors.InvalidArgumentError` and is left alone.

**FSDP2 / ModelParallel.** Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor) and
``FSDPStrategy`` save sharded checkpoints with ``torch.distributed.checkpoint.save`` directly
and never call ``CheckpointIO``. :class:`ModelParallelStrategy` is a drop-in subclass whose
``save_checkpoint`` / ``load_checkpoint`` route DCP through :class:`ckptstore.torch.dcp.Writer`
and :class:`~ckptstore.torch.dcp.Reader`: one committed checkpoint for all ranks (model and
optimizer shards plus the rest of Lightning's dict, which the stock strategy pickles into
``meta.pt``, stored here as in :class:`CheckpointIO`), resumable on another world size, and
a damaged checkpoint leaves every rank's model and optimizer unchanged. The FSDP1
``FSDPStrategy`` is not routed (lightning 2.6 runs it on GPUs only, so it is untested here):
use :class:`ModelParallelStrategy` (FSDP2) instead (see python/README.md).

**A change of optimizer class** (state saved by AdamW, resumed into ``SGD``): refused with
:class:`ckptstore.IncompatibleStateError` naming both classes, by rule F1 of
:func:`ckptstore.check_optimizer_fit` (the one rule of :func:`ckptstore.torch.load`), unless
the option ``allow_optimizer_change=True`` is given. A Lightning optimizer state dict does
not name its class, so the class (``type(optimizer).__name__`` of the optimizer that runs,
as :func:`ckptstore.torch.save` records it) is recorded at save, and checked at resume,
by whichever component sees the live optimizers:

* :class:`ModelParallelStrategy` records each optimizer's class with the rest of the dict and
  checks it in ``load_checkpoint`` before anything is read into the live model or optimizer
  (``ModelParallelStrategy(allow_optimizer_change=True)`` lets a change through): a refused
  resume leaves both exactly as they were.
* With :class:`CheckpointIO` (stock strategies), ``CheckpointIO`` only stores and returns a
  dict and never sees an optimizer, so the callback :class:`OptimizerCheck`
  (``Trainer(plugins=[CheckpointIO()], callbacks=[OptimizerCheck()])``; its
  ``allow_optimizer_change``) records the classes (its callback state) and checks them once
  the Trainer has built the optimizers, before Lightning loads any optimizer state, the
  learning rate schedulers or the loops' progress, and before any training step. What is not
  possible there: Lightning's stock strategies load the model's weights (``restore_model``)
  *before* they create the optimizers (``configure_optimizers`` runs in ``strategy.setup``),
  so when a class change is refused the model already holds the checkpoint's weights (the
  optimizer, schedulers and loops are untouched). Without the callback nothing is recorded or
  checked (a checkpoint that records no class is resumed as before, as is one saved without
  the callback). Strategies that restore the optimizer themselves (Lightning's
  ``DeepSpeedStrategy``) are left to their own load: the callback does not check them.
* Fabric (``fabric.save`` / ``fabric.load`` through :class:`CheckpointIO`): not checked;
  Fabric converts the optimizer to its state dict before ``CheckpointIO`` sees it, and no
  hook runs with both. Use :func:`ckptstore.torch.save` / :func:`ckptstore.torch.load` for
  the check there.

With the opt-in the checkpoint's optimizer state is installed as stored and each parameter
group gets the checkpoint's hyperparameters plus the live group's own for the settings the
checkpoint's group lacks (an ``SGD`` resumed from AdamW keeps its ``momentum``), as
:func:`ckptstore.torch.load` does. Under :class:`ModelParallelStrategy` (DCP loads into the
live optimizer's own state tensors) the live optimizer gets the checkpoint's state for the
state names it has itself; its others, and the checkpoint's names it does not use, start
fresh (``SGD`` from AdamW: a new momentum buffer at the next step).

Tested with lightning 2.6.6 and torch 2.15 (CPU, gloo).
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import lightning.fabric.plugins.io as _lio
import torch

from lightning.fabric.utilities.rank_zero import rank_zero_info as _rank_zero_info
from lightning.pytorch.callbacks import Callback as _Callback

from .. import atomic, open as _open, wait_for_cleanup as _wait_for_cleanup
from ..errors import CheckpointError, CheckpointNotFoundError, IncompatibleStateError, InvalidArgumentError
from ..torch._state import _check_class, _group_hyper, _optimizer_class
from ._tree import PickleNotAllowedError, TreeSaver, load_tree, save_tree

__all__ = [
    "CheckpointIO",
    "ModelParallelStrategy",
    "OptimizerCheck",
    "PickleNotAllowedError",
    "load_from_checkpoint",
    "patch_load_from_checkpoint",
    "MANIFEST",
    "DCP_TREE_KEY",
]

#: The manifest file of a committed ckptstore checkpoint directory.
MANIFEST = "ckpt-manifest.json"
#: Manifest metadata key under which :class:`ModelParallelStrategy` keeps the rest of
#: Lightning's checkpoint dict (beside DCP's own metadata).
DCP_TREE_KEY = "ckptstore.lightning"
_DCP_TREE_VERSION = 1
#: DCP state-dict key of the tensors of the rest of the dict.
_DCP_EXTRA = "ckptstore.extra"


def _location(path: Any) -> str:
    """A location for the engine: an ``s3://`` URL as it is, a local path as a string."""
    s = os.fspath(path)
    if not isinstance(s, str):
        raise InvalidArgumentError(f"checkpoint paths are strings, got {path!r}")
    return s[len("file://") :] if s.startswith("file://") else s


def _is_remote(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _local(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def _key(location: str) -> str:
    """The same key for every spelling of one location (relative or absolute path)."""
    return location if _is_remote(location) else os.path.abspath(_local(location))


class CheckpointIO(_lio.CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores each checkpoint as one committed ckptstore
    checkpoint (see the module docs).

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
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
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
            parent = os.path.dirname(os.path.abspath(_local(location)))
            os.makedirs(parent, exist_ok=True)
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
        """Remove the committed ckptstore checkpoint at ``path`` (see the module docs); a
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
        manifest = d / MANIFEST
        if not d.is_dir() or not manifest.is_file():
            raise InvalidArgumentError(
                f"refusing to remove {location!r}: it is not a committed ckptstore checkpoint "
                f"(no {MANIFEST})"
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


def _placement(map_location: Any) -> Any:
    """``map_location`` for :func:`load_tree`, with ``torch.load``'s meaning of a callable
    that returns ``None`` (Lightning's ``_default_map_location`` does for every tensor it
    leaves alone): the default placement, the device the tensor was saved from."""
    if not callable(map_location):
        return map_location
    m = map_location

    def place(t: Any, saved: str) -> Any:
        r = m(t, saved)
        if r is None:
            return t if str(saved) == "cpu" else t.to(saved)
        return r

    return place


def _load_ckptstore(location: str, map_location: Any, allow_pickle: bool) -> Dict[str, Any]:
    """The dict of the ckptstore checkpoint at ``location`` (:func:`load_tree`), errors
    naming the checkpoint."""
    try:
        return load_tree(location, allow_pickle=allow_pickle, map_location=_placement(map_location))
    except CheckpointError as e:
        _naming(e, location)
        raise


def _torch_reason(message: str) -> str:
    """The reason in ``torch.load``'s weights-only refusal, without its advice."""
    i = message.find("WeightsUnpickler error:")
    r = message[i + len("WeightsUnpickler error:") :] if i >= 0 else message
    r = r.split("Check the documentation of torch.load")[0]
    return " ".join(r.replace("\033[1m", "").replace("\033[0m", "").split())[:500]


def _load_torch_file(location: str, map_location: Any, allow_pickle: bool, hint: str) -> Any:
    """A ``torch.save`` file, as ``TorchCheckpointIO`` loads it (``map_location=None``:
    every tensor on the CPU), with ``weights_only=True`` unless ``allow_pickle``."""
    ml = (lambda storage, loc: storage) if map_location is None else map_location
    path = _local(location)
    try:
        obj = torch.load(path, map_location=ml, weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if not allow_pickle and "Weights only load failed" in str(e):
            raise PickleNotAllowedError(
                f"{location!r} is not a ckptstore checkpoint but a file that "
                f"torch.load(weights_only=True) refuses ({_torch_reason(str(e))}): {hint}"
            ) from None
        raise InvalidArgumentError(
            f"{location!r} is neither a ckptstore checkpoint (a directory) nor a torch.save "
            f"file torch.load can read: {e}"
        ) from e
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError, ImportError) as e:
        raise InvalidArgumentError(
            f"{location!r} is neither a ckptstore checkpoint (a directory) nor a torch.save "
            f"file torch.load can read: {type(e).__name__}: {e}"
        ) from e
    _rank_zero_info(
        f"ckptstore: {location} is a torch.save file (Lightning's default checkpoint format), "
        f"loaded with torch.load(weights_only={not allow_pickle}); checkpoints saved from now "
        "on are ckptstore checkpoints"
    )
    return obj


# ---- LightningModule.load_from_checkpoint of a ckptstore checkpoint -------------------------

_PATCH_LOCK = threading.Lock()


def _is_ckptstore_checkpoint(path: Any) -> bool:
    """Whether ``path`` names a committed ckptstore checkpoint: a local directory holding
    ``ckpt-manifest.json``, or an ``s3://`` checkpoint that opens. An open file, an
    ``http(s)://`` URL or anything else is not."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        location = _location(path)
    except (TypeError, InvalidArgumentError):
        return False
    if _is_remote(location):
        if not location.startswith("s3://"):
            return False
        try:
            _open(location, lazy=True).close()
        except CheckpointNotFoundError:
            return False  # a torch.save object there, or nothing: Lightning's own load
        return True
    return os.path.isfile(os.path.join(_local(location), MANIFEST))


def _routing_loader(original: Any) -> Any:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        try:
            ours = _is_ckptstore_checkpoint(path_or_url)
        except CheckpointError:
            # An s3:// location the engine cannot read (credentials, a damaged manifest):
            # Lightning's own load, which worked before the patch, with this error as context.
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        if not ours:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        location = _location(path_or_url)
        try:
            return _load_ckptstore(location, map_location, allow_pickle=weights_only is False)
        except PickleNotAllowedError as e:
            raise PickleNotAllowedError(
                f"{location!r} holds a pickled value: pass weights_only=False to "
                "load_from_checkpoint to unpickle it, only if you trust the checkpoint as much "
                "as code you run"
            ) from e

    pl_load._ckptstore_original = original  # type: ignore[attr-defined]
    return pl_load


def patch_load_from_checkpoint() -> None:
    """Make ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) load a
    ckptstore checkpoint. Lightning reads the path with ``torch.load`` itself
    (``lightning.pytorch.core.saving``'s ``pl_load``), which fails on a directory; this
    wraps that one function so that a committed ckptstore checkpoint (a directory holding
    ``ckpt-manifest.json``, or an ``s3://`` checkpoint that opens) is loaded as
    :meth:`CheckpointIO.load_checkpoint` loads it, and everything else (files, open file
    objects, URLs) goes to Lightning's loader unchanged. A pickled value is loaded only
    with ``load_from_checkpoint(..., weights_only=False)``, as ``torch.load`` would.
    Idempotent; constructing a :class:`CheckpointIO` calls it."""
    import lightning.pytorch.core.saving as saving

    with _PATCH_LOCK:
        current = saving.pl_load
        if getattr(current, "_ckptstore_original", None) is None:
            saving.pl_load = _routing_loader(current)


def load_from_checkpoint(cls: Any, checkpoint_path: Any, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` (a ``LightningModule`` or
    ``LightningDataModule`` class) for a ckptstore checkpoint as for any other: for scripts
    that load a checkpoint without constructing a :class:`CheckpointIO`. Installs
    :func:`patch_load_from_checkpoint` first."""
    patch_load_from_checkpoint()
    return cls.load_from_checkpoint(checkpoint_path, **kwargs)


def _naming(e: CheckpointError, location: str) -> CheckpointError:
    """``e`` with the checkpoint's location in its message (the engine's message names the
    tensor and shard file, not always the checkpoint)."""
    msg = getattr(e, "message", None)
    if isinstance(msg, str) and location not in msg:
        e.message = f"{location}: {msg}"
        if e.args:
            e.args = (e.message, *e.args[1:])
    return e


# ---- the optimizer class: recorded at save, checked at resume -------------------------------


def _with_live_hyper(live_groups: Any, saved_groups: Any) -> list:
    """The checkpoint's parameter groups (matched to the live ones by position), each with
    the live group's hyperparameters for the settings it lacks (``ckptstore.torch.load``'s
    rule for a deliberate change of optimizer)."""
    out = []
    for i, sg in enumerate(saved_groups):
        if i < len(live_groups) and isinstance(sg, dict):
            g = _group_hyper(live_groups[i], sg, True)
            g["params"] = sg.get("params")
            out.append(g)
        else:
            out.append(sg)
    return out


def _keep_live_hyper_hook(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``Optimizer.register_load_state_dict_pre_hook`` hook of an allowed change of class."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        return state_dict
    return dict(state_dict, param_groups=_with_live_hyper(optimizer.param_groups, groups))


class OptimizerCheck(_Callback):
    """A Lightning callback that refuses to resume a checkpoint saved by another optimizer
    class (module docs), for :class:`CheckpointIO` under Lightning's stock strategies.

    It records ``type(optimizer).__name__`` of each of the Trainer's optimizers (seen through
    ``LightningOptimizer``) as its callback state at every save, and at a resume raises
    :class:`ckptstore.IncompatibleStateError` naming both classes once the Trainer has built
    its optimizers and before Lightning loads their state (nor the schedulers', the loops'
    or any step). Lightning's stock strategies have already loaded the model's weights at
    that point (they do so before creating the optimizers). ``allow_optimizer_change=True``
    lets a deliberate change through: the checkpoint's optimizer state is loaded, each group
    with the live group's hyperparameters for the settings the checkpoint's lacks. A
    checkpoint without this callback's state is resumed unchecked. Under
    :class:`ModelParallelStrategy` (which checks, before anything changes, with its own
    ``allow_optimizer_change``) and strategies that restore the optimizer themselves, it
    records but does not check.
    """

    def __init__(self, *, allow_optimizer_change: bool = False) -> None:
        self.allow_optimizer_change = bool(allow_optimizer_change)
        self._trainer: Any = None
        self._saved: Optional[list] = None
        self._checked = False
        self._hooks: list = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        self._saved = None
        self._checked = False
        self._remove_hooks()

    def state_dict(self) -> Dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.optimizers:
            return {}
        return {"optimizer_classes": [_optimizer_class(o) for o in trainer.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        classes = state_dict.get("optimizer_classes") if isinstance(state_dict, dict) else None
        self._saved = list(classes) if isinstance(classes, (list, tuple)) else None
        self._checked = False
        trainer = self._trainer
        if trainer is not None and trainer.optimizers:
            # A strategy that restores after its setup: the optimizers exist already.
            self._check(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning's stock strategies: the optimizers were created in strategy.setup; their
        # state, the schedulers' and the loops' are restored right after this hook.
        self._check(trainer)

    def _check(self, trainer: Any) -> None:
        if self._saved is None or self._checked or trainer.state.fn != "fit":
            return  # only fit restores optimizer state
        self._checked = True
        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy) or not strategy.lightning_restore_optimizer:
            return  # the strategy restores the optimizers itself (ours checks there)
        where = "" if trainer.ckpt_path is None else _location(trainer.ckpt_path)
        for i, opt in enumerate(trainer.optimizers):
            saved = self._saved[i] if i < len(self._saved) else None
            try:
                changed = _check_class(_optimizer_class(opt), saved, self.allow_optimizer_change)
            except IncompatibleStateError as e:
                raise _naming(e, f"{where} (optimizer {i})" if where else f"optimizer {i}")
            if changed:
                self._hooks.append(opt.register_load_state_dict_pre_hook(_keep_live_hyper_hook))

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._remove_hooks()  # the optimizer state is restored by now

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove_hooks()


# ---- ModelParallelStrategy (FSDP2 / DTensor) through ckptstore's DCP Writer / Reader -------

from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402


def _split_rest(rest: Dict[str, Any], allow_pickle: bool) -> tuple:
    """The non-model, non-optimizer part of a Lightning checkpoint as a JSON skeleton and
    its tensors ``{name: tensor}`` (numpy arrays as CPU tensors), described in the
    skeleton."""
    from ._tree import _Flattener

    tensors: Dict[str, Any] = {}
    described: Dict[str, Any] = {}

    def prepare(name: str, v: Any) -> tuple:
        import numpy as np

        if isinstance(v, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(v))
            kind = "ndarray"
        else:
            t = v.detach()
            kind = "tensor"
        tensors[name] = t
        described[name] = {"kind": kind, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
        return (name,)

    f = _Flattener(prepare, allow_pickle)
    skeleton = f.walk(rest, "")
    return {"version": _DCP_TREE_VERSION, "tree": skeleton, "tensors": described}, tensors


def _split_tensors(d: Any) -> tuple:
    """A (nested) state dict as ``(tensors, rest)``: the same nesting of dicts, tensor leaves
    in the first, every other leaf (and empty dicts) in the second."""
    tensors: Dict[Any, Any] = {}
    rest: Dict[Any, Any] = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif isinstance(v, dict):
            t, r = _split_tensors(v)
            if t:
                tensors[k] = t
            if r or not t:
                rest[k] = r
        else:
            rest[k] = v
    return tensors, rest


def _merge_tensors(tensors: Dict[Any, Any], rest: Dict[Any, Any]) -> Dict[Any, Any]:
    """The inverse of :func:`_split_tensors`."""
    out: Dict[Any, Any] = dict(rest)
    for k, v in tensors.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_tensors(v, out[k])
        else:
            out[k] = v
    return out


def _ckptstore_error(e: BaseException, rank: int) -> Optional[CheckpointError]:
    """The :class:`CheckpointError` inside DCP's ``CheckpointException`` (this rank's if it
    has one, else another rank's), or ``None``."""
    failures = getattr(e, "failures", None) or {}
    order = sorted(failures, key=lambda r: (r != rank, r))
    for r in order:
        f = failures[r]
        exc = f[0] if isinstance(f, tuple) else f
        if isinstance(exc, CheckpointError):
            return exc
    return None


def _dcp_items(meta: Dict[str, Any]) -> set:
    """The DCP names (``optimizer_0.state.net.0.weight.exp_avg``) a checkpoint holds."""
    from ..torch.dcp import META_KEY

    m = meta.get(META_KEY)
    items = m.get("items") if isinstance(m, dict) else None
    return set(items) if isinstance(items, dict) else set()


def _only_stored(tensors: Dict[Any, Any], prefix: str, stored: set) -> Dict[Any, Any]:
    """The nested tensors whose DCP names (``prefix.key.key...``) are in ``stored``."""
    out: Dict[Any, Any] = {}
    for k, v in tensors.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict):
            out[k] = _only_stored(v, name, stored)
        elif name in stored:
            out[k] = v
    return out


def _has_pickle(v: Any) -> bool:
    if isinstance(v, list):
        return any(_has_pickle(x) for x in v)
    if isinstance(v, dict):
        if len(v) == 1 and "$pickle" in v:
            return True
        return any(_has_pickle(x) for x in v.values())
    return False


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel over DTensor) with its
    distributed checkpoints stored by ckptstore through DCP (see the module docs).

    Takes the arguments of ``lightning.pytorch.strategies.ModelParallelStrategy`` plus
    ``allow_pickle`` and ``max_shard_size`` (per rank). ``save_distributed_checkpoint``
    must stay ``True`` (for a full checkpoint on rank 0 use the stock strategy with
    :class:`CheckpointIO`). Unless a ``CheckpointIO`` plugin is given, this strategy's
    checkpoint IO is a :class:`CheckpointIO` (``ModelCheckpoint`` removes superseded
    checkpoints through it).

    ``save_checkpoint``: every rank writes its shards with :class:`ckptstore.torch.dcp.Writer`
    and rank 0 commits them with the rest of the dict (loops, callbacks, schedulers,
    hyperparameters: JSON in the manifest, its tensors as replicated DCP tensors) in one
    commit. ``load_checkpoint``: one ``dcp.load`` with :class:`ckptstore.torch.dcp.Reader`
    for the model, every optimizer and those tensors, so that the CRC of every piece read is
    checked on every rank, and the ranks agree, before any destination is written; then the
    optimizer state is applied with ``set_optimizer_state_dict`` (``load_state_dict``:
    replaced whole). Resharding to another world size is DCP's.

    DCP is given tensors only: every other leaf (the optimizer's ``param_groups``,
    non-tensor model state), which DCP would ``torch.save`` into bytes items and unpickle on
    load, is stored as JSON with the rest of the dict, so the checkpoint holds no pickle
    unless ``allow_pickle`` let a value through. As with the stock strategy, the load first
    builds the live optimizer's state dict with ``get_optimizer_state_dict``, which gives an
    optimizer that has no state yet zero-filled state (a step with ``lr=0``): a failed
    resume leaves the model as it was and such an optimizer with that initial state.

    The class of each optimizer is recorded at save; ``load_checkpoint`` refuses a checkpoint
    saved by another class (:class:`ckptstore.IncompatibleStateError` naming both) before it
    builds any state dict or reads anything, so the model and the optimizers are left exactly
    as they were, unless ``allow_optimizer_change=True`` (module docs: what a change loads).
    """

    def __init__(
        self,
        *args: Any,
        allow_pickle: bool = False,
        max_shard_size: Optional[int] = None,
        allow_optimizer_change: bool = False,
        **kwargs: Any,
    ) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise InvalidArgumentError(
                "ckptstore's ModelParallelStrategy saves distributed checkpoints only: for a "
                "full checkpoint use lightning's ModelParallelStrategy(save_distributed_checkpoint="
                "False) with plugins=[ckptstore.integrations.lightning.CheckpointIO()]"
            )
        super().__init__(*args, **kwargs)
        self.allow_pickle = bool(allow_pickle)
        self.max_shard_size = max_shard_size
        self.allow_optimizer_change = bool(allow_optimizer_change)
        if self._checkpoint_io is None:
            self._checkpoint_io = CheckpointIO(allow_pickle=allow_pickle)

    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        from ..torch.dcp import Writer

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported"
            )
        location = _location(self.broadcast(_location(filepath)))
        if not _is_remote(location) and os.path.isfile(_local(location)):
            raise InvalidArgumentError(
                f"{location!r} is a file: a checkpoint of another format is in the way"
            )
        rest = dict(checkpoint)
        # DCP gets the tensors only: it would pickle every other leaf (torch.save into a
        # bytes item, loaded with torch.load(weights_only=False)). The rest (optimizer
        # param_groups, non-tensor model state) goes into the JSON tree with the remainder
        # of Lightning's dict.
        state: Dict[str, Any] = {}
        state["state_dict"], model_rest = _split_tensors(rest.pop("state_dict"))
        optim_rests = []
        for i, osd in enumerate(rest.pop("optimizer_states", [])):
            state[f"optimizer_{i}"], r = _split_tensors(osd)
            optim_rests.append(r)
        whole = {"rest": rest, "state_dict": model_rest, "optimizer_states": optim_rests}
        tree, tensors = _split_rest(whole, self.allow_pickle)
        tree["optimizer_classes"] = [_optimizer_class(o) for o in self.optimizers]
        if tensors:
            state[_DCP_EXTRA] = tensors
        writer = Writer(location, max_shard_size=self.max_shard_size, metadata={DCP_TREE_KEY: tree})
        dcp.save(state, storage_writer=writer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from ..torch.dcp import Reader
        from ._tree import _Loader

        location = _location(self.broadcast(_location(checkpoint_path)))
        with _open(location) as ck:
            meta = ck.metadata
            cid = ck.checkpoint_id
        tree = meta.get(DCP_TREE_KEY)
        if not isinstance(tree, dict) or tree.get("version") != _DCP_TREE_VERSION:
            raise InvalidArgumentError(
                f"{location!r} is not a checkpoint of ckptstore's ModelParallelStrategy (no "
                f"{DCP_TREE_KEY!r} metadata of version {_DCP_TREE_VERSION})"
            )
        allow = self.allow_pickle and weights_only is not True
        if not allow and _has_pickle(tree["tree"]):
            raise PickleNotAllowedError(
                f"{location!r} holds a pickled value; pass allow_pickle=True to the strategy to "
                "load it, only if you trust the checkpoint as much as code you run"
            )
        assert self.model is not None and self.lightning_module is not None
        # The optimizer classes first: before any state dict is built or anything is read.
        saved_classes = tree.get("optimizer_classes")
        if not isinstance(saved_classes, list):
            saved_classes = []
        changed = []
        for i, optim in enumerate(self.optimizers):
            saved = saved_classes[i] if i < len(saved_classes) else None
            try:
                changed.append(_check_class(_optimizer_class(optim), saved, self.allow_optimizer_change))
            except IncompatibleStateError as e:
                raise _naming(e, f"{location} (optimizer {i})")
        module = self.model
        state: Dict[str, Any] = {"state_dict": _split_tensors(get_model_state_dict(module))[0]}
        live_groups: Dict[int, Any] = {}
        for i, optim in enumerate(self.optimizers):
            osd = get_optimizer_state_dict(module, optim)
            tensors, rest = _split_tensors(osd)
            if changed[i]:
                # Another class: read the live optimizer's state names the checkpoint has.
                stored = _dcp_items(meta)
                tensors = _only_stored(tensors, f"optimizer_{i}", stored)
                live_groups[i] = rest.get("param_groups") or []
            state[f"optimizer_{i}"] = tensors
        fresh: Dict[str, Any] = {}
        for name, d in (tree.get("tensors") or {}).items():
            fresh[name] = torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
        if fresh:
            state[_DCP_EXTRA] = fresh
        # One load: every CRC checked on every rank, and agreed, before anything is written.
        try:
            dcp.load(state, storage_reader=Reader(location, expect_checkpoint_id=cid))
        except CheckpointError as e:
            _naming(e, location)
            raise
        except CheckpointException as e:
            # DCP gathers the ranks' errors: raise ckptstore's own (this rank's first).
            err = _ckptstore_error(e, self.global_rank)
            if err is None:
                raise
            raise _naming(err, location) from e
        loader = _Loader(None, location, allow, None)
        for name, d in (tree.get("tensors") or {}).items():
            t = fresh[name]
            if d.get("kind") == "ndarray":
                loader.fresh[("$ndarray", name)] = t.numpy()
            else:
                loader.fresh[("$tensor", name)] = t
        whole = loader.build(tree["tree"])
        module.load_state_dict(
            _merge_tensors(state["state_dict"], whole["state_dict"]),
            strict=self.lightning_module.strict_loading,
        )
        for i, optim in enumerate(self.optimizers):
            if i >= len(whole["optimizer_states"]):
                raise InvalidArgumentError(
                    f"{location!r} holds {len(whole['optimizer_states'])} optimizer state(s), "
                    f"the strategy has {len(self.optimizers)} optimizers"
                )
            saved_rest = whole["optimizer_states"][i]
            if i in live_groups and isinstance(saved_rest, dict):
                saved_rest = dict(saved_rest)
                saved_rest["param_groups"] = _with_live_hyper(
                    live_groups[i], saved_rest.get("param_groups") or []
                )
            set_optimizer_state_dict(
                module,
                optim,
                optim_state_dict=_merge_tensors(state[f"optimizer_{i}"], saved_rest),
                options=StateDictOptions(cpu_offload=True),
            )
        return whole["rest"]
