"""Exceptions raised by ckptstore.

Every error of the Rust engine arrives as a subclass of :class:`CheckpointError` whose
message is the engine's (it names the file, shard, tensor, parameter or state at fault).
Some classes also derive from the matching built-in exception, so that ordinary handlers
keep working: a missing tensor is a ``KeyError``, a missing checkpoint a
``FileNotFoundError``, an I/O failure an ``OSError``, a bad argument a ``ValueError``.

Attributes set when known: ``file``, ``shard``, ``name`` (tensor), ``param``, ``state``,
``group`` (an optimizer parameter group's position),
``expected``/``got`` (CRC32 values of a :class:`ChecksumError`), ``op``, ``filename``,
``errno``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointIOError",
    "CorruptCheckpointError",
    "ChecksumError",
    "UnsupportedFormatError",
    "TensorNotFoundError",
    "InvalidTensorError",
    "OptimizerStateError",
    "IncompatibleStateError",
    "InvalidArgumentError",
    "PartError",
    "MissingPartsError",
    "PickleNotAllowedError",
    "BudgetError",
]


class CheckpointError(Exception):
    """Base class of every ckptstore error; ``str(e)`` is the engine's message."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (manifest, safetensors file or Hugging Face index) at the path."""

    def __init__(self, message: str = "") -> None:
        CheckpointError.__init__(self, message)


class CheckpointIOError(CheckpointError, OSError):
    """An operating-system call failed (open, read, fsync, rename, lock, ...)."""

    def __init__(self, message: str = "") -> None:
        CheckpointError.__init__(self, message)


class CorruptCheckpointError(CheckpointError):
    """A manifest, shard header or shard file is damaged or inconsistent."""


class ChecksumError(CorruptCheckpointError):
    """Stored bytes do not match their CRC32 (a tensor, a shard header or the manifest)."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint needs a newer ckptstore (format version or feature)."""


class TensorNotFoundError(CheckpointError, KeyError):
    """No tensor of that name in the checkpoint."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class InvalidTensorError(CheckpointError, ValueError):
    """A tensor handed to the writer (or asked of a view) is inconsistent."""


class OptimizerStateError(CheckpointError):
    """The optimizer section or state is inconsistent, or a conversion cannot be done."""


class IncompatibleStateError(OptimizerStateError):
    """A checkpoint's optimizer state does not fit the live optimizer or model; nothing
    was changed. From the optimizer compatibility rule
    (:func:`ckptstore.check_optimizer_fit`): ``group`` (the group's position, or ``None``)
    and ``param`` (the parameter, ``""`` when none) say where."""

    group: "int | None" = None
    param: str = ""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument is invalid (metadata not an object, a size of zero, a bad layout...)."""


class PartError(CheckpointError):
    """A multi-rank save's parts are invalid or disagree (two ranks offering one whole
    tensor, a global tensor with different dtypes or shapes, replicas whose bytes differ,
    overlapping chunks, a part of another checkpoint id); nothing was committed. Has
    ``name`` and ``ranks`` where two ranks disagree."""


class MissingPartsError(PartError, TimeoutError):
    """Ranks of a multi-rank save wrote no part (``missing``: their ranks), so nothing was
    committed and the previous checkpoint stays."""


class PickleNotAllowedError(InvalidArgumentError):
    """A value that only pickle can store (or a stored pickled value) met without the
    caller's ``allow_pickle=True`` opt-in; nothing was saved or loaded. The one class for
    every module (``ckptstore.torch``, the tree codec and each integration re-export it)."""


class BudgetError(CheckpointError):
    """A tiered save does not fit the local tier's byte budget (the tiered
    ``CheckpointManager``'s ``local_budget``): raised on every rank alike, before anything
    of the step is kept; the steps saved before stay as they were. The numbers, per host,
    also as attributes: ``budget``, ``host`` (the host that does not fit), ``needed`` (the
    bytes it would hold), ``snapshot`` (its ranks' snapshot buffers), ``own`` and
    ``replicas`` (one step's files of its own ranks and those it keeps for other hosts),
    ``record`` (the step's record and directories), ``kept`` (the bytes of the steps that
    must stay: the newest complete one, those a persist still reads), ``keep_last``, and
    ``fits_keep_last`` (the largest ``keep_last`` that fits, ``None`` when none does)."""

    budget: int = 0
    host: int = 0
    needed: int = 0
    snapshot: int = 0
    own: int = 0
    replicas: int = 0
    record: int = 0
    kept: int = 0
    keep_last: int = 0
    fits_keep_last: "int | None" = None
