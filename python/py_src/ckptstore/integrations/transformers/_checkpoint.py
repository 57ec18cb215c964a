"""One checkpoint of the Trainer or of Accelerate's state: the model and the optimizer as
:func:`ckptstore.torch.save` stores them, plus a tree of JSON values and tensors; the model
restored through its own ``load_state_dict``; the RNG states."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from ... import _ckptstore
from ... import open as _open
from ... import torch as _ct
from ...errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError, InvalidArgumentError
from ...torch.internal import build_items, empty_for, to_numpy
from .._common import prefix_message
from .._tree import TREE_KEY, flatten, load_tree, prepare_any

logger = logging.getLogger(__package__)  # the package's logger

#: Metadata key marking a checkpoint written by this package: ``{"version", "kind", ...}``.
MARKER_KEY = "ckptstore.transformers"
#: Root key of the tree (scheduler, scaler, RNG, trainer state) in the checkpoint.
TREE_ROOT = "hf.trainer"
_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.json"


def save_checkpoint(
    path: "str | os.PathLike[str]",
    model: Any,
    optimizer: Any,
    tree: Dict[str, Any],
    *,
    kind: str,
    allow_pickle: bool = False,
    max_shard_size: Optional[int] = None,
) -> dict:
    """Save ``model`` and ``optimizer`` as :func:`ckptstore.torch.save` stores them, plus
    ``tree`` (JSON values and tensors, :mod:`ckptstore.integrations._tree`) under
    :data:`TREE_ROOT`, as one committed checkpoint in the directory ``path`` (atomically
    replacing one there). Returns the commit info."""
    items = _items(model, optimizer, tree, kind, allow_pickle, to_numpy, prepare_any)
    return _save_items(path, items, max_shard_size)


def _items(
    model: Any,
    optimizer: Any,
    tree: Dict[str, Any],
    kind: str,
    allow_pickle: bool,
    prepare: Any,
    prepare_tree: Any,
) -> tuple:
    """``(entries, metadata JSON, optimizer parts)`` of :func:`save_checkpoint`, every
    tensor turned into ``(name, wire dtype, array)`` by ``prepare`` (the live tensor, or a
    snapshot buffer's copy)."""
    entries, meta_json, optim = build_items(model, optimizer, None, prepare)
    t_entries, t_meta = flatten({TREE_ROOT: tree}, prepare_tree, allow_pickle)
    taken = {e[0] for e in entries}
    for name, _, _ in t_entries:
        if name in taken:
            raise InvalidArgumentError(f"model tensor {name!r} has the name of a trainer state tensor")
    meta = json.loads(meta_json)
    meta.update(json.loads(t_meta))
    meta[MARKER_KEY] = {"version": _VERSION, "kind": kind}
    return entries + t_entries, json.dumps(meta, allow_nan=False), optim


def _save_items(path: "str | os.PathLike[str]", items: tuple, max_shard_size: Optional[int]) -> dict:
    entries, metadata, optim = items
    return _ckptstore.save(os.fspath(path), entries, metadata, max_shard_size, optim, "inline")


def is_ckptstore_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` holds a committed checkpoint written by this package."""
    if not os.path.isdir(path):
        return False
    try:
        with _open(path) as ck:
            return ck.kind == "ckptstore" and isinstance(ck.metadata.get(MARKER_KEY), dict)
    except CheckpointError:
        return False


def _read_tree(path: "str | os.PathLike[str]", allow_pickle: bool) -> Dict[str, Any]:
    """The tree of a checkpoint of this package: every tensor fresh and CRC-checked."""
    with _open(path) as ck:
        marker = ck.metadata.get(MARKER_KEY)
        if not isinstance(marker, dict) or marker.get("version") != _VERSION:
            raise InvalidArgumentError(
                f"{os.fspath(path)!r}: not a checkpoint of ckptstore.integrations.transformers "
                f"version {_VERSION} (metadata {MARKER_KEY!r}: {marker!r})"
            )
        if TREE_KEY not in ck.metadata:
            raise CorruptCheckpointError(f"{os.fspath(path)!r}: the trainer state tree is missing")
    tree = load_tree(path, allow_pickle=allow_pickle, map_location="cpu")
    if not isinstance(tree, dict) or not isinstance(tree.get(TREE_ROOT), dict):
        raise CorruptCheckpointError(f"{os.fspath(path)!r}: the trainer state tree has no {TREE_ROOT!r}")
    return tree[TREE_ROOT]


@contextlib.contextmanager
def _naming(path: "str | os.PathLike[str]", what: str) -> Iterator[None]:
    """Prefix the message of a ckptstore error raised inside with ``what`` and ``path``
    (the engine's messages name the tensor and shard file, not the checkpoint)."""
    try:
        yield
    except CheckpointError as e:
        prefix_message(e, f"{what} {os.fspath(path)!r}")
        raise


# ---- restoring the model through its own load_state_dict -------------------------------------


class _Staged:
    """What :func:`ckptstore.torch.load` uses of a model, over fresh tensors: its
    ``state_dict`` is ``tensors`` (filled from the checkpoint, every CRC checked), its
    parameters are the live model's (they name the optimizer's parameters)."""

    def __init__(self, model: Any, tensors: Dict[str, Any]) -> None:
        self._model = model
        self._tensors = tensors

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return dict(self._tensors)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self._model.named_parameters(*args, **kwargs)


def _custom_loading(model: Any) -> bool:
    """Whether ``model`` loads state its own way: an overridden ``load_state_dict`` (on its
    class or the object) or a ``load_state_dict`` pre-hook on any of its modules. Then its
    ``load_state_dict`` decides which names and shapes it takes."""
    fn = getattr(getattr(model, "load_state_dict", None), "__func__", None)
    if fn is not torch.nn.Module.load_state_dict:
        return True
    return any(getattr(m, "_load_state_dict_pre_hooks", None) for m in model.modules())


def _restore(path: str, model: Any, optimizer: Any = None, allow_optimizer_change: bool = False) -> None:
    """Restore ``model`` (and ``optimizer``) from a checkpoint of this package, the model
    through its own ``load_state_dict`` (its overrides and pre-hooks run, as in the stock
    Trainer).

    Before anything changes: the model's names and shapes against the checkpoint (unless
    the model loads its own way, :func:`_custom_loading`: its ``load_state_dict`` judges),
    the optimizer by :func:`ckptstore.torch.load`'s rule, and every CRC32 (the model's
    tensors are read into fresh tensors). Then the optimizer's state is replaced whole and
    ``model.load_state_dict(tensors, True)`` runs; if it raises, the optimizer gets its
    previous state back."""
    with _open(path) as ck:
        meta = ck.metadata.get(_ct.META_KEY)
        names = meta.get("model") if isinstance(meta, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorruptCheckpointError("the checkpoint lists no model tensors")
        infos = {n: ck.info(n) for n in names}
    if not _custom_loading(model):
        live = model.state_dict()
        missing = [n for n in live if n not in infos]
        unexpected = [n for n in infos if n not in live]
        bad = [n for n in live if n in infos and tuple(infos[n]["shape"]) != tuple(live[n].shape)]
        if missing or unexpected or bad:
            if missing:
                why = f"the checkpoint has no tensor {missing[0]!r}"
            elif unexpected:
                why = f"the checkpoint holds {unexpected[0]!r}, which the model does not have"
            else:
                n = bad[0]
                why = (f"{n!r} has shape {tuple(infos[n]['shape'])} in the checkpoint, "
                       f"{tuple(live[n].shape)} in the model")
            raise IncompatibleStateError(f"cannot restore the model: {why}")
    tensors = {n: empty_for(info) for n, info in infos.items()}
    before = optimizer.state_dict() if optimizer is not None else None
    # Every CRC checked, the optimizer checked, then its state replaced; the model's bytes
    # land in `tensors`, nothing of the live model changes here.
    _ct.load(path, _Staged(model, tensors), optimizer, allow_optimizer_change=allow_optimizer_change)
    try:
        model.load_state_dict(tensors, True)
    except BaseException:
        if before is not None:
            optimizer.load_state_dict(before)
        raise


# ---- RNG states ----------------------------------------------------------------------------


def _rng_state() -> Dict[str, Any]:
    st: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.random.get_rng_state_all()
    return st


def _set_rng_state(st: Dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.random.set_rng_state(st["cpu"])
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            logger.warning(
                "the checkpoint holds CUDA RNG states of %d devices, this process sees %d: "
                "CUDA RNG states not restored",
                len(cuda),
                torch.cuda.device_count(),
            )

