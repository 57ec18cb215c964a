"""ckptstore as the storage layer of ``torch.distributed.checkpoint`` (DCP).

::

    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Writer, Reader

    dcp.save(state_dict, storage_writer=Writer("run/ckpt"))
    dcp.load(state_dict, storage_reader=Reader("run/ckpt"))
    fut = dcp.async_save(state_dict, storage_writer=Writer("run/ckpt"))  # torch >= 2.3

DCP's planners decide who writes what (DTensor, FSDP2, ShardedTensor, deduplication,
resharding on load); ckptstore stores it:

* ``write_data`` (every rank) writes that rank's items with :func:`ckptstore.write_part`:
  each tensor item as a :class:`ckptstore.Chunk` of the global tensor at DCP's chunk
  offsets (CPU tensors are handed to the engine without a copy, the interpreter released),
  each bytes item as a 1-D ``U8`` tensor ``dcp.bytes/<fqn>``. The part descriptor travels
  back to the coordinator inside the ``WriteResult``\\ s.
* ``finish`` (the coordinator) commits with :func:`ckptstore.commit`: every part checked
  together (each global tensor tiled exactly once), then the manifest, written last and
  fsynced, the only commit point. Until then the previous checkpoint in the directory stays
  the committed one; files of dead attempts and of older checkpoints are removed by the
  commit, or, for a commit killed after its commit point, by the next commit into the
  directory (and, for a step of a manager root, by the manager's ``gc`` / ``ckpt gc ROOT``).
* DCP's ``Metadata`` lives in the manifest as JSON (metadata key ``torch.distributed.checkpoint``):
  per state-dict entry its kind, dtype and tensor properties, DCP's planner data and storage
  meta. The chunk layout is not copied there: ``read_metadata`` rebuilds it from the
  manifest's own global-tensor table, which the engine validated at commit and at open. Of a
  two-level checkpoint (``Writer(layout="two_level")``) it takes each global's grid cells
  from the root manifest instead of the chunks, reading no part index: each rank then loads
  only the parts holding the boxes it reads, and a damaged part fails only the loads that
  need it. Nothing on the tensor path is unpickled.
* ``read_data`` reads each ``ReadItem``'s box of the stored tensor straight from the
  read-only map into the destination tensor DCP gives (a fresh buffer first only when the
  destination is strided or of another dtype), after checking the CRC32 of every stored
  tensor the plan touches. By default the ranks agree (one all-reduce) that every check
  passed before any rank writes a destination: a damaged checkpoint raises
  :class:`ckptstore.ChecksumError` naming the tensor and leaves the state dict untouched on
  every rank. ``Reader(fresh_destinations=True)`` (for state dicts of fresh tensors that
  the caller drops on error, as :func:`ckptstore.torch.distributed.load` does) checks each
  block as it copies it, one pass over the bytes, and the ranks still agree before the load
  returns; ``Reader(streaming=True)`` does the same into live destinations without the
  agreement, and a failed check then leaves them partly written (the error says so).

**What loading bytes items trusts.** DCP serializes non-tensor state-dict values (Python
objects: hyperparameters, RNG states, ...) with ``torch.save``, and its load planner
deserializes them with ``torch.load(weights_only=False)``: that is ``pickle``, which runs
code chosen by whoever wrote the checkpoint. ckptstore CRC-checks those bytes like any
tensor, which detects damage, not malice: load checkpoints with bytes items only from
writers you trust. State dicts of tensors only (as :mod:`ckptstore.torch.distributed`
saves) have no bytes items, and their load never unpickles anything.

Supported torch: tested with 2.15 (CPU, gloo). The writer and reader use only the
``StorageWriter`` / ``StorageReader`` protocol of torch >= 2.4 (``storage_meta``,
``set_up_storage_writer(is_coordinator, rank=..., use_collectives=...)``), so earlier 2.x
releases from 2.4 on are expected to work but are untested. DTensor placements are not part of DCP's
``Metadata`` in these versions
(the planner records global shapes and chunk boxes only), so there is nothing more to store.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Any, Optional

import numpy as np

from .. import _ckptstore, atomic, new_checkpoint_id
from .. import commit as _commit
from ..errors import CheckpointError, InvalidArgumentError, PartError
from ._dtypes import _to_numpy, _torch, _torch_of, _wire_of
from ._values import _decode, _encode

__all__ = ["Writer", "Reader", "META_KEY", "BYTES_PREFIX"]

#: Manifest metadata key holding DCP's metadata as JSON.
META_KEY = "torch.distributed.checkpoint"
#: Prefix of the U8 tensors that hold DCP's bytes items.
BYTES_PREFIX = "dcp.bytes/"
_META_VERSION = 1
# WriteResult index of the entry that carries a rank's part descriptor to the coordinator.
_PART_FQN = "__ckptstore.part__"

import torch  # noqa: E402  (this module is only imported by torch users)
from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (  # noqa: E402
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (  # noqa: E402
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future  # noqa: E402

try:  # async_save's bwc path treats a writer that is an AsyncStager as its own stager
    from torch.distributed.checkpoint.staging import BlockingAsyncStager as _Stager
except ImportError:  # pragma: no cover - torch without async staging
    _Stager = object  # type: ignore[assignment,misc]


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


class Writer(StorageWriter, _Stager):  # type: ignore[misc]
    """A DCP ``StorageWriter`` that saves into the ckptstore checkpoint directory ``path``.

    ``max_shard_size``: most bytes of tensor data per shard file of each rank (default:
    the engine's, 4 GiB). ``metadata``: a JSON-serializable dict stored in the manifest
    beside DCP's metadata (read it back with ``ckptstore.open(path).metadata``).

    ``layout``: the manifest's shape, passed to :func:`ckptstore.commit`. ``"flat"``: one
    manifest listing every chunk, which every reader decodes whole (right for tens of
    ranks). ``"two_level"``: a root manifest naming the ranks' part descriptors, which keep
    the chunk entries; a :class:`Reader` decodes the root and loads only the parts its
    rank's read items touch. ``"auto"`` (default): two-level from 100,000 chunks over all
    ranks, flat below. Anything else raises :class:`ckptstore.InvalidArgumentError`.

    ``dcp.save`` must run with collectives (the default): the coordinator draws the
    checkpoint id and commits the parts of every rank.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        max_shard_size: Optional[int] = None,
        metadata: Optional[dict[Any, Any]] = None,
        layout: str = "auto",
    ) -> None:
        if not isinstance(layout, str) or layout not in ("auto", "flat", "two_level"):
            raise InvalidArgumentError(
                f'layout must be "auto", "flat" or "two_level", got {layout!r}'
            )
        StorageWriter.__init__(self)
        if _Stager is not object:
            _Stager.__init__(self)
        self.path = os.fspath(path)
        self.max_shard_size = max_shard_size
        self.user_metadata = dict(metadata or {})
        self.layout = layout
        self.is_coordinator = False
        self.rank = 0
        self.checkpoint_id: Optional[str] = None
        self.commit_info: Optional[dict[Any, Any]] = None

    # -- DCP protocol ---------------------------------------------------------------

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.checkpoint_id = None
        self.commit_info = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "ckptstore.torch.dcp.Writer needs dcp.save with use_collectives=True: one "
                "coordinator commits the parts of every rank"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator alone makes the directory, before any rank writes (they get their
        # plans after this): on a shared file system, ranks that each look the path up and
        # make it race through their clients' caches (a negative lookup cached on one host
        # while another made the parent), and fail. Object stores have no directories.
        if "://" not in self.path:
            atomic.make_dirs(self.path)
        cid = new_checkpoint_id()
        self.checkpoint_id = cid
        return [
            dataclasses.replace(p, storage_data={"ckptstore_checkpoint_id": cid, "rank": i})
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        sd = plan.storage_data or {}
        cid = sd.get("ckptstore_checkpoint_id")
        if not isinstance(cid, str):
            raise InvalidArgumentError(
                "the save plan carries no ckptstore checkpoint id: was prepare_global_plan "
                "of this Writer called?"
            )
        self.checkpoint_id = cid
        rank = int(sd.get("rank", self.rank))
        items: list[tuple[Any, ...]] = []
        keep: list[Any] = []  # buffers the engine reads while writing
        results: list[WriteResult] = []
        for wi in plan.items:
            data = planner.resolve_data(wi)
            fqn = wi.index.fqn
            if wi.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = np.frombuffer(data.getvalue(), dtype=np.uint8)
                keep.append(raw)
                items.append((BYTES_PREFIX + fqn, "U8", raw, None))
                results.append(WriteResult(index=wi.index, size_in_bytes=raw.nbytes, storage_data=None))
                continue
            td = wi.tensor_data
            assert td is not None and isinstance(data, torch.Tensor)
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.numel() > 0:  # empty chunks hold nothing (the engine refuses them)
                _, wire, arr = _to_numpy(fqn, t)
                keep.append(arr)
                items.append(
                    (fqn, wire, arr, ([int(d) for d in td.size], [int(o) for o in td.chunk.offsets]))
                )
            results.append(
                WriteResult(index=wi.index, size_in_bytes=t.numel() * t.element_size(), storage_data=None)
            )
        part = _ckptstore.write_part(self.path, cid, rank, items, self.max_shard_size)
        results.append(
            WriteResult(index=MetadataIndex(_PART_FQN), size_in_bytes=0, storage_data=bytes(part))
        )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        parts = []
        for r, rank_results in enumerate(results):
            found = [w.storage_data for w in rank_results if w.index.fqn == _PART_FQN]
            if len(found) != 1:
                raise PartError(f"rank {r} reported {len(found)} part descriptors, expected 1")
            parts.append(found[0])
        if self.checkpoint_id is None:
            raise InvalidArgumentError("finish called before prepare_global_plan")
        meta = dict(self.user_metadata)
        meta[META_KEY] = _metadata_to_json(metadata, self.storage_meta())
        self.commit_info = _commit(
            self.path,
            self.checkpoint_id,
            parts=parts,
            world_size=len(results),
            metadata=meta,
            layout=self.layout,
        )

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _metadata_to_json(metadata: Metadata, storage_meta: Optional[StorageMeta]) -> dict[Any, Any]:
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes", "name": BYTES_PREFIX + fqn}
        elif isinstance(md, TensorStorageMetadata):
            p = md.properties
            strides = getattr(p, "strides", None)
            items[fqn] = {
                "kind": "tensor",
                "name": fqn,
                "dtype": _dtype_name(p.dtype),
                "size": [int(d) for d in md.size],
                "requires_grad": bool(p.requires_grad),
                "strides": None if strides is None else list(strides),
            }
        else:
            raise InvalidArgumentError(
                f"state-dict entry {fqn!r}: unknown DCP storage metadata {type(md).__name__}"
            )
    sm = metadata.storage_meta or storage_meta
    return {
        "version": _META_VERSION,
        "dcp_version": metadata.version,
        "items": items,
        "planner_data": _encode(metadata.planner_data, "DCP planner data"),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules or []),
        },
    }


def _resolve(planner: Any, ri: Any) -> Any:
    """``planner.resolve_tensor(ri)``: the destination of the read item ``ri``. For DCP's
    default planner and a plain tensor, found here: its lookup tests the tensor against
    the ``_Checkpointable`` runtime protocol, 0.5 ms a call on Python 3.11 (half of a
    one-rank restore of 256 MiB in 672 calls); the same tensor, narrowed the same way."""
    cls = type(planner)
    if (cls.resolve_tensor is DefaultLoadPlanner.resolve_tensor
            and cls.lookup_tensor is DefaultLoadPlanner.lookup_tensor
            and cls.transform_tensor is DefaultLoadPlanner.transform_tensor):
        obj = planner.state_dict.get(ri.dest_index.fqn)
        off = ri.dest_index.offset
        if type(obj) is torch.Tensor and (off is None or not any(off)):
            return narrow_tensor_by_index(obj, ri.dest_offsets, ri.lengths)
    return planner.resolve_tensor(ri)


def _partly_written(e: CheckpointError, path: str) -> CheckpointError:
    """``e`` of a streaming load (same class and attributes), its message saying that the
    destinations are partly written and must not be used."""
    out = type(e)(
        f"{e} -- streaming load of {path}: the state dict's tensors are partly written "
        "and must not be used (load again from a good checkpoint)"
    )
    out.__dict__.update({k: v for k, v in e.__dict__.items() if k != "message"})
    out.partly_written = True  # type: ignore[attr-defined]
    return out


def _requests(plan: LoadPlan) -> tuple[list[Any], list[Any]]:
    """A load plan's read items as region reads ``(item, name, offsets, shape)`` of stored
    tensors and whole reads ``(item, name)`` of stored bytes."""
    tensor_reqs = []
    byte_reqs = []
    for ri in plan.items:
        fqn = ri.storage_index.fqn
        if ri.type == LoadItemType.BYTE_IO:
            byte_reqs.append((ri, BYTES_PREFIX + fqn))
        else:
            base = ri.storage_index.offset or [0] * len(ri.lengths)
            offs = [int(b) + int(o) for b, o in zip(base, ri.storage_offsets)]
            tensor_reqs.append((ri, fqn, offs, [int(n) for n in ri.lengths]))
    return tensor_reqs, byte_reqs


def _plan_ranges(reader: "Reader", plan: LoadPlan, skip: Any = ()) -> list[tuple[str, int, int]]:
    """Where the stored bytes lie that ``plan`` (this rank's load plan, read through
    ``reader``, of a local checkpoint) reads, but for the read items in ``skip`` (their
    ids): ``(shard file path, begin, end)``, merged per file, each range whole CRC
    blocks or chunks (what the read checks). No collective; no tensor data read."""
    tensor_reqs, byte_reqs = _requests(plan)
    rr = reader._open()
    regions = [(n, o, s) for ri, n, o, s in tensor_reqs if 0 not in s and id(ri) not in skip]
    for _, name in byte_reqs:
        _, shape = rr.shape_of(name)
        if 0 not in shape:
            regions.append((name, [0] * len(shape), list(shape)))
    return [(os.fspath(f), int(b), int(e)) for f, b, e in rr.byte_ranges(regions)]


def _prefetch(ranges: list[Any]) -> None:
    """Ask the kernel to read the byte ranges a plan needs ahead (``POSIX_FADV_WILLNEED``):
    the CRC pass then faults in pages the kernel is already reading sequentially. Advisory:
    errors are ignored."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for f, begin, end in ranges:
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                advise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except OSError:
            pass


class Reader(StorageReader):
    """A DCP ``StorageReader`` over the ckptstore checkpoint at ``path``.

    ``all_or_nothing`` (default ``True``): ``read_data`` first checks the CRC32 of every
    stored tensor its plan reads, then all ranks agree through one all-reduce (on
    ``process_group``, default the world; pass the group you give ``dcp.load``) that every
    rank's checks passed, and only then write into the destinations. Without it (or without
    an initialized process group) each rank checks before it writes its own destinations.

    ``fresh_destinations`` (default ``False``): the caller promises that the tensors it
    hands ``dcp.load`` are fresh memory that nothing reads if the load raises (as
    :func:`ckptstore.torch.distributed.load` does). Each block is then CRC-checked as it
    is copied into its destination (one pass over the bytes instead of a check pass and
    a copy pass), and the ranks still agree before ``dcp.load`` returns: a damaged
    checkpoint raises on every rank, with the fresh tensors partly written and the live
    state untouched.

    ``streaming`` (default ``False``, opt-in): check while copying into the destinations
    themselves, with no agreement between ranks. The fastest load, but **a failed check
    leaves the destinations partly written**: the error says so, and that state must not
    be used (load again from a good checkpoint, or restart). Use it where a failed load
    ends the process anyway.

    Every rank reads the checkpoint the coordinator's ``read_metadata`` found (and, with
    ``expect_checkpoint_id``, that one): a commit into the directory in between makes the
    load fail instead of mixing checkpoints.

    ``received`` (an attribute, empty by default): read items whose bytes are already in
    their destinations, ``{id(read item): destination bytes as a uint8 numpy array}``, each
    the whole of one stored chunk (received from a peer's copy of the shard, as the tiered
    manager's restore does). ``read_data`` checks them against the stored CRC32s in place
    of reading them (``Checkpoint.verify_received``), with the same agreement as a read.

    ``wanted`` (an attribute, ``None`` by default): for a rank that plans its own reads
    (:func:`ckptstore.torch.distributed.load`), ``{fqn: [(offsets, sizes), ...]}``, the boxes
    of each tensor it reads. ``read_metadata`` then lists, of each such global of a
    two-level checkpoint, only the grid cells that intersect them: the rank's ``Metadata``
    grows with its own reads, not with every rank's cell of every tensor (at 1,024 ranks x
    10,000 tensors, gigabytes of Python objects on every rank). The plan is the same. Not
    for ``dcp.load``, where the coordinator's ``Metadata`` serves every rank.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        all_or_nothing: bool = True,
        process_group: Any = None,
        expect_checkpoint_id: Optional[str] = None,
        fresh_destinations: bool = False,
        streaming: bool = False,
    ) -> None:
        StorageReader.__init__(self)
        self.expect_checkpoint_id = expect_checkpoint_id
        self.fresh_destinations = bool(fresh_destinations)
        self.streaming = bool(streaming)
        self.path = os.fspath(path)
        self.received: dict[int, Any] = {}
        self.wanted: Optional[dict[str, list[Any]]] = None
        self.all_or_nothing = all_or_nothing
        self.process_group = process_group
        self.use_collectives = True
        self._rr: Any = None
        self._cid: Optional[str] = None

    def reset(self, checkpoint_id: "str | os.PathLike[str] | None" = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._rr = None
        self._cid = None
        self.received = {}

    def _open(self) -> Any:
        if self._rr is None:
            rr = _ckptstore.Checkpoint(self.path, lazy=True)
            want = self.expect_checkpoint_id
            if want is not None and rr.checkpoint_id != want:
                raise CheckpointError(
                    f"{self.path}: expected checkpoint {want}, found {rr.checkpoint_id}: a "
                    "save committed into the directory during the load"
                )
            self._rr = rr
        return self._rr

    def parts_read(self) -> tuple[int, int]:
        """Of a two-level checkpoint: how many part indexes this reader has read so far,
        and their bytes (``Checkpoint.parts_read()``); ``(0, 0)`` for a flat checkpoint."""
        return tuple(self._open().parts_read())  # type: ignore[return-value]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rr = self._open()
        meta = json.loads(rr.metadata_json())
        m = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("items"), dict):
            raise CheckpointError(
                f"{self.path}: not a DCP checkpoint (no {META_KEY!r} metadata in the manifest)"
            )
        torch_ = _torch()
        sdm: dict[str, Any] = {}
        for fqn, it in m["items"].items():
            if it.get("kind") == "bytes":
                rr.shape_of(it["name"])  # present?
                sdm[fqn] = BytesStorageMetadata()
                continue
            size = [int(d) for d in it["size"]]
            dtype = getattr(torch_, it["dtype"])
            if int(np.prod(size, dtype=np.int64)) == 0:
                chunks: list[Any] = []
            else:
                wire, shape = rr.shape_of(it["name"])
                if list(shape) != size or _wire_of.get(dtype) != wire:
                    raise CheckpointError(
                        f"{self.path}: tensor {fqn!r} is {wire} {list(shape)} in the manifest, "
                        f"{it['dtype']} {size} in its DCP metadata"
                    )
                # A two-level checkpoint's global: its grid cells, from the root alone (each
                # inside one stored chunk), so that no part index is read here; the plan's
                # boxes then load only the parts they touch.
                within = None if self.wanted is None else self.wanted.get(fqn)
                boxes = rr.grid_cells(it["name"]) if within is None else rr.grid_cells(it["name"], within)
                if boxes is None:
                    boxes = rr.chunks(it["name"])
                chunks = [
                    ChunkStorageMetadata(offsets=torch_.Size(o), sizes=torch_.Size(s))
                    for o, s in boxes
                ]
            props = TensorProperties(dtype=dtype, requires_grad=bool(it.get("requires_grad")))
            if it.get("strides") is not None and hasattr(props, "strides"):
                props.strides = tuple(it["strides"])
            sdm[fqn] = TensorStorageMetadata(properties=props, size=torch_.Size(size), chunks=chunks)
        sm = m.get("storage_meta") or {}
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            modules=list(sm.get("modules") or []),
        )
        storage_meta.load_id = rr.checkpoint_id
        self._cid = rr.checkpoint_id
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=_decode(m.get("planner_data")),
            storage_data={"ckptstore_checkpoint_id": rr.checkpoint_id},
            storage_meta=storage_meta,
            version=m.get("dcp_version"),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.use_collectives = kwargs.get("use_collectives", True)
        want = (metadata.storage_data or {}).get("ckptstore_checkpoint_id")
        rr = self._open()
        if want is not None and rr.checkpoint_id != want:
            raise CheckpointError(
                f"{self.path}: the coordinator read checkpoint {want}, this rank found "
                f"{rr.checkpoint_id}: a save committed into the directory during the load"
            )
        self._cid = rr.checkpoint_id

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[Any]:
        rr = self._open()
        tensor_reqs, byte_reqs = _requests(plan)
        got = [(ri, (n, o, s, self.received[id(ri)])) for ri, n, o, s in tensor_reqs if id(ri) in self.received]
        if got:
            tensor_reqs = [r for r in tensor_reqs if id(r[0]) not in self.received]

        one_pass = self.streaming or self.fresh_destinations
        # 1. Read the bytes items, and check every stored tensor the plan reads: all of it
        #    before any destination is written, or (one pass) each block as it is copied
        #    into its destination.
        err: Optional[BaseException] = None
        blobs = []
        writing = False
        try:
            regions = [(n, o, s) for _, n, o, s in tensor_reqs if 0 not in s]
            _prefetch(rr.byte_ranges(regions))
            if got:  # bytes already in their destinations: checked in place of a read
                rr.verify_received([req for _, req in got])
            if not one_pass:
                rr.verify_regions(regions)
            for ri, name in byte_reqs:
                _, shape = rr.shape_of(name)
                buf = np.empty(shape, dtype=np.uint8)
                rr.read_into([(name, [0], list(shape), buf)])
                blobs.append((ri, buf))
            if one_pass:
                writing = True
                self._write(rr, planner, tensor_reqs, fill=True)
        except BaseException as e:  # noqa: BLE001 - reported after the ranks agree
            if self.streaming:
                if writing and isinstance(e, CheckpointError):
                    raise _partly_written(e, self.path) from e
                raise
            err = e
        if not self.streaming:
            self._agree(err)
        if not one_pass:
            # 2. Write the destinations: every byte was checked, every rank agreed.
            self._write(rr, planner, tensor_reqs, fill=False)
        for ri, _ in got:
            planner.commit_tensor(ri, _resolve(planner, ri).detach())
        for ri, buf in blobs:
            planner.load_bytes(ri, io.BytesIO(buf.tobytes()))
        return _done(None)

    def _write(self, rr: Any, planner: LoadPlanner, tensor_reqs: list[Any], fill: bool) -> None:
        """Copy each read item's box into the destination DCP resolves for it: straight
        into a CPU destination of the stored dtype and layout, through a fresh buffer
        otherwise; ``fill``: each block CRC-checked as it is copied (``fill_into``), else
        copied from bytes already checked (``read_into`` after ``verify_regions``)."""
        read = rr.fill_into if fill else rr.read_into
        fast = []
        slow = []
        for ri, name, offs, shape in tensor_reqs:
            if 0 in shape:
                continue
            dst = _resolve(planner, ri).detach()
            wire, _ = rr.shape_of(name)
            if (
                dst.device.type == "cpu"
                and dst.is_contiguous()
                and _wire_of.get(dst.dtype) == wire
                and tuple(dst.shape) == tuple(shape)
            ):
                fast.append((ri, dst, (name, offs, shape, dst.reshape(-1).view(torch.uint8).numpy())))
            else:
                slow.append((ri, dst, name, offs, shape, wire))
        if fast:
            read([f[2] for f in fast])
            for ri, dst, _ in fast:
                planner.commit_tensor(ri, dst)
        for ri, dst, name, offs, shape, wire in slow:
            nbytes = int(np.prod(shape, dtype=np.int64)) * _torch_of[wire].itemsize
            buf = np.empty(nbytes, dtype=np.uint8)
            read([(name, offs, shape, buf)])
            src = torch.from_numpy(buf).view(_torch_of[wire]).reshape(shape)
            if tuple(dst.shape) != tuple(shape):
                raise CheckpointError(
                    f"read item {ri.storage_index}: destination of shape {tuple(dst.shape)}, "
                    f"stored region of shape {tuple(shape)}"
                )
            dst.copy_(src)
            planner.commit_tensor(ri, dst)

    def _agree(self, err: Optional[BaseException]) -> None:
        """Raise ``err``, or an error saying another rank failed, unless every rank's
        checks passed (one all-reduce when the ranks can agree)."""
        import torch.distributed as dist

        if (
            self.all_or_nothing
            and self.use_collectives
            and dist.is_available()
            and dist.is_initialized()
        ):
            flag = torch.tensor([0 if err is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            if err is None and int(flag.item()):
                raise CheckpointError(
                    f"{self.path}: another rank's checks failed (see its error); no rank "
                    "wrote any destination"
                )
        if err is not None:
            raise err

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: "str | os.PathLike[str]") -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
