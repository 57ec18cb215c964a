"""``ckptstore.torch.save`` and ``ckptstore.torch.load``: one process's model, optimizer
and ``extra`` as one checkpoint (what is stored and the all-or-nothing restore:
:mod:`ckptstore.torch`)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import numpy as np

from .. import _ckptstore
from .. import open as _open
from .._prep import check_shard_size as _check_shard_size
from .._prep import fspath as _fspath
from ..errors import IncompatibleStateError

# _STAGE_BYTES is read as ``_staging._STAGE_BYTES`` wherever it is used, so that a test
# that sets it there reaches the code that reads it.
from . import _staging, _state
from ._dtypes import (
    _bytes_of,
    _empty_for,
    _from_raw,
    _to_numpy,
    _torch,
    _wire_of,
)
from ._items import EXTRA_PREFIX, META_KEY, _build_items
from ._staging import _stage_to_cuda
from ._state import (
    _build_state_dict,
    _changed_class,
    _check_fit,
    _param_names,
)
from ._values import _decode

__all__ = ["save", "load"]


def save(
    path: "str | os.PathLike[str]",
    model: Any = None,
    optimizer: Any = None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    max_shard_size: Optional[int] = None,
    cleanup: str = "background",
) -> dict:
    """Save ``model`` (its ``state_dict()``), ``optimizer`` (its ``state_dict()``, with
    parameters named by their model names) and ``extra`` as one checkpoint in the directory
    ``path``, atomically and durably replacing any checkpoint there.

    ``extra`` maps string keys to tensors or arrays (stored as tensors) or JSON values
    (numbers, strings, lists, dicts; tuples and non-finite floats are kept); :func:`load`
    returns it. Returns the commit info of :func:`ckptstore.save`.

    CPU tensors are written from their own memory, without a copy; keep them unchanged
    until ``save`` returns (it releases the GIL while writing).

    ``cleanup`` (default ``"background"``, for training loops): ``save`` returns once the
    new checkpoint is committed and durable, and the previous checkpoint's files are
    removed on a background thread (the next save into ``path`` waits for it;
    :func:`ckptstore.wait_for_cleanup` waits for all and runs at exit). ``"inline"``
    removes them before returning. See :func:`ckptstore.save`.
    """
    _check_shard_size(max_shard_size)
    entries, metadata, optim = _build_items(model, optimizer, extra, _to_numpy)
    return _ckptstore.save(_fspath(path), entries, metadata, max_shard_size, optim, cleanup)


# ---- load --------------------------------------------------------------------------------


def load(
    path: "str | os.PathLike[str]",
    model: Any = None,
    optimizer: Any = None,
    *,
    strict: bool = True,
    layout: Any = None,
    allow_optimizer_change: bool = False,
) -> dict:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint at ``path``;
    return the ``extra`` dict saved with it (tensors as fresh torch tensors).

    Everything is checked before anything changes: the model's every state-dict entry must
    be in the checkpoint with the same shape (with ``strict``, the checkpoint must not hold
    model entries the model lacks); the optimizer must fit the checkpoint's by the rule of
    :func:`ckptstore.check_optimizer_fit` (format-spec/optimizer.md §Compatibility): the
    same optimizer class as the one saved (``type(optimizer).__name__`` of the optimizer
    that runs, seen through Accelerate's and Lightning's wrappers; recorded by
    :func:`save`), as many parameter groups, matched by position, each naming the same
    parameters (by model name, in any order) with the same shapes; every tensor used is
    read and its CRC32 checked. Any failure raises a :class:`ckptstore.CheckpointError`
    (``IncompatibleStateError``, ``ChecksumError``, ...) with the model and optimizer
    untouched.

    ``allow_optimizer_change=True`` is the opt-in for a deliberate change of optimizer
    (say, state saved from TransformerEngine's ``FusedAdam`` restored into
    ``torch.optim.Adam``): the class is then not compared (the rest of the rule still
    applies), the checkpoint's state is installed as stored, and each group's
    hyperparameters are the checkpoint's plus the live group's own for the settings the
    checkpoint's group lacks (so an ``SGD`` restored from ``AdamW`` keeps its
    ``momentum``).

    The optimizer then gets a complete fresh state dict through ``load_state_dict``:
    hyperparameters from the checkpoint, and state exactly for the parameters the
    checkpoint has state for (others end with none). By default (``layout=None``) and for
    CPU or CUDA parameters whose state is stored plain in the dtype ``load_state_dict``
    gives it, each state tensor is a fresh ``torch.empty`` tensor on its parameter's device
    that the engine fills in one pass (read once from the mapped shard, CRC-checked on the
    way, written once; for CUDA, written once into a reused pinned buffer, then copied to
    the device), in the same parallel pass that checks the model's CRCs;
    ``load_state_dict`` keeps those tensors (no copy). Otherwise ``layout`` is passed to
    :meth:`Checkpoint.load_optimizer`
    (default: as stored); FP16-scaled states are handed to torch as float32. Model tensors
    are then written in place: contiguous CPU tensors of the stored dtype straight from the
    mapped file into their memory (the second read of their bytes: checking them first is
    what keeps the model unchanged on a damaged checkpoint), others with ``copy_`` under
    ``no_grad`` (dtype casts as ``copy_`` does them). CUDA tensors (model
    entries of the stored dtype, and the optimizer state of CUDA parameters except
    ``step``) are filled through two reused 64 MiB pinned buffers, tensors larger than a
    buffer in pieces, the host-to-device copy of one buffer overlapped with the filling of
    the other. ``load`` returns when every copy has finished.
    """
    torch = _torch()
    ck = _open(path)
    meta = ck.metadata.get(META_KEY) or {}

    # 1. The model: names and shapes (its bytes are CRC-checked in step 4, copied in step 5).
    copies = []
    if model is not None:
        live = model.state_dict(keep_vars=True)
        missing = [n for n in live if n not in ck]
        if missing:
            raise IncompatibleStateError(
                f"cannot restore the model: the checkpoint has no tensor {missing[0]!r}"
                + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
            )
        saved = meta.get("model")
        if strict and saved is not None:
            unexpected = [n for n in saved if n not in live]
            if unexpected:
                raise IncompatibleStateError(
                    f"cannot restore the model: the checkpoint holds {unexpected[0]!r}, which "
                    "the model does not have (strict=False to ignore)"
                )
        for n, t in live.items():
            info = ck.info(n)
            if tuple(info["shape"]) != tuple(t.shape):
                raise IncompatibleStateError(
                    f"cannot restore the model: {n!r} has shape {tuple(info['shape'])} in the "
                    f"checkpoint, {tuple(t.shape)} in the model"
                )
            copies.append((n, t, info))

    # 2. The optimizer: a complete new state dict, checked against the live optimizer. On
    # the direct path its tensors are fresh torch.empty tensors of their final dtype, filled
    # in step 4; otherwise (a layout, CUDA parameters, scaled or chunked state, a dtype that
    # load_state_dict would cast) the engine loads and converts them here.
    new_sd = None
    fills: list[tuple[str, np.ndarray]] = []
    # Fresh CUDA state tensors of the direct path: (nbytes, flat uint8 view, stored name).
    cuda_fills: list[tuple[int, Any, str]] = []
    if optimizer is not None:
        if not ck.has_optimizer:
            raise IncompatibleStateError(
                "cannot restore the optimizer: the checkpoint holds no optimizer state"
            )
        # The section only (no state read yet): the rule first.
        plan = ck.optimizer_plan()
        assert plan is not None  # has_optimizer
        ometa = meta.get("optimizer") or {}
        saved_class = ometa.get("class") if isinstance(ometa, dict) else None
        names = _param_names(model, optimizer)
        _check_fit(
            optimizer,
            names,
            plan["param_groups"],
            plan["param_shapes"],
            saved_class,
            allow_optimizer_change,
        )
        keep_live = _changed_class(optimizer, saved_class, allow_optimizer_change)
        if layout is None and _state._direct_ok(model, optimizer, plan):
            new_sd = _build_state_dict(
                model,
                optimizer,
                plan,
                ometa,
                fresh=fills,
                cuda_fresh=cuda_fills,
                keep_live_hyper=keep_live,
            )
        else:
            st = ck.load_optimizer(layout, release=True)
            new_sd = _build_state_dict(model, optimizer, st, ometa, keep_live_hyper=keep_live)

    # 3. Extra values: tensors into fresh torch.empty tensors, filled in step 4.
    extra: dict[str, Any] = {k: _decode(v) for k, v in (meta.get("extra") or {}).items()}
    for k in meta.get("extra_tensors") or []:
        n = EXTRA_PREFIX + k
        info = ck.info(n)
        extra[k] = _empty_for(info)
        fills.append((n, _bytes_of(extra[k])))

    # 4. One pass over the bytes (parallel, interpreter released): the fresh tensors of
    # steps 2 and 3 filled with their CRC computed on the way, and the CRC of every model
    # tensor checked; mapped pages leave the process as it goes (they stay in the page
    # cache, hot for the copy of step 5). Nothing live is written before all have passed.
    # Fresh CUDA state tensors larger than a staging buffer are staged in pieces (4b):
    # their CRCs are checked in this pass.
    big = [n for nb, _, n in cuda_fills if nb > _staging._STAGE_BYTES]
    ck.fill_and_verify(fills, [n for n, _, _ in copies] + big, release=True)
    # 4b. Fresh CUDA state tensors (not live yet): filled through two reused pinned buffers
    # by the same engine pass (read once from the map, CRC-checked on the way into the
    # pinned buffer; larger ones, checked above, in pieces), each buffer's host-to-device
    # copy overlapped with the next fill. A damaged tensor raises here, before anything
    # live changes.
    if cuda_fills:
        _stage_to_cuda(
            cuda_fills,
            lambda pairs: ck.fill_and_verify(pairs, release=True),
            ck.copy_ranges_into_unchecked,
        )

    # 5. Apply: nothing above changed the model or the optimizer.
    if new_sd is not None:
        # The state tensors already have their parameter's dtype and device:
        # load_state_dict keeps them as they are (no copy) and replaces the state whole.
        optimizer.load_state_dict(new_sd)
    if copies:
        direct = []
        staged = []
        slow = []
        for n, t, info in copies:
            d = t.detach()
            plain = (
                d.is_contiguous()
                and d.layout == torch.strided
                and not (d.is_conj() or d.is_neg())
                and _wire_of.get(d.dtype) == info["dtype"]
            )
            if plain and d.device.type == "cpu":
                # Straight into the tensor's memory: the stored bytes are its bytes.
                direct.append((n, d.reshape(-1).view(torch.uint8).numpy()))
            elif (
                plain
                and d.device.type == "cuda"
                and info["nbytes"] > 0
                and _staging._STAGE_BYTES > 0
            ):
                # Through reused pinned buffers, copies overlapped with the next reads
                # (tensors larger than a buffer in pieces).
                staged.append((info["nbytes"], d.reshape(-1).view(torch.uint8), n))
            else:
                slow.append((n, t, info))
        with torch.no_grad():
            if direct:
                ck.copy_into_unchecked(direct, release=True)
            if staged:
                _stage_to_cuda(
                    staged, lambda pairs: ck.copy_into_unchecked(pairs, release=True), ck.copy_ranges_into_unchecked
                )
            if slow:
                raw = ck.read([n for n, _, _ in slow], verify=False, raw=True)
                for n, t, info in slow:
                    t.copy_(_from_raw(raw[n], info["dtype"], tuple(info["shape"])))
    return extra
