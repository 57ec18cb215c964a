"""What :func:`ckptstore.torch.save` stores: the native save's items (name, wire dtype,
array), the metadata under :data:`META_KEY` and the optimizer parts, for ``save`` and for
the checkpoint manager's background saves."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional

import numpy as np

from .._prep import check_utf8 as _check_utf8
from .._prep import optimizer_parts as _optimizer_parts
from ..errors import InvalidArgumentError, InvalidTensorError
from ._dtypes import _torch
from ._state import _encode_groups, _optimizer_class, _param_names
from ._values import _encode

#: Metadata key under which the torch helpers record what they stored.
META_KEY = "ckptstore.torch"
#: Prefix of the tensors that hold ``extra`` tensors.
EXTRA_PREFIX = "extra/"
_META_VERSION = 1


def _build_items(
    model: Any,
    optimizer: Any,
    extra: Optional[Mapping[str, Any]],
    prepare: Callable[[str, Any], tuple[str, str, np.ndarray]],
) -> tuple[list[tuple[str, str, np.ndarray]], str, Any]:
    """What :func:`save` stores for ``model``, ``optimizer`` and ``extra``: the native
    save's items, its metadata JSON and its optimizer parts. ``prepare(name, tensor)``
    turns each tensor into ``(name, wire dtype, array)``: over the live tensor for
    :func:`save`, over a snapshot buffer for the manager's background saves."""
    torch = _torch()
    entries: list[tuple[str, str, np.ndarray]] = []
    meta: dict[str, Any] = {"version": _META_VERSION, "model": [], "extra": {}, "extra_tensors": []}
    if model is not None:
        for name, t in model.state_dict().items():
            if not isinstance(t, torch.Tensor):
                raise InvalidTensorError(
                    f"model state {name!r} is a {type(t).__name__}, not a tensor: "
                    "ckptstore.torch stores tensors (put other values in extra=)"
                )
            entries.append(prepare(name, t))
            meta["model"].append(name)
    optim = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        names = _param_names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = _encode_groups(sd["param_groups"], names)
        state: dict[str, dict[str, Any]] = {}
        values: dict[str, dict[str, Any]] = {}
        for i, st in sd["state"].items():
            n = names[i]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    state.setdefault(n, {})[k] = v
                elif v is not None:
                    values.setdefault(n, {})[k] = _encode(v, f"parameter {n!r}, state {k!r}")
        opt = {
            "param_groups": groups,
            "param_shapes": {n: tuple(p.shape) for n, p in zip(names, params)},
            "state": state,
        }
        optim = _optimizer_parts(opt, prepare=prepare)
        meta["optimizer"] = {"class": _optimizer_class(optimizer), "values": values}
    for k, v in (extra or {}).items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"extra keys must be strings, got {k!r}")
        _check_utf8(k, "extra key", InvalidArgumentError)
        if isinstance(v, (torch.Tensor, np.ndarray)):
            entries.append(prepare(EXTRA_PREFIX + k, v))
            meta["extra_tensors"].append(k)
        else:
            meta["extra"][k] = _encode(v, f"extra {k!r}")
    metadata = json.dumps({META_KEY: meta}, allow_nan=False)
    return entries, metadata, optim
