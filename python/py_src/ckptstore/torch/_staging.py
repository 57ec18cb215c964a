"""CUDA destinations: host bytes copied into CUDA tensors through two reused pinned
buffers, the copy of one overlapped with the filling of the other.

Code that reads :data:`_STAGE_BYTES` elsewhere reads it as ``_staging._STAGE_BYTES``, so
that setting it here (tests, benchmarks) reaches every use."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import InvalidArgumentError
from ._dtypes import _torch

#: Size of each of the two pinned staging buffers; larger tensors are staged in pieces of
#: this size. 0 turns staging off (CUDA tensors are then written with ``copy_`` from
#: pageable memory, and fresh CUDA state is moved by ``load_state_dict``).
_STAGE_BYTES = 64 << 20
_ALIGN = 256


def _batches(sizes: "list[int]", cap: int) -> "list[list[tuple[int, int]]]":
    """Greedy, order-keeping batches of ``(index, offset)``: each batch's items, at
    ``_ALIGN``-aligned offsets, fit in ``cap`` bytes. Every size must be <= ``cap``."""
    out: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    off = 0
    for i, nb in enumerate(sizes):
        if nb > cap:
            raise InvalidArgumentError(f"internal: staged item of {nb} bytes > buffer {cap}")
        if cur and off + nb > cap:
            out.append(cur)
            cur, off = [], 0
        cur.append((i, off))
        off += -(-nb // _ALIGN) * _ALIGN
    if cur:
        out.append(cur)
    return out


def _stage_to_cuda(
    items: list,
    fill: Callable[[list], None],
    fill_range: Optional[Callable[[list], None]] = None,
) -> None:
    """Copy host bytes into CUDA tensors through two reused pinned buffers.

    ``items``: ``(nbytes, flat uint8 CUDA tensor, key)``. ``fill(pairs)`` writes, for each
    ``(key, uint8 numpy view of pinned memory)``, the key's bytes into the view (checked
    bytes: the caller checks them, before or on the way). An item larger than
    ``_STAGE_BYTES`` goes in pieces of at most that size, written by
    ``fill_range(triples)``, for each ``(key, byte offset, view)`` (required then). While
    the device copies one buffer (``non_blocking`` on a side stream), the other is filled;
    a buffer is refilled only after the event recorded behind its last copies has
    completed. Returns when every copy has finished."""
    torch = _torch()
    devs = {it[1].device for it in items}
    if len(devs) > 1:
        for d in devs:
            _stage_to_cuda([it for it in items if it[1].device == d], fill, fill_range)
        return
    # (nbytes, destination, key, byte offset or None for a whole item)
    pieces: list[tuple[int, Any, Any, Optional[int]]] = []
    for nb, dst, key in items:
        if nb <= _STAGE_BYTES:
            pieces.append((nb, dst, key, None))
            continue
        if fill_range is None:
            raise InvalidArgumentError(f"{key!r}: {nb} bytes is over the staging buffer")
        for off in range(0, nb, _STAGE_BYTES):
            n = min(_STAGE_BYTES, nb - off)
            pieces.append((n, dst[off : off + n], key, off))
    if not pieces:
        return
    dev = pieces[0][1].device
    batches = _batches([nb for nb, _, _, _ in pieces], _STAGE_BYTES)
    need = max(sum(-(-pieces[i][0] // _ALIGN) * _ALIGN for i, _ in b) for b in batches)
    cap = min(_STAGE_BYTES, need)
    bufs = [
        torch.empty(cap, dtype=torch.uint8, pin_memory=True)
        for _ in range(min(2, len(batches)))
    ]
    done: list[Any] = [None] * len(bufs)
    stream = torch.cuda.Stream(device=dev)
    # The destinations may still be in use on the caller's stream.
    stream.wait_stream(torch.cuda.current_stream(dev))
    for bi, batch in enumerate(batches):
        k = bi % len(bufs)
        if done[k] is not None:
            done[k].synchronize()
        buf = bufs[k]
        views = [(i, buf[off : off + pieces[i][0]]) for i, off in batch]
        whole = [(pieces[i][2], v.numpy()) for i, v in views if pieces[i][3] is None]
        ranged = [(pieces[i][2], pieces[i][3], v.numpy()) for i, v in views if pieces[i][3] is not None]
        if whole:
            fill(whole)
        if ranged:
            assert fill_range is not None, "pieces of a tensor need fill_range"
            fill_range(ranged)
        with torch.cuda.stream(stream):
            for i, v in views:
                pieces[i][1].copy_(v, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        done[k] = ev
    stream.synchronize()
