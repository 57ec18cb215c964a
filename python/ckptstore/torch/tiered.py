"""Tiered checkpoints across hosts (issue 39), a first slice: host-local tier, replicas on
peer hosts over torch.distributed, a persistent tier, a collective restore of the newest
whole step.

::

    from ckptstore.torch.distributed import CheckpointManager

    with CheckpointManager(local="/dev/shm/ckpt", persistent="/shared/run",
                           persist_every=100, replicas=1) as mgr:    # every rank
        step = mgr.restore_latest(model, optimizer)                  # None: nothing saved yet
        ...
        mgr.save(step, model, optimizer, extra={"epoch": 3})         # every rank
        mgr.wait()

**Layout of a host's local tier** (``local``, the same path on every host, private to it)::

    index.json                 the steps this host knows saved, and each commit.json's CRC32
    step-<n>/commit.json       the step's record: checkpoint id, world size, every rank's
                               files with size and CRC32, the manifest metadata
    step-<n>/src-<h>/          the parts (``part-<id>-r<rank>.json`` and shard files, as
                               ckptstore.write_part writes them) of the ranks of host h:
                               this host's own, and those replicated here from other hosts

**Save** (every rank; blocking, so :meth:`CheckpointManager.wait` returns at once):

1. Every rank writes its DCP save items into ``step-<n>/src-<h>/`` of its host through
   :class:`ckptstore.torch.dcp.Writer` (the state dict and metadata of
   :func:`ckptstore.torch.distributed.save`); the coordinator keeps the manifest metadata
   instead of committing (the parts are on different hosts: a commit needs them together).
2. Each host's first rank sends the files of its host's ranks to the ``replicas`` next hosts
   of the ring (host h to h+1, ..., never itself) as uint8 tensors over gloo point-to-point
   (isend/irecv); the receiver checks every file's CRC32 against the writer's, writes them
   with fsync into a staging directory and publishes it as ``step-<n>/src-<h>/``
   (:func:`ckptstore.atomic.publish_dir`).
3. The ranks all-gather their status; when every part and replica is durable, the
   coordinator broadcasts the step's record, which each host writes durably
   (``commit.json``, then ``index.json``, both with :func:`ckptstore.atomic.write_file`): a
   step is saved when it is in an index. Any failure raises on every rank; a lost host makes
   the survivors' collectives raise gloo's ``RuntimeError`` within the process group's
   timeout.
4. Retention: the newest ``keep`` indexed steps stay in each local tier (the index is
   rewritten first, then the older step directories removed whole).
5. A step whose number is a multiple of ``persist_every`` is also saved to
   ``<persistent>/step-<n>`` with :func:`ckptstore.torch.distributed.save`: an ordinary
   committed ckptstore checkpoint (``ckpt verify`` and ``distributed.load`` open it).

**Restore** (every rank): each host's first rank checks what its local tier holds (for every
indexed step, every rank's files present with the recorded size and CRC32); the ranks
all-gather it with the coordinator's list of committed persistent steps and agree on the
newest step whose every part has a good copy on some live host, else the newest persisted
step. For a fast-tier step, every host assembles the step's files in ``.restore-<n>/`` of its
local tier: its own good copies (hard links), the rest sent by a host holding a good copy
over gloo point-to-point (checked by CRC32 on arrival); it commits them there
(:func:`ckptstore.commit`, the same checkpoint id, so each host holds one ordinary
checkpoint), and every rank loads with :func:`ckptstore.torch.distributed.load` (every block
CRC-checked, the ranks agreeing, any world size and mesh: the assembled checkpoint holds
every part). A candidate whose load fails is passed over for the next one. Taking an older
step than the newest any tier recorded warns (``warnings.warn``) with what was missing.

**Not done yet** (later slices of issue 39):

- The save blocks the training loop for the local write, the replication and (on
  persisted steps) a second save to the persistent tier; no background thread, no reuse of
  snapshot buffers; the persistent copy is a second snapshot, not an upload of the local
  files.
- Restore moves every part to every host (each host assembles the whole step) instead of
  the parts its ranks read; CRCs of the local copies are checked file by file before the
  engine checks them again block by block.
- ``persistent`` must be a directory (no ``s3://``); no retention nor gc on the persistent
  tier; a local tier on ``s3://`` is not supported.
- The default process group only (no ``process_group`` argument); no timeout of its own (the
  process group's applies); the error of a lost host is gloo's, naming no host.
- A step is restored from the fast tier only if every part has a good copy on a host of
  the current job; parts are never combined across the fast and persistent tiers.
- No integration with TorchTitan's or Lightning's configs, no random fault mix, no benchmark.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import uuid
import warnings
import zlib
from typing import Any, Mapping, Optional

from .. import atomic, commit as _commit
from ..errors import CheckpointError, InvalidArgumentError
from . import distributed as _d

__all__ = ["CheckpointManager"]

_INDEX = "index.json"
_COMMIT = "commit.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_SRC_RE = re.compile(r"^src-(\d+)$")
_VERSION = 1


# ---- helpers -------------------------------------------------------------------------------


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _crc_file(path: str) -> tuple[int, int]:
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


def _write_fsync(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _pack(files: list[tuple[str, bytes]], error: Optional[str] = None) -> Any:
    """Files as one uint8 tensor: an 8-byte header length, a JSON header, the contents."""
    import torch

    head = json.dumps({"files": [[n, len(b)] for n, b in files], "error": error}).encode()
    buf = bytearray(struct.pack("<Q", len(head)) + head)
    for _, b in files:
        buf += b
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def _unpack(t: Any) -> tuple[list[tuple[str, bytes]], Optional[str]]:
    raw = t.numpy().tobytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    pos = 8 + n
    out = []
    for name, size in head["files"]:
        out.append((name, raw[pos : pos + size]))
        pos += size
    return out, head.get("error")


def _send_pack(t: Any, dst: int, tag: int) -> None:
    import torch
    import torch.distributed as dist

    dist.send(torch.tensor([t.numel()], dtype=torch.int64), dst, tag=tag)
    dist.send(t, dst, tag=tag)


def _recv_pack(src: int, tag: int) -> Any:
    import torch
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, tag=tag)
    t = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(t, src, tag=tag)
    return t


def _exchange(payload: Any, dst: int, src: int, tag: int) -> Any:
    """Send ``payload`` to ``dst`` while receiving one from ``src`` (a ring step)."""
    import torch
    import torch.distributed as dist

    n_out = torch.tensor([payload.numel()], dtype=torch.int64)
    n_in = torch.zeros(1, dtype=torch.int64)
    for w in [dist.isend(n_out, dst, tag=tag), dist.irecv(n_in, src, tag=tag)]:
        w.wait()
    buf = torch.empty(int(n_in.item()), dtype=torch.uint8)
    for w in [dist.isend(payload, dst, tag=tag + 1), dist.irecv(buf, src, tag=tag + 1)]:
        w.wait()
    return buf


def _part_writer(path: str, metadata: dict) -> Any:
    """A DCP Writer whose coordinator keeps the manifest metadata instead of committing."""
    from .dcp import META_KEY as DCP_KEY, Writer, _metadata_to_json

    class _PartWriter(Writer):
        manifest_metadata: Optional[dict] = None

        def finish(self, metadata: Any, results: Any) -> None:  # noqa: D401 - DCP protocol
            for r, rank_results in enumerate(results):
                if sum(1 for w in rank_results if w.index.fqn == "__ckptstore.part__") != 1:
                    raise CheckpointError(f"rank {r} reported no part descriptor")
            meta = dict(self.user_metadata)
            meta[DCP_KEY] = _metadata_to_json(metadata, self.storage_meta())
            self.manifest_metadata = meta

    return _PartWriter(path, metadata=metadata)


# ---- the manager ---------------------------------------------------------------------------


class CheckpointManager:
    """Tiered checkpoints of an FSDP2 / DTensor / plain model and its optimizer across the
    hosts of a torch.distributed job (see the module docstring for what this slice does).
    Construct it on every rank after ``init_process_group``; it finds which ranks share a
    local directory (a host) by marker files, and removes what an interrupted save left in
    the local tier (step directories no index names, restore staging directories).

    ``local``: this host's tier (RAM or node-local disk), the same path string on every
    host. ``persistent``: a directory every rank can read (``None``: none).
    ``persist_every``: persist steps that are multiples of it (``None``/0: never).
    ``replicas``: copies of each host's parts on other hosts (at most hosts - 1; fewer hosts
    lower it with a warning). ``keep``: steps kept in each local tier.
    """

    def __init__(
        self,
        local: "str | os.PathLike[str]",
        persistent: "str | os.PathLike[str] | None" = None,
        persist_every: Optional[int] = None,
        replicas: int = 1,
        *,
        keep: int = 2,
    ) -> None:
        local = os.fspath(local)
        if "://" in local:
            raise InvalidArgumentError(f"local must be a directory, got {local!r}")
        if persistent is not None:
            persistent = os.fspath(persistent)
            if "://" in persistent:
                raise InvalidArgumentError(
                    f"persistent on an object store ({persistent!r}) is not supported yet: give a directory"
                )
        if not isinstance(replicas, int) or replicas < 0:
            raise InvalidArgumentError(f"replicas must be an int >= 0, got {replicas!r}")
        if not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(f"keep must be an int >= 1, got {keep!r}")
        if persist_every is not None and (not isinstance(persist_every, int) or persist_every < 0):
            raise InvalidArgumentError(f"persist_every must be an int >= 0, got {persist_every!r}")
        self.local = local
        self.persistent = persistent
        self.persist_every = persist_every or 0
        self.keep = keep
        self.last_extra: Optional[dict] = None
        self.last_tier: Optional[str] = None
        self._closed = False
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        os.makedirs(local, exist_ok=True)
        self.hosts = self._find_hosts()
        self.host = next(i for i, g in enumerate(self.hosts) if self.rank in g)
        self.leader = self.hosts[self.host][0] == self.rank
        n_hosts = len(self.hosts)
        if replicas > n_hosts - 1:
            if replicas:
                warnings.warn(
                    f"ckptstore: replicas={replicas} needs {replicas + 1} hosts, the job has "
                    f"{n_hosts}: {n_hosts - 1} replica(s) kept",
                    stacklevel=2,
                )
            replicas = n_hosts - 1
        self.replicas = replicas
        err = None
        if self.leader:
            try:
                self._gc_start()
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        self._agree([err], "cleaning the local tier")

    # -- collectives -----------------------------------------------------------------------

    def _gather(self, obj: Any) -> list:
        dist = _dist()
        if not dist:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _bcast(self, obj: Any) -> Any:
        dist = _dist()
        if not dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, errors: list, what: str) -> None:
        """All-gather each rank's errors; raise on every rank if any rank has one."""
        got = self._gather([e for e in errors if e])
        bad = [e for es in got for e in es]
        if bad:
            raise RuntimeError(f"ckptstore tiers: {what} failed: " + "; ".join(bad))

    def _find_hosts(self) -> list[list[int]]:
        """Ranks grouped by the local directory they share (each rank leaves a marker file
        there; the ranks that see one another's markers are one host)."""
        token = self._bcast(uuid.uuid4().hex if self.rank == 0 else None)
        mark = os.path.join(self.local, f".member-{token}-r{self.rank}")
        with open(mark, "w"):
            pass
        dist = _dist()
        if dist:
            dist.barrier()
        prefix = f".member-{token}-r"
        mine = sorted(int(n[len(prefix):]) for n in os.listdir(self.local) if n.startswith(prefix))
        if dist:
            dist.barrier()
        os.unlink(mark)
        groups = self._gather(mine)
        hosts = sorted({tuple(g) for g in groups})
        flat = sorted(r for g in hosts for r in g)
        if flat != list(range(self.world)) or any(self.rank not in g for g in [groups[self.rank]]):
            raise InvalidArgumentError(
                f"the ranks do not split into hosts by their local directory {self.local!r}: {groups}"
            )
        return [list(g) for g in hosts]

    # -- the local tier --------------------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.local, f"step-{step}")

    def _read_index(self) -> dict:
        try:
            with open(os.path.join(self.local, _INDEX), "rb") as f:
                idx = json.loads(f.read())
            steps = idx["steps"]
            return {int(k): dict(v) for k, v in steps.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            warnings.warn(f"ckptstore: the local tier's index {self.local}/{_INDEX} is unreadable ({e}): ignored", stacklevel=3)
            return {}

    def _write_index(self, idx: dict) -> None:
        body = {"version": _VERSION, "steps": {str(k): v for k, v in sorted(idx.items())}}
        atomic.write_file(self.local, _INDEX, json.dumps(body, sort_keys=True))

    def _gc_start(self) -> None:
        atomic.sweep_leftovers(self.local)
        idx = self._read_index()
        for name in os.listdir(self.local):
            p = os.path.join(self.local, name)
            m = _STEP_RE.match(name)
            if (m and int(m.group(1)) not in idx) or name.startswith(".restore-"):
                atomic.remove_dir(p)
            elif m:
                atomic.sweep_leftovers(p)
                for sub in os.listdir(p):
                    if sub.startswith(".src-") and os.path.isdir(os.path.join(p, sub)):
                        shutil.rmtree(os.path.join(p, sub))

    def _retain(self) -> None:
        idx = self._read_index()
        old = sorted(idx)[: -self.keep]
        if not old:
            return
        for s in old:
            del idx[s]
        self._write_index(idx)
        for s in old:
            atomic.remove_dir(self._step_dir(s))

    # -- save ------------------------------------------------------------------------------

    def save(self, step: int, model: Any, optimizer: Any = None, extra: Optional[Mapping[str, Any]] = None) -> None:
        """Save ``step`` (every rank): local tier, replicas, index; persisted too when
        ``step`` is a multiple of ``persist_every``. Blocks until the step is saved; raises
        on every rank when it is not (nothing is then recorded for it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        dist = _dist()
        sdir = self._step_dir(step)
        # 0. A step saved again: forget the old one first.
        err = None
        if self.leader:
            try:
                idx = self._read_index()
                if step in idx:
                    del idx[step]
                    self._write_index(idx)
                if os.path.exists(sdir):
                    atomic.remove_dir(sdir)
            except Exception as e:  # noqa: BLE001
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        self._agree([err], f"preparing step {step}")

        # 1. Every rank's part into its host's local tier.
        own = os.path.join(sdir, f"src-{self.host}")
        sd, meta = _d.state_and_meta(model, optimizer, extra)
        w = _part_writer(own, {_d.META_KEY: meta})
        try:
            dcp.save(sd, storage_writer=w)
        except CheckpointException as e:  # a BaseException in DCP: report as ckptstore's own
            failures = getattr(e, "failures", None) or {}
            first = next(iter(failures.values()), e)
            raise CheckpointError(
                f"writing step {step} into {own!r} failed on rank(s) {sorted(failures)}: {first}"
            ) from e
        cid = w.checkpoint_id
        files: dict[str, list[int]] = {}
        err = None
        try:
            for name in sorted(os.listdir(own)):
                if name.startswith((f"part-{cid}-r{self.rank}.", f"shard-{cid}-r{self.rank}-")):
                    files[name] = list(_crc_file(os.path.join(own, name)))
            atomic.fsync_dir(own)
            if not any(n.startswith("part-") for n in files):
                raise CheckpointError(f"no part file of rank {self.rank} in {own}")
        except Exception as e:  # noqa: BLE001
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
        status = self._gather((files, err, w.manifest_metadata if self.rank == 0 else None))
        bad = [s[1] for s in status if s[1]]
        if bad:
            raise RuntimeError(f"ckptstore tiers: writing step {step} failed: " + "; ".join(bad))
        all_files = {r: s[0] for r, s in enumerate(status)}
        manifest_meta = status[0][2]

        # 2. Replicas: host h's files to hosts h+1 .. h+replicas (ring), leaders only. The
        #    transfers are collectives (a lost host raises gloo's error out of them); the
        #    checks and writes around them report through the status all-gather.
        err = None
        if self.leader and self.replicas:
            err = self._replicate(step, all_files)
        self._agree([err], f"replicating step {step}")

        # 3. The coordinator records the step; every host writes the record durably.
        record = None
        if self.rank == 0:
            record = {
                "version": _VERSION,
                "step": step,
                "checkpoint_id": cid,
                "world_size": self.world,
                "saved_at": time.time(),
                "hosts": self.hosts,
                "replicas": self.replicas,
                "files": {str(r): f for r, f in all_files.items()},
                "metadata": manifest_meta,
            }
        record = self._bcast(record)
        err = None
        if self.leader:
            try:
                body = json.dumps(record, sort_keys=True).encode()
                atomic.write_file(sdir, _COMMIT, body)
                idx = self._read_index()
                idx[step] = {"checkpoint_id": cid, "commit_crc32": zlib.crc32(body), "commit_size": len(body)}
                self._write_index(idx)
            except Exception as e:  # noqa: BLE001
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        self._agree([err], f"recording step {step}")

        # 4. Retention (after the record: a failure here loses nothing).
        if self.leader:
            try:
                self._retain()
            except Exception as e:  # noqa: BLE001 - the step is saved; gc retries next time
                warnings.warn(f"ckptstore: retention in {self.local} failed: {e}", stacklevel=2)

        # 5. The persistent tier.
        if self.persistent and self.persist_every and step % self.persist_every == 0:
            _d.save(os.path.join(self.persistent, f"step-{step}"), model, optimizer, extra)

    def _replicate(self, step: int, all_files: dict) -> Optional[str]:
        """Send this host's files around the ring and store what arrives; the first error
        (as text), or None. Every exchange runs even after an error (the peers expect it)."""
        sdir = self._step_dir(step)
        own = os.path.join(sdir, f"src-{self.host}")
        err = None
        mine = []
        try:
            for r in self.hosts[self.host]:
                for name in sorted(all_files[r]):
                    with open(os.path.join(own, name), "rb") as f:
                        mine.append((name, f.read()))
            payload = _pack(mine)
        except Exception as e:  # noqa: BLE001
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
            payload = _pack([], err)
        n_hosts = len(self.hosts)
        for j in range(1, self.replicas + 1):
            dst_h = (self.host + j) % n_hosts
            src_h = (self.host - j) % n_hosts
            got = _exchange(payload, self.hosts[dst_h][0], self.hosts[src_h][0], tag=1000 + 2 * j)
            if err is not None:
                continue
            try:
                files, error = _unpack(got)
                if error:
                    raise CheckpointError(f"host {src_h} could not send its files: {error}")
                want = {n: v for r in self.hosts[src_h] for n, v in all_files[r].items()}
                if sorted(n for n, _ in files) != sorted(want):
                    raise CheckpointError(
                        f"host {src_h} sent files {[n for n, _ in files]}, expected {sorted(want)}"
                    )
                stage = os.path.join(sdir, f".src-{src_h}.tmp-{uuid.uuid4().hex[:8]}")
                os.makedirs(stage)
                for name, data in files:
                    if [len(data), zlib.crc32(data)] != list(want[name]):
                        raise CheckpointError(f"{name} from host {src_h}: size or CRC32 differs from its writer's")
                    _write_fsync(os.path.join(stage, name), data)
                atomic.fsync_dir(stage)
                atomic.publish_dir(stage, os.path.join(sdir, f"src-{src_h}"))
            except Exception as e:  # noqa: BLE001
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        return err

    def wait(self) -> None:
        """Every rank: saves are blocking in this slice, so this returns at once."""
        self._check_open()

    # -- restore ---------------------------------------------------------------------------

    def _scan(self) -> dict:
        """What this host's local tier holds: per indexed step, the record and the ranks
        whose every file is present with its recorded size and CRC32 (and why not)."""
        out = {}
        for step, ent in sorted(self._read_index().items()):
            sdir = self._step_dir(step)
            try:
                with open(os.path.join(sdir, _COMMIT), "rb") as f:
                    body = f.read()
                if zlib.crc32(body) != ent.get("commit_crc32") or len(body) != ent.get("commit_size"):
                    raise CheckpointError("commit.json does not match the index's CRC32")
                record = json.loads(body)
            except (OSError, ValueError, CheckpointError) as e:
                out[step] = {"record": None, "good": [], "bad": {"*": f"{sdir}/{_COMMIT}: {e}"}}
                continue
            good, bad = [], {}
            for h, ranks in enumerate(record["hosts"]):
                src = os.path.join(sdir, f"src-{h}")
                if not os.path.isdir(src):
                    continue
                for r in ranks:
                    why = None
                    for name, (size, crc) in sorted(record["files"][str(r)].items()):
                        p = os.path.join(src, name)
                        try:
                            got = _crc_file(p)
                        except OSError as e:
                            why = f"{p}: {e.strerror or e}"
                            break
                        if list(got) != [size, crc]:
                            why = f"{p}: size or CRC32 differs from the record (damaged)"
                            break
                    if why is None:
                        good.append(r)
                    else:
                        bad[str(r)] = why
            out[step] = {"record": record, "good": sorted(good), "bad": bad}
        return out

    def _persisted(self) -> list[int]:
        if not self.persistent or not os.path.isdir(self.persistent):
            return []
        from .. import _ckptstore

        steps = []
        for name in os.listdir(self.persistent):
            m = _STEP_RE.match(name)
            if not m:
                continue
            try:
                _ckptstore.Checkpoint(os.path.join(self.persistent, name), lazy=True)
            except Exception:  # noqa: BLE001 - not committed (or not a checkpoint): not a candidate
                continue
            steps.append(int(m.group(1)))
        return sorted(steps)

    def restore_latest(self, model: Any, optimizer: Any = None) -> Optional[int]:
        """Restore the newest step that can be read whole from some tier (every rank);
        returns it, or ``None`` when no tier holds any. The ``extra`` dict it was saved with
        is ``self.last_extra`` afterwards, the tier it came from ``self.last_tier``
        (``"fast"``: local and peer copies; ``"persistent"``). Raises
        :class:`ckptstore.CheckpointError` when steps were recorded but none can be read."""
        self._check_open()
        held = self._scan() if self.leader else None
        pers = self._persisted() if self.rank == 0 else None
        gathered = self._gather((self.host, held, pers))
        persisted = gathered[0][2]
        by_host = {h: hd for h, hd, _ in gathered if hd is not None}

        # Per (step, checkpoint id): which current hosts hold a good copy of which rank's part.
        fast: dict[tuple[int, str], dict] = {}
        notes: dict[int, list[str]] = {}
        for h in sorted(by_host):
            for step, ent in by_host[h].items():
                for r, why in ent["bad"].items():
                    notes.setdefault(step, []).append(f"host {h}: {why}")
                rec = ent["record"]
                if rec is None:
                    continue
                key = (step, rec["checkpoint_id"])
                f = fast.setdefault(key, {"record": rec, "holders": {}})
                for r in ent["good"]:
                    f["holders"].setdefault(r, []).append(h)
        candidates: list[tuple[int, str, Any]] = []
        for (step, cid), f in fast.items():
            missing = [r for r in range(f["record"]["world_size"]) if r not in f["holders"]]
            if missing:
                notes.setdefault(step, []).append(f"no good copy on any host of the parts of rank(s) {missing}")
            else:
                candidates.append((step, "fast", f))
        for step in persisted:
            candidates.append((step, "persistent", None))
        # Newest first; for one step the fast tier first (of two saves of one step number,
        # say by a host back with stale files, the later one), then the persistent one.
        candidates.sort(
            key=lambda c: (-c[0], c[1] != "fast", -float((c[2] or {}).get("record", {}).get("saved_at") or 0))
        )
        newest = max([s for s, _ in fast] + list(notes) + list(persisted), default=None)
        if newest is None:
            return None
        for step, kind, f in candidates:
            try:
                if kind == "fast":
                    extra = self._restore_fast(step, f, model, optimizer)
                else:
                    extra = _d.load(os.path.join(self.persistent, f"step-{step}"), model, optimizer)
            except CheckpointError as e:  # every rank raised it (the loads agree): next one
                notes.setdefault(step, []).append(f"{kind} tier: {e}")
                continue
            if step != newest:
                missed = sorted((s for s in notes if s > step), reverse=True)
                detail = "; ".join(f"step {s}: " + ", ".join(notes[s]) for s in missed)
                warnings.warn(
                    f"ckptstore: restored step {step} from the {kind} tier, not the newest "
                    f"recorded step {newest}: {detail or 'no whole copy'} (persisted steps: "
                    f"{persisted})",
                    stacklevel=2,
                )
            self.last_extra = extra
            self.last_tier = kind
            return step
        raise CheckpointError(
            "ckptstore tiers: no step can be restored from any tier: "
            + "; ".join(f"step {s}: " + ", ".join(n) for s, n in sorted(notes.items(), reverse=True))
        )

    def _restore_fast(self, step: int, f: dict, model: Any, optimizer: Any) -> dict:
        """Every host assembles the step's files (its own good copies, the others sent by a
        host holding them), commits them in ``.restore-<step>``, and every rank loads."""
        import torch.distributed as dist_mod

        rec = f["record"]
        holders: dict[int, list[int]] = f["holders"]
        cid = rec["checkpoint_id"]
        world = rec["world_size"]
        n_hosts = len(self.hosts)
        stage = os.path.join(self.local, f".restore-{step}")
        # The same transfer list on every rank: part r to host d from one of its holders.
        transfers = []
        for r in range(world):
            hs = holders[r]
            for d in range(n_hosts):
                if d not in hs:
                    transfers.append((r, hs[(d + r) % len(hs)], d))
        err = None
        if self.leader:
            try:
                if os.path.exists(stage):
                    atomic.remove_dir(stage)
                os.makedirs(stage)
                sdir = self._step_dir(step)
                for r in range(world):
                    if self.host in holders[r]:
                        src = os.path.join(sdir, f"src-{self._saved_host(rec, r)}")
                        for name in rec["files"][str(r)]:
                            try:
                                os.link(os.path.join(src, name), os.path.join(stage, name))
                            except OSError:
                                shutil.copyfile(os.path.join(src, name), os.path.join(stage, name))
            except Exception as e:  # noqa: BLE001
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
            for i, (r, src_h, dst_h) in enumerate(transfers):
                tag = 5000 + i
                if self.host == src_h:
                    files, why = [], None
                    try:
                        src = os.path.join(self._step_dir(step), f"src-{self._saved_host(rec, r)}")
                        for name in sorted(rec["files"][str(r)]):
                            with open(os.path.join(src, name), "rb") as fh:
                                files.append((name, fh.read()))
                    except OSError as e:
                        files, why = [], f"host {self.host}: {e}"
                    _send_pack(_pack(files, why), self.hosts[dst_h][0], tag)
                elif self.host == dst_h:
                    got, why = _unpack(_recv_pack(self.hosts[src_h][0], tag))
                    if err is None:
                        try:
                            if why:
                                raise CheckpointError(why)
                            want = rec["files"][str(r)]
                            if sorted(n for n, _ in got) != sorted(want):
                                raise CheckpointError(f"host {src_h} sent the wrong files for rank {r}")
                            for name, data in got:
                                if [len(data), zlib.crc32(data)] != list(want[name]):
                                    raise CheckpointError(f"{name} from host {src_h}: CRC32 differs from the record")
                                _write_fsync(os.path.join(stage, name), data)
                        except Exception as e:  # noqa: BLE001
                            err = f"rank {self.rank}: {type(e).__name__}: {e}"
            if err is None:
                try:
                    parts = []
                    for r in range(world):
                        with open(os.path.join(stage, f"part-{cid}-r{r}.json"), "rb") as fh:
                            parts.append(fh.read())
                    _commit(stage, cid, parts=parts, world_size=world, metadata=rec["metadata"])
                except Exception as e:  # noqa: BLE001
                    err = f"rank {self.rank}: {type(e).__name__}: {e}"
        got = self._gather(err)
        bad = [e for e in got if e]
        try:
            if bad:
                raise CheckpointError(f"assembling step {step} failed: " + "; ".join(bad))
            return _d.load(stage, model, optimizer)
        finally:
            if _dist():
                dist_mod.barrier()
            if self.leader and os.path.exists(stage):
                atomic.remove_dir(stage)

    @staticmethod
    def _saved_host(rec: dict, rank: int) -> int:
        return next(h for h, rs in enumerate(rec["hosts"]) if rank in rs)

    # -- lifetime --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the CheckpointManager is closed")

    def close(self) -> None:
        """Finish (saves are blocking: nothing pending) and refuse further calls."""
        self._closed = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager(local={self.local!r}, persistent={self.persistent!r}, "
            f"persist_every={self.persist_every}, replicas={self.replicas}, keep={self.keep})"
        )
