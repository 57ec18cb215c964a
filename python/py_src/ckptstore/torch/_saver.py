"""The one background saver of the Python package: :class:`AsyncSaver`.

Every non-blocking save goes through it (:class:`ckptstore.torch.CheckpointManager`,
:class:`ckptstore.integrations._tree.TreeSaver` and the integrations built on it, the
Hugging Face Trainer's ``ckptstore_async``): a save copies every tensor it stores into a
reused set of snapshot buffers (:class:`Snapshot`) and returns; one writer thread runs the
writes in the order the saves were made; at most ``max_in_flight`` saves (and buffer sets)
exist at once; the first failure no one has seen is raised by the next :meth:`save`,
:meth:`wait` or :meth:`close`, and every save's own outcome by its handle.

The writer thread, started by the first save, serves every save of the saver until it is
closed or collected (or the interpreter exits with nothing queued): one thread, so one
malloc arena. A thread per save took a new arena each time (glibc: up to 8 per core), each
keeping at its top what its save's transient buffers had used, which ``malloc_trim`` does
not return: host memory grew by about a rank's state per save, for tens of saves (measured
on the tiered manager, 2 ranks, 3.2 MB each: 45 MiB over 16 saves, flat with one thread).

The engine's Rust ``save_async`` is not exposed to Python: the snapshot buffers are
Python-owned (torch's pinned memory), so the asynchronous part lives here and each write is
one native, interpreter-releasing save.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from .._prep import prepare as _prepare
from ..errors import InvalidArgumentError, InvalidTensorError
from ._dtypes import _to_numpy, _torch, _wire_of

__all__ = ["AsyncSaver", "Handle", "Snapshot", "check_max_in_flight"]

#: How often an idle writer thread looks whether its saver is gone or the interpreter exits.
_IDLE_POLL_S = 0.25


def check_max_in_flight(max_in_flight: Any) -> int:
    """``max_in_flight``: an integer >= 1, else :class:`InvalidArgumentError`."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidArgumentError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    return max_in_flight


class Snapshot:
    """One set of snapshot buffers, keyed by stored tensor name and reused from save to
    save: a buffer is allocated only for a name it does not hold yet, or whose shape or
    dtype changed. CUDA tensors are copied into pinned CPU buffers.

    Torch tensors are copied in :meth:`end`, all in one ``torch._foreach_copy_`` (one
    release of the interpreter lock): a loop of ``copy_`` calls gives the lock up and waits
    for it once per tensor, which another busy Python thread (a data loader, a logger)
    stretches to 5 ms a tensor. The buffers :meth:`copy` and :meth:`tensor` return hold
    their data once :meth:`end` has returned."""

    def __init__(self) -> None:
        self.bufs: Dict[str, Any] = {}
        self.allocations = 0  # buffers allocated over this set's life
        self._used: set = set()
        self._devices: set = set()
        self._dst: List[Any] = []  # torch copies deferred to end(): destinations
        self._src: List[Any] = []  # and their sources
        #: What a caller built around a buffer, by name (the tiered manager's DTensors):
        #: kept while the name is stored, for the caller to reuse while it fits.
        self.wrapped: Dict[str, Any] = {}

    def begin(self) -> None:
        self._used = set()
        self._devices = set()
        self._dst, self._src = [], []

    def copy(self, name: str, src: Any) -> Tuple[str, str, np.ndarray]:
        """``(name, wire dtype, array)`` over this set's copy of ``src`` (a torch tensor or
        anything numpy takes)."""
        if name in self._used:
            raise InvalidTensorError(f"tensor {name!r} is stored twice")
        self._used.add(name)
        if not isinstance(src, np.ndarray):
            torch = _torch()
            if isinstance(src, torch.Tensor):
                return self._copy_tensor(torch, name, src.detach())
        a = np.asarray(src)
        buf = self.bufs.get(name)
        if not isinstance(buf, np.ndarray) or buf.shape != a.shape or buf.dtype != a.dtype:
            buf = np.empty(a.shape, a.dtype)
            self.bufs[name] = buf
            self.allocations += 1
        np.copyto(buf, a)
        return _prepare(name, buf)

    def _copy_tensor(self, torch: Any, name: str, src: Any) -> Tuple[str, str, np.ndarray]:
        if src.layout != torch.strided:
            raise InvalidTensorError(f"tensor {name!r}: only dense (strided) tensors can be stored")
        if src.dtype not in _wire_of:
            raise InvalidTensorError(f"tensor {name!r}: dtype {src.dtype} cannot be stored")
        return _to_numpy(name, self._tensor_buf(torch, name, src))

    def tensor(self, name: str, src: Any) -> Any:
        """This set's copy of the torch tensor ``src``, as a CPU tensor of its shape and
        dtype (a writer that takes torch tensors, as DCP does)."""
        if name in self._used:
            raise InvalidTensorError(f"tensor {name!r} is stored twice")
        self._used.add(name)
        torch = _torch()
        if src.layout != torch.strided:
            raise InvalidTensorError(f"tensor {name!r}: only dense (strided) tensors can be stored")
        return self._tensor_buf(torch, name, src.detach())

    def _tensor_buf(self, torch: Any, name: str, src: Any) -> Any:
        buf = self.bufs.get(name)
        if not isinstance(buf, torch.Tensor) or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
            self.bufs[name] = buf
            self.allocations += 1
        if src.is_cuda:
            self._devices.add(src.device)
        self._dst.append(buf)
        self._src.append(src)
        return buf

    def end(self) -> None:
        """Copy the torch tensors (CUDA ones without blocking, then waited for); drop the
        buffers of names this save did not store."""
        dst, src = self._dst, self._src
        self._dst, self._src = [], []
        if dst:
            torch = _torch()
            foreach = getattr(torch, "_foreach_copy_", None)
            if foreach is not None:
                foreach(dst, src, non_blocking=True)
            else:  # pragma: no cover - torch before 2.1
                for b, t in zip(dst, src):
                    b.copy_(t, non_blocking=t.is_cuda)
        if self._devices:
            torch = _torch()
            for d in self._devices:
                torch.cuda.synchronize(d)
        for k in [k for k in self.bufs if k not in self._used]:
            del self.bufs[k]
        for k in [k for k in self.wrapped if k not in self._used]:
            del self.wrapped[k]

    @property
    def nbytes(self) -> int:
        total = 0
        for b in self.bufs.values():
            total += b.nbytes if isinstance(b, np.ndarray) else b.numel() * b.element_size()
        return total


class Handle:
    """A background save's outcome: set once by the writer thread, read by the caller.
    ``what`` names the save in the timeout message."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._event = threading.Event()
        self._info: Any = None
        self._error: Optional[BaseException] = None
        self._reported = False

    def done(self) -> bool:
        """True once the save has finished, committed or failed (never blocks)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait until the save is committed and durable; return the commit info. Raises
        the save's error (a :class:`ckptstore.CheckpointError`), or ``TimeoutError`` if
        ``timeout`` seconds pass first."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"the save of {self._what} is still in flight")
        self._reported = True
        if self._error is not None:
            raise self._error
        return self._info

    def _finish(self, info: Any, error: Optional[BaseException]) -> None:
        self._info = info
        self._error = error
        self._event.set()


class AsyncSaver:
    """Background saves in order, with reused snapshot buffers (see the module docs).

    :meth:`save` takes the caller's ``build(copy)``, which walks what is saved and turns
    each tensor into ``copy(name, tensor)`` (the snapshot's copy), returning a job; then
    ``write(job)`` runs on the writer thread and returns the commit info. ``name``: the
    writer thread's name; ``what``: how errors name the owner (``"the TreeSaver"``).
    """

    def __init__(self, max_in_flight: int = 1, *, name: str = "ckptstore-save",
                 what: str = "the saver") -> None:
        self.max_in_flight = check_max_in_flight(max_in_flight)
        self._name = name
        self._what = what
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a save queued, or the saver closed
        self._free: List[Snapshot] = []  # buffer sets no save is using
        self.buffer_sets = 0  # buffer sets in existence (<= max_in_flight)
        self._queue: Deque[Tuple[Handle, Snapshot, Any, Callable[[Any], Any], Any]] = deque()
        self._worker: Optional[threading.Thread] = None
        self._handles: List[Handle] = []  # not yet known to be finished and reported
        self.closed = False

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by idle snapshot buffer sets (kept for reuse)."""
        with self._lock:
            return sum(s.nbytes for s in self._free)

    @property
    def allocations(self) -> int:
        """Snapshot buffers allocated over the life of the idle buffer sets: flat from the
        second save of an unchanged structure on."""
        with self._lock:
            return sum(s.allocations for s in self._free)

    def check_open(self) -> None:
        if self.closed:
            raise InvalidArgumentError(f"{self._what} is closed")

    def save(
        self,
        handle: Handle,
        build: Callable[[Any], Any],
        write: Callable[[Any], Any],
        *,
        after: Optional[threading.Event] = None,
        whole_snapshot: bool = False,
    ) -> Handle:
        """Start a background save; return ``handle``, finished by the writer thread.

        Blocks while ``max_in_flight`` saves are in flight; raises an earlier save's error
        no one has seen yet (nothing started), then ``build``'s own error (nothing queued).
        ``after``: an event the write waits for before it starts (the caller sets it, also
        on failure); a write abandoned at interpreter exit does not hang it.
        ``whole_snapshot``: ``build`` gets the :class:`Snapshot` (``tensor``, ``copy``)
        instead of its ``copy``."""
        self.check_open()
        self._slots.acquire()
        try:
            self._raise_unreported()
            with self._lock:
                if self._free:
                    snap = self._free.pop()
                else:
                    snap = Snapshot()
                    self.buffer_sets += 1
            try:
                snap.begin()
                job = build(snap if whole_snapshot else snap.copy)
                snap.end()
            except BaseException:
                with self._lock:
                    self._free.append(snap)
                raise
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._handles.append(handle)
            self._queue.append((handle, snap, job, write, after))
            if self._worker is None or not self._worker.is_alive():  # (not alive: a forked child)
                self._worker = threading.Thread(target=_writer, args=(weakref.ref(self), self._work),
                                                name=self._name, daemon=False)
                self._worker.start()
            else:
                self._work.notify()
        return handle

    def _run(self, box: List[Any]) -> None:
        """One queued save (taken out of ``box``, so that nothing else holds its job), on
        the writer thread."""
        h, snap, job, write, after = box.pop()
        info, error = None, None
        # Held until `after` is set, or the interpreter is shutting down (its main
        # thread has stopped: a save abandoned before its release must not hang exit).
        while after is not None and not after.wait(0.25):
            if not threading.main_thread().is_alive():
                break
        try:
            info = write(job)
        except BaseException as e:  # noqa: BLE001 - surfaced through the handle
            error = e
        del job
        # The buffers are back before the handle says done, and the outcome is known
        # before the slot is given back (a save that waited for it sees this error).
        with self._lock:
            self._free.append(snap)
        h._finish(info, error)
        self._slots.release()

    def _raise_unreported(self) -> None:
        with self._lock:
            failed = [h for h in self._handles if h.done() and h._error is not None and not h._reported]
            self._handles = [h for h in self._handles if not h.done()]
        for h in failed:
            h._reported = True
        if failed:
            raise failed[0]._error  # type: ignore[misc]

    def in_flight(self) -> List[Handle]:
        """The handles of the saves not finished yet, oldest first."""
        with self._lock:
            return [h for h in self._handles if not h.done()]

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error no one has seen yet."""
        with self._lock:
            pending = list(self._handles)
        for h in pending:
            h._event.wait()
        self._raise_unreported()

    def close(self) -> None:
        """Refuse further saves, wait (as :meth:`wait`, raising its error), end the writer
        thread and free the snapshot buffers."""
        self.closed = True
        try:
            self.wait()
        finally:
            with self._lock:
                self._free.clear()
                worker = self._worker
                self._work.notify_all()
            if worker is not None and worker is not threading.current_thread():
                worker.join()


def _writer(ref: "weakref.ref[AsyncSaver]", work: threading.Condition) -> None:
    """A saver's writer thread: runs its queued saves in order, and waits for the next
    while the saver is open (see the module docs: one thread, one malloc arena). It holds
    no reference to the saver between saves, and ends once the saver is closed or
    collected, or the interpreter is exiting (its main thread done) with nothing queued:
    exit waits for the saves in flight, not for an idle saver."""
    while True:
        with work:
            while True:
                saver = ref()
                if saver is None:
                    return
                if saver._queue:
                    box: List[Any] = [saver._queue.popleft()]
                    break
                if saver.closed or not threading.main_thread().is_alive():
                    saver._worker = None
                    return
                del saver
                work.wait(_IDLE_POLL_S)
        saver._run(box)
        del saver
