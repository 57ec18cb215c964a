"""JSON encoding of the values stored beside the tensors (optimizer hyperparameters,
non-tensor state, ``extra`` values): tuples, non-finite floats and small tensors kept."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ._dtypes import _torch


def _encode(v: Any, where: str) -> Any:
    torch = _torch()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, tuple):
        return {"$tuple": [_encode(x, where) for x in v]}
    if isinstance(v, list):
        return [_encode(x, where) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _encode(x, where) for k, x in v.items()}
    if isinstance(v, torch.Tensor) and v.numel() <= 64:
        return {"$tensor": v.detach().cpu().tolist(), "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, (np.generic,)):
        return _encode(v.item(), where)
    raise InvalidArgumentError(
        f"{where}: cannot store a value of type {type(v).__name__} (JSON types, tuples and "
        "small tensors only)"
    )


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1 and "$tuple" in v:
            return tuple(_decode(x) for x in v["$tuple"])
        if len(v) == 1 and "$float" in v:
            return float(v["$float"])
        if len(v) == 2 and "$tensor" in v and "dtype" in v:
            torch = _torch()
            return torch.tensor(v["$tensor"], dtype=getattr(torch, v["dtype"]))
        return {k: _decode(x) for k, x in v.items()}
    return v
