"""A host's local tier for the tiered manager (:mod:`ckptstore.torch.tiered`): its index,
the steps' records, the check of what it holds, retention and the clean-up of what an
interrupted save or restore left. Run by the host's first rank only.

Layout (``root``, the same path on every host, private to it)::

    index.json                 the steps this host knows saved, each with its commit.json's
                               size and CRC32 (a step is saved on this host when it is here)
    step-<n, 8+ digits>/       a step (the name of every ckptstore manager's steps; earlier
                               versions wrote step-<n>, still read)
    step-<n>/commit.json       the step's record: checkpoint id, world size, hosts, every
                               rank's files with size and CRC32, the manifest metadata
    step-<n>/src-<h>/          the files of the ranks of host h (this host's own, and those
                               replicated here from other hosts)
    step-<n>/.src-<h>.tmp-*    a replica being received (published by one rename)
    .restore-<n>/              a step being assembled for a restore

With a byte budget (the manager's ``local_budget``) the manager measures the tier as ``du``
does (:meth:`LocalTier.usage`: every entry's allocated blocks, a hard-linked file once) and
removes steps with :meth:`LocalTier.remove`; a step a persist reads is pinned, and
:meth:`LocalTier.wait_released` waits for its release.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
import zlib
from typing import Any, NamedTuple, Optional

from .. import atomic, new_checkpoint_id
from ..errors import CheckpointError, InvalidArgumentError
from . import _sharded as _d
from ._tier_wire import crc_file, err_text

INDEX = "index.json"
COMMIT = "commit.json"
STEP_RE = re.compile(r"^step-(\d+)$")
RESTORE_RE = re.compile(r"^\.restore-(\d+)$")
VERSION = 1
#: The unit a file system holds a file in (a page of tmpfs, a block of most disks): the
#: budget counts every file and directory as whole pages, as ``du`` does.
PAGE = 4096


def pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages (:data:`PAGE`)."""
    return -(-int(n) // PAGE) * PAGE



def machine_id() -> str:
    """This process's machine, as far as a local tier can tell: the kernel's boot id and the
    network namespace (the ranks of one host share both; separate machines differ in the
    first, network-namespace hosts on one machine in the second); ``""`` where ``/proc``
    does not say. Two ranks that see one another's files in their local directory but have
    different ids share the directory through a network file system."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return ""


def find_hosts(local: str, rank: int, world: int, token: str, gather: Any, barrier: Any) -> list[list[int]]:
    """The job's ranks grouped into hosts by the local directory they share: each rank
    leaves a marker file in ``local`` (named with the job's ``token``), and the ranks that
    see one another's markers are one host (``gather``: an all-gather of one object per
    rank; ``barrier``: the group's barrier). Raises on every rank alike
    (:class:`~ckptstore.errors.InvalidArgumentError`) where the ranks do not split into
    hosts, or where ranks of one "host" run on different machines (:func:`machine_id`: the
    local tier is then a shared file system's directory, whose loss would lose every copy)."""
    mark = os.path.join(local, f".member-{token}-r{rank}")
    with open(mark, "w"):
        pass
    barrier()
    prefix = f".member-{token}-r"
    mine = sorted(int(n[len(prefix):]) for n in os.listdir(local) if n.startswith(prefix))
    barrier()
    os.unlink(mark)
    got = gather((mine, machine_id()))
    groups = [g for g, _ in got]
    hosts = sorted({tuple(g) for g in groups})
    if sorted(r for g in hosts for r in g) != list(range(world)):
        raise InvalidArgumentError(f"the ranks do not split into hosts by their local directory {local!r}: {groups}")
    for g in hosts:
        machines = {got[r][1] for r in g} - {""}
        if len(machines) > 1:
            raise InvalidArgumentError(
                f"the local tier {local!r} is shared between machines: ranks {list(g)} see one another's "
                f"files there but run on {len(machines)} different machines (boot id and network "
                "namespace); a local tier must be each host's own storage (/dev/shm, a local disk), a "
                "shared directory is the persistent tier (persistent=)"
            )
    return [list(g) for g in hosts]

class Usage(NamedTuple):
    """What the local tier holds, as ``du`` counts it: ``total`` bytes (everything under the
    root, the root included), ``steps`` (indexed step -> the bytes of its directory),
    ``pinned`` (indexed steps a persist still reads)."""

    total: int
    steps: dict
    pinned: list


class LocalTier:
    """The local tier at ``root``; ``keep``: indexed steps kept by :meth:`retain`."""

    def __init__(self, root: str, keep: int) -> None:
        self.root = root
        self.keep = keep
        self._pins: dict[int, int] = {}  # steps a persist is reading: never removed
        self._lock = threading.Condition()  # notified when a pin is released

    def step_dir(self, step: int) -> str:
        """``step-<8+ digits>``, the step directory name of every ckptstore manager; a
        directory an earlier version left unpadded (``step-<n>``) is still found."""
        padded = os.path.join(self.root, f"step-{step:08d}")
        if not os.path.exists(padded):
            old = os.path.join(self.root, f"step-{step}")
            if old != padded and os.path.isdir(old):
                return old
        return padded

    def src_dir(self, step: int, host: int) -> str:
        return os.path.join(self.step_dir(step), f"src-{host}")

    # -- the index ---------------------------------------------------------------------------

    def read_index(self) -> dict:
        try:
            with open(os.path.join(self.root, INDEX), "rb") as f:
                idx = json.loads(f.read())
            return {int(k): dict(v) for k, v in idx["steps"].items()}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            warnings.warn(f"ckptstore: the local tier's index {self.root}/{INDEX} is unreadable ({e}): ignored",
                          stacklevel=3)
            return {}

    def write_index(self, idx: dict) -> None:
        body = {"version": VERSION, "steps": {str(k): v for k, v in sorted(idx.items())}}
        atomic.write_file(self.root, INDEX, json.dumps(body, sort_keys=True))

    def forget(self, step: int) -> None:
        """A step saved again: out of the index first, then its directory removed."""
        idx = self.read_index()
        if step in idx:
            del idx[step]
            self.write_index(idx)
        if os.path.exists(self.step_dir(step)):
            atomic.remove_dir(self.step_dir(step))

    def record(self, step: int, record: dict, between: Any = None) -> None:
        """Write the step's record durably, then name it in the index: the step is saved.
        ``between()`` runs in between (the kill seam)."""
        body = json.dumps(record, sort_keys=True).encode()
        atomic.write_file(self.step_dir(step), COMMIT, body)
        if between is not None:
            between()
        idx = self.read_index()
        idx[step] = {"checkpoint_id": record["checkpoint_id"], "commit_crc32": zlib.crc32(body),
                     "commit_size": len(body)}
        self.write_index(idx)

    def load_record(self, step: int) -> dict:
        """The step's record, checked against the index's CRC32; raises CheckpointError."""
        ent = self.read_index().get(step)
        p = os.path.join(self.step_dir(step), COMMIT)
        if ent is None:
            raise CheckpointError(f"{self.root}: step {step} is not in the index")
        try:
            with open(p, "rb") as f:
                body = f.read()
        except OSError as e:
            raise CheckpointError(f"{p}: {e.strerror or e}") from e
        if zlib.crc32(body) != ent.get("commit_crc32") or len(body) != ent.get("commit_size"):
            raise CheckpointError(f"{p}: does not match the index's CRC32 (damaged)")
        try:
            return json.loads(body)
        except ValueError as e:
            raise CheckpointError(f"{p}: {e}") from e

    # -- retention and leftovers -------------------------------------------------------------

    def pin(self, step: int) -> None:
        with self._lock:
            self._pins[step] = self._pins.get(step, 0) + 1

    def unpin(self, step: int) -> None:
        with self._lock:
            n = self._pins.get(step, 0) - 1
            if n > 0:
                self._pins[step] = n
            else:
                self._pins.pop(step, None)
                self._lock.notify_all()

    def wait_released(self, steps: list[int], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no persist reads any of ``steps``; whether
        none does."""
        end = time.monotonic() + max(0.0, timeout)
        with self._lock:
            while any(s in self._pins for s in steps):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def retain(self) -> list[int]:
        """Keep the newest ``keep`` indexed steps, and any step a persist still reads; the
        index is rewritten first, then the older step directories removed whole."""
        idx = self.read_index()
        with self._lock:
            old = [s for s in sorted(idx)[: -self.keep] if s not in self._pins]
        return self.remove(old)

    def remove(self, steps: list[int]) -> list[int]:
        """Remove the indexed ``steps`` that no persist reads (the index rewritten first,
        then their directories removed whole); those removed."""
        idx = self.read_index()
        with self._lock:
            gone = [s for s in sorted(set(steps)) if s in idx and s not in self._pins]
        if not gone:
            return []
        for s in gone:
            del idx[s]
        self.write_index(idx)
        for s in gone:
            atomic.remove_dir(self.step_dir(s))
        return gone

    def usage(self) -> Usage:
        """The bytes the tier holds, as ``du`` counts them (allocated blocks of every file
        and directory, the root's own included; a hard-linked file once; an entry removed
        meanwhile not at all), with those of each indexed step's directory."""
        idx = self.read_index()
        seen: set[tuple[int, int]] = set()

        def du(path: str) -> int:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return 0
            n = 0
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                n = st.st_blocks * 512
            if os.path.isdir(path) and not os.path.islink(path):
                try:
                    names = os.listdir(path)
                except (FileNotFoundError, NotADirectoryError):
                    return n
                n += sum(du(os.path.join(path, name)) for name in names)
            return n

        steps = {s: du(self.step_dir(s)) for s in sorted(idx)}
        total = du(self.root)  # the steps' entries are seen already: counted once
        with self._lock:
            pinned = sorted(s for s in self._pins if s in idx)
        return Usage(total + sum(steps.values()), steps, pinned)

    def clean(self) -> int:
        """Remove what an interrupted save or restore left: step directories the index does
        not name, restore staging, replicas half received, engine leftovers. Run where no
        save or restore of this manager is in flight (at start-up, by ``gc``)."""
        n = atomic.sweep_leftovers(self.root)
        idx = self.read_index()
        with self._lock:
            pinned = set(self._pins)
        for name in os.listdir(self.root):
            p = os.path.join(self.root, name)
            m = STEP_RE.match(name)
            r = RESTORE_RE.match(name)
            stale = m and int(m.group(1)) not in idx and int(m.group(1)) not in pinned
            if stale or (r and int(r.group(1)) not in pinned):
                atomic.remove_dir(p)
                n += 1
            elif m:
                n += atomic.sweep_leftovers(p)
                for sub in os.listdir(p):
                    if sub.startswith(".src-") and os.path.isdir(os.path.join(p, sub)):
                        shutil.rmtree(os.path.join(p, sub))
                        n += 1
        return n

    # -- what this host holds ----------------------------------------------------------------

    def scan(self, crc: bool = True) -> dict:
        """Per indexed step: the record's summary (``None`` when the record is damaged; see
        :func:`summary`), the ranks whose every file is present in this tier with its
        recorded size and CRC32 (``good``; without ``crc``, the size only:
        :meth:`check_ranks` then checks the step chosen), and why the others that are here
        are not (``bad``). What every rank all-gathers at a restore: a few hundred bytes a
        step, not the record (megabytes at thousands of ranks x tensors), which the ranks
        get from one holder for the step they try."""
        out: dict[int, dict[str, Any]] = {}
        idx = self.read_index()
        for step in sorted(idx):
            try:
                record = self.load_record(step)
            except CheckpointError as e:
                out[step] = {"summary": None, "good": [], "bad": {"*": str(e)}}
                continue
            good: list[int] = []
            bad: dict[str, str] = {}
            for h, ranks in enumerate(record["hosts"]):
                src = self.src_dir(step, h)
                if not os.path.isdir(src):
                    continue
                for r in ranks:
                    why = self.check_files(src, record["files"][str(r)], crc)
                    if why is None:
                        good.append(r)
                    else:
                        bad[str(r)] = why
            out[step] = {"summary": summary(record, idx[step]), "good": sorted(good), "bad": bad}
        return out

    def check_ranks(self, step: int, record: dict, ranks: list[int]) -> dict:
        """``{rank: why}`` for the ranks of ``ranks`` whose files here do not all have the
        recorded size and CRC32."""
        bad = {}
        for r in ranks:
            src = self.src_dir(step, saved_host(record, r))
            why = self.check_files(src, record["files"][str(r)], True)
            if why is not None:
                bad[r] = why
        return bad

    @staticmethod
    def check_files(src: str, files: dict, crc: bool = True) -> Optional[str]:
        for name, (size, want) in sorted(files.items()):
            p = os.path.join(src, name)
            try:
                got = crc_file(p) if crc else (os.stat(p).st_size, want)
            except OSError as e:
                return f"{p}: {e.strerror or e}"
            if list(got) != [size, want]:
                return f"{p}: size or CRC32 differs from the record (damaged)"
        return None


#: A safetensors header's length cap (the engine's and safetensors' ``MAX_HEADER_SIZE``).
_MAX_HEADER = 100_000_000


def shard_head_len(path: str) -> int:
    """How many leading bytes of the shard file ``path`` are its header: the 8-byte
    little-endian length, then that many bytes (checked to fit the file and the cap)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
    n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 <= n <= min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"{path}: not a shard file (its header length prefix does not fit its {size} bytes)")
    return 8 + n


def summary(record: dict, entry: dict) -> dict:
    """What a restore needs of a step's record to choose it (its id, world size and save
    time) and to know it got the same record from a holder (the CRC32 and size that the
    index ``entry`` gives its ``commit.json``)."""
    return {"checkpoint_id": record["checkpoint_id"], "world_size": record["world_size"],
            "saved_at": record.get("saved_at"), "commit_crc32": entry.get("commit_crc32"),
            "commit_size": entry.get("commit_size")}


def saved_host(record: dict, rank: int) -> int:
    """The host whose ``src-<h>`` holds ``rank``'s files in a step's record."""
    return next(h for h, rs in enumerate(record["hosts"]) if rank in rs)


def check_arrival(name: str, data: Any, want: dict, src_host: int) -> None:
    """A file received from ``src_host`` (a uint8 tensor, or the ``(size, crc32)`` of what
    was written): its size and CRC32 must be the record's."""
    if name not in want:
        raise CheckpointError(f"host {src_host} sent {name}, which the record does not name")
    got = list(data) if isinstance(data, tuple) else [data.numel(), zlib.crc32(data.numpy())]
    if got != list(want[name]):
        raise CheckpointError(f"{name} from host {src_host}: size or CRC32 differs from the record "
                              "(damaged in transit or at the source)")


def new_stage(parent: str, name: str) -> str:
    stage = os.path.join(parent, f".{name}.tmp-{uuid_hex()}")
    os.makedirs(stage)
    return stage


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


def snapshot(obj: Any, snap: Any, path: str) -> Any:
    """``obj`` (a DCP state dict) with every tensor replaced by the snapshot's copy; a
    DTensor keeps its placement (its local shard copied)."""
    import torch

    DTensor = _d._dtensor_type()

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, DTensor):
            # The local shard itself: ``to_local()`` is an autograd function (3 us a call,
            # a third of the walk's time over 500 tensors), and only its bytes are read.
            shard = getattr(obj, "_local_tensor", None)
            local = snap.tensor(path, shard if isinstance(shard, torch.Tensor) else obj.to_local())
            # The DTensor around the buffer is kept too, while buffer and spec are the same.
            w = snap.wrapped.get(path)
            if w is None or getattr(w, "_local_tensor", None) is not local or w._spec != obj._spec:
                w = snap.wrapped[path] = type(obj)(local, obj._spec, requires_grad=False)
            return w
        if isinstance(obj, torch.Tensor):
            return snap.tensor(path, obj)
        return obj

    return walk(obj, path)


def part_writer(path: str, metadata: dict[Any, Any]) -> Any:
    """A DCP Writer whose coordinator keeps the manifest metadata instead of committing."""
    from .dcp import META_KEY as DCP_KEY
    from .dcp import Writer, _metadata_to_json

    class _PartWriter(Writer):
        manifest_metadata: Optional[dict[Any, Any]] = None

        def prepare_local_plan(self, plan: Any) -> Any:  # noqa: D401 - DCP protocol
            atomic.make_dirs(self.path)  # every host's own local directory
            return plan

        def finish(self, metadata: Any, results: Any) -> None:  # noqa: D401 - DCP protocol
            for r, rank_results in enumerate(results):
                if sum(1 for w in rank_results if w.index.fqn == "__ckptstore.part__") != 1:
                    raise CheckpointError(f"rank {r} reported no part descriptor")
            self.keep(metadata)

        def keep(self, metadata: Any) -> None:
            meta = dict(self.user_metadata)
            meta[DCP_KEY] = _metadata_to_json(metadata, self.storage_meta())
            self.manifest_metadata = meta

    return _PartWriter(path, metadata=metadata)


# -- the local budget ---------------------------------------------------------------------
# Bytes as the tier's file system holds them (whole pages, ``du``'s count: _tier_local.PAGE).


#: Whether the tiered save plans each rank's part alone when every rank's entries agree
#: (:func:`save_part`); ``False``: always ``dcp.save`` and its global plan (the tests
#: compare the two). The same on every rank.
SPMD_PLAN = True


def save_part(sd: Any, w: Any, rank: int, world: int, gather: Any, dcp_save: Any) -> Optional[str]:
    """Every rank: write this rank's part of the state dict ``sd`` with ``w``
    (:func:`part_writer`), as ``dcp.save`` with DCP's default planner would, but without
    its global plan when every rank's state dict has the same entries (names, kinds,
    global sizes and dtypes; one all-gather of a digest with ``gather``), as an SPMD job's
    does: each rank then drops the writes another rank makes (a replicated DTensor's chunk
    is written by its replica at coordinate 0 of every replicated mesh dimension, an object
    or a plain tensor of at most :data:`SMALL` bytes by rank 0, a larger plain tensor by
    rank ``crc32(name) % world``), and rank 0 builds the manifest
    metadata from its own entries; the ranks then all-gather their errors (every part is
    written when it returns). ``dcp.save`` gathers every rank's plan on rank 0, plans
    there and broadcasts the global ``Metadata``, every rank's every chunk, to all: at
    1,024 ranks x 10,000 tensors, minutes and tens of GiB (python/benches/
    bench_tier_meta.py). Otherwise (the ranks' entries differ) ``dcp_save()``. Returns
    the ranks' errors as text (the same on every rank), or None; raises only what the
    process group (or ``dcp_save``) raises."""
    import dataclasses
    import hashlib

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import WriteItemType

    if not SPMD_PLAN:
        dcp_save()
        return None
    plan = planner = None
    digest: Optional[str] = None
    try:
        planner = DefaultSavePlanner()
        w.reset()
        w.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        planner.set_up_planner(sd, w.storage_meta(), rank == 0)
        plan = w.prepare_local_plan(planner.create_local_plan())
        entries = sorted({(wi.index.fqn, wi.type.name) + (() if wi.tensor_data is None else (
            tuple(wi.tensor_data.size), str(wi.tensor_data.properties.dtype))) for wi in plan.items})
        digest = hashlib.sha256(repr((entries, plan.planner_data)).encode()).hexdigest()
        err = None
    except Exception as e:  # noqa: BLE001 - every rank learns it below
        err = err_text(rank, e)
    got = gather((digest, err, new_checkpoint_id() if rank == 0 else None))
    bad = [g[1] for g in got if g[1]]
    if bad:
        return "; ".join(bad)
    if any(g[0] != got[0][0] for g in got):
        dcp_save()
        return None
    assert plan is not None and planner is not None
    err = None
    try:
        keep = [wi for wi in plan.items if _writes_here(wi, planner.state_dict, rank, world)]
        final = planner.finish_plan(dataclasses.replace(
            plan, items=keep, storage_data={"ckptstore_checkpoint_id": got[0][2], "rank": rank}))
        results = w.write_data(final, planner).wait()
        if sum(1 for r in results if r.index.fqn == "__ckptstore.part__") != 1:
            raise CheckpointError(f"rank {rank} wrote no part descriptor")
        if rank == 0:  # the manifest metadata: every entry's kind, dtype and size
            sdm: dict[str, Any] = {}
            for wi in plan.items:
                if wi.type == WriteItemType.BYTE_IO:
                    sdm[wi.index.fqn] = BytesStorageMetadata()
                else:
                    sdm.setdefault(wi.index.fqn, TensorStorageMetadata(
                        properties=wi.tensor_data.properties, size=wi.tensor_data.size, chunks=[]))
            w.keep(Metadata(state_dict_metadata=sdm, planner_data=plan.planner_data))
    except Exception as e:  # noqa: BLE001
        err = err_text(rank, e)
    bad = [e for e in gather(err) if e]
    return "; ".join(bad) if bad else None


def _writes_here(wi: Any, sd: dict, rank: int, world: int) -> bool:
    """Whether this rank writes the item ``wi`` of its local plan (see :func:`save_part`)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    obj: Any = sd.get(wi.index.fqn)
    if wi.type == WriteItemType.SHARD:
        spec = getattr(obj, "_spec", None)
        if spec is None:  # a ShardedTensor's own shard
            return True
        coord = obj.device_mesh.get_coordinate() or []
        return all(c == 0 for c, pl in zip(coord, spec.placements) if not pl.is_shard())
    td = wi.tensor_data
    if td is None or td.size.numel() * td.properties.dtype.itemsize <= SMALL:
        return rank == 0
    return zlib.crc32(wi.index.fqn.encode()) % world == rank


#: A plain tensor of at most this many bytes, or an object, is written by rank 0 (Adam's
#: ``step`` of every parameter, say): every rank reads them, and finds them in one part's
#: index (spread over the ranks, a restore would load every rank's part index for them:
#: 3.6 GiB at 1,024 ranks x 10,000 tensors). Larger ones (a DDP model's) are spread.
SMALL = 64 << 10
