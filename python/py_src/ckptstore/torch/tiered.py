"""Tiered checkpoints across hosts: every save lands in each host's local tier (host
memory or node-local disk) with copies of each host's part on other hosts, some are also
persisted to a directory or ``s3://`` prefix, and a restore takes the newest step every
rank can read whole from some tier, checked and resharded.

::

    from ckptstore.torch.distributed import CheckpointManager

    with CheckpointManager(local="/dev/shm/ckpt", persistent="s3://bucket/run",
                           persist_every=100, replicas=1,            # every rank
                           local_budget=48 << 30) as mgr:            # bytes per host
        step = mgr.restore_latest(model, optimizer)                  # None: nothing saved yet
        ...
        mgr.save(step, model, optimizer, extra={"epoch": 3})         # every rank, non-blocking
        mgr.wait()                                                   # raises a failed save's error

**Save** (every rank). :meth:`CheckpointManager.save` copies the model's and optimizer's
tensors (DTensor shards as they are) into snapshot buffers it reuses from save to save
(:class:`ckptstore.torch.internal.AsyncSaver`; a save first waits for the one before it) and
returns; a writer thread then, on the manager's own gloo process group:

1. writes every rank's part into ``step-<n>/src-<h>/`` of its host's local tier
   (:class:`ckptstore.torch.dcp.Writer`: the state dict and metadata of
   :func:`ckptstore.torch.distributed.save`, each rank planning its own part when every
   rank's entries agree, with no global plan: ``_tier_local.save_part``; nothing is
   committed), gathers every file's size and CRC32, and broadcasts the step's record;
2. copies each host's files to the ``replicas`` next hosts of the ring (host h to h+1, ...,
   never itself), its first rank sending to theirs over torch.distributed point-to-point
   in 8 MiB chunks; each file is checked against its writer's CRC32 on arrival, written
   with fsync into a staging directory published as ``step-<n>/src-<h>/`` in one rename;
3. writes the step's record durably on every host (``commit.json``, then
   ``index.json``): **a step is saved when it is in an index**;
4. applies retention (``keep`` steps per local tier);
5. on a step that is a multiple of ``persist_every`` (or saved with ``persist=True``), hands the step's committed local
   files to each host's persist thread (:mod:`ckptstore.torch._tier_persist`): copied into
   ``<persistent>/step-<n, 8+ digits>/`` and committed there by rank 0, an ordinary
   ckptstore checkpoint; the next steps are saved meanwhile.

Any failure in 1-3 raises on every rank from :meth:`~CheckpointManager.wait` (or the next
save), and nothing is recorded for that step. A host lost during a save (its link down: no
FIN reaches the peers) makes the survivors' collectives fail after ``timeout`` seconds; the
error names the ranks and hosts that never reached the phase (each rank marks its progress
in the job's rendezvous store). A failed persist is raised by :meth:`~CheckpointManager.wait`
on every rank; the steps on the fast tier stand.

**Budget** (``local_budget``: bytes per host; ``None``, the default: none). What a host
holds for checkpoints, its local tier's files (its own ranks' parts and the replicas it
keeps for other hosts, counted as ``du`` counts them: allocated pages, directories included)
and its ranks' snapshot buffers, stays within it. Before a save's snapshot is taken (the
save before it finished), each host's first rank removes leftovers from its tier and
measures it; the ranks gather that with every rank's state size, and every rank takes the
same decision from what they gathered:

- at the manager's first save, a configuration that cannot hold its snapshot buffers and
  ``keep_last`` steps (2 at least: the newest stays while the next is written) on some host
  is refused, nothing written: :class:`ckptstore.errors.BudgetError` on every rank, naming
  the budget, the host, the snapshot bytes, a step's own part, replica and record bytes,
  ``keep_last``, and what fits (a smaller ``keep_last``, fewer ``replicas``, the least
  budget);
- a step that does not fit beside what the tier holds removes the oldest steps first (the
  step saved again first; never the newest step every host holds, never a step a persist is
  still copying), else waits for an in-flight persist to release a step (at most
  ``timeout`` seconds in all), else is refused (:class:`~ckptstore.errors.BudgetError` from
  ``save``, on every rank, with the numbers), nothing removed.

A step's files are estimated before they exist: from the last save's (each rank's files,
grown by what its tensors grew, plus a page a file), at the first save from the tensors'
bytes plus an allowance for headers and the record. Once every part is written its sizes
are known: a step larger than estimated (a large ``extra``) removes what it may, else is
refused from :meth:`~CheckpointManager.wait` with its part removed. Under pressure fewer
than ``keep_last`` steps may stay (a warning, once). Not counted: a restore's staging
(``.restore-<n>``, removed after it), and the training process's own memory. A local tier in
``/dev/shm`` (tmpfs) is host memory: its pages count against the job's memory cgroup like
the process's own, the tmpfs must be sized above the budget (a warning at start otherwise;
Docker's default ``/dev/shm`` is 64 MiB: ``--shm-size``), and a reboot empties it (the
persistent tier is what survives one).

**Hosts** are found from the local tier: the ranks that see one another's marker files in
``local`` are one host. ``local`` must be each host's own storage; where it is a directory of
a shared file system (the same files seen from several machines, which would make them one
"host" whose loss loses every copy), every rank refuses it at start
(:class:`~ckptstore.errors.InvalidArgumentError`). A shared directory is for ``persistent``:
rank 0 makes its root and each step's directory, the hosts upload into it, rank 0 commits
(format-spec/durability.md, "On a shared file system").

**Restore** (every rank, any world size): each host's first rank scans its local tier
(every indexed step: its record's summary, which ranks' files are present with the recorded
size); the ranks all-gather that with rank 0's list of committed persistent steps and try, newest first, a
step whose every part has a copy on some live host (the fast tier), then a persisted step.
For a fast-tier step every host builds the step in ``.restore-<n>/``: its own copies
hard-linked, the other ranks' part descriptors and shard headers from a holder with each
shard a sparse placeholder, committed there (:func:`ckptstore.commit`); each rank plans its
load against it (once); each rank receives the whole stored chunks that are exactly one of
its fresh tensors (a replaced host on the same mesh: all of them) from a rank of a holding
host straight into those tensors, each host fetches into its placeholders the byte ranges
its ranks read of the rest, and every rank loads it with
:func:`ckptstore.torch.distributed.load` (every byte read or received CRC-checked,
resharded onto the current world and mesh, nothing changed unless every rank's checks
passed, the old state replaced whole). A failed try checks every copy of the step whole
(size and CRC32), drops the damaged ones and tries once more from the others; a candidate
that still fails is passed over for the next. Taking an older step than the newest any
tier recorded warns with what was missing. After a fast-tier restore, the copies a host
lacks (one that came back empty) are made again in the background, before the next save:
a second loss right after a restore is survived. A restore from the persistent tier reads
each chunk several ranks need once, sent on to the others (``ckptstore.torch._fanout``).

Where the local tier is on a host, its layout and clean-up are in
:mod:`ckptstore.torch._tier_local`; the fast-tier restore in
:mod:`ckptstore.torch._tier_restore`; the wire, progress marks and kill seam in
:mod:`ckptstore.torch._tier_wire`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from datetime import timedelta
from typing import Any, Callable, Mapping, NamedTuple, Optional

from .. import atomic
from .._faults import fault_point
from ..errors import CheckpointError, InvalidArgumentError
from . import _sharded as _d
from ._saver import AsyncSaver, Handle
from ._tier_budget import BudgetMixin
from ._tier_local import LocalTier, check_arrival, find_hosts, new_stage, pages, part_writer, save_part, snapshot
from ._tier_persist import PersistentTier, Persister
from ._tier_restore import copies_missing, fetch_record, recopy, restore_fast
from ._tier_wire import Arrival, Progress, bounded, crc_file, discard, transfer, trim_heap, write_fsync
from ._tier_wire import GroupError as _GroupError
from ._tier_wire import dist_or_none as _dist
from ._tier_wire import err_text as _err

__all__ = ["CheckpointManager"]

_TAG_REPLICATE = 1 << 20


class _Request(NamedTuple):
    """What ``restore_latest`` restores into, and how (its arguments)."""

    model: Any
    optimizer: Any
    allow_optimizer_change: bool
    check_extra: Optional[Callable[[dict[Any, Any]], Any]]
    layout: Any = None


class CheckpointManager(BudgetMixin):
    """Tiered checkpoints of an FSDP2 / DTensor / plain model and its optimizer across the
    hosts of a torch.distributed job (see the module docstring). Construct it on every rank
    after ``init_process_group``; it finds which ranks share a local directory (a host) by
    marker files, and removes what an interrupted save or restore left in the local tier.

    ``local``: this host's tier, the same path on every host (RAM or node-local disk).
    ``persistent``: a directory every rank can read, or an ``s3://`` URL (``None``: none).
    ``persist_every``: persist the steps that are multiples of it (``None``/0: never).
    ``replicas``: copies of each host's files on other hosts (at most hosts - 1: fewer hosts
    lower it with a warning). ``keep_last``: steps kept in each local tier.
    ``persist_keep_last``: committed steps kept in the persistent tier (``None``: all); the
    words of the other managers (``ckptstore.CheckpointManager``,
    :class:`ckptstore.torch.CheckpointManager`: ``keep_last``; ``keep`` and ``persist_keep``
    are the old names, deprecated, kept for one release). ``timeout``: seconds any one
    operation between ranks may wait (a lost host is reported after it), also the persistent
    commit's wait for every host's upload. ``process_group``: a gloo group of all ranks for
    the manager's own traffic, which must not be used by anything else while a save is in
    flight (``None``: the manager makes one, with ``timeout``).
    ``local_budget``: bytes each host may hold for checkpoints, its local tier's files (its
    ranks' parts and the replicas it keeps) and its ranks' snapshot buffers together
    (``None``: no budget). The first save refuses, on every rank, a configuration that
    cannot fit (``keep_last`` steps of the state, 2 at least, beside the snapshot buffers)
    with :class:`ckptstore.errors.BudgetError` naming the numbers; a later save that would
    not fit first removes the oldest steps (never the newest complete one, never one a
    persist still reads), else waits up to ``timeout`` for a persist to release a step,
    else is refused with that error, the saved steps untouched.
    """

    def __init__(
        self,
        local: "str | os.PathLike[str]",
        persistent: "str | os.PathLike[str] | None" = None,
        persist_every: Optional[int] = None,
        replicas: int = 1,
        *,
        keep_last: int = 2,
        persist_keep_last: Optional[int] = None,
        timeout: float = 300.0,
        process_group: Any = None,
        keep: Optional[int] = None,
        persist_keep: Optional[int] = None,
        local_budget: Optional[int] = None,
    ) -> None:
        for old, new, v in (("keep", "keep_last", keep), ("persist_keep", "persist_keep_last", persist_keep)):
            if v is not None:
                warnings.warn(f"ckptstore: the tiered CheckpointManager's {old}= is now {new}= (the other "
                              f"managers' word); {old}= goes in the next release", DeprecationWarning, stacklevel=2)
        keep_last = keep if keep is not None else keep_last
        persist_keep_last = persist_keep if persist_keep is not None else persist_keep_last
        local = os.fspath(local)
        if "://" in local:
            raise InvalidArgumentError(f"local must be a directory, got {local!r}")
        for name, v, low in (("replicas", replicas, 0), ("keep_last", keep_last, 1),
                             ("persist_every", persist_every, 0), ("persist_keep_last", persist_keep_last, 1)):
            if v is None and name in ("persist_every", "persist_keep_last"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {v!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if local_budget is not None and (isinstance(local_budget, bool) or not isinstance(local_budget, int)
                                         or local_budget <= 0):
            raise InvalidArgumentError(f"local_budget must be None or a number of bytes > 0, got {local_budget!r}")
        self.local_budget = local_budget
        # Each rank's files at the last save (tensor bytes, tensors, file bytes, files) and the
        # record's bytes: the estimate of the next step (``None``: no save yet).
        self._sizes = None
        self._budget_warned = False
        self.local = local
        self.persistent = None if persistent is None else os.fspath(persistent)
        self.persist_every = persist_every or 0
        self.keep_last = keep_last
        self.timeout = float(timeout)
        self.last_extra: Optional[dict[Any, Any]] = None
        self.last_tier: Optional[str] = None
        self._closed = False
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        self._own_pg = dist is not None and process_group is None
        if self._own_pg:
            process_group = bounded(
                lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout)),
                self.timeout, f"rank {self.rank}: making the manager's gloo group",
            )
        self.pg = process_group
        err = None
        try:
            # Where local is (by mistake) on a shared file system, every host makes it at once.
            atomic.make_dirs(local)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = _err(self.rank, e)
        self._agree([err], "making the local tier")
        token = self._bcast(uuid.uuid4().hex if self.rank == 0 else None)
        self.hosts = find_hosts(local, self.rank, self.world, token, self._gather,
                                (lambda: dist.barrier(group=self.pg)) if dist else (lambda: None))
        self.host = next(i for i, g in enumerate(self.hosts) if self.rank in g)
        self.leader = self.hosts[self.host][0] == self.rank
        self._progress = Progress(self.rank, self.world, token)
        n_hosts = len(self.hosts)
        if replicas > n_hosts - 1:
            warnings.warn(
                f"ckptstore: replicas={replicas} needs {replicas + 1} hosts, the job has {n_hosts}: "
                f"{n_hosts - 1} replica(s) kept",
                stacklevel=2,
            )
            replicas = n_hosts - 1
        self.replicas = replicas
        self._tier = LocalTier(local, keep_last)
        self._persistent: Optional[PersistentTier] = None
        self._persistent_view: Optional[PersistentTier] = None  # steps() on the other ranks
        self._persister: Optional[Persister] = None
        err = None
        if self.persistent is not None and self.rank == 0:
            try:
                self._persistent = PersistentTier(self.persistent, persist_keep_last)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = _err(self.rank, e)
        # Rank 0 made the persistent root before other hosts open it (durability.md: hosts that
        # each make it race through their clients' caches on a shared file system, and fail).
        if self._bcast(err) is not None:
            self._agree([err], "opening the tiers")
        try:
            if self.persistent is not None and (self.leader or self.rank == 0):
                if self._persistent is None:
                    self._persistent = PersistentTier(self.persistent, persist_keep_last)
                if self.leader:
                    self._persister = Persister(self._persistent, self._tier, self.rank, self.host, self.world,
                                                self.timeout)
            if self.leader:
                self._tier.clean()
                self._check_fs_size()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = _err(self.rank, e)
        self._saver = AsyncSaver(1, name="ckptstore-tiers", what="the tiered CheckpointManager")
        self._agree([err], "opening the tiers")

    # -- collectives on the manager's group --------------------------------------------------

    def _gather(self, obj: Any) -> list[Any]:
        dist = _dist()
        if not dist:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _bcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (a global rank), on every rank."""
        dist = _dist()
        if not dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def _agree(self, errors: list[Any], what: str) -> None:
        """All-gather each rank's errors; raise on every rank if any rank has one."""
        got = self._gather([e for e in errors if e])
        bad = [e for es in got for e in es]
        if bad:
            raise CheckpointError(f"ckptstore tiers: {what} failed: " + "; ".join(bad))

    def _phase(self, label: str, fn: Any, *args: Any) -> Any:
        """Run ``fn`` (a step that talks to other ranks) as the phase ``label``; a failure of
        the process group (a lost peer) is raised naming the ranks that never got there."""
        self._progress.mark(label)
        try:
            return fn(*args)
        except CheckpointError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - gloo's RuntimeError, DCP's CheckpointException
            behind = self._progress.behind(self.hosts)
            raise _GroupError(f"ckptstore tiers: {label} failed on rank {self.rank}{behind}: {e}") from e

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int, model: Any, optimizer: Any = None, extra: Optional[Mapping[str, Any]] = None,
             *, persist: Optional[bool] = None) -> Handle:
        """Start saving ``step`` (every rank) and return once its tensors are copied into the
        snapshot buffers (after the previous save has finished: one in flight). The
        returned handle's ``wait()`` or :meth:`wait` reports the outcome; an earlier save's
        error nobody saw is raised here first (nothing started). ``persist``: also persist
        this step (``True``, a training run's last step, say) or not (``False``); ``None``:
        when ``step`` is a multiple of ``persist_every``. The same on every rank. With a
        ``local_budget``, before the snapshot the ranks agree that the step fits (removing
        old steps or waiting for a persist as the manager's docstring says), and a step that
        does not raises :class:`ckptstore.errors.BudgetError` here, on every rank."""
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        if persist is not None and not isinstance(persist, bool):
            raise InvalidArgumentError(f"persist must be None, True or False, got {persist!r}")
        if persist is None:
            persist = bool(self.persist_every and step % self.persist_every == 0)
        persist = persist and self.persistent is not None
        sd, meta = _d.state_and_meta(model, optimizer, extra)

        def build(snap: Any) -> tuple[Any, ...]:
            # With a budget, room is made first (the previous save has finished: nothing
            # else uses the group), before the snapshot buffers grow.
            room = self._make_room(step, sd) if self.local_budget is not None else None
            snapped = snapshot(sd, snap, "")
            fault_point("tiers.snapshot", step, self.rank)
            return step, snapped, meta, persist, room

        return self._saver.save(Handle(f"step {step}"), build, self._write, whole_snapshot=True)

    def _record(self, step: int, cid: str, all_files: dict[Any, Any], metadata: Any, saved_at: float) -> dict[str, Any]:
        """The step's record (``commit.json``; format-spec/tiers.md)."""
        return {
            "version": 1, "step": step, "checkpoint_id": cid, "world_size": self.world,
            "saved_at": saved_at, "hosts": self.hosts, "replicas": self.replicas,
            "files": {str(r): f for r, f in all_files.items()}, "metadata": metadata,
        }

    def _write(self, job: tuple[Any, ...]) -> dict[Any, Any]:
        """The writer thread: steps 1-5 of the module docstring."""
        import torch.distributed.checkpoint as dcp

        step, sd, meta, due, room = job
        tier = self._tier
        err = None
        if self.leader:
            try:
                tier.forget(step)
            except Exception as e:  # noqa: BLE001
                err = _err(self.rank, e)
        self._phase(f"step {step}: prepare", self._agree, [err], f"preparing step {step}")

        own = tier.src_dir(step, self.host)
        w = part_writer(own, {_d.META_KEY: meta})
        werr = self._phase(f"step {step}: local write", save_part, sd, w, self.rank, self.world, self._gather,
                           lambda: dcp.save(sd, storage_writer=w, process_group=self.pg))
        if werr:  # the same on every rank
            raise CheckpointError(f"ckptstore tiers: writing step {step} failed: {werr}")
        fault_point("tiers.local-write", step, self.rank)
        cid = w.checkpoint_id
        files: dict[str, list[int]] = {}
        err = None
        try:
            for name in sorted(os.listdir(own)):
                if name.startswith((f"part-{cid}-r{self.rank}.", f"shard-{cid}-r{self.rank}-")):
                    files[name] = list(crc_file(os.path.join(own, name)))
            atomic.fsync_dir(own)
            if not any(n.startswith("part-") for n in files):
                raise CheckpointError(f"no part file of rank {self.rank} in {own}")
        except Exception as e:  # noqa: BLE001
            err = _err(self.rank, e)
        usage = None
        if room is not None and self.leader and err is None:
            try:  # every rank's part is written (save_part returned on all)
                usage = tier.usage()
            except Exception as e:  # noqa: BLE001
                err = _err(self.rank, e)
        # Every rank's files, gathered by all (a few hundred bytes a rank); the record, with the
        # manifest's metadata (megabytes at thousands of ranks x tensors), broadcast once.
        status = self._phase(f"step {step}: gather", self._gather, (files, err, usage))
        bad = [s[1] for s in status if s[1]]
        if bad:
            raise CheckpointError(f"ckptstore tiers: writing step {step} failed: " + "; ".join(bad))
        all_files = {r: s[0] for r, s in enumerate(status)}
        record = self._record(step, cid, all_files, w.manifest_metadata, time.time()) if self.rank == 0 else None
        record = self._phase(f"step {step}: record", self._bcast, record)

        err = None
        if room is not None:
            views = {h: status[ranks[0]][2] for h, ranks in enumerate(self.hosts)}
            err = self._fit_written(step, room, all_files, record, views)
        if self.leader and self.replicas:
            err = self._replicate(step, all_files) or err
        self._phase(f"step {step}: replicate", self._agree, [err], f"replicating step {step}")
        err = None
        if self.leader:
            try:
                tier.record(step, record, between=lambda: fault_point("tiers.record", step, self.rank))
            except Exception as e:  # noqa: BLE001
                err = _err(self.rank, e)
        if due:  # no upload in flight from here to the agreement below: rank 0's gc is safe
            if self._persister is not None:
                self._persister.join()
            if self.rank == 0 and self._persistent is not None:
                try:
                    self._persistent.gc()
                except Exception as e:  # noqa: BLE001 - retention retries at the next persist
                    warnings.warn(f"ckptstore: retention in {self.persistent} failed: {e}", stacklevel=2)
                # The step's directory is made once, before any host uploads into it (as the
                # root above). Where it cannot be, the persist fails on it and ``wait`` raises
                # that (the step stands in the fast tier), as for any failed persist.
                loc = self._persistent.location(step)
                if err is None and "://" not in loc:
                    try:
                        atomic.make_dirs(loc)
                    except OSError:
                        pass
        self._phase(f"step {step}: recorded", self._agree, [err], f"recording step {step}")

        if self.leader:
            try:
                tier.retain()
            except Exception as e:  # noqa: BLE001 - the step is saved; gc retries
                warnings.warn(f"ckptstore: retention in {self.local} failed: {e}", stacklevel=2)
            if due and self._persister is not None:
                self._persister.start(step, record, tier.src_dir(step, self.host), list(self.hosts[self.host]))
        if room is not None:  # the next step's estimate
            self._sizes = {
                "ranks": [(room["tensor_bytes"][r], room["tensors"][r],
                           sum(pages(v[0]) for v in all_files[r].values()), len(all_files[r]))
                          for r in range(self.world)],
                "record": pages(len(json.dumps(record, sort_keys=True))),
            }
        trim_heap()
        return {"step": step, "checkpoint_id": cid}

    def _replicate(self, step: int, all_files: dict[Any, Any]) -> Optional[str]:
        """Send this host's files around the ring and keep what arrives; the first error as
        text, or None. Every transfer runs to its end even after an error (the peers expect
        its bytes); the receive side records an error and drops the rest."""
        tier = self._tier
        sdir = tier.step_dir(step)
        own = tier.src_dir(step, self.host)
        names = sorted(n for r in self.hosts[self.host] for n in all_files[r])
        err: Optional[str] = None
        n_hosts = len(self.hosts)
        for j in range(1, self.replicas + 1):
            dst_h, src_h = (self.host + j) % n_hosts, (self.host - j) % n_hosts
            want = {n: v for r in self.hosts[src_h] for n, v in all_files[r].items()}
            got: dict[str, Any] = {"stage": None, "err": None}
            arrivals: dict[str, Arrival] = {}

            def dest(name: str, size: int, got: dict[Any, Any] = got,
                    want: dict[Any, Any] = want, arrivals: dict[Any, Any] = arrivals) -> Any:
                if got["err"]:  # the rest is dropped
                    return discard
                if got["stage"] is None or name not in want:
                    return None  # a buffer: `receive` refuses it
                arrivals[name] = Arrival(os.path.join(got["stage"], name))
                return arrivals[name].write

            def receive(inc: Any, name: Optional[str], data: Any, src_h: int = src_h, want: dict[Any, Any] = want,
                        got: dict[Any, Any] = got, arrivals: dict[Any, Any] = arrivals) -> None:
                if got["err"]:
                    return
                try:
                    if name is None:
                        if inc.error:
                            raise CheckpointError(f"host {src_h} could not send its files: {inc.error}")
                        if sorted(n for n, _ in inc.files) != sorted(want):
                            raise CheckpointError(f"host {src_h} announced {[n for n, _ in inc.files]}, "
                                                  f"expected {sorted(want)}")
                        got["stage"] = new_stage(sdir, f"src-{src_h}")
                        return
                    if data is None:  # written chunk by chunk, its CRC32 taken on the way
                        check_arrival(name, arrivals.pop(name).finish(), want, src_h)
                    else:  # an empty file (or one not asked for: refused)
                        check_arrival(name, data, want, src_h)
                        write_fsync(os.path.join(got["stage"], name), data.numpy())
                except Exception as e:  # noqa: BLE001
                    got["err"] = _err(self.rank, e)

            try:
                self._phase(f"step {step}: replica {j}", transfer, [(n, os.path.join(own, n)) for n in names],
                            None, self.hosts[dst_h][0], self.hosts[src_h][0], _TAG_REPLICATE * j, self.pg,
                            receive, dest)
            finally:
                for a in arrivals.values():
                    a.close()
            fault_point("tiers.replicate", step, self.rank)
            err = err or got["err"]
            if err is None:
                try:
                    atomic.fsync_dir(got["stage"])
                    atomic.publish_dir(got["stage"], tier.src_dir(step, src_h))
                except Exception as e:  # noqa: BLE001
                    err = _err(self.rank, e)
        return err

    def wait(self) -> None:
        """Every rank: wait for the save in flight and the persist in flight; raise the
        first save error nobody has seen, or any rank's persist error (on every rank)."""
        self._check_open()
        self._saver.wait()
        perr = self._persister.take_errors() if self._persister is not None else []
        got = self._phase("wait", self._gather, perr)
        bad = [e for es in got for e in es]
        if bad:
            raise CheckpointError("ckptstore tiers: persisting failed: " + "; ".join(bad))

    # -- restore -------------------------------------------------------------------------------

    @_d._gc_paused
    def restore_latest(self, model: Any, optimizer: Any = None, *, allow_optimizer_change: bool = False,
                       check_extra: Optional[Callable[[dict[Any, Any]], Any]] = None,
                       layout: Any = None) -> Optional[int]:
        """Restore the newest step that can be read whole from some tier (every rank, after
        any save in flight); returns it, or ``None`` when no tier holds any. Afterwards
        ``self.last_extra`` is the ``extra`` it was saved with, ``self.last_tier`` where it
        came from (``"fast"``: local and peer copies; ``"persistent"``).
        ``allow_optimizer_change``: as in :func:`ckptstore.torch.distributed.load` (a
        deliberate change of optimizer class). ``check_extra``: as in that function, called
        with a step's ``extra`` before anything changes; a step whose extra it refuses (on
        any rank) is passed over like one that cannot be read, and named in the warning.
        ``layout``: the moments' layout, as in :func:`ckptstore.torch.distributed.load`
        (the engine converts them); a state it refuses (an absmax too small for FP16
        scaling, say) raises :class:`ckptstore.OptimizerStateError` on every rank with
        nothing changed, since every copy of the step holds the same values. Raises
        :class:`ckptstore.CheckpointError` on every rank alike when steps were
        recorded but none can be read (naming why for each)."""
        req = _Request(model, optimizer, bool(allow_optimizer_change), check_extra, layout)
        self.wait()
        held = self._tier.scan(crc=False) if self.leader else None
        pers = self._persistent.steps() if self.rank == 0 and self._persistent is not None else None
        gathered = self._phase("restore: scan", self._gather, (self.host, held, pers))
        persisted = gathered[0][2] or []
        by_host = {h: hd for h, hd, _ in gathered if hd is not None}

        # Per (step, checkpoint id): which current hosts hold a good copy of which rank's part.
        fast: dict[tuple[int, str], dict[Any, Any]] = {}
        notes: dict[int, list[str]] = {}
        for h in sorted(by_host):
            for step, ent in by_host[h].items():
                for why in ent["bad"].values():
                    notes.setdefault(step, []).append(f"host {h}: {why}")
                summ = ent["summary"]
                if summ is None:
                    continue
                f = fast.setdefault((step, summ["checkpoint_id"]),
                                    {"summary": summ, "record": None, "holders": {}, "from": []})
                f["from"].append(h)
                for r in ent["good"]:
                    f["holders"].setdefault(r, []).append(h)
        candidates: list[tuple[int, str, Any]] = []
        for (step, _cid), f in fast.items():
            missing = [r for r in range(f["summary"]["world_size"]) if r not in f["holders"]]
            if missing:
                notes.setdefault(step, []).append(f"no good copy on any host of the parts of rank(s) {missing}")
            else:
                candidates.append((step, "fast", f))
        candidates += [(s, "persistent", None) for s in persisted]
        # Newest first; for one step the fast tier first (of two saves of one step number,
        # say by a host back with stale files, the later one), then the persistent one.
        candidates.sort(key=lambda c: (-c[0], c[1] != "fast", -float((c[2] or {}).get("summary",
        {}).get("saved_at") or 0)))
        newest = max([s for s, _ in fast] + list(notes) + list(persisted), default=None)
        if newest is None:
            return None
        for step, kind, f in candidates:
            extra = self._restore_one(step, kind, f, persisted, notes, req)
            if extra is None:
                continue
            if step != newest:
                missed = sorted((s for s in notes if s > step), reverse=True)
                detail = "; ".join(f"step {s}: " + ", ".join(notes[s]) for s in missed)
                warnings.warn(
                    f"ckptstore: restored step {step} from the {kind} tier, not the newest recorded step "
                    f"{newest}: {detail or 'no whole copy'} (persisted steps: {persisted})",
                    stacklevel=2,
                )
            self.last_extra = extra
            self.last_tier = kind
            if kind == "fast" and self.replicas and copies_missing(self, f):
                self._copy_back(step, f)
            return step
        raise CheckpointError(
            "ckptstore tiers: no step can be restored from any tier: "
            + "; ".join(f"step {s}: " + ", ".join(n) for s, n in sorted(notes.items(), reverse=True))
        )

    def _copy_back(self, step: int, f: dict[Any, Any]) -> None:
        """Queue, on the writer thread (the next save runs after it), the copies of ``step``
        that hosts should hold and do not (a host that came back empty; see
        :func:`ckptstore.torch._tier_restore.recopy`), so that a second loss before the next
        save is survived. A failure warns on every rank; the step stays where it was."""
        def write(_job: Any) -> dict[Any, Any]:
            err = recopy(self, step, f)
            errs = self._phase(f"copies of step {step}: done", self._gather, err)
            bad = [e for e in errs if e]
            if bad:
                warnings.warn(f"ckptstore: copying step {step} back onto the hosts that lack it failed "
                              f"(the next save replicates anew): {'; '.join(bad)}", stacklevel=2)
            return {"step": step, "copied_back": not bad}

        self._saver.save(Handle(f"copies of step {step}"), lambda _snap: (step,), write, whole_snapshot=True)

    def _restore_one(self, step: int, kind: str, f: Any, persisted: list[Any], notes: dict[Any, Any],
                     req: "_Request") -> Optional[dict[Any, Any]]:
        """Restore ``step`` from the ``kind`` tier; the extra dict, or None (with a note why)
        when it cannot be. A fast-tier step is first tried with the copies as the scan saw
        them (their size): every byte a load reads is CRC-checked on the way, so a damaged
        copy fails that try (on every rank alike); the copies are then checked whole
        (``_check_copies``: the damaged lose their holder) and the step tried once more
        from the good ones, if it still has a copy of every part."""
        repersist = bool(kind == "fast" and self.persist_every and step % self.persist_every == 0
                         and self.persistent and step not in persisted)
        # A step to persist again is checked whole first: its every byte is uploaded.
        checked = repersist
        if repersist and not (fetch_record(self, step, f, notes) and self._check_copies(step, f, notes)):
            return None
        while True:
            try:
                if kind == "fast":
                    if f["record"] is None and not fetch_record(self, step, f, notes):
                        return None
                    return restore_fast(self, step, f, req, repersist)
                loc = self._bcast(self._persistent.location(step) if self.rank == 0 else None)  # type: ignore[union-attr]
                return self._load(step, loc, req)
            except (_GroupError, _d._LayoutRefused):
                # The process group failed: no next candidate can be agreed on; or the
                # engine refused the layout for values every copy holds alike.
                raise
            except CheckpointError as e:  # every rank raised it (the loads agree)
                if kind == "fast" and not checked and not isinstance(e, _d._ExtraRefused):
                    checked = True
                    if self._check_copies(step, f, notes):
                        continue
                    return None
                notes.setdefault(step, []).append(f"{kind} tier: {e}")
                return None

    def _check_copies(self, step: int, f: dict[Any, Any], notes: dict[Any, Any]) -> bool:
        """The CRC32 check of the copies a fast-tier candidate would use (the scan only saw
        them present with the right size): every host checks its own, the ranks gather the
        damaged ones, which lose their holder. Whether every rank still has a good copy."""
        rec, holders = f["record"], f["holders"]
        bad = {}
        if self.leader:
            mine = [r for r in range(rec["world_size"]) if self.host in holders.get(r, [])]
            bad = self._tier.check_ranks(step, rec, mine)
        got = self._phase(f"restore: check step {step}", self._gather, (self.host, bad))
        for h, b in got:
            for r, why in b.items():
                holders[int(r)] = [x for x in holders[int(r)] if x != h]
                notes.setdefault(step, []).append(f"host {h}: {why}")
        missing = [r for r in range(rec["world_size"]) if not holders.get(r)]
        if missing:
            notes.setdefault(step, []).append(f"no good copy on any host of the parts of rank(s) {missing}")
        return not missing

    def _load(self, step: int, loc: str, req: "_Request", prep: Any = None) -> dict[Any, Any]:
        """:func:`ckptstore.torch.distributed.load` on the manager's group, or, given
        ``prep`` (that load's steps up to its reads, planned on every rank), the rest of
        it. Its own errors (a damaged or incompatible checkpoint) are raised alike on every
        rank and pass through; a failure of the group is a ``_GroupError``."""
        def load() -> dict[Any, Any]:
            kw = dict(process_group=self.pg, allow_optimizer_change=req.allow_optimizer_change,
                      check_extra=req.check_extra)
            if prep is None:
                return _d.load(loc, req.model, req.optimizer, layout=req.layout, **kw)
            return _d._finish(prep, req.model, req.optimizer, strict=True, layout=req.layout, **kw)

        extra: dict[Any, Any] = self._phase(f"restore: load step {step}", load)
        return extra

    # -- lifetime ------------------------------------------------------------------------------

    def gc(self) -> dict[Any, Any]:
        """Every rank, with no save in flight: remove what interrupted saves, restores and
        persists left in every tier, and apply each tier's retention. Returns what this rank
        removed, in the other managers' words: ``deleted`` (the steps retention removed from
        this host's local tier), ``interrupted_removed`` (leftovers removed there; both for
        the host's first rank, empty elsewhere), ``persistent`` (rank 0: the persistent
        tier's ``gc()`` report, as :meth:`ckptstore.CheckpointManager.gc` gives it; else
        ``None``)."""
        self.wait()
        err = None
        out: dict[str, Any] = {"deleted": [], "interrupted_removed": 0, "persistent": None}
        try:
            if self.leader:
                out["interrupted_removed"] = self._tier.clean()
                out["deleted"] = self._tier.retain()
            if self.rank == 0 and self._persistent is not None:
                out["persistent"] = self._persistent.gc()
        except Exception as e:  # noqa: BLE001
            err = _err(self.rank, e)
        self._phase("gc", self._agree, [err], "gc")
        return out

    def steps(self) -> list[int]:
        """The steps this rank sees saved, oldest first: those its host's local tier has
        recorded and those committed in the persistent tier. No collective: another rank's
        view may differ (a host replaced, a copy damaged); :meth:`restore_latest` is where
        the ranks agree on the newest step they can all read."""
        self._check_open()
        got = set(self._tier.read_index())
        tier = self._persistent
        if tier is None and self.persistent is not None:
            # Ranks that neither persist nor commit: a view of the tier, made once.
            if self._persistent_view is None:
                self._persistent_view = PersistentTier(self.persistent, None)
            tier = self._persistent_view
        if tier is not None:
            got.update(tier.steps())
        return sorted(got)

    def latest(self) -> Optional[int]:
        """The newest of :meth:`steps`, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def keep(self) -> int:
        """The old name of :attr:`keep_last` (deprecated, for one release)."""
        return self.keep_last

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the CheckpointManager is closed")

    def close(self) -> None:
        """Every rank: wait for what is in flight (raising as :meth:`wait`), then refuse
        further calls and release the manager's process group."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            try:
                self._saver.close()
            except Exception:  # noqa: BLE001 - wait() above raised it already
                pass
            dist = _dist()
            if self._own_pg and dist is not None:
                try:
                    dist.destroy_process_group(self.pg)
                except Exception:  # noqa: BLE001 - a broken group: nothing left to release
                    pass

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: do not wait on a group that may be broken
            self._closed = True

    def __repr__(self) -> str:
        return (
            f"CheckpointManager(local={self.local!r}, persistent={self.persistent!r}, "
            f"persist_every={self.persist_every}, replicas={self.replicas}, keep_last={self.keep_last})"
        )
