"""The fast-tier restore of the tiered manager (:mod:`ckptstore.torch.tiered`): a host
builds a step out of its own copies and placeholders, every rank plans its load, the hosts
fetch exactly the byte ranges their ranks read, every rank loads (format-spec/tiers.md
§Choosing a step). Functions of the manager (``mgr``), every rank calling each.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Optional

from .. import _ckptstore, atomic
from .. import commit as _commit
from .._faults import fault_point
from ..errors import CheckpointError
from . import _sharded as _d
from ._dtypes import _torch
from ._fanout import whole_chunk_items
from ._tier_local import check_arrival, new_stage, saved_host, shard_head_len
from ._tier_wire import Arrival, pwrite_all, transfer, write_fsync
from ._tier_wire import dist_or_none as _dist
from ._tier_wire import err_text as _err
from .dcp import _plan_ranges, _requests

#: Base tags of a restore's rounds: the headers, then the byte ranges (+ 65536 k in round k).
TAG_HEADS = 1 << 24
TAG_RANGES = 1 << 25
TAG_DIRECT = 1 << 26
TAG_RECOPY = 1 << 28
TAG_NEED = 1 << 29


def restore_fast(mgr: Any, step: int, f: dict, req: Any, repersist: bool) -> dict:
    """Every host builds the step's checkpoint in ``.restore-<step>`` out of what it
    holds (its copies of ranks' files, linked) and, for every other rank, its part
    descriptor and shard headers sent by a host holding them, each shard a sparse
    placeholder of its recorded size behind its real header; and commits it. Each rank
    then works out the byte ranges its load reads (DCP's plan against the stage), the
    hosts fetch the ranges of placeholders that their ranks read from a holder, and
    every rank loads: only the bytes some rank reads move between hosts. (A range
    never fetched is never read; were it read, its CRC check would fail the load.)
    ``repersist``: the step is due for the persistent tier but not there (its persist
    was interrupted): rank 0's host then fetches every byte and persists its stage."""
    rec, holders = f["record"], f["holders"]
    cid, world, files = rec["checkpoint_id"], rec["world_size"], rec["files"]
    stage = os.path.join(mgr.local, f".restore-{step}")
    sdir = mgr._tier.step_dir(step)
    n_hosts = len(mgr.hosts)
    owner = {n: int(r) for r, fs in files.items() for n in fs}

    def holder(r: int, d: int) -> int:  # the host that sends rank r's bytes to host d
        return holders[r][(d + r) % len(holders[r])]

    def src_path(name: str) -> str:
        return os.path.join(sdir, f"src-{saved_host(rec, owner[name])}", name)

    absent = {d: [r for r in range(world) if d not in holders[r]] for d in range(n_hosts)}
    placeholders = {n for r in absent[mgr.host] for n in files[str(r)] if not n.startswith("part-")}
    err = None
    if mgr.leader:
        try:
            if os.path.exists(stage):
                shutil.rmtree(stage)
            os.makedirs(stage)
            for r in range(world):
                if r not in absent[mgr.host]:
                    for name in files[str(r)]:
                        try:
                            os.link(src_path(name), os.path.join(stage, name))
                        except OSError:
                            shutil.copyfile(src_path(name), os.path.join(stage, name))
        except Exception as e:  # noqa: BLE001
            err = _err(mgr.rank, e)

        def heads(src_h: int, dst_h: int) -> list:  # a part descriptor whole, a shard's header
            return [(n, src_path(n)) if n.startswith("part-") else (n, src_path(n), 0, None)
                    for r in absent[dst_h] if holder(r, dst_h) == src_h for n in sorted(files[str(r)])]

        def put_head(src_h: int, name: str, data: Any) -> None:
            if owner.get(name) not in absent[mgr.host]:
                raise CheckpointError(f"host {src_h} sent {name}, which this host did not ask for")
            size = files[str(owner[name])][name][0]
            if name not in placeholders:
                check_arrival(name, data, files[str(owner[name])], src_h)
            elif data.numel() > size:
                raise CheckpointError(f"host {src_h} sent {data.numel()} header bytes of {name}, "
                                      f"which is {size} bytes")
            with open(os.path.join(stage, name), "wb") as fh:  # a scratch copy: no fsync
                fh.write(data.numpy())
                fh.truncate(size)

        err = rounds(mgr, f"restore: step {step} heads", TAG_HEADS, heads, put_head, err)
        if err is None:
            try:
                parts = []
                for r in range(world):
                    with open(os.path.join(stage, f"part-{cid}-r{r}.json"), "rb") as fh:
                        parts.append(fh.read())
                _commit(stage, cid, parts=parts, world_size=world, metadata=rec["metadata"])
            except Exception as e:  # noqa: BLE001
                err = _err(mgr.rank, e)
    mgr._phase(f"restore: step {step} staged", mgr._agree, [err], f"assembling step {step}")

    # What each rank's load reads of the placeholders; per host, the union of its ranks'.
    # (Every rank plans, placeholders or not: taking the model's state dict is the same
    # call on every rank.) The load planned here is the one run below: planned once.
    need: list = []
    perr = None
    prep = None
    into: dict[str, tuple] = {}  # this rank's direct items: key -> (read item, request)
    pre = None  # the part of the plan read from this host's own copies while the rest arrives
    try:
        rr = _ckptstore.Checkpoint(stage, lazy=True)
        prep = _d._prepare(stage, json.loads(rr.metadata_json()), rr.checkpoint_id, req.model, req.optimizer,
                           True, req.allow_optimizer_change)
        del rr
        _d._plan(prep, mgr.pg)
        try:
            if not repersist:  # (a host that persists the step needs every byte in its stage)
                into = _direct_items(prep, placeholders)
            need = [(os.path.basename(p), b, e)
                    for p, b, e in _plan_ranges(prep.reader, prep.plan, {id(ri) for ri, _ in into.values()})
                    if os.path.basename(p) in placeholders]
            pre = _split_held(prep, placeholders, into)
        finally:
            prep.reader.reset()  # closed while the fetch fills the placeholders; the load reopens
        if pre is not None:
            _start_pre_read(prep, pre)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        perr = _err(mgr.rank, e)
        into = {}
    direct = [(k, *_split_key(k), int(r[3].size)) for k, (_, r) in sorted(into.items())]
    blob = json.dumps(need).encode() if need else b""
    got = mgr._phase(f"restore: step {step} plan", mgr._gather, (mgr.host, len(blob), perr, len(direct)))
    mgr._agree([g[2] for g in got], f"planning the load of step {step}")
    wanted: dict[int, dict[str, list]] = {}
    lists = mgr._phase(f"restore: step {step} ranges to the leaders", _to_leaders, mgr, got, blob)
    for r, ranges in lists.items():
        for name, begin, end in ranges:
            wanted.setdefault(got[r][0], {}).setdefault(name, []).append((int(begin), int(end)))
    if repersist:  # rank 0's host persists from its stage: every byte of it
        h0 = next(h for h, rs in enumerate(mgr.hosts) if 0 in rs)
        for r in absent[h0]:
            for name, (size, _) in files[str(r)].items():
                if not name.startswith("part-"):
                    wanted.setdefault(h0, {})[name] = [(0, int(size))]
    err = None
    if mgr.leader:
        def ranges(src_h: int, dst_h: int) -> list:
            return [(f"{n}@{b}", src_path(n), b, e - b) for n, rs in sorted(wanted.get(dst_h, {}).items())
                    if holder(owner[n], dst_h) == src_h for b, e in _merge(rs)]

        mine = {f"{n}@{b}": (n, b, e - b) for n, rs in wanted.get(mgr.host, {}).items() for b, e in _merge(rs)}
        fds: dict[str, int] = {}
        failed: dict[str, str] = {}  # key -> why its bytes are not all in the stage

        def dest(key: str, size: int) -> Any:  # each chunk written into the placeholder on arrival
            if key not in mine or mine[key][2] != size:
                return None
            name, begin, _ = mine[key]

            def write(offset: int, chunk: Any) -> None:
                if key in failed:
                    return
                try:
                    if name not in fds:
                        fds[name] = os.open(os.path.join(stage, name), os.O_WRONLY)
                    pwrite_all(fds[name], chunk.numpy(), begin + offset)
                except OSError as e:  # a full disk, say: the step is not assembled here
                    failed[key] = f"{os.path.join(stage, name)}: {e.strerror or e}"
            return write

        def put_range(src_h: int, key: str, data: Any) -> None:
            if data is None:  # written chunk by chunk (`dest`)
                if key in failed:
                    raise CheckpointError(f"writing {key} from host {src_h} failed: {failed[key]}")
                return
            if key not in mine or data.numel() != mine[key][2] or data.numel():
                raise CheckpointError(
                    f"host {src_h} sent {key} ({data.numel()} bytes), which this host did not ask for")

        try:  # a scratch copy: no fsync
            err = rounds(mgr, f"restore: step {step} fetch", TAG_RANGES, ranges, put_range, None, dest)
        finally:
            for fd in fds.values():
                os.close(fd)
    # Straight into the fresh tensors: each rank receives the whole stored chunks that
    # are exactly one of its destinations from a rank of the holding host, checked against
    # the stored CRC32s inside the load (the ranks agree there, before anything changes).
    derr = None
    if any(g[3] for g in got):
        derr = direct_rounds(mgr, step, direct, lambda n, d: holder(owner[n], d), src_path, into)
    loaded = False
    try:
        mgr._phase(f"restore: step {step} assembled", mgr._agree, [err or derr], f"assembling step {step}")
        fault_point("tiers.restore", step, mgr.rank)
        if prep is not None:
            _settled(prep)  # (its error, if any, is raised and agreed inside the load)
            prep.reader.received = {id(ri): r[3] for ri, r in into.values()}
            prep.fan_out = False  # every byte is on this host or here already (every rank)
        extra = mgr._load(step, stage, req, prep)
        loaded = True
        return extra
    finally:
        if prep is not None:
            _settled(prep)  # nothing reads the stage when it goes
        dist = _dist()
        try:
            if dist:
                mgr._phase(f"restore: step {step} done", dist.barrier, mgr.pg)
        finally:
            if mgr.rank == 0 and loaded and repersist and mgr._persister is not None:
                mgr._persister.start(step, rec, stage, None, remove_src=True)
            elif mgr.leader and os.path.exists(stage):
                shutil.rmtree(stage, ignore_errors=True)


def _to_leaders(mgr: Any, got: list, blob: bytes) -> dict[int, list]:
    """Every rank's byte ranges to read of the placeholders (``blob``: JSON, its length in
    ``got[rank][1]``), sent to every host's first rank, which alone fetches: ``{rank:
    ranges}`` there, ``{}`` elsewhere. Point to point from the ranks that have any (an
    all-gather would give every rank a buffer of world x the longest list: 212 MiB at 1,024
    ranks x 10,000 tensors with one host replaced)."""
    torch = _torch()
    leaders = [rs[0] for rs in mgr.hosts]
    bufs: dict[int, Any] = {}
    dist = _dist()
    if dist:
        works = []
        if blob:
            out = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            works += [dist.isend(out, ld, group=mgr.pg, tag=TAG_NEED) for ld in leaders if ld != mgr.rank]
        if mgr.leader:
            for r, g in enumerate(got):
                if g[1] and r != mgr.rank:
                    bufs[r] = torch.empty(g[1], dtype=torch.uint8)
                    works.append(dist.irecv(bufs[r], r, group=mgr.pg, tag=TAG_NEED))
        for w in works:
            w.wait()
    if not mgr.leader:
        return {}
    out_lists = {r: json.loads(bytes(b.numpy())) for r, b in bufs.items()}
    if blob:
        out_lists[mgr.rank] = json.loads(blob)
    return out_lists


def fetch_record(mgr: Any, step: int, f: dict, notes: dict) -> bool:
    """``f["record"]``, the fast-tier candidate's record, from the first host that holds
    it (its first rank loads it, checked against its index, and broadcasts it): the
    scan gathered only its summary. Whether every rank now has it (else a note why)."""
    if f["record"] is not None:
        return True
    h = min(f["from"])
    src = mgr.hosts[h][0]
    got: Any = None
    if mgr.rank == src:
        try:
            got = mgr._tier.load_record(step)
            if got.get("checkpoint_id") != f["summary"]["checkpoint_id"]:
                got = f"host {h}: the record of step {step} changed since the scan"
        except CheckpointError as e:
            got = f"host {h}: {e}"
    got = mgr._phase(f"restore: record of step {step}", mgr._bcast, got, src)
    if isinstance(got, str):
        notes.setdefault(step, []).append(got)
        return False
    f["record"] = got
    return True


def copies_missing(mgr: Any, f: dict) -> dict[int, dict[int, int]]:
    """Where step ``f`` (a fast-tier candidate: its record and the current hosts holding
    each saved rank's part) lacks copies: each saved host's files ``src-<x>`` belong on
    ``1 + replicas`` live hosts, host ``x`` (modulo the hosts there are now) and the
    ``replicas`` after it on the ring, as a save places them. ``{receiving host: {x:
    sending host}}``, the sender a host that holds every rank of ``src-<x>``; empty when
    every copy is in place (or none can be made)."""
    rec, holders = f["record"], f["holders"]
    n = len(mgr.hosts)
    want: dict[int, dict[int, int]] = {}
    for x, ranks in enumerate(rec["hosts"]):
        have = set.intersection(*(set(holders.get(r, ())) for r in ranks)) if ranks else set()
        if not have:
            continue
        for j in range(min(1 + mgr.replicas, n)):
            d = (x + j) % n
            if d not in have:
                want.setdefault(d, {})[x] = min(have)
    return want


def recopy(mgr: Any, step: int, f: dict) -> Optional[str]:
    """After a restore of step ``f`` (every rank, on the manager's writer thread): copy the
    whole files each host should hold of the step (:func:`copies_missing`) from a host that
    holds them, each checked against the record's size and CRC32 as it lands, written with
    fsync into a stage published as ``step-<n>/src-<x>/`` in one rename; then a host that
    had no record of the step writes it (``commit.json``, then ``index.json``), so a second
    loss before the next save finds the step on the hosts left. The first error as text,
    or None (the step stays restorable from where it was)."""
    rec = f["record"]
    want = copies_missing(mgr, f)
    if not want:
        return None
    tier = mgr._tier
    sdir = tier.step_dir(step)
    files = {x: {n: v for r in ranks for n, v in rec["files"][str(r)].items()} for x, ranks in enumerate(rec["hosts"])}
    err: Optional[str] = None
    stages: dict[int, str] = {}
    arrivals: dict[str, Any] = {}
    done: set = set()
    if mgr.leader:
        def items(src_h: int, dst_h: int) -> list:  # whole files, "src-<x>/<name>"
            return [(f"src-{x}/{name}", os.path.join(tier.src_dir(step, x), name))
                    for x, h in sorted(want.get(dst_h, {}).items()) if h == src_h for name in sorted(files[x])]

        def dest(key: str, size: int) -> Any:
            x, name = _src_key(key)
            if want.get(mgr.host, {}).get(x) is None or name not in files[x]:
                return None  # a buffer: `put` refuses it
            if x not in stages:
                os.makedirs(sdir, exist_ok=True)
                stages[x] = new_stage(sdir, f"src-{x}")
            arrivals[key] = Arrival(os.path.join(stages[x], name))
            return arrivals[key].write

        def put(src_h: int, key: str, data: Any) -> None:
            x, name = _src_key(key)
            if data is None:
                check_arrival(name, arrivals.pop(key).finish(), files[x], src_h)
            elif want.get(mgr.host, {}).get(x) is not None and name in files[x]:
                if x not in stages:
                    os.makedirs(sdir, exist_ok=True)
                    stages[x] = new_stage(sdir, f"src-{x}")
                check_arrival(name, data, files[x], src_h)
                write_fsync(os.path.join(stages[x], name), data.numpy())
            else:
                raise CheckpointError(f"host {src_h} sent {key}, which this host did not ask for")
            done.add(key)

        try:
            err = rounds(mgr, f"copies of step {step}", TAG_RECOPY, items, put, None, dest)
        finally:
            for a in arrivals.values():
                a.close()
        if err is None:
            try:
                for x in sorted(want.get(mgr.host, {})):
                    missing = [n for n in files[x] if f"src-{x}/{n}" not in done]
                    if missing:
                        raise CheckpointError(f"src-{x}: {len(missing)} file(s) never arrived, e.g. {missing[0]}")
                    atomic.fsync_dir(stages[x])
                    atomic.publish_dir(stages[x], tier.src_dir(step, x))
                if want.get(mgr.host) and step not in tier.read_index():
                    tier.record(step, rec)
            except Exception as e:  # noqa: BLE001
                err = _err(mgr.rank, e)
        for stage in stages.values():
            if os.path.exists(stage):
                shutil.rmtree(stage, ignore_errors=True)
    return err


def _src_key(key: str) -> tuple[int, str]:
    """A recopied file's key ``"src-<x>/<name>"`` as ``(x, name)``."""
    head, name = key.split("/", 1)
    return int(head[4:]), name


def _split_key(key: str) -> tuple[str, int]:
    """A direct item's key ``"<shard>@<begin>"`` as ``(shard, begin)``."""
    name, begin = key.rsplit("@", 1)
    return name, int(begin)


def _direct_items(prep: Any, placeholders: set) -> dict[str, tuple]:
    """The read items of ``prep``'s plan that can be received straight into their
    destinations (:func:`ckptstore.torch._fanout.whole_chunk_items`) whose chunk lies in a
    placeholder shard (bytes this host does not hold): ``{"<shard>@<begin>": (read item,
    (name, offsets, shape, destination bytes))}``."""
    rr = prep.reader._open()
    out: dict[str, tuple] = {}
    for ri, req in whole_chunk_items(prep).values():
        ranges = rr.byte_ranges([req[:3]])
        if len(ranges) != 1 or os.path.basename(ranges[0][0]) not in placeholders:
            continue
        f, b, e = ranges[0]
        key = f"{os.path.basename(f)}@{b}"
        if req[3].size == e - b and key not in out:
            out[key] = (ri, req)
    return out


def _split_held(prep: Any, placeholders: set, into: dict) -> Optional[Any]:
    """The read items of ``prep``'s plan (its reader open) whose bytes lie wholly in shards
    this host holds (no placeholder) and that are not received directly (``into``), as a
    plan of their own, taken out of ``prep.plan``; None when there are none. Those can be
    read while the other bytes travel."""
    rr = prep.reader._open()
    direct = {id(ri) for ri, _ in into.values()}
    held = set()
    for ri, name, offs, shape in _requests(prep.plan)[0]:
        if id(ri) in direct or 0 in shape:
            continue
        if all(os.path.basename(f) not in placeholders for f, _, _ in rr.byte_ranges([(name, offs, shape)])):
            held.add(id(ri))
    if not held:
        return None
    pre = replace(prep.plan, items=[ri for ri in prep.plan.items if id(ri) in held])
    prep.plan = replace(prep.plan, items=[ri for ri in prep.plan.items if id(ri) not in held])
    return pre


def _start_pre_read(prep: Any, pre: Any) -> None:
    """Read the plan ``pre`` (:func:`_split_held`) into its fresh destinations in a
    thread, each block CRC-checked as it is copied (the engine runs with the interpreter
    released), while this rank's other bytes arrive; ``prep.pre_read`` is its future, which
    the load waits on first (its error is the load's, agreed there like any read's)."""
    done: Future = Future()

    def run() -> None:
        try:
            prep.reader.read_data(pre, prep.planner).wait()
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - raised by the load, on its thread
            done.set_exception(e)
        finally:
            prep.reader.reset()

    prep.pre_read = done
    threading.Thread(target=run, name="ckptstore-pre-read", daemon=True).start()


def _settled(prep: Any) -> None:
    """Wait until the pre-read of ``prep`` (if any) has ended, without raising its error
    (the load raises it); its reader is closed then."""
    if prep.pre_read is not None:
        prep.pre_read.exception()


def direct_rounds(mgr: Any, step: int, wants: list, holder: Any, src_path: Any, into: dict) -> Optional[str]:
    """Every rank receives its direct items (``into``; ``wants``: this rank's, ``(key,
    shard, begin, size)``) straight into their destinations, each from a rank of the host
    that holds its shard (``holder(shard, host)``) reading its local tier: in round ``(k,
    j)`` the ranks of host h send to ranks of host h + k, the receiver with local index i
    from the sender with local index ``i % (ranks of h)``, in sub-round ``i // (ranks of
    h)``; every pair at once. Each round opens with the receiver telling its sender which
    items it wants of that host (no rank holds the others' lists: at 1,024 ranks x 30,000
    chunks they would be gigabytes on every rank). The first error as text, or None; every
    round runs (the peers expect its bytes) even after an error."""
    torch = _torch()
    hosts, n_hosts = mgr.hosts, len(mgr.hosts)
    where = {r: (h, i) for h, rs in enumerate(hosts) for i, r in enumerate(rs)}
    me_h, me_i = where[mgr.rank]
    box: dict[str, Any] = {"err": None, "left": set(into)}

    def asked(q: int, data: Any) -> tuple[list, Optional[str]]:  # what rank q asked of this host
        try:
            got = json.loads(bytes(data.numpy()))
            out = []
            for key, name, begin, size in got:
                if key != f"{name}@{begin}" or holder(name, where[q][0]) != me_h:
                    raise CheckpointError(f"rank {q} asked host {me_h} for {key}, which it does not send there")
                out.append((key, src_path(name), int(begin), int(size)))
            return out, None
        except Exception as e:  # noqa: BLE001 - sent to q in the header: q raises it
            return [], _err(mgr.rank, e)

    for k in range(1, n_hosts):
        subs = max(-(-len(hosts[(h + k) % n_hosts]) // len(hosts[h])) for h in range(n_hosts))
        for j in range(subs):
            to_h, from_h = (me_h + k) % n_hosts, (me_h - k) % n_hosts
            qi = me_i + j * len(hosts[me_h])
            q = hosts[to_h][qi] if qi < len(hosts[to_h]) else None
            p = hosts[from_h][me_i % len(hosts[from_h])] if me_i // len(hosts[from_h]) == j else None
            expect = [w for w in wants if holder(w[1], me_h) == from_h] if p is not None else []
            tag = TAG_DIRECT + ((k - 1) * subs + j) * 65536
            ask = torch.frombuffer(bytearray(json.dumps(expect).encode()), dtype=torch.uint8)
            inbox: dict[str, Any] = {}

            def take(inc: Any, key: Optional[str], data: Any, box_: dict = inbox) -> None:
                if key is not None:
                    box_["wants"] = data

            mgr._phase(f"restore: step {step} direct round {k}.{j} asks", transfer,
                       [("wants", ask)] if p is not None else [], None, p, q, tag, mgr.pg, take)
            send, why = asked(q, inbox.get("wants")) if q is not None else ([], None)

            def dest(key: str, size: int) -> Any:
                got = into.get(key)
                return torch.from_numpy(got[1][3]) if got is not None and got[1][3].size == size else None

            def receive(inc: Any, key: Optional[str], data: Any, src: Any = p) -> None:
                if box["err"]:
                    return
                try:
                    if key is None:
                        if inc.error:
                            raise CheckpointError(f"rank {src} could not send its files: {inc.error}")
                        return
                    got = into.get(key)
                    if got is None or data is None or data.data_ptr() != got[1][3].ctypes.data:
                        raise CheckpointError(f"rank {src} sent {key}, which rank {mgr.rank} did not ask for")
                    box["left"].discard(key)
                except Exception as e:  # noqa: BLE001
                    box["err"] = _err(mgr.rank, e)

            # Every pair that exchanged lists exchanges headers (an empty list too: neither
            # side acts on what it cannot be sure the other side knows).
            mgr._phase(f"restore: step {step} direct round {k}.{j}", transfer, send, why, q, p, tag + 16,
                       mgr.pg, receive, dest)
    if box["err"] is None and box["left"]:
        box["err"] = _err(mgr.rank, CheckpointError(
            f"step {step}: {len(box['left'])} chunk(s) never arrived, e.g. {sorted(box['left'])[0]}"))
    return box["err"]


def rounds(mgr: Any, label: str, tag: int, items: Any, put: Any, err: Optional[str],
           dest: Any = None) -> Optional[str]:
    """Between the hosts' first ranks, in rounds: in round k every host sends to host
    + k ``items(this host, host + k)`` (``transfer``'s items) and receives from host - k,
    all pairs at once, one item each way at a time, ``put(source host, key, data)``
    keeping each arrival (received where ``dest(key, size)`` says, as ``transfer``).
    Every round runs (the peers expect its bytes) even after an
    error; the first error as text (``err`` if given), or None."""
    n_hosts = len(mgr.hosts)
    for k in range(1, n_hosts):
        to_h, from_h = (mgr.host + k) % n_hosts, (mgr.host - k) % n_hosts
        if not any(items(h, (h + k) % n_hosts) for h in range(n_hosts)):
            continue
        send, expect = items(mgr.host, to_h), items(from_h, mgr.host)
        out: list = []
        oerr = None
        try:  # an item of size None: a shard's header (its length read here, the sender)
            out = [(x[0], x[1], 0, shard_head_len(x[1])) if len(x) == 4 and x[3] is None else x for x in send]
        except Exception as e:  # noqa: BLE001 - sent instead of the items
            oerr = _err(mgr.rank, e)
        box: dict[str, Any] = {"err": err}

        def receive(inc: Any, key: Optional[str], data: Any, src_h: int = from_h, box: dict = box) -> None:
            if box["err"]:
                return
            try:
                if key is None:
                    if inc.error:
                        raise CheckpointError(f"host {src_h} could not send its files: {inc.error}")
                    return
                put(src_h, key, data)
            except Exception as e:  # noqa: BLE001
                box["err"] = _err(mgr.rank, e)

        mgr._phase(f"{label} round {k}", transfer, out, oerr, mgr.hosts[to_h][0] if send else None,
                    mgr.hosts[from_h][0] if expect else None, tag + k * 65536, mgr.pg, receive, dest)
        err = box["err"]
    return err


def _merge(ranges: list) -> list:
    """Byte ranges ``(begin, end)`` sorted, those that touch or overlap merged."""
    out: list = []
    for b, e in sorted(ranges):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out
