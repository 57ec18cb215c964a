"""The values :mod:`ckptstore.torch` stores beside the tensors (optimizer hyperparameters,
non-tensor optimizer state, ``extra`` values, DCP planner data), in the package's one value
codec (:mod:`ckptstore._codec`, format-spec/values.md): never pickled; a tensor among them
inline (at most ``INLINE_MAX`` elements)."""

from __future__ import annotations

from typing import Any

from .._codec import INLINE_MAX, Decoder, Encoder

_HINT = (
    "ckptstore.torch never pickles: store JSON values, tuples, sets, bytes, numpy scalars, "
    f"torch dtypes, devices and sizes, and tensors of at most {INLINE_MAX} elements here "
    "(tensors in extra= at its top level are stored as tensors)"
)


def _encode(v: Any, where: str) -> Any:
    """``v`` as JSON (``where`` names it in errors). Raises
    :class:`~ckptstore.errors.PickleNotAllowedError` (an ``InvalidArgumentError``) for a
    value the codec stores only pickled."""
    return Encoder(hint=_HINT).encode(v, where)


def _decode(v: Any, where: str = "the checkpoint") -> Any:
    """The value :func:`_encode` stored (and the older inline-tensor form); ``where``
    names it in errors."""
    return Decoder(where=where).decode(v)
