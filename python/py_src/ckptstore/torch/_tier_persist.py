"""The persistent tier of the tiered manager (:mod:`ckptstore.torch.tiered`): the engine's
checkpoint manager over a directory or an ``s3://`` prefix (``ROOT/step-<n, 8+ digits>/``,
each an ordinary committed ckptstore checkpoint that ``ckpt verify``, ``ckpt ls``,
``ckpt consolidate``, :func:`ckptstore.torch.distributed.load` and a single-host reader
open), its retention, and the background upload that fills it from the fast tier.

**Persisting a step** copies files that are already committed on the fast tier; nothing is
snapshot again and training is not blocked:

1. each host's first rank, on its own thread, copies the files of its host's ranks from its
   local tier into the step's location (:func:`ckptstore.atomic.copy_files`: streamed,
   every file checked against the size and CRC32 its writer recorded, published whole),
   the shards first, then the part descriptors that name them;
2. rank 0 then commits them (:func:`ckptstore.commit` with the file rendezvous: it waits,
   up to the manager's timeout, for every rank's part descriptor, checks every part and
   shard header together and writes the manifest last).

Retention (the engine's ``gc``, which also removes what interrupted uploads left) runs on
rank 0 only where no upload can be in flight: in the save of the next step to persist, after
every host has joined its previous upload and before any starts the next (the ranks meet in
a collective in between), and in the manager's ``gc``.

A step restored from the fast tier that is due for persisting but not committed in the
persistent tier (its persist was interrupted) is persisted again by rank 0's host from the
checkpoint the restore assembled and committed there: its shards, then its manifest (the
commit point) copied last. The local step is pinned against the
local tier's retention (and its restore staging against clean-up) while its files are
read. The
outcome of each persist is kept for :meth:`Persister.take_errors`, which the manager's
``wait`` gathers from every rank. A step not committed (a host lost mid-upload) is never
listed by :meth:`PersistentTier.steps`; the engine's ``gc`` removes what it left.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Optional

from .. import _ckptstore, atomic
from .. import commit as _commit
from .._faults import fault_point
from ._tier_local import LocalTier
from ._tier_wire import crc_file, trim_heap

MANIFEST = "ckpt-manifest.json"


class PersistentTier:
    """The engine's manager over ``root``; ``keep``: committed steps retention keeps
    (``None``: all)."""

    def __init__(self, root: str, keep: Optional[int]) -> None:
        self.root = root
        self._mgr = _ckptstore.CheckpointManager(root, keep_last=keep)

    def location(self, step: int) -> str:
        return os.fspath(self._mgr.step_dir(step))

    def steps(self) -> list[int]:
        return [int(s) for s in self._mgr.steps()]

    def gc(self) -> dict:
        return dict(self._mgr.gc())


class Persister:
    """One host's uploads to the persistent tier, one step at a time, on a thread of its
    own (on the host's first rank; rank 0 also commits)."""

    def __init__(self, tier: PersistentTier, local: LocalTier, rank: int, host: int, world: int,
                 timeout: float) -> None:
        self.tier, self.local = tier, local
        self.rank, self.host, self.world, self.timeout = rank, host, world, timeout
        self._thread: Optional[threading.Thread] = None
        self._errors: list[str] = []
        self._lock = threading.Lock()

    def start(self, step: int, record: dict, src: str, ranks: Optional[list[int]],
              remove_src: bool = False) -> None:
        """Persist ``step`` (its record as saved on the fast tier) in the background, after
        the previous persist has finished: this host copies the files of ``ranks`` from the
        directory ``src`` (its own part of a step it saved), then rank 0 commits; or, with
        ``ranks=None``, the whole checkpoint committed in ``src`` (a step a restore assembled,
        which ``remove_src`` removes afterwards), its manifest last."""
        self.join()
        self.local.pin(step)
        t = threading.Thread(target=self._run, args=(step, record, src, ranks, remove_src),
                             name=f"ckptstore-persist-{step}", daemon=True)
        self._thread = t
        t.start()

    def join(self) -> None:
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None

    def take_errors(self) -> list[str]:
        """Wait for the persist in flight; the errors since the last call."""
        self.join()
        with self._lock:
            out, self._errors = self._errors, []
        return out

    def _run(self, step: int, record: dict, src: str, ranks: list[int], remove_src: bool) -> None:
        try:
            self._persist(step, record, src, ranks)
        except BaseException as e:  # noqa: BLE001 - reported by the manager's wait()
            with self._lock:
                self._errors.append(
                    f"rank {self.rank}: persisting step {step} to {self.tier.root}: {type(e).__name__}: {e}"
                )
        finally:
            if remove_src:
                shutil.rmtree(src, ignore_errors=True)
            self.local.unpin(step)
            trim_heap()

    def _persist(self, step: int, record: dict, src: str, ranks: Optional[list[int]]) -> None:
        loc = self.tier.location(step)
        if ranks is None:  # a committed checkpoint (a restore's): its files, the manifest last
            names = sorted(n for n in os.listdir(src) if not n.startswith(".") and n != MANIFEST)
            atomic.copy_files(src, loc, [(n, *crc_file(os.path.join(src, n))) for n in names])
            fault_point("tiers.persist-upload", step, self.rank)
            fault_point("tiers.persist-commit", step, self.rank)
            atomic.copy_files(src, loc, [(MANIFEST, *crc_file(os.path.join(src, MANIFEST)))])
            return
        shards: list[Any] = []
        parts: list[Any] = []
        for r in ranks:
            for name, (size, crc) in sorted(record["files"][str(r)].items()):
                (parts if name.startswith("part-") else shards).append((name, size, crc))
        atomic.copy_files(src, loc, shards)
        fault_point("tiers.persist-upload", step, self.rank)
        atomic.copy_files(src, loc, parts)
        if self.rank != 0:
            return
        fault_point("tiers.persist-commit", step, self.rank)
        _commit(loc, record["checkpoint_id"], world_size=record["world_size"], timeout=self.timeout,
                metadata=record["metadata"])
