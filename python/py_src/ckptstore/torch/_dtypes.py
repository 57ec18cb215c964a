"""Torch dtypes and tensor <-> array conversion: the wire dtype of each torch dtype and
back (derived from the engine's table, :mod:`ckptstore._dtypes`), and the views and fresh
tensors through which tensor bytes go to and from the engine. ``torch`` is imported on
first use (:func:`_torch`)."""

from __future__ import annotations

import warnings
from typing import Any, Dict

import numpy as np

from .._dtypes import TABLE, type_name
from .._prep import check_utf8 as _check_utf8
from .._prep import prepare as _prepare
from ..errors import InvalidTensorError

_wire_of: Dict[Any, str] = {}
_torch_of: Dict[str, Any] = {}
_no_numpy: set[Any] = set()  # torch dtypes whose tensors torch cannot hand to numpy


def _torch() -> Any:
    import torch  # lazy: ckptstore does not depend on torch

    if not _wire_of:
        # The engine's table (ckptstore._dtypes), each dtype by its name in torch; those
        # this torch lacks (older torch has no uint16/32/64) are left out.
        for wire, _, _, _ in TABLE:
            dt = getattr(torch, type_name(wire), None)
            if isinstance(dt, torch.dtype):
                _wire_of[dt] = wire
                _torch_of[wire] = dt
                try:
                    torch.empty(1, dtype=dt).numpy()
                except TypeError:  # no numpy dtype in this torch: crossed as integers
                    _no_numpy.add(dt)
    return torch


# Same-size integer dtypes through which tensors that torch cannot hand to numpy (BF16, the
# wider unsigned ones in some torch versions) are viewed, by item size.
_CARRIER = {2: "int16", 4: "int32", 8: "int64"}


def _to_numpy(name: str, t: Any) -> tuple[str, str, np.ndarray]:
    """``(name, wire dtype, array)`` over the tensor's own memory (CPU tensors are not
    copied; others are copied to the CPU first)."""
    torch = _torch()
    if isinstance(t, np.ndarray):
        return _prepare(name, t)
    _check_utf8(name, "tensor name", InvalidTensorError)
    if not isinstance(t, torch.Tensor):
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
    if t.dtype in _no_numpy:  # viewed as same-size integers
        t = t.view(getattr(torch, _CARRIER[t.element_size()]))
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
