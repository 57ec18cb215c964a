"""The non-tensor state of a step as JSON (the manifest's ``ckptstore.torchtitan`` entry):
tensors out under their flat DCP names, the rest a skeleton naming them; decoded back with
pickled values refused unless the caller opts in."""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointError, InvalidArgumentError, PickleNotAllowedError

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class _Encoder:
    """Walks a state dict: tensors out into ``tensors`` (flat DCP names), the rest into a
    JSON skeleton that names them."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if path in self.tensors:
                raise InvalidArgumentError(f"two state entries flatten to the same name {path!r}")
            self.tensors[path] = v
            return {"$t": path}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v if _I64_MIN <= v <= _I64_MAX else {"$int": str(v)}
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$tuple": [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            sub = (lambda k: f"{path}.{k}") if path else str
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self.encode(x, sub(k)) for k, x in v.items()}
            return {"$dict": [[self.encode(k, sub(k)), self.encode(x, sub(k))] for k, x in v.items()]}
        if isinstance(v, np.generic) and not isinstance(v, (np.void, np.object_)):
            return self.encode(v.item(), path)
        if self.allow_pickle:
            try:
                raw = pickle.dumps(v)
            except Exception as e:  # noqa: BLE001 - pickle raises many kinds
                raise InvalidArgumentError(f"state entry {path!r}: cannot pickle it: {e}") from e
            return {"$pickle": base64.b64encode(raw).decode("ascii")}
        raise PickleNotAllowedError(
            f"state entry {path!r}: a value of type {type(v).__name__} is not JSON, bytes or "
            "a tensor; storing it needs pickle (allow_pickle=True in the checkpoint config)"
        )


_DROP = object()


def _decode(v: Any, path: str, tensors: dict[str, Any], allow_pickle: bool, where: str) -> Any:
    """The value of skeleton ``v``; tensor references become ``tensors[name]`` (or
    ``_DROP`` when the load did not ask for that tensor)."""
    if isinstance(v, list):
        out = [_decode(x, path, tensors, allow_pickle, where) for x in v]
        return [x for x in out if x is not _DROP]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        tag, x = next(iter(v.items()))
        if tag == "$t":
            return tensors.get(x, _DROP)
        if tag == "$int":
            return int(x)
        if tag == "$float":
            return float(x)
        if tag == "$bytes":
            return base64.b64decode(x)
        if tag == "$tuple":
            return tuple(_decode(y, path, tensors, allow_pickle, where) for y in x)
        if tag == "$dict":
            out = {}
            for k, y in x:
                val = _decode(y, path, tensors, allow_pickle, where)
                if val is not _DROP:
                    out[_decode(k, path, tensors, allow_pickle, where)] = val
            return out
        if tag == "$pickle":
            if not allow_pickle:
                raise PickleNotAllowedError(
                    f"{where}: state entry {path!r} is pickled; loading it runs code chosen by "
                    "the checkpoint's writer: set allow_pickle=True only for checkpoints you trust"
                )
            return pickle.loads(base64.b64decode(x))
    out = {}
    for k, y in v.items():
        if k.startswith("$"):
            raise CheckpointError(f"{where}: unknown tag {k!r} in the stored state at {path!r}")
        val = _decode(y, f"{path}.{k}" if path else k, tensors, allow_pickle, where)
        if val is not _DROP:
            out[k] = val
    return out


def _merge(a: Any, b: Any) -> Any:
    """Rank skeletons merged key by key (plain objects only); ``a`` (lower rank) wins."""
    if (
        isinstance(a, dict)
        and isinstance(b, dict)
        and not any(k.startswith("$") for k in a)
        and not any(k.startswith("$") for k in b)
    ):
        out = dict(a)
        for k, y in b.items():
            out[k] = _merge(a[k], y) if k in a else y
        return out
    return a


def _substitute(v: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Placeholders (``_Ref``) -> the loaded tensors."""
    if isinstance(v, _Ref):
        return tensors[v.name]
    if isinstance(v, dict):
        return {k: _substitute(x, tensors) for k, x in v.items()}
    if isinstance(v, list):
        return [_substitute(x, tensors) for x in v]
    if isinstance(v, tuple):
        return tuple(_substitute(x, tensors) for x in v)
    return v


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
