"""A checkpoint manager for PyTorch training loops: one checkpoint per step under a root
(a directory or an ``s3://`` prefix), retention, restore of the latest step, and saves that
overlap with training.

::

    from ckptstore.torch import CheckpointManager

    with CheckpointManager("run/ckpts", keep_last=3, keep_every=1000) as mgr:
        start = mgr.restore_latest(model, optimizer)      # the step, or None
        for step in range(0 if start is None else start + 1, steps):
            train_step(model, optimizer)
            if step % 100 == 0:
                mgr.save(step, model, optimizer, extra={"rng": torch.get_rng_state()})
    # leaving the block waits for the saves in flight and raises their errors

Each step is a normal ckptstore checkpoint in ``ROOT/step-<step>/`` with the content of
:func:`ckptstore.torch.save`; the steps are managed by the Rust engine's manager, so
``ckpt ls ROOT`` and ``ckpt gc ROOT`` see the same steps, retention and leases.

A non-blocking ``save`` copies every tensor it stores (model state dict, optimizer state,
``extra`` tensors) into snapshot buffers before it returns, so the next
``optimizer.step()`` may change the live tensors at once; a background thread writes and
commits the snapshot with the interpreter released. The buffers are kept and reused by the
next save (the second save of the same model allocates nothing); ``max_in_flight`` bounds
the saves in flight and so the number of buffer sets (each as large as the state saved).
Saves commit in the order they were made.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Literal, Mapping, Optional, Tuple

import numpy as np

from .. import CheckpointManager as _StepStore
from .. import _faults
from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ._dtypes import _to_numpy
from ._items import _build_items
from ._saveload import load as _load
from ._saver import AsyncSaver, Handle, check_max_in_flight

__all__ = ["CheckpointManager", "SaveHandle"]


# ---- what a step stores: exactly what ckptstore.torch.save stores -------------------------


def _build(
    model: Any,
    optimizer: Any,
    extra: Optional[Mapping[str, Any]],
    prepare: Callable[[str, Any], Tuple[str, str, np.ndarray]],
) -> Tuple[List[Tuple[str, str, np.ndarray]], str, Any]:
    """What :func:`ckptstore.torch.save` stores (so that :func:`ckptstore.torch.load`
    restores it), with ``prepare`` over the live tensors or over snapshot buffers."""
    return _build_items(model, optimizer, extra, prepare)


class SaveHandle(Handle):
    """A save started by :meth:`CheckpointManager.save`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step}")
        self._step = step

    @property
    def step(self) -> int:
        """The step being saved."""
        return self._step

    def wait(self, timeout: Optional[float] = None) -> dict[Any, Any]:
        """Wait until the step is committed and durable (and retention applied); return
        the commit info (``checkpoint_id``, ``shards``, ``tensors``, ``data_bytes``,
        ``removed``). Raises the save's error (a :class:`ckptstore.CheckpointError`), or
        ``TimeoutError`` if ``timeout`` seconds pass first."""
        info: dict[Any, Any] = super().wait(timeout)
        return info

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle(step={self._step}, {state})"


class CheckpointManager:
    """Steps of a PyTorch training run under ``root`` (see the module docs).

    ``keep_last``: retention keeps the newest ``keep_last`` committed steps (``None``:
    every step); ``keep_every``: it also keeps every step that is a multiple of it.
    Retention runs after each durable save and never deletes a step a reader holds (a
    :meth:`restore` in progress, a :meth:`lease`, a Rust reader, another process).
    ``max_in_flight``: most background saves in flight; :meth:`save` blocks while that many
    are. ``max_shard_size``: most bytes of tensor data per shard file.

    A context manager: leaving the ``with`` block waits for every save in flight and
    raises the first error no one has seen yet (see :meth:`close`).
    """

    def __init__(
        self,
        root: "str | os.PathLike[str]",
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        max_in_flight: int = 1,
        *,
        max_shard_size: Optional[int] = None,
    ) -> None:
        check_max_in_flight(max_in_flight)
        if max_shard_size is not None and max_shard_size <= 0:
            raise InvalidArgumentError("max_shard_size must be positive")
        self._store = _StepStore(root, keep_last=keep_last, keep_every=keep_every)
        self._max_shard_size = max_shard_size
        self._saver = AsyncSaver(
            max_in_flight, name="ckptstore-manager-save", what="the checkpoint manager"
        )
        #: Test seam: called with the step in the background thread, after the snapshot
        #: and before the write (tests hold a save there while they change the model).
        self._before_write: Optional[Callable[[int], None]] = None
        _faults.arm()  # the test seam (ckptstore._faults): a malformed spec raises here

    # ---- the steps ---------------------------------------------------------------------

    @property
    def root(self) -> "os.PathLike[str] | str":
        """The root: a ``pathlib.Path``, or the URL (``str``) of an ``s3://`` root."""
        return self._store.root

    @property
    def max_in_flight(self) -> int:
        """The most background saves in flight (and buffer sets held)."""
        return self._saver.max_in_flight

    def steps(self) -> List[int]:
        """The committed steps, ascending (saves in flight are not among them)."""
        return self._store.steps()

    def latest(self) -> Optional[int]:
        """The newest committed step, or ``None`` under an empty root."""
        return self._store.latest()

    def list(self) -> List[dict[Any, Any]]:
        """Every step directory, committed or not, and leftovers of interrupted saves
        (``{"step", "path", "committed", "bytes"}`` each, by step), as ``ckpt ls``."""
        return self._store.list()

    def step_dir(self, step: int) -> "os.PathLike[str] | str":
        """Where ``step`` lives, its directory or URL (a normal checkpoint once committed)."""
        return self._store.step_dir(step)

    def lease(self, step: int) -> Any:
        """Hold committed ``step`` against retention (a context manager with ``path``):
        open it with :func:`ckptstore.open` or :func:`ckptstore.torch.load` while held.
        Raises :class:`ckptstore.CheckpointNotFoundError` if the step is not committed."""
        return self._store.lease(step)

    def gc(self) -> dict[Any, Any]:
        """Apply retention now (it also runs after every save); see
        :meth:`ckptstore.CheckpointManager.gc`."""
        return self._store.gc()

    # ---- saving ------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: Any = None,
        optimizer: Any = None,
        extra: Optional[Mapping[str, Any]] = None,
        blocking: bool = False,
    ) -> SaveHandle:
        """Save ``model``, ``optimizer`` and ``extra`` (as :func:`ckptstore.torch.save`
        does) as step ``step``; apply retention once it is durable.

        Non-blocking (the default): blocks while ``max_in_flight`` saves are in flight,
        then copies every tensor into the snapshot buffers and returns; the live tensors
        may change as soon as it returns. The write and commit run in a background thread;
        the returned handle's :meth:`SaveHandle.wait` gives the outcome.

        ``blocking=True``: waits for the saves in flight, then writes from the live
        tensors (no copy) and returns a finished handle once the step is durable; raises
        the save's error directly.

        An error of an earlier background save that no one has seen yet (through its
        handle, :meth:`wait` or :meth:`close`) is raised here, before anything starts
        (with ``max_in_flight=1`` that includes the save just before this one).
        Saving a step that is already committed replaces it atomically.
        """
        step = _check_step(step)
        self._saver.check_open()
        if blocking:
            self.wait()
            entries, metadata, optim = _build(model, optimizer, extra, _to_numpy)
            info = self._store._native.save(step, entries, metadata, self._max_shard_size, optim)
            h = SaveHandle(step)
            h._finish(info, None)
            return h

        def build(copy: Callable[[str, Any], Tuple[str, str, np.ndarray]]) -> tuple[Any, ...]:
            if _faults.armed("manager.snapshot"):  # the test seam, per tensor copied
                def copy_then_hit(name: str, src: Any, copy: Callable[[str, Any], Any] = copy) -> Any:
                    out = copy(name, src)
                    _faults.fault_point("manager.snapshot")
                    return out

                return _build(model, optimizer, extra, copy_then_hit)
            return _build(model, optimizer, extra, copy)

        def write(items: tuple[Any, ...]) -> dict[Any, Any]:
            entries, metadata, optim = items
            hook = self._before_write
            if hook is not None:
                hook(step)
            _faults.fault_point("manager.write")
            return self._store._native.save(step, entries, metadata, self._max_shard_size, optim)

        return self._saver.save(SaveHandle(step), build, write)  # type: ignore[return-value]

    def in_flight(self) -> List[SaveHandle]:
        """The handles of the background saves not finished yet, oldest first."""
        return self._saver.in_flight()  # type: ignore[return-value]

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error no one has seen yet."""
        self._saver.wait()

    def close(self) -> None:
        """Wait for every save in flight, free the snapshot buffers, and raise the first
        background error no one has seen yet. Saving is refused afterwards; the reading
        methods keep working."""
        self._saver.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc is None:
            self.close()
            return False
        # The block failed: its exception goes on; the saves still finish, and their
        # errors are attached to it rather than raised in its place.
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001
            if hasattr(exc, "add_note"):
                exc.add_note(f"ckptstore: a background save failed as well: {e!r}")
        return False

    @property
    def snapshot_nbytes(self) -> int:
        """Bytes held by snapshot buffers that no save is using now (kept for reuse)."""
        return self._saver.snapshot_bytes

    # ---- restoring ---------------------------------------------------------------------

    def restore(
        self,
        step: int,
        model: Any = None,
        optimizer: Any = None,
        *,
        strict: bool = True,
        layout: Any = None,
        allow_optimizer_change: bool = False,
    ) -> dict[Any, Any]:
        """Restore ``model`` and ``optimizer`` in place from committed ``step``, holding
        the step against retention meanwhile; return its ``extra`` dict. The guarantees
        and arguments are those of :func:`ckptstore.torch.load`: everything is checked
        (names, shapes, the optimizer class unless ``allow_optimizer_change``, every CRC)
        before anything changes, and the optimizer state is replaced whole. Raises
        :class:`ckptstore.CheckpointNotFoundError` if the step is not committed."""
        step = _check_step(step)
        with self._store.lease(step) as lease:
            _faults.fault_point("manager.restore")
            return _load(
                lease.path,
                model,
                optimizer,
                strict=strict,
                layout=layout,
                allow_optimizer_change=allow_optimizer_change,
            )

    def restore_latest(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        strict: bool = True,
        layout: Any = None,
        return_extra: bool = False,
        allow_optimizer_change: bool = False,
    ) -> Any:
        """Restore ``model`` and ``optimizer`` from the newest committed step (as
        :meth:`restore`); return the step, or ``None`` (nothing changed) under an empty
        root. ``return_extra=True``: return ``(step, extra)`` (``(None, {})`` when
        empty). A step deleted by another process between choosing and holding it is
        skipped for the next newest."""
        for _ in range(16):
            step = self.latest()
            if step is None:
                return (None, {}) if return_extra else None
            try:
                lease = self._store.lease(step)
            except CheckpointNotFoundError:
                continue  # deleted meanwhile: look again
            with lease:
                _faults.fault_point("manager.restore")
                extra = _load(
                    lease.path,
                    model,
                    optimizer,
                    strict=strict,
                    layout=layout,
                    allow_optimizer_change=allow_optimizer_change,
                )
            return (step, extra) if return_extra else step
        raise CheckpointNotFoundError(
            f"{self.root}: the latest step kept disappearing while it was being restored"
        )

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.root)!r}, max_in_flight={self.max_in_flight})"


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InvalidArgumentError(f"a step is an integer >= 0, got {step!r}")
    n = int(step)
    if n >= 1 << 64:
        raise InvalidArgumentError(f"step {n} is too large (at most 2**64 - 1)")
    return n
