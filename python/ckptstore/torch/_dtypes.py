"""Dtype tables and tensor <-> array conversion: the wire dtype of each torch dtype (and
back), and the views and fresh tensors through which tensor bytes go to and from the
engine. ``torch`` is imported on first use (:func:`_torch`)."""

from __future__ import annotations

import warnings
from typing import Any, Dict

import numpy as np

from ..errors import InvalidTensorError

_wire_of: Dict[Any, str] = {}
_torch_of: Dict[str, Any] = {}


def _torch():
    import torch  # lazy: ckptstore does not depend on torch

    if not _wire_of:
        pairs = [
            (torch.bool, "BOOL"),
            (torch.uint8, "U8"),
            (torch.int8, "I8"),
            (torch.int16, "I16"),
            (torch.float16, "F16"),
            (torch.bfloat16, "BF16"),
            (torch.int32, "I32"),
            (torch.float32, "F32"),
            (torch.int64, "I64"),
            (torch.float64, "F64"),
        ]
        for name, wire in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
            if hasattr(torch, name):
                pairs.append((getattr(torch, name), wire))
        for dt, wire in pairs:
            _wire_of[dt] = wire
            _torch_of[wire] = dt
    return torch


# Same-size integer dtypes through which tensors without a numpy dtype are viewed.
_CARRIER = {"BF16": "int16", "U16": "int16", "U32": "int32", "U64": "int64"}


def _to_numpy(name: str, t: Any) -> tuple[str, str, np.ndarray]:
    """``(name, wire dtype, array)`` over the tensor's own memory (CPU tensors are not
    copied; others are copied to the CPU first)."""
    torch = _torch()
    if isinstance(t, np.ndarray):
        from .. import _prepare

        return _prepare(name, t)
    from .. import _check_utf8

    _check_utf8(name, "tensor name", InvalidTensorError)
    if not isinstance(t, torch.Tensor):
        from .. import _prepare

        return _prepare(name, np.asarray(t))
    t = t.detach()
    if t.device.type == "meta":
        raise InvalidTensorError(f"tensor {name!r} is on the meta device: it holds no data to store")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.layout != torch.strided:
        raise InvalidTensorError(f"tensor {name!r}: only dense (strided) tensors can be stored")
    wire = _wire_of.get(t.dtype)
    if wire is None:
        raise InvalidTensorError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
    if wire in _CARRIER:
        t = t.view(getattr(torch, _CARRIER[wire]))
    return name, wire, t.numpy()


def _from_array(a: np.ndarray) -> Any:
    """A torch tensor over a numpy array's memory (writable arrays only, no copy)."""
    torch = _torch()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_raw(raw: np.ndarray, wire: str, shape: tuple[int, ...]) -> Any:
    """A torch tensor of ``wire`` dtype and ``shape`` over a read-only uint8 array of its
    bytes (no copy; only ever read, as the source of ``copy_`` or ``clone``)."""
    torch = _torch()
    with warnings.catch_warnings():
        # torch warns that the array is not writable: it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(raw)
    return t.view(_torch_of[wire]).reshape(shape)


def _empty_for(info: dict, device: Any = None) -> Any:
    """A fresh tensor for the stored tensor ``info`` (its dtype and shape), on ``device``
    (default: the CPU)."""
    torch = _torch()
    dt = _torch_of.get(info["dtype"])
    if dt is None:
        raise InvalidTensorError(f"dtype {info['dtype']} has no torch dtype here")
    return torch.empty(tuple(info["shape"]), dtype=dt, device=device)


def _bytes_of(t: Any) -> np.ndarray:
    """A writable 1-D ``uint8`` numpy view of a contiguous CPU tensor's memory."""
    torch = _torch()
    return t.reshape(-1).view(torch.uint8).numpy()
