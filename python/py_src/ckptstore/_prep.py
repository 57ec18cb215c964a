"""The checks and conversions every writer of the package applies to what a caller hands
it, before the engine gets it: arrays in the form the engine takes without copying, names
and ids checked as UTF-8, paths, ``max_shard_size``, the manifest metadata as JSON, and an
optimizer dict in the native save's form. One internal module serving the root API, the
torch layer and the integrations (none of them reaches into another's private names)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional

import numpy as np

from ._dtypes import wire_dtype
from ._types import F16Scaled
from .errors import CheckpointError, InvalidArgumentError, InvalidTensorError

#: Prefix of the tensors that hold optimizer state (``optim/<param>/<state>``), the
#: engine's own naming convention.
OPTIM_PREFIX = "optim/"

def check_utf8(text: str, what: str, error: type) -> None:
    """Raise ``error`` when ``text`` is not valid UTF-8 (a lone surrogate): names and ids are
    stored as UTF-8, so such text can name nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} {text!r} is not valid UTF-8") from None


def prepare(name: str, value: Any) -> tuple[str, str, np.ndarray]:
    """``(name, wire dtype, array)`` in the form the engine takes without copying: native
    byte order and non-negative whole-element strides (copied only when not so)."""
    if not isinstance(name, str):
        raise InvalidTensorError(f"tensor names must be strings, got {name!r}")
    check_utf8(name, "tensor name", InvalidTensorError)
    try:
        a = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (TypeError, ValueError) as e:
        raise InvalidTensorError(f"tensor {name!r}: not an array: {e}") from e
    wire = wire_dtype(a.dtype)
    if a.dtype.byteorder == (">" if np.little_endian else "<"):
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.c_contiguous and any(
        s < 0 or s % a.itemsize for s in a.strides
    ):
        a = np.ascontiguousarray(a)
    return name, wire, a


StateEntry = tuple[str, str, tuple[str, str, np.ndarray], Optional[tuple[str, str, np.ndarray]]]


def check_shard_size(v: Any) -> None:
    """``max_shard_size``: ``None`` or an integer in ``[1, 2**64)``."""
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"max_shard_size must be an integer, got {v!r}")
    if not 0 < v < 1 << 64:
        raise InvalidArgumentError(f"max_shard_size must be in [1, 2**64), got {v}")


def fspath(path: Any) -> str:
    """``os.fspath(path)``, refused with :class:`InvalidArgumentError` when the operating
    system cannot name it (a lone surrogate that no file system encoding can encode)."""
    p = os.fspath(path)
    try:
        os.fsencode(p)
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"path {p!r} cannot be encoded as a file name") from None
    return p


def check_id(checkpoint_id: Any) -> Any:
    """A checkpoint id that is not UTF-8 (a lone surrogate) is an invalid argument (the
    engine checks the rest: 32 lowercase hex digits)."""
    if isinstance(checkpoint_id, str):
        check_utf8(checkpoint_id, "checkpoint id", InvalidArgumentError)
    return checkpoint_id


def metadata_json(metadata: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The manifest's ``metadata`` as JSON text (``None`` stays ``None``)."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError("metadata must be a dict (a JSON object)")
    try:
        return json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"metadata must be JSON-serializable: {e}") from e


def optimizer_parts(
    optimizer: Mapping[str, Any],
    prepare: Callable[[str, Any], tuple[str, str, np.ndarray]] = prepare,
) -> tuple[str, list[StateEntry]]:
    """The native save's form of an optimizer dict: the groups as JSON (each parameter as
    ``[name, shape]``, hyperparameters apart) and one ``(param, state, values, scale)``
    entry per state (``scale`` is ``None`` for plain states). ``prepare(name, value)``
    turns each state tensor into ``(name, wire dtype, array)``. The engine builds the
    manifest's optimizer section from these and checks every rule of
    format-spec/optimizer.md itself. A dict not of that shape (a group without
    ``params``, a state that is no dict, a NaN hyperparameter...) raises
    :class:`InvalidArgumentError`."""
    if not isinstance(optimizer, Mapping):
        raise InvalidArgumentError("optimizer state must be a dict")
    try:
        return optimizer_parts_unchecked(optimizer, prepare)
    except CheckpointError:
        raise
    except (TypeError, ValueError, LookupError, AttributeError, OverflowError, RecursionError) as e:
        raise InvalidArgumentError(f"optimizer state is malformed: {e!r}") from e


def optimizer_parts_unchecked(
    optimizer: Mapping[str, Any],
    prepare: Callable[[str, Any], tuple[str, str, np.ndarray]],
) -> tuple[str, list[StateEntry]]:
    groups = optimizer.get("param_groups")
    if groups is None:
        raise InvalidArgumentError("optimizer state needs 'param_groups'")
    shapes = optimizer.get("param_shapes") or {}
    state = optimizer.get("state") or {}
    out_groups = []
    entries: list[StateEntry] = []
    for g in groups:
        params = []
        for p in g["params"]:
            if not isinstance(p, str):
                raise InvalidArgumentError(
                    f"parameters are named by strings in ckptstore, got {p!r}"
                )
            pstate = state.get(p) or {}
            if p in shapes:
                shape = [int(d) for d in shapes[p]]
            elif pstate:
                # No recorded shape: the state of highest rank is shaped like the parameter.
                arrs = [v.q if isinstance(v, F16Scaled) else v for v in pstate.values()]
                shape = [int(d) for d in np.shape(max(arrs, key=np.ndim))]
            else:
                raise InvalidArgumentError(
                    f"optimizer state: no shape for parameter {p!r} (it has no state): "
                    "give 'param_shapes'"
                )
            params.append([p, shape])
        out_groups.append(
            {"params": params, "hyper": {k: v for k, v in g.items() if k != "params"}}
        )
    for p, pstate in state.items():
        for sname, v in (pstate or {}).items():
            tname = f"{OPTIM_PREFIX}{p}/{sname}"
            if isinstance(v, F16Scaled):
                entries.append(
                    (p, sname, prepare(tname, v.q), prepare(tname + ".scale", v.scale))
                )
            else:
                entries.append((p, sname, prepare(tname, v), None))
    return json.dumps(out_groups, allow_nan=False), entries
