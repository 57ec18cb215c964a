"""ckptstore: checkpoint storage for ML training, from Python.

The Rust engine writes sharded safetensors checkpoints under a checksummed manifest,
committed atomically and durably, and reads them through read-only memory maps. This
package exposes it to numpy (this module) and to PyTorch (:mod:`ckptstore.torch`).

Quick start::

    import numpy as np, ckptstore

    ckptstore.save("ckpt", {"w": np.ones((4, 4), np.float32), "step": np.int64(10)},
                   metadata={"run": "demo"})
    ck = ckptstore.open("ckpt")
    w = ck["w"]              # read-only, zero-copy view of the mapped file
    ck.verify()              # every CRC32
    ck.metadata              # {"run": "demo"}

Dtypes: bool, uint8/16/32/64, int8/16/32/64, float16/32/64 and bfloat16 (as
``ml_dtypes.bfloat16``). Arrays are read and written little-endian, as on disk.

Optimizer state (format-spec/optimizer.md) travels as a dict shaped like a torch
``state_dict`` but keyed by parameter *names*::

    {
      "param_groups": [{"params": ["w", "b"], "lr": 1e-3, "betas": [0.9, 0.999]}],
      "param_shapes": {"w": (4, 4), "b": (4,)},
      "state": {"w": {"step": array(10.), "exp_avg": array(...), "exp_avg_sq": F16Scaled(...)}},
    }

:func:`save` takes it as ``optimizer=``; :meth:`Checkpoint.load_optimizer` returns it in
fresh writable arrays, converted to the layout the live optimizer wants.

Layouts (``Checkpoint.load_optimizer(layout)``): ``None`` (everything as stored), a target
name applied to every floating-point state shaped like its parameter (never to counters
such as ``step``), or a dict mapping state names (or ``(param, state)`` tuples) to target
names, with ``"*"`` for the default. Targets: ``"as_stored"``, ``"f32"``, ``"bf16"``,
``"f16_scaled"`` (FP16 codes plus an FP32 scale, the stored scale shape kept or ``(1,)``),
``"f16_scaled_scalar"`` (scale shape ``()``), ``"f16_scaled_one"`` (scale shape ``(1,)``).
"""

from __future__ import annotations

import atexit
import json
import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from . import _ckptstore
from ._ckptstore import Checkpoint
from ._dtypes import wire_dtype
from ._prep import OPTIM_PREFIX
from ._prep import check_id as _check_id
from ._prep import check_shard_size as _check_shard_size
from ._prep import fspath as _fspath
from ._prep import metadata_json as _metadata_json
from ._prep import optimizer_parts as _optimizer_parts
from ._prep import prepare as _prepare
from ._types import Chunk, F16Scaled
from .errors import (
    BudgetError,
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    IncompatibleStateError,
    InvalidArgumentError,
    InvalidTensorError,
    MissingPartsError,
    OptimizerStateError,
    PartError,
    PickleNotAllowedError,
    TensorNotFoundError,
    UnsupportedFormatError,
)

__version__: str = _ckptstore.__version__

__all__ = [
    "save",
    "open",
    "Checkpoint",
    "F16Scaled",
    "Chunk",
    "new_checkpoint_id",
    "wait_for_cleanup",
    "write_part",
    "commit",
    "CheckpointManager",
    "wire_dtype",
    "check_optimizer_fit",
    "OPTIM_PREFIX",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "InvalidArgumentError",
    "InvalidTensorError",
    "MissingPartsError",
    "OptimizerStateError",
    "PartError",
    "PickleNotAllowedError",
    "TensorNotFoundError",
    "UnsupportedFormatError",
    "BudgetError",
]

PathLike = Union[str, "os.PathLike[str]"]

def save(
    path: PathLike,
    tensors: Mapping[str, Any],
    *,
    metadata: Optional[Mapping[str, Any]] = None,
    max_shard_size: Optional[int] = None,
    optimizer: Optional[Mapping[str, Any]] = None,
    cleanup: str = "inline",
) -> dict[Any, Any]:
    """Save ``tensors`` (name -> numpy array) as a checkpoint in the directory ``path``,
    atomically replacing any checkpoint there.

    The engine writes shards to temporary files, fsyncs and renames them, then commits
    the manifest the same way: after a crash the directory holds the old checkpoint or the
    new one, never a mix; when ``save`` returns the new one is durable. Readers that have
    the old checkpoint open keep reading it.

    Arrays of any supported dtype (0-dim included) are read in place, without a copy:
    non-contiguous arrays are gathered by the writer through their strides (a copy is made
    first only for negative or non-element strides and for non-native byte order).
    Anything else is converted with ``np.asarray``. Do not modify the arrays from another
    thread while ``save`` runs (the interpreter is released during the write).

    ``metadata``: a JSON-serializable dict stored in the manifest (``Checkpoint.metadata``).
    ``max_shard_size``: most bytes of tensor data per shard file (default 4 GiB).
    ``optimizer``: optimizer state in the dict form described in the module docs; its
    tensors are stored as ``optim/<param>/<state>``.
    ``cleanup``: when the previous checkpoint's files are removed, once the new one is
    committed. ``"inline"`` (default): before ``save`` returns. ``"background"``: on a
    background thread that holds the directory's writer lock until it is done, so that
    ``save`` returns at the commit point (removing a 1 GiB checkpoint's files took about
    0.9 s on ext4 here); the next save into the directory waits for it, and
    :func:`wait_for_cleanup` (also run at interpreter exit) waits for all. Local
    directories only: S3 saves remove inline.

    Returns ``{"checkpoint_id", "shards", "tensors", "data_bytes", "removed"}`` (with
    ``"background"``, ``removed`` counts only leftovers removed before writing). Raises
    :class:`CheckpointError` subclasses (``InvalidTensorError``, ``InvalidArgumentError``,
    ``OptimizerStateError``, ``CheckpointIOError``) before anything is committed.
    """
    if not isinstance(tensors, Mapping):
        raise InvalidArgumentError("tensors must be a mapping of name -> array")
    entries = [_prepare(n, v) for n, v in tensors.items()]
    opt = None if optimizer is None else _optimizer_parts(optimizer)
    meta = _metadata_json(metadata)
    _check_shard_size(max_shard_size)
    return _ckptstore.save(_fspath(path), entries, meta, max_shard_size, opt, cleanup)


def wait_for_cleanup() -> int:
    """Wait until every background cleanup this process started (``save(...,
    cleanup="background")``, the default of :func:`ckptstore.torch.save`) has removed its
    files; returns how many it removed. Registered with :mod:`atexit`, so a program that
    ends right after a save leaves no previous checkpoint's files behind."""
    return _ckptstore.wait_for_cleanup()


atexit.register(wait_for_cleanup)


def check_optimizer_fit(
    live_groups: Sequence[Sequence[tuple[str, Sequence[int]]]],
    saved_groups: Sequence[Sequence[tuple[str, Optional[Sequence[int]]]]],
    *,
    live_class: Optional[str] = None,
    saved_class: Optional[str] = None,
    allow_optimizer_change: bool = False,
) -> None:
    """Raise :class:`IncompatibleStateError` unless a checkpoint's optimizer state fits a
    live optimizer, by the one rule of format-spec/optimizer.md §Compatibility (the Rust
    engine's ``optim::check_compatible``, which ``OptimizerState::restore_from``,
    :func:`ckptstore.torch.load`, :func:`ckptstore.torch.distributed.load` and the torch
    :class:`~ckptstore.torch.CheckpointManager` apply too):

    * F1: the optimizer class is the same when both are known (``None``: unknown), unless
      ``allow_optimizer_change`` (a deliberate change of optimizer);
    * F2: the same number of parameter groups, matched by position;
    * F3: neither side names a parameter twice;
    * F4: group ``i`` of both sides names the same parameters, by name, **in any order**;
    * F5: every parameter has the same shape on both sides.

    Each ``*_groups`` is a sequence of groups, each a sequence of ``(name, shape)``
    pairs. The error's ``group`` (position, or ``None``) and ``param`` (``""`` when none)
    attributes say where it failed; its message says what each side has."""
    _ckptstore.check_optimizer_fit(
        live_groups,
        saved_groups,
        live_class=live_class,
        saved_class=saved_class,
        allow_optimizer_change=allow_optimizer_change,
    )


def new_checkpoint_id() -> str:
    """A fresh checkpoint id (32 hex digits) for a multi-rank save: drawn once (by the
    coordinator) and handed to every rank (e.g. with ``torch.distributed.broadcast_object_list``)."""
    return _ckptstore.new_checkpoint_id()


def write_part(
    path: PathLike,
    checkpoint_id: str,
    rank: int,
    tensors: Mapping[str, Any],
    *,
    max_shard_size: Optional[int] = None,
) -> bytes:
    """Write this rank's part of the multi-rank checkpoint ``checkpoint_id`` into the
    directory ``path`` (format-spec/global.md): its own shard files (temporary file,
    fsync, rename) and its part descriptor ``part-<id>-r<rank>.json``. Returns the part
    descriptor, to hand to the coordinator's :func:`commit` (with a collective such as
    ``torch.distributed.gather_object``), or leave for the file rendezvous.

    ``tensors`` maps a name to an array (a whole tensor, which exactly one rank offers),
    a :class:`Chunk` (a piece of the global tensor of that name), or a list of Chunks
    (several pieces of it). Arrays are read in place, as in :func:`save`. Nothing is
    committed until :func:`commit`; raises before writing anything for invalid input.
    """
    if not isinstance(tensors, Mapping):
        raise InvalidArgumentError("tensors must be a mapping of name -> array or Chunk")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < 1 << 32:
        raise InvalidArgumentError(f"rank must be an integer in [0, 2**32), got {rank!r}")
    items: list[tuple[str, str, np.ndarray, Optional[tuple[list[int], list[int]]]]] = []
    for name, value in tensors.items():
        pieces = value if isinstance(value, (list, tuple)) else [value]
        for v in pieces:
            if isinstance(v, Chunk):
                if any(not 0 <= d < 1 << 64 for d in (*v.global_shape, *v.offsets)):
                    raise InvalidTensorError(
                        f"tensor {name!r}: chunk offsets {list(v.offsets)} and global shape "
                        f"{list(v.global_shape)} must be integers in [0, 2**64)"
                    )
                n, wire, a = _prepare(name, v.array)
                items.append((n, wire, a, (list(v.global_shape), list(v.offsets))))
            elif isinstance(value, (list, tuple)):
                raise InvalidArgumentError(
                    f"tensor {name!r}: a list holds Chunks only, got {type(v).__name__}"
                )
            else:
                n, wire, a = _prepare(name, v)
                items.append((n, wire, a, None))
    _check_shard_size(max_shard_size)
    return _ckptstore.write_part(
        _fspath(path), _check_id(checkpoint_id), int(rank), items, max_shard_size
    )


def commit(
    path: PathLike,
    checkpoint_id: str,
    parts: Optional[Sequence[bytes]] = None,
    world_size: Optional[int] = None,
    timeout: Optional[float] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    optimizer: Optional[Mapping[str, Any]] = None,
    layout: str = "auto",
) -> dict[Any, Any]:
    """Commit the multi-rank checkpoint ``checkpoint_id`` in ``path``: check every part
    and shard together (every global tensor tiled exactly once, the same dtype and global
    shape from every rank, replicated chunks byte-identical), then write the manifest last
    (fsynced, renamed, directory fsynced): the only commit point. Until it returns, the
    previous checkpoint in ``path`` stays the committed one.

    ``parts``: the descriptors :func:`write_part` returned on every rank. Without
    ``parts``, the file rendezvous: wait up to ``timeout`` seconds (default 300) for the
    part files of ``world_size`` ranks; the error names the ranks still missing. With both,
    the parts' ranks must be exactly ``0..world_size``. ``metadata``: a JSON-serializable
    dict stored in the manifest. ``optimizer``: the manifest's optimizer section
    (format-spec/optimizer.md: ``{"groups": [...], "params": [...]}``), whose states may
    name global tensors the ranks wrote as chunks (sharded optimizer state); the engine
    checks every rule before committing.

    ``layout``: the manifest's shape (format-spec/global.md §The two-level manifest).
    ``"flat"``: one manifest listing every chunk (feature ``global``), which every reader
    decodes whole; right for tens of ranks. ``"two_level"``: a root manifest naming the
    ranks' part descriptors, which keep the chunk entries and stay in the directory
    (features ``global`` and ``parts``); a reader decodes the root and loads each part on
    first use. A job whose parts hold only whole tensors (no chunks) commits flat.
    ``"auto"`` (default): two-level from 100,000 chunks over all parts, flat below.
    Anything else raises :class:`InvalidArgumentError` (a :class:`ValueError`).
    """
    if not isinstance(layout, str) or layout not in ("auto", "flat", "two_level"):
        raise InvalidArgumentError(
            f'layout must be "auto", "flat" or "two_level", got {layout!r}'
        )
    meta = _metadata_json(metadata)
    plist = None if parts is None else [bytes(p) for p in parts]
    if plist is None and world_size is None:
        raise InvalidArgumentError("commit needs parts, or world_size for the file rendezvous")
    section = None
    if optimizer is not None:
        try:
            section = json.dumps(dict(optimizer), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"optimizer section must be JSON: {e}") from e
    return _ckptstore.commit(
        _fspath(path),
        _check_id(checkpoint_id),
        plist,
        world_size,
        timeout,
        meta,
        section,
        layout,
    )


def open(path: PathLike, *, lazy: bool = False) -> Checkpoint:  # noqa: A001 - the reader entry point
    """Open a checkpoint: a ckptstore directory, a ``.safetensors`` file, a directory
    holding ``model.safetensors``, a Hugging Face sharded directory
    (``model.safetensors.index.json``), or an ``s3://bucket/prefix`` URL.

    Validates the structure (manifest CRC, every byte range, shard sizes and header
    CRCs) and maps the shards read-only; reads no tensor data. An object-store checkpoint
    is downloaded at open (every tensor CRC-checked as it lands), or, with ``lazy=True``,
    only its manifest and shard headers are fetched and every read fetches the byte ranges
    it needs (``ck[name]``, ``read``, ``read_region``, ``read_into``, ``verify``, CRC-checked
    into fresh arrays; for checkpoints larger than memory and for reading a few tensors).
    Local checkpoints are memory-mapped either way. Raises
    :class:`CheckpointNotFoundError` when there is nothing to open and
    :class:`CorruptCheckpointError` / :class:`ChecksumError` for damage.
    """
    return Checkpoint(_fspath(path), lazy=bool(lazy))


def _check_count(name: str, v: Optional[int]) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v < 1 << 64:
        raise InvalidArgumentError(f"{name} must be an integer in [1, 2**64) or None, got {v!r}")
    return int(v)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InvalidArgumentError(f"a step is an integer >= 0, got {step!r}")
    if step >= 1 << 64:
        raise InvalidArgumentError(f"step {step} is too large (at most 2**64 - 1)")
    return int(step)


class CheckpointManager:
    """The steps of a training run under one root, a directory or an ``s3://`` prefix:
    ``ROOT/step-<step>/`` holds one normal checkpoint per step (the engine's manager,
    format-spec/durability.md and s3.md §Manager; ``ckpt ls`` and ``ckpt gc`` read the same
    layout).

    A step counts once its manifest is committed: in a directory an interrupted save
    leaves a ``.tmp-step-`` directory that :meth:`steps` ignores and the next save removes.
    On an object store there are no locks: leases only check that the step is committed
    (readers download it whole), and :meth:`gc` sees only this process's saves in flight,
    so run one writer per root.
    ``keep_last``: retention keeps the newest ``keep_last`` committed steps (``None``:
    every step); ``keep_every``: it also keeps every step that is a multiple of it.
    Retention runs after each save and never deletes a step that a reader holds through
    :meth:`lease` (or the engine's own readers, in any process).

    ::

        mgr = ckptstore.CheckpointManager("run", keep_last=2)
        mgr.save(100, {"w": w}, optimizer=opt_state)      # blocking, durable, then gc
        with mgr.lease(mgr.latest()) as lease:            # gc keeps the step meanwhile
            ck = ckptstore.open(lease.path)

    :class:`ckptstore.torch.CheckpointManager` adds PyTorch models and background saves.
    """

    def __init__(
        self,
        root: PathLike,
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
    ) -> None:
        self._native = _ckptstore.CheckpointManager(
            _fspath(root),
            _check_count("keep_last", keep_last),
            _check_count("keep_every", keep_every),
        )

    @property
    def root(self) -> "os.PathLike[str] | str":
        """The root: a ``pathlib.Path``, or the URL (``str``) of an object-store root."""
        return self._native.root

    def step_dir(self, step: int) -> "os.PathLike[str] | str":
        """Where ``step`` lives (whether or not it exists): its directory, or its URL."""
        return self._native.step_dir(_check_step(step))

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return self._native.steps()

    def latest(self) -> Optional[int]:
        """The newest committed step, or ``None``."""
        return self._native.latest()

    def list(self) -> list[dict[Any, Any]]:
        """Every step directory, committed or not, and leftovers of interrupted saves:
        ``{"step", "path", "committed", "bytes"}`` each, by step (as ``ckpt ls``)."""
        return self._native.list()

    def gc(self) -> dict[Any, Any]:
        """Apply retention now: ``{"deleted": [steps], "in_use": [steps a reader holds,
        kept for now], "interrupted_removed": n, "swept": n}`` (``swept``: files removed
        from kept steps that their manifest does not name)."""
        return self._native.gc()

    def lease(self, step: int) -> Any:
        """Hold committed ``step`` against retention until released: a context manager
        with ``step``, ``path``, ``held`` and ``release()``. Raises
        :class:`CheckpointNotFoundError` if the step is not committed."""
        return self._native.lease(_check_step(step))

    def save(
        self,
        step: int,
        tensors: Mapping[str, Any],
        *,
        metadata: Optional[Mapping[str, Any]] = None,
        max_shard_size: Optional[int] = None,
        optimizer: Optional[Mapping[str, Any]] = None,
    ) -> dict[Any, Any]:
        """Save ``tensors`` (and ``optimizer``) as step ``step``, as :func:`save` does, and
        return once it is committed and durable and retention has run. Saving a committed
        step replaces it atomically. The arrays are read in place: keep them unchanged
        until this returns."""
        step = _check_step(step)
        if not isinstance(tensors, Mapping):
            raise InvalidArgumentError("tensors must be a mapping of name -> array")
        entries = [_prepare(n, v) for n, v in tensors.items()]
        opt = None if optimizer is None else _optimizer_parts(optimizer)
        _check_shard_size(max_shard_size)
        return self._native.save(step, entries, _metadata_json(metadata), max_shard_size, opt)

    def __repr__(self) -> str:
        return f"ckptstore.CheckpointManager({str(self.root)!r})"
