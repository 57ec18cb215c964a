"""Read once, fan out (format-spec/tiers.md §Read once): a load on several ranks reads each
stored chunk that several ranks need (replicated parameters under DDP or HSDP, a world
that shrank onto fewer ranks with replicated state) from storage once, on one of those
ranks, and sends it to the others over the process group, straight into their fresh
destination tensors; each receiver checks what it got against the stored CRC32s
(``Checkpoint.verify_received``) and reads from storage itself whatever failed the check
or never came. Functions of one load (:func:`ckptstore.torch.distributed.load`, the
tiered manager's persistent restore), every rank calling each.

Only whole stored chunks that are exactly one destination (a contiguous CPU tensor of
the stored dtype and shape) travel; everything else each rank reads as before.
``CKPTSTORE_READ_ONCE=0`` in every rank's environment turns it off (each rank reads what
it needs from storage itself, as before; a measurement's baseline).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import CheckpointError, ChecksumError
from ._dtypes import _torch, _wire_of
from ._tier_wire import err_text, transfer
from .dcp import _requests, _resolve

#: Whether loads fan out (``CKPTSTORE_READ_ONCE``, default on); the same on every rank.
ENABLED = os.environ.get("CKPTSTORE_READ_ONCE", "1") != "0"

#: Base tag of the fan-out's rounds (+ 65536 k in round k).
TAG_FANOUT = 1 << 27

#: What the last fan-out did on this rank (for tests and benchmarks): chunks and bytes
#: read from storage, sent, received and checked, and read again from storage after a
#: failed check or a sender that could not send.
LAST: dict[str, int] = {}


def whole_chunk_items(prep: Any) -> dict[tuple, tuple]:
    """The read items of ``prep``'s plan (planned, its reader open) whose box is the whole
    of one stored chunk and whose destination is a contiguous CPU tensor of the stored
    dtype and shape: ``{(name, offsets): (read item, (name, offsets, shape, destination
    bytes as a uint8 numpy array))}``; the first of two items of one chunk only."""
    torch = _torch()
    tensor_reqs, _ = _requests(prep.plan)
    rr = prep.reader._open()
    out: dict[tuple, tuple] = {}
    for ri, name, offs, shape in tensor_reqs:
        key = (name, tuple(offs))
        if 0 in shape or key in out:
            continue
        # The stored chunks meeting the box: of a two-level checkpoint, from the parts
        # holding it alone (every part, for every tensor: gigabytes at 1,024 ranks).
        if [list(offs), list(shape)] not in [[list(o), list(z)] for o, z in rr.chunks(name, (offs, shape))]:
            continue
        dst = _resolve(prep.planner, ri).detach()
        if not (dst.device.type == "cpu" and dst.is_contiguous() and tuple(dst.shape) == tuple(shape)
                and _wire_of.get(dst.dtype) == rr.shape_of(name)[0]):
            continue
        out[key] = (ri, (name, offs, shape, dst.reshape(-1).view(torch.uint8).numpy()))
    return out


def assign(wants: list) -> dict[tuple, int]:
    """Who reads what: ``wants[r]`` is rank r's ``[(key, bytes)]``; each key several ranks
    want goes to one of them, the largest keys first, each to the rank with the fewest
    bytes to read so far (counting what it alone wants), ties to the lowest rank. The same
    answer on every rank (it depends on ``wants`` only). ``{key: reader}`` for the keys
    wanted more than once."""
    who: dict[tuple, list] = {}
    size: dict[tuple, int] = {}
    for r, items in enumerate(wants):
        for key, n in items:
            who.setdefault(key, []).append(r)
            size[key] = int(n)
    load = [0] * len(wants)
    for key, rs in who.items():
        if len(rs) == 1:
            load[rs[0]] += size[key]
    out: dict[tuple, int] = {}
    for key in sorted((k for k, rs in who.items() if len(rs) > 1), key=lambda k: (-size[k], k)):
        r = min(who[key], key=lambda r: (load[r], r))
        out[key] = r
        load[r] += size[key]
    return out


def read_once(prep: Any, pg: Any) -> None:
    """Read ``prep``'s plan into its destinations (every rank; raises this rank's error,
    which the caller agrees on): the chunks several ranks want from storage once (see the
    module docs), the rest as :meth:`ckptstore.torch.dcp.Reader.read_data` reads it.
    Every rank runs every exchange, even after an error of its own (its peers then read
    from storage what it could not send)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner import LoadPlan

    reader, plan, planner = prep.reader, prep.plan, prep.planner
    world = dist.get_world_size(pg) if dist.is_available() and dist.is_initialized() else 1
    LAST.clear()
    if world == 1 or not ENABLED:
        reader.read_data(plan, planner).wait()
        got = [_resolve(planner, ri) for ri, _, _, _ in _requests(plan)[0]]
        LAST.update(read_bytes=sum(int(t.numel()) * t.element_size() for t in got))
        return
    me = dist.get_rank(pg)
    err: Optional[BaseException] = None
    items: dict[tuple, tuple] = {}
    try:
        items = whole_chunk_items(prep)
    except Exception as e:  # noqa: BLE001 - raised after the exchanges
        err = e
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [(k, int(r[3].size)) for k, (_, r) in sorted(items.items())], group=pg)
    wants = [g or [] for g in gathered]
    reader_of = assign(wants)
    incoming = {k: reader_of[k] for k in items if reader_of.get(k, me) != me}
    skip = {id(items[k][0]) for k in incoming}
    # 1. What this rank reads from storage: everything but what it receives.
    if err is None:
        try:
            reader.read_data(LoadPlan([ri for ri in plan.items if id(ri) not in skip]), planner).wait()
        except Exception as e:  # noqa: BLE001 - raised after the exchanges
            err = e
    mine = {k for k, r in reader_of.items() if r == me}
    LAST.update(read_chunks=len(items) - len(incoming), incoming=len(incoming),
                read_bytes=sum(int(r[3].size) for k, (_, r) in items.items() if k not in incoming))
    # 2. The exchange: in round k, rank r sends to r + k what it read for it and receives
    # from r - k; every pair at once.
    arrived: set = set()
    sent = 0
    for k in range(1, world):
        to, frm = (me + k) % world, (me - k) % world
        send = [(_label(key), _torch().from_numpy(items[key][1][3])) for key, n in wants[to]
                if key in mine and key in items]
        expect = [key for key, r in incoming.items() if r == frm]
        if not send and not expect:
            continue
        by_label = {_label(key): key for key in expect}

        def dest(label: str, size: int, by_label: dict = by_label) -> Any:
            key = by_label.get(label)
            buf = items[key][1][3] if key is not None else None
            return _torch().from_numpy(buf) if buf is not None and buf.size == size else None

        def receive(inc: Any, label: Optional[str], data: Any, by_label: dict = by_label) -> None:
            key = by_label.get(label) if label is not None else None
            if key is not None and data is not None and data.data_ptr() == items[key][1][3].ctypes.data:
                arrived.add(key)

        try:
            transfer(send, err_text(me, err) if err is not None else None, to if send else None,
                     frm if expect else None, TAG_FANOUT + k * 65536, pg, receive, dest)
        except CheckpointError:
            pass  # a sender that could not send: what it owed is read from storage below
        sent += sum(int(t.numel()) for _, t in send) if err is None else 0
    if err is not None:
        raise err
    # 3. What arrived, checked against the stored CRC32s; what failed or never came, read
    # from storage here.
    rr = reader._open()
    again = [key for key in incoming if key not in arrived]
    for key in sorted(arrived):
        try:
            rr.verify_received([items[key][1]])
        except ChecksumError:
            again.append(key)
    if again:
        rr.fill_into([items[key][1] for key in sorted(again)])
    for key in incoming:
        planner.commit_tensor(items[key][0], _resolve(planner, items[key][0]).detach())
    LAST.update(sent_bytes=sent, received=len(arrived), read_again=len(again),
                read_bytes=LAST["read_bytes"] + sum(int(items[k][1][3].size) for k in again))


def _label(key: tuple) -> str:
    """A chunk's name on the wire: the tensor's name and the chunk's offsets."""
    return f"{key[0]}@{','.join(str(int(o)) for o in key[1])}"
