"""``LightningModule.load_from_checkpoint`` of a ckptstore checkpoint: Lightning reads the
path with ``torch.load`` itself; its ``pl_load`` is wrapped to route a committed ckptstore
checkpoint (and only that) through the plug-in's load."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

from ... import open as _open
from ...errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, PickleNotAllowedError
from .._common import MANIFEST
from ._base import _is_remote, _load_ckptstore, _local, _location

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

