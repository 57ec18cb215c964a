"""What the plug-in, the ``load_from_checkpoint`` patch and the strategy share: the
location of a checkpoint and the load of a ckptstore checkpoint as Lightning's dict."""

from __future__ import annotations

import os
from typing import Any, Dict

from ...errors import CheckpointError, InvalidArgumentError
from .._common import name_error
from .._tree import load_tree


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
        name_error(e, location)
        raise

