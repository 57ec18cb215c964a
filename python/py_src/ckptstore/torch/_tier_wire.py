"""What the tiered manager (:mod:`ckptstore.torch.tiered`) sends between hosts and how it
tells who it waited for: files moved over torch.distributed point-to-point (one header,
then each file or byte range in chunks of 8 MiB, runs of small ones packed into shared
messages, up to RECV_AHEAD received ahead of the one being kept; format-spec/tiers.md),
CRC32 of files, the progress marks that name the rank a failed collective waited for, and
the kill seam of the fault tests.

Every function that talks takes the manager's own process group; ranks are global ranks.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time
import zlib
from typing import Any, Optional

import numpy as np

from ..errors import CheckpointError

#: Set, each rank writes the seconds since its previous phase as it enters the next one
#: (where a save or a restore spends its time): to stderr, or appended to the file it names
#: when it is an absolute path.
_TRACE = os.environ.get("CKPTSTORE_TIERS_TRACE", "")
def dist_or_none() -> Any:
    """``torch.distributed`` when a process group is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def err_text(rank: int, e: BaseException) -> str:
    """An error as the ranks gather it: ``rank <r>: <type>: <message>``."""
    return f"rank {rank}: {type(e).__name__}: {e}"


def trim_heap() -> None:
    """Give the pages freed by a save back to the system (glibc ``malloc_trim``): the save's
    transient buffers come from the writer thread's malloc arena, which otherwise keeps them,
    and host memory would grow with the saves. Elsewhere (not glibc) it does nothing."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def crc_file(path: str) -> tuple[int, int]:
    """``(size, crc32)`` of the file ``path``."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            crc = zlib.crc32(b, crc)
            size += len(b)
    return size, crc


def write_fsync(path: str, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """All of ``data`` (a buffer) written at ``offset`` of ``fd``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class Arrival:
    """A new file ``path`` received chunk by chunk (:func:`transfer`'s ``write``): each
    chunk written at its offset, its CRC32 taken on the way; :meth:`finish` makes it
    durable. A write that fails keeps nothing more; :meth:`finish` raises its error."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self.crc = 0
        self.error: Optional[OSError] = None
        self._fd: Optional[int] = None

    def write(self, offset: int, chunk: Any) -> None:
        if self.error is not None:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            data = chunk.numpy()
            self.crc = zlib.crc32(data, self.crc)
            pwrite_all(self._fd, data, offset)
            self.size = max(self.size, offset + data.nbytes)
        except OSError as e:
            self.error = e

    def finish(self) -> tuple[int, int]:
        """fsync and close the file; its ``(size, crc32)`` (chunks arrive in order)."""
        try:
            if self.error is None and self._fd is not None:
                os.fsync(self._fd)
        except OSError as e:
            self.error = e
        finally:
            self.close()
        if self.error is not None:
            raise self.error
        return self.size, self.crc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _file_tensor(path: str, size: int, begin: int = 0) -> Any:
    """``size`` bytes of the file at ``begin``, mapped (copy-on-write, so writable for
    torch, never written): sent straight from the page cache. The files sent are
    committed ones, which nothing rewrites in place (format-spec/tiers.md)."""
    import torch

    try:
        a = np.memmap(path, dtype=np.uint8, mode="c", offset=begin, shape=(size,))
    except ValueError as e:  # the file is shorter than the range
        raise OSError(f"{path}: {size} bytes at {begin} expected, the file is shorter ({e})") from e
    return torch.from_numpy(a)


def _header(out: list, error: Optional[str]) -> tuple[list, Optional[str]]:
    """``[key, size, path, begin]`` per item to send: ``(key, path)`` a whole file,
    ``(key, path, begin, size)`` a byte range of it, ``(key, tensor)`` the bytes of a
    1-D uint8 tensor (in place of the path)."""
    files = []
    if error is None:
        try:
            for item in out:
                if len(item) == 2 and not isinstance(item[1], (str, os.PathLike)):
                    files.append([item[0], int(item[1].numel()), item[1], 0])
                elif len(item) == 2:
                    files.append([item[0], os.stat(item[1]).st_size, os.fspath(item[1]), 0])
                else:
                    files.append([item[0], int(item[3]), os.fspath(item[1]), int(item[2])])
        except OSError as e:
            error = f"{e.filename}: {e.strerror or e}"
    return ([] if error else files), error


def _head_tensor(files: list, error: Optional[str]) -> Any:
    import torch

    b = json.dumps({"files": files, "error": error}).encode()
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class Incoming:
    """What a peer's header announced: ``files`` (``[name, size]``) and ``error`` (the peer
    could not send: raise it)."""

    def __init__(self, head: Any) -> None:
        h = json.loads(head.numpy().tobytes() or b"{}")
        self.files: list = [(str(n), int(z)) for n, z in h.get("files") or []]
        self.error: Optional[str] = h.get("error")


def _exchange_heads(out: Any, dst: Optional[int], src: Optional[int], tag: int, pg: Any) -> Optional[Incoming]:
    import torch
    import torch.distributed as dist

    n_in = torch.zeros(1, dtype=torch.int64)
    works = []
    if dst is not None:
        works.append(dist.isend(torch.tensor([out.numel()], dtype=torch.int64), dst, group=pg, tag=tag))
    if src is not None:
        works.append(dist.irecv(n_in, src, group=pg, tag=tag))
    _wait(works)
    head = torch.empty(int(n_in.item()), dtype=torch.uint8)
    works = []
    if dst is not None:
        works.append(dist.isend(out, dst, group=pg, tag=tag + 1))
    if src is not None:
        works.append(dist.irecv(head, src, group=pg, tag=tag + 1))
    _wait(works)
    return Incoming(head) if src is not None else None


#: Bytes of one wire chunk: every item moves as chunks of this size (the last one shorter),
#: each its own point-to-point message, so that a receiver keeps one chunk while the next
#: ones arrive.
CHUNK = 8 << 20
#: Chunks a sender has in flight at most.
SEND_AHEAD = 4
#: Messages a receiver has posted at most: gloo sends a message once its receive is posted,
#: so with one receive ahead every message waited a round trip (a direct restore of 256 MiB
#: in 384 messages of ~1.3 MiB moved at 40% of the raw rate). Those that land in reused
#: buffers (packed small items, chunks given to a writer) take one of this many, of
#: ``CHUNK`` bytes each, mapped when first needed.
RECV_AHEAD = 8
#: An item smaller than ``CHUNK // PACK_DIV`` bytes shares its message with the small items
#: next to it (up to ``CHUNK`` bytes a message): a restore fetches hundreds of ranges of a
#: few bytes (an Adam ``step`` each), which one message apiece made cost 0.6 ms each.
PACK_DIV = 16


def _messages(sizes: list) -> list:
    """The wire messages of items of ``sizes``, in order: each a list of segments ``(item,
    begin, length)``. An item of ``CHUNK // PACK_DIV`` bytes or more moves alone, in chunks
    of ``CHUNK`` bytes; a run of smaller ones (empty ones included) shares messages of at
    most ``CHUNK`` bytes, each item whole in one."""
    pack = max(1, CHUNK // PACK_DIV)
    msgs: list = []
    run: list = []
    room = 0
    for i, z in enumerate(sizes):
        if z < pack:
            if run and room + z > CHUNK:
                msgs.append(run)
                run, room = [], 0
            run.append((i, 0, z))
            room += z
            continue
        if run:
            msgs.append(run)
            run, room = [], 0
        msgs.extend([(i, b, min(CHUNK, z - b))] for b in range(0, z, CHUNK))
    if run:
        msgs.append(run)
    return msgs


def _read_into(buf: Any, path: str, begin: int, fds: dict) -> None:
    """``buf`` (a uint8 tensor) filled from ``path`` at ``begin``; OSError if it is shorter."""
    if path not in fds:
        fds[path] = os.open(path, os.O_RDONLY)
    view = memoryview(buf.numpy()).cast("B")
    at = begin
    while view:
        n = os.preadv(fds[path], [view], at)
        if n == 0:
            raise OSError(f"{path}: {buf.numel()} bytes at {begin} expected, the file is shorter")
        view, at = view[n:], at + n


def transfer(out: list, error: Optional[str], dst: Optional[int], src: Optional[int], tag: int, pg: Any,
             receive: Any, dest: Any = None) -> None:
    """Send the files ``out`` (``(key, path)``, or ``(key, path, begin, size)`` for a byte
    range of the file, or ``(key, tensor)`` for the bytes of a 1-D uint8 tensor) to rank
    ``dst`` while receiving ``src``'s (either may be ``None``):
    both headers first, then every item in messages (:func:`_messages`: a large item in
    chunks of :data:`CHUNK` bytes, runs of small ones packed together), each its own
    message (tag ``tag + 2 + n``, its number), a large item's sent from a read-only mapping
    of the file, at most :data:`SEND_AHEAD` at a time, while the arriving ones are received
    up to :data:`RECV_AHEAD` ahead of the one being kept. ``receive(incoming, None, None)`` first, with the
    header; then ``receive(incoming, key, data)`` as each item completes. ``dest(key,
    size)``: None (the item arrives in a fresh buffer, handed over as ``data``), a uint8
    tensor of exactly ``size`` elements that the item is received straight into (the
    memory of its destination; handed over as ``data``), or a callable ``write(offset,
    chunk)`` that takes each chunk as it arrives (a uint8 tensor, reused once the call
    returns; ``data`` is then None). ``receive`` does not raise (it
    records what went wrong: the peer keeps sending regardless). A file this side cannot
    read goes as ``error`` in its header (no files follow), which the receiver raises; one
    that fails after the header is sent as zeros (its CRC check fails there), and a
    ``write`` that raises keeps nothing more of its item: either error is raised here once
    every message has moved."""
    import torch
    import torch.distributed as dist

    files, error = _header(out, error) if dst is not None else ([], None)
    inc = _exchange_heads(_head_tensor([f[:2] for f in files], error), dst, src, tag, pg)
    if inc is not None:
        receive(inc, None, None)
    ins = inc.files if inc is not None else []
    out_msgs, in_msgs = _messages([f[1] for f in files]), _messages([z for _, z in ins])
    failed: Optional[Exception] = None
    mapped: dict[int, Any] = {}  # item -> the mapping its chunks are sent from
    zeros: Any = None

    def chunk_of(i: int, b: int, z: int) -> Any:  # a large item's chunk, from its mapping
        nonlocal failed, zeros
        if i not in mapped:
            mapped.clear()  # the previous item's last chunk holds its own view
            _, size, path, begin = files[i]
            try:
                mapped[i] = _file_tensor(path, size, begin) if isinstance(path, str) else path
            except OSError as e:  # the peer is waiting for `size` bytes: its CRC check fails
                failed = failed or e
                mapped[i] = None
        t = mapped[i]
        if t is None:
            zeros = torch.zeros(CHUNK, dtype=torch.uint8) if zeros is None else zeros
            return zeros[:z]
        return t[b:b + z]

    def packed(segs: list, total: int) -> Any:  # small items read into one fresh buffer
        nonlocal failed
        buf = torch.empty(total, dtype=torch.uint8)
        fds: dict[str, int] = {}
        at = 0
        try:
            for i, _, z in segs:
                _, _, path, begin = files[i]
                try:
                    if isinstance(path, str):
                        _read_into(buf[at:at + z], path, begin, fds)
                    else:
                        buf[at:at + z].copy_(path[begin:begin + z])
                except OSError as e:  # sent as zeros: its CRC check fails there
                    failed = failed or e
                    buf[at:at + z].zero_()
                at += z
        finally:
            for fd in fds.values():
                os.close(fd)
        return buf

    def post_send(n: int) -> Any:
        segs = out_msgs[n]
        total = sum(z for _, _, z in segs)
        if not total:  # empty items only: nothing is sent
            return None
        t = chunk_of(*segs[0]) if len(segs) == 1 else packed(segs, total)
        return dist.isend(t, dst, group=pg, tag=tag + 2 + n), t

    # Receiving: item i's fresh buffer (no dest), or its writer; messages land in item i's
    # buffer (a chunk of a large item without a writer) or in one of RECV_AHEAD reused ones.
    whole: dict[int, Any] = {}
    writers: dict[int, Any] = {}
    ring: dict[int, Any] = {}

    def start(i: int) -> None:  # item i's first bytes are next: its writer or its buffer
        key, size = ins[i]
        w = None
        try:
            w = dest(key, size) if dest is not None and size else None
        except Exception:  # noqa: BLE001 - a fresh buffer then; `receive` sees it
            w = None
        if isinstance(w, torch.Tensor) and w.dtype == torch.uint8 and w.dim() == 1 and w.numel() == size \
                and w.is_contiguous():
            whole[i] = w  # straight into the destination
        elif w is None or isinstance(w, torch.Tensor):  # a tensor that does not fit: `receive` sees it
            whole[i] = torch.empty(size, dtype=torch.uint8)
        else:
            writers[i] = w

    def target(n: int) -> Any:
        segs = in_msgs[n]
        for i, b, _ in segs:
            if b == 0:
                start(i)
        i, b, z = segs[0]
        if len(segs) == 1 and i in whole:
            return whole[i][b:b + z]
        slot = n % RECV_AHEAD  # message n - RECV_AHEAD, its last user, is kept by now
        if slot not in ring:  # anonymous mappings of their own, unmapped when the transfer
            # ends: 8 MiB buffers taken from malloc and freed save after save raise glibc's
            # mmap threshold and fragment the heap (RSS +17% over 50 saves at 256 MiB/host)
            ring[slot] = torch.frombuffer(mmap.mmap(-1, CHUNK), dtype=torch.uint8)
        return ring[slot][:sum(z for _, _, z in segs)]

    def post_recv(n: int) -> None:
        t = target(n)
        posted[n] = (dist.irecv(t, src, group=pg, tag=tag + 2 + n) if t.numel() else None, t)

    def keep(n: int, got: Any) -> None:  # message n arrived in `got`: each segment kept
        nonlocal failed
        segs = in_msgs[n]
        at = 0
        for i, b, z in segs:
            piece = got[at:at + z]
            at += z
            if i in writers:
                try:
                    writers[i](b, piece)
                except Exception as e:  # noqa: BLE001 - raised once the peer is done
                    failed = failed or e
                    writers[i] = discard
            elif len(segs) > 1:
                whole[i][b:b + z].copy_(piece)
            if b + z == ins[i][1]:  # the item's last bytes
                writers.pop(i, None)
                receive(inc, ins[i][0], whole.pop(i, None))

    sends: list = []
    posted: dict[int, tuple] = {}  # message n: (its receive, its target)
    for n in range(min(RECV_AHEAD, len(in_msgs))):
        post_recv(n)
    for n in range(max(len(out_msgs), len(in_msgs))):
        if n < len(out_msgs):
            if len(sends) >= SEND_AHEAD:
                sends.pop(0)[0].wait()
            w = post_send(n)
            if w is not None:
                sends.append(w)
        if n < len(in_msgs):
            recv, got = posted.pop(n)
            if recv is not None:
                recv.wait()
            keep(n, got)
            if n + RECV_AHEAD < len(in_msgs):  # its ring slot is free again
                post_recv(n + RECV_AHEAD)
    _wait([w for w, _ in sends])
    if failed is not None:
        raise failed


def discard(offset: int, chunk: Any) -> None:
    """A writer that keeps nothing (the rest of an item whose writer failed)."""


class Progress:
    """How far each rank got, in the job's rendezvous store: one key per rank, overwritten
    as it enters each collective phase of the manager with a sequence number (every rank
    enters the same phases in the same order) and a label, so that a collective that fails
    (a host lost: its link down, the peers waiting out the timeout) names the ranks that
    never reached it. Without a store (no process group) it does nothing."""

    def __init__(self, rank: int, world: int, token: str) -> None:
        self.rank, self.world = rank, world
        self.seq = 0
        self.label = "start"
        self._store = None
        self._prefix = f"ckptstore-tiers/{token}/"
        self._t = time.monotonic()
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: errors then name no rank
            self._store = None
        self.mark("start")

    def mark(self, label: str) -> None:
        self.seq += 1
        self.label = label
        if _TRACE:
            now = time.monotonic()
            line = f"ckptstore tiers: rank {self.rank} +{now - self._t:.3f}s -> {label}\n"
            if _TRACE.startswith("/"):
                with open(_TRACE, "a") as f:
                    f.write(line)
            else:
                sys.stderr.write(line)
            self._t = now
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}{self.rank}", f"{self.seq} {label}")
            except Exception:  # noqa: BLE001 - a diagnostic only
                pass

    def behind(self, hosts: list[list[int]], wait_s: float = 5.0) -> str:
        """Which ranks never reached this rank's current phase (asked of the store in a
        thread, ``wait_s`` at most: the store itself may be on the lost host)."""
        if self._store is None:
            return ""
        out: dict[str, Any] = {}
        store = self._store

        def ask() -> None:
            try:
                got = {}
                for r in range(self.world):
                    k = f"{self._prefix}{r}"
                    got[r] = store.get(k).decode() if store.check([k]) else "0 start"
                out["got"] = got
            except Exception as e:  # noqa: BLE001 - the store's process is gone, say
                out["error"] = e

        t = threading.Thread(target=ask, name="ckptstore-tier-progress", daemon=True)
        t.start()
        t.join(wait_s)
        host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
        if "error" in out:
            return f" (the job's rendezvous store, on rank 0, could not be asked who is behind: {out['error']})"
        if "got" not in out:
            h0 = host_of.get(0, 0)
            return (f" (the job's rendezvous store, on rank 0 of host {h0}, did not answer within "
                    f"{wait_s:g} s: host {h0} is likely the lost one)")
        late = []
        for r, v in sorted(out["got"].items()):
            seq, _, label = v.partition(" ")
            if int(seq) < self.seq:
                late.append(f"rank {r} on host {host_of.get(r, '?')} (last seen at: {label})")
        return f" (waiting for {', '.join(late)})" if late else ""


class GroupError(CheckpointError):
    """An operation between ranks failed (a peer lost, the group broken): raised on each
    rank that saw it; nothing more can be agreed on this process group."""


def bounded(fn: Any, timeout: float, what: str) -> Any:
    """``fn()`` on a thread of its own, waited for ``timeout`` seconds (and a little more):
    gloo's group creation does not return while a peer's host is gone without a FIN (seen
    with torch 2.15: past any timeout), so a rank gives up on it, raising, and its launcher
    restarts it (the thread is left behind: a daemon)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="ckptstore-tiers-group", daemon=True)
    t.start()
    t.join(timeout + 10.0)
    if "err" in box:
        raise GroupError(f"ckptstore tiers: {what} failed: {box['err']}") from box["err"]
    if "ok" not in box:
        raise GroupError(f"ckptstore tiers: {what} did not finish within {timeout:g} s: a peer is lost "
                          "(or the job's rendezvous store is)")
    return box["ok"]
