"""The tiered manager's local budget (:mod:`ckptstore.torch.tiered`, its docstring's
"Budget"; format-spec/tiers.md §The local budget): a byte budget per host for the local
tier's files and the snapshot buffers, checked at the first save, room made by retention
before a save, refusals that name the numbers. :class:`BudgetMixin` holds the manager's
methods for it; every decision is taken alike on every rank from one all-gather.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any, Callable, NamedTuple, Optional

from ..errors import BudgetError, CheckpointError
from . import _sharded as _d
from ._tier_local import PAGE, Usage, pages
from ._tier_wire import err_text as _err

# A step's files are known once written; before, they are estimated: from the previous save
# of this manager (each rank's files then, plus what its tensors grew by, plus a page per
# file for headers whose numbers got longer), or at the first save from the tensors' bytes
# plus these allowances (measured: 300 to 700 bytes of shard header and part descriptor per
# tensor; commit.json about 240 per tensor chunk).
_FIRST_PER_TENSOR = 1024
_FIRST_PER_RANK = 4 * PAGE  # the part descriptor's, the shard's and the lock file's last pages
_RECORD_PER_TENSOR = 512


def _size(n: int) -> str:
    """``n`` bytes as people read them, the exact number first."""
    if n >= 1 << 30:
        return f"{n:,} bytes ({n / (1 << 30):.2f} GiB)"
    if n >= 1 << 20:
        return f"{n:,} bytes ({n / (1 << 20):.1f} MiB)"
    return f"{n:,} bytes"


def _state_bytes(obj: Any) -> tuple[int, int]:
    """The bytes and the number of the tensors :func:`_snapshot` copies from ``obj`` (a
    DTensor's local shard): the snapshot buffers the save holds."""
    import torch

    DTensor = _d._dtensor_type()
    nbytes = count = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
            continue
        if isinstance(o, DTensor):
            shard = getattr(o, "_local_tensor", None)
            o = shard if isinstance(shard, torch.Tensor) else o.to_local()
        if isinstance(o, torch.Tensor):
            nbytes += o.numel() * o.element_size()
            count += 1
    return nbytes, count


class _StepBytes(NamedTuple):
    """One step in one host's local tier: its own ranks' files, the copies it keeps of
    other hosts' files, and its record (``commit.json``, the step's directories, the
    index's temporary copy)."""

    own: int
    replicas: int
    record: int

    @property
    def total(self) -> int:
        return self.own + self.replicas + self.record


class _Room(NamedTuple):
    """What a host must do to fit a step (:func:`_plan_room`): ``remove`` these steps;
    else ``wait`` for a persist to release these; else it is ``over`` by that many bytes
    even then. ``kept``: the steps that must stay (the newest complete, those pinned, those
    retention keeps), ``stays``: the bytes the tier holds after the removals."""

    remove: list[int]
    wait: list[int]
    over: int
    kept: list[int]
    pinned: list[int]
    stays: int


def _plan_room(budget: int, need: int, view: Usage, protect: set[int], replace: Optional[int]) -> _Room:
    """The oldest steps ``view`` must lose for ``need`` more bytes to fit ``budget``: the
    step saved again (``replace``) first, then the oldest indexed steps, never one of
    ``protect`` nor one a persist reads. A pure function of what every rank gathered, so
    every rank computes the same."""
    stays = view.total
    cands = [replace] if replace is not None and replace in view.steps and replace not in view.pinned else []
    cands += [s for s in sorted(view.steps) if s != replace and s not in protect and s not in view.pinned]
    remove: list[int] = []
    for s in cands:
        if stays + need <= budget:
            break
        remove.append(s)
        stays -= view.steps[s]
    kept = sorted(s for s in view.steps if s not in remove)
    pinned = [s for s in view.pinned if s not in protect and s != replace]
    if stays + need <= budget:
        return _Room(remove, [], 0, kept, pinned, stays)
    freed = sum(view.steps[s] for s in pinned)
    if pinned and stays - freed + need <= budget:
        return _Room(remove, pinned, 0, kept, pinned, stays)
    return _Room(remove, [], stays + need - budget, kept, pinned, stays)


def _protected(views: dict[int, Usage], step: int) -> dict[int, set[int]]:
    """Per host, the step a save must never remove to make room: the newest step every
    host has indexed (complete), or where none is, the host's own newest (not the step
    being saved again)."""
    sets = [set(v.steps) - {step} for v in views.values()]
    complete = set.intersection(*sets) if sets else set()
    out = {}
    for h, v in views.items():
        mine = set(v.steps) - {step}
        out[h] = {max(complete)} if complete else ({max(mine)} if mine else set())
    return out



class BudgetMixin:
    """The local budget of :class:`ckptstore.torch.tiered.CheckpointManager` (its module
    docstring, "Budget"; format-spec/tiers.md §The local budget): the methods that size a
    save against ``local_budget``, make room, and refuse with the numbers."""

    # What the manager (the class this is mixed into) provides.
    rank: int
    world: int
    host: int
    hosts: list[list[int]]
    leader: bool
    local: str
    local_budget: Optional[int]
    keep_last: int
    replicas: int
    timeout: float
    _tier: Any
    _sizes: Any
    _budget_warned: bool
    _gather: Callable[[Any], list[Any]]
    _phase: Callable[..., Any]
    _agree: Callable[[list[Any], str], None]
    _record: Callable[..., dict[str, Any]]



    def _check_fs_size(self) -> None:
        """At start (a host's first rank): warn when the budget is more than the file system
        holding the local tier can hold (a tmpfs sized below it fails a save when full)."""
        if self.local_budget is None:
            return
        try:
            st = os.statvfs(self.local)
        except (OSError, AttributeError):  # pragma: no cover - no statvfs
            return
        size = st.f_blocks * st.f_frsize
        if 0 < size < self.local_budget:
            warnings.warn(
                f"ckptstore: local_budget={_size(self.local_budget)} is more than the file system holding "
                f"{self.local} holds ({_size(size)}): a save fails once it is full, before the budget is "
                "reached (for /dev/shm: mount -o remount,size=..., or docker run --shm-size=...)",
                stacklevel=3,
            )

    def _estimate(self, tbs: list[int], nts: list[int]) -> tuple[list[int], int]:
        """Each rank's files of the next step and its record, in bytes (whole pages), from
        each rank's tensor bytes ``tbs`` and tensor count ``nts`` and the last save's sizes."""
        prev = self._sizes
        files = []
        for r in range(self.world):
            t, n = tbs[r], nts[r]
            if prev is not None:
                t0, n0, f0, k0 = prev["ranks"][r]
                files.append(pages(max(0, f0 + t - t0) + _FIRST_PER_TENSOR * max(0, n - n0)) + k0 * PAGE)
            else:
                files.append(pages(t + _FIRST_PER_TENSOR * n) + _FIRST_PER_RANK + PAGE * (t >> 32))
        record = prev["record"] + PAGE if prev is not None else pages(_RECORD_PER_TENSOR * sum(nts) + 4 * PAGE)
        return files, record

    def _step_bytes(self, files: list[int], record: int, replicas: Optional[int] = None) -> dict[int, _StepBytes]:
        """One step in each host's tier, from each rank's files (bytes) and the record's:
        its own ranks' files, those of its ``replicas`` ring predecessors, the record with
        the step's directories and the index's temporary copy."""
        reps = self.replicas if replicas is None else replicas
        n = len(self.hosts)
        own = {h: sum(files[r] for r in ranks) for h, ranks in enumerate(self.hosts)}
        return {h: _StepBytes(own[h], sum(own[(h - j) % n] for j in range(1, reps + 1)),
                              record + (3 + reps) * PAGE) for h in own}

    def _make_room(self, step: int, sd: Any) -> dict[str, Any]:
        """The budget before a save's snapshot (every rank, on the caller's thread, no save
        in flight): each host's first rank cleans its tier of leftovers and measures it, the
        ranks gather that with each rank's state size, and every rank decides the same from
        what they gathered: refuse a configuration that cannot fit (the first save), refuse
        a step that cannot fit now, wait for a persist to release a step (bounded by
        ``timeout``), or remove the oldest steps that make room. What the write needs of it."""
        budget = int(self.local_budget or 0)
        tb, nt = _state_bytes(sd)
        start = time.monotonic()
        while True:
            view, err = None, None
            if self.leader:
                try:
                    self._tier.clean()
                    view = self._tier.usage()
                except Exception as e:  # noqa: BLE001 - raised on every rank below
                    err = _err(self.rank, e)
            waited = time.monotonic() - start
            got = self._phase(f"step {step}: budget", self._gather, (tb, nt, view, err, waited))
            bad = [g[3] for g in got if g[3]]
            if bad:
                raise CheckpointError(f"ckptstore tiers: measuring the local tier for step {step} failed: "
                                      + "; ".join(bad))
            tbs, nts = [g[0] for g in got], [g[1] for g in got]
            views: dict[int, Usage] = {h: got[ranks[0]][2] for h, ranks in enumerate(self.hosts)}
            snap = {h: sum(tbs[r] for r in ranks) for h, ranks in enumerate(self.hosts)}
            files, record = self._estimate(tbs, nts)
            sizes = self._step_bytes(files, record)
            if self._sizes is None:
                self._check_config(budget, snap, files, record)
            protect = _protected(views, step)
            rooms = {h: _plan_room(budget, snap[h] + sizes[h].total, views[h], protect[h], step) for h in views}
            over = [h for h in rooms if rooms[h].over]
            waits = [h for h in rooms if rooms[h].wait]
            waited = max(g[4] for g in got)  # the ranks' longest wait: one decision, one message
            if over or (waits and waited >= self.timeout):
                h = max(over, key=lambda h: rooms[h].over) if over else waits[0]
                raise self._room_error(step, budget, h, snap[h], sizes[h], rooms[h], protect[h],
                                       waited if waits else None)
            if not waits:
                break
            if self.leader and self.host in waits:  # then all gather again
                left = self.timeout - (time.monotonic() - start)
                self._tier.wait_released(rooms[self.host].wait, min(left, self.timeout / 4))

        if any(rooms[h].remove for h in rooms):
            err = None
            if self.leader and rooms[self.host].remove:
                try:
                    self._tier.remove(rooms[self.host].remove)
                except Exception as e:  # noqa: BLE001 - raised on every rank below
                    err = _err(self.rank, e)
            self._phase(f"step {step}: make room", self._agree, [err], f"making room for step {step}")
            self._warn_fewer(step, budget, views, rooms, snap, sizes)
        return {"tensor_bytes": tbs, "tensors": nts, "snapshot": snap, "protect": protect}

    def _warn_fewer(self, step: int, budget: int, views: dict[int, Usage], rooms: dict[int, _Room],
                    snap: dict[int, int], sizes: dict[int, _StepBytes]) -> None:
        """Once (rank 0): the budget made a save remove a step ``keep_last`` would keep."""
        if self.rank != 0 or self._budget_warned:
            return
        for h, rm in rooms.items():
            older = sorted(s for s in views[h].steps if s != step)
            kept = older[len(older) - (self.keep_last - 1):] if self.keep_last > 1 else []
            lost = [s for s in rm.remove if s in kept]
            if lost:
                self._budget_warned = True
                want = snap[h] + max(self.keep_last, 2) * sizes[h].total
                warnings.warn(
                    f"ckptstore: local_budget={_size(budget)} holds fewer than keep_last={self.keep_last} steps "
                    f"of this size on host {h}: step(s) {rm.remove} removed to make room for step {step} "
                    f"(keep_last would keep {lost}; a step takes {_size(sizes[h].total)} there, the snapshot "
                    f"buffers {_size(snap[h])}); local_budget >= {want:,} keeps keep_last steps (warned once)",
                    stacklevel=6,
                )
                return

    def _budget_error(self, message: str, **numbers: Any) -> BudgetError:
        e = BudgetError(message)
        e.keep_last = self.keep_last
        for k, v in numbers.items():
            setattr(e, k, v)
        return e

    def _check_config(self, budget: int, snap: dict[int, int], files: list[int], record: int) -> None:
        """The first save: raise :class:`BudgetError` unless every host holds its snapshot
        buffers and ``keep_last`` steps (2 at least: the newest stays while the next is
        written); the message names the numbers of the host short of most, and what fits."""
        n = max(self.keep_last, 2)
        sizes = self._step_bytes(files, record)
        need = {h: snap[h] + n * sizes[h].total for h in sizes}
        h = max(need, key=lambda h: need[h] - budget)
        if need[h] <= budget:
            return
        b, per = sizes[h], sizes[h].total
        # The most steps every host holds beside its snapshot buffers.
        fit = min((budget - snap[x]) // sizes[x].total if budget > snap[x] else 0 for x in sizes)
        fits = [f"keep_last={fit}"] if fit >= 2 else []
        for r in range(self.replicas - 1, -1, -1):
            alt = self._step_bytes(files, record, r)
            if all(snap[x] + n * alt[x].total <= budget for x in alt):
                fits.append(f"replicas={r}")
                break
        fits.append(f"local_budget >= {max(need.values()):,}")
        least = max(snap[x] + 2 * sizes[x].total for x in sizes)
        none = f"no keep_last fits (each needs 2 steps: local_budget >= {least:,}); " if fit < 2 < n else ""
        twice = " (the newest step stays while the next is written: 2 steps at least)" if self.keep_last < 2 else ""
        raise self._budget_error(
            f"ckptstore tiers: local_budget={_size(budget)} per host cannot hold this configuration: host {h} "
            f"(ranks {self.hosts[h]}) needs {_size(need[h])} = snapshot buffers {_size(snap[h])} + {n} steps x "
            f"{_size(per)} (own part {_size(b.own)} + replicas {_size(b.replicas)} for replicas={self.replicas} + "
            f"record {_size(b.record)}) for keep_last={self.keep_last}{twice}; a step's files estimated from its "
            f"tensors' bytes at the first save; {none}fits: {', or '.join(fits)}; nothing was saved",
            budget=budget, host=h, needed=need[h], snapshot=snap[h], own=b.own, replicas=b.replicas,
            record=b.record, kept=0, fits_keep_last=fit if fit >= 2 else None,
        )

    def _room_error(self, step: int, budget: int, h: int, snap: int, size: _StepBytes, room: _Room,
                    protect: set[int], waited: Optional[float], written: bool = False) -> BudgetError:
        """A step that does not fit host ``h`` even after the removals allowed (and, with
        ``waited``, after waiting that long for a persist); ``written``: its own part is
        written already (counted in what the tier keeps), and is removed."""
        files = size.replicas + size.record if written else size.total
        needed = snap + files + room.stays
        why = []
        newest = [s for s in room.kept if s in protect]
        if newest:
            why.append(f"step {newest[0]}, the newest complete")
        if room.pinned:
            w = f"; waited {waited:.0f} s for it" if waited is not None else ""
            why.append(f"step(s) {room.pinned}, read by a persist in flight{w}")
        others = [s for s in room.kept if s not in protect and s not in room.pinned]
        if others:
            why.append(f"step(s) {others}")
        if written:
            why.append(f"step {step}'s own part, larger than estimated, now removed")
        least = snap + 2 * size.total
        return self._budget_error(
            f"ckptstore tiers: step {step} does not fit local_budget={_size(budget)} on host {h}: it needs "
            f"{_size(needed)} = snapshot buffers {_size(snap)} + the step's files {_size(files)} (own part "
            f"{_size(size.own)}{' (written)' if written else ''} + replicas {_size(size.replicas)} + record "
            f"{_size(size.record)}) + {_size(room.stays)} the tier keeps ({'; '.join(why) or 'its index'}); "
            f"nothing of step {step} was kept, the saved steps stand; fits: local_budget >= {needed:,} now, "
            f">= {least:,} once no older step must stay",
            budget=budget, host=h, needed=needed, snapshot=snap, own=size.own, replicas=size.replicas,
            record=size.record, kept=room.stays, fits_keep_last=None,
        )

    def _fit_written(self, step: int, room: dict[str, Any], all_files: dict[Any, Any], record: dict[str, Any],
                     views: dict[int, Usage]) -> Optional[str]:
        """The budget once every rank's part is written (its exact size known, the tier
        measured by each host's first rank), before the replicas arrive: remove the older
        steps allowed to make room for the replicas and the record (this rank's error, as
        text), or, when they cannot fit, remove the step's own part and raise
        :class:`BudgetError` on every rank alike."""
        budget = int(self.local_budget or 0)
        files = [sum(pages(v[0]) for v in all_files[r].values()) for r in range(self.world)]
        rec = pages(len(json.dumps(record, sort_keys=True)))
        sizes = self._step_bytes(files, rec)
        snap = room["snapshot"]
        rooms = {h: _plan_room(budget, snap[h] + sizes[h].replicas + sizes[h].record, views[h],
                               room["protect"][h], None) for h in views}
        over = [h for h in rooms if rooms[h].over]
        if over:
            if self.leader:
                try:
                    self._tier.forget(step)
                except Exception:  # noqa: BLE001 - not indexed: clean() removes it later
                    pass
            h = max(over, key=lambda h: rooms[h].over)
            raise self._room_error(step, budget, h, snap[h], sizes[h], rooms[h], room["protect"][h], None, True)
        if self.leader and rooms[self.host].remove:
            try:
                self._tier.remove(rooms[self.host].remove)
            except Exception as e:  # noqa: BLE001 - agreed on with the replicas
                return _err(self.rank, e)
        return None
