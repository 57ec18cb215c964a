"""The package's one dtype table, the engine's (``_ckptstore.dtype_table``, built from
``ckptstore::DType``): wire names and numpy dtypes both ways. The torch layer derives its
torch dtypes from it by name (``torch.<numpy name>``); nothing else lists dtypes."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _ckptstore
from .errors import InvalidArgumentError, InvalidTensorError

#: ``(wire name, numpy type string or None for BF16, item size, floating-point)``.
TABLE: list[tuple[str, "str | None", int, bool]] = _ckptstore.dtype_table()
_NP_OF: dict[str, np.dtype] = {w: np.dtype(ts) for w, ts, _, _ in TABLE if ts is not None}
_WIRE_OF: dict[np.dtype, str] = {dt: w for w, dt in _NP_OF.items()}


def type_name(wire: str) -> str:
    """The numpy (and torch) type name of a wire dtype: ``"float32"``, ``"bfloat16"``, ...
    (``KeyError`` for a wire name no array holds)."""
    return "bfloat16" if wire == "BF16" else _NP_OF[wire].name


def wire_dtype(dtype: Any) -> str:
    """The safetensors wire name ("F32", "BF16", "BOOL", ...) of a numpy dtype; raises
    :class:`InvalidTensorError` for dtypes the format does not hold."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16" and dt.itemsize == 2:
        return "BF16"
    native = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
    try:
        return _WIRE_OF[native]
    except KeyError:
        raise InvalidTensorError(
            f"dtype {dt} cannot be stored: use bool, (u)int8-64, float16/32/64 or "
            "ml_dtypes.bfloat16"
        ) from None


def numpy_dtype(wire: str) -> np.dtype:
    """The numpy dtype of a wire dtype (``ml_dtypes.bfloat16`` for BF16); raises
    :class:`InvalidArgumentError` for one numpy cannot hold."""
    if wire == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return _NP_OF[wire]
    except KeyError:
        raise InvalidArgumentError(f"dtype {wire} has no numpy dtype here") from None
