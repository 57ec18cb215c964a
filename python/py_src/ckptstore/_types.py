"""Value types shared by the numpy API and the torch helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["F16Scaled", "Chunk"]


@dataclass(frozen=True, eq=False)
class F16Scaled:
    """An optimizer state held as FP16 codes with one FP32 scale (TransformerEngine
    FusedAdam arithmetic): value = ``float32(q) * scale``.

    ``q`` is a float16 array shaped like the state; ``scale`` a float32 array of shape
    ``()`` or ``(1,)``. Returned by :meth:`Checkpoint.load_optimizer` for states loaded as
    ``"f16_scaled"``; accepted by :func:`ckptstore.save` in an optimizer state, where it is
    stored exactly (codes plus scale).
    """

    q: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The state's shape (that of ``q``)."""
        return tuple(self.q.shape)

    def to_float32(self) -> np.ndarray:
        """The values as a fresh float32 array (``float32(q) * scale``), computed by the
        engine (``ckptstore::convert::f16_scaled_to_f32``)."""
        from . import _ckptstore

        q = np.require(self.q, dtype=np.float16, requirements="C")  # 0-dim stays 0-dim
        out = np.empty(q.shape, dtype=np.float32)
        _ckptstore.f16_scaled_to_f32(q, np.require(self.scale, dtype=np.float32, requirements="C"), out.reshape(-1))
        return out

    def __repr__(self) -> str:
        return (
            f"F16Scaled(q=<float16 {tuple(self.q.shape)}>, "
            f"scale={np.asarray(self.scale).tolist()!r} {tuple(np.shape(self.scale))})"
        )


@dataclass(frozen=True, eq=False)
class Chunk:
    """A piece of a global tensor held by one rank, for :func:`ckptstore.write_part`:
    ``array`` holds the elements of the box that starts at ``offsets`` of a global tensor
    of shape ``global_shape`` (the box's shape is ``array.shape``)."""

    array: Any
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(d) for d in self.offsets))

    def __repr__(self) -> str:
        # Never raises, whatever `array` is (a ragged list has no shape).
        try:
            shape = repr(tuple(np.shape(self.array)))
        except (ValueError, TypeError):
            shape = f"<{type(self.array).__name__} without a shape>"
        return (
            f"Chunk(shape={shape}, offsets={self.offsets}, "
            f"global_shape={self.global_shape})"
        )
