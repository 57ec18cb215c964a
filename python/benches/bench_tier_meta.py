"""The tiered manager's metadata at scale, in one process per measurement and no process
group: the step record, the holdings every rank gathers at a restore, the restore's plan per
rank, and the save's gathers and commit on the coordinator, for R ranks x T sharded tensors
(default 1,024 x 10,000), computed by the package's own functions on synthetic inputs.

    nice -n 10 .venv/bin/python python/benches/bench_tier_meta.py                 # 1,024 x 10,000, fitted
    .venv/bin/python python/benches/bench_tier_meta.py --ranks 64 --tensors 1000  # measured as it is
    .venv/bin/python python/benches/bench_tier_meta.py --at 64,128,256 --coord-at 16,32 --json /tmp/tm.json

The state (FSDP2 with Adam): ``T`` DTensors sharded ``Shard(0)`` over the ``R`` ranks, each
rank holding one row block of every one (``T // 3`` parameters named like a decoder's,
``model.layers.<i>.self_attn.q_proj.weight`` ..., their ``exp_avg`` and ``exp_avg_sq``; the
``T - 3 (T // 3)`` parameters left have no state), plus Adam's 0-dim ``step`` per parameter
with state (rank 0 writes them, as the tiered save does; --steps-spread: one rank each, as DCP's
deduplication has it). The values are tiny (a row
block is 1 x 4 FP32): the metadata of a real run differs only in the digits of its offsets
and sizes. Ranks are grouped ``--ranks-per-host`` (8) to a host; ``replicas=1``,
``keep_last=2``.

Each rank count of ``--at`` (by default the target itself when ``R x T`` is at most 1.3
million chunks, else 32, 64, 128) is one case, built once on /dev/shm (every rank's part
descriptor and shards through the engine's ``write_part``, as ``dcp.Writer`` calls it) and
measured by fresh child processes, each with its own peak RSS (VmHWM, reset between phases
through ``/proc/self/clear_refs``), ``time.perf_counter`` and CPU times (``process_time``),
Python's cyclic garbage collector off unless ``--gc`` (objects are still freed when their
last reference goes; with it on, the save's coordinator at 16 x 10,000 took 6.8x longer):

* ``commit``: what a host's first rank does in a fast-tier restore (``_tier_restore``: every
  rank's part descriptor read, ``ckptstore.commit`` of the stage, ``auto`` layout: two-level
  from 100,000 chunks), and the coordinator of ``ckptstore.torch.distributed.save``
  (``dcp.Writer.finish``);
* ``record``: every rank's files with size and CRC32 (``crc_file``), the step record the
  coordinator broadcasts and every host writes (``LocalTier.record``: commit.json, then
  index.json, steps 1 and 2), read back (``LocalTier.load_record``);
* ``scan``: a host's scan of its local tier (``LocalTier.scan(crc=False)``, its own ranks' and
  its ring predecessor's files, each step named by its record's summary), then the restore's
  all-gather of every host's scan on one rank: the buffer ``all_gather_object`` allocates
  (world x the largest pickle, every rank's slot padded to it) and every pickle decoded (the
  record of the step tried is then broadcast: ``record``);
* ``plan``: one rank's restore plan against the committed checkpoint, under torch's ``fake``
  process group (the rank's DTensors need a mesh; nothing is sent): the manifest metadata
  (``metadata_json``), DCP's ``Metadata`` (``dcp.Reader.read_metadata``, measured apart: its
  objects in memory, its pickle), ``_sharded._prepare`` and ``_sharded._plan`` (DCP's default
  load planner, with the grid cells the rank's tensors touch), its direct items and the byte
  ranges it reads (``dcp._plan_ranges``), with one replaced host's ranks reading everything
  from peers: the plan's all-gather (sizes and errors) and the lists each leader receives;
* ``rank``: one rank's side of the tiered save (``_tier_local.part_writer`` under ``dcp.save``'s
  steps, run one by one: DCP's default save planner's local plan, its pickle sent to the
  coordinator, the plan it gets back, ``write_data``'s results, the global ``Metadata``
  broadcast at the end of ``dcp.save``, the manager's all-gather of files and the record);
* ``coord`` (at the sizes of ``--coord-at``: it holds every rank's plan in memory): the
  coordinator of that save: every rank's local plan gathered (the other ranks' plans are rank
  0's with their own offsets, pickled; the gather decodes each from a buffer laid out as
  ``gather_object``'s), ``create_global_plan`` and ``prepare_global_plan``, the plans pickled
  for the scatter, every rank's write results gathered (each with its part descriptor),
  ``_PartWriter.finish``, the ``Metadata`` pickled for its broadcast.

With more than one size, each quantity is fitted over the sizes (least squares with
coefficients >= 0: constant + R, and R x R where the bytes grow so, as a gather of records
that each list every rank) and evaluated at ``--ranks``; the fit, its largest relative
residual and the measured points are printed. Goals (the issue): <= 16 MiB of tier metadata
per rank (each per-rank row), descriptor gather + commit <= 10 s (judged on the smaller of
wall and CPU time: a shared VM), coordinator <= 1 GiB (peak RSS over its start). ``--json
PATH`` writes every figure. The default run at 1,024 x 10,000 took 19-40 minutes on the
2-core VM at load 4-9 (about half of it importing torch in the children).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import status_kib  # noqa: E402  (stdlib only, so imported first)

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

MiB = 1 << 20
GiB = 1 << 30
#: A decoder layer's 9 parameters: (module path, dimensions).
KINDS = (("self_attn.q_proj", 2), ("self_attn.k_proj", 2), ("self_attn.v_proj", 2),
         ("self_attn.o_proj", 2), ("mlp.gate_proj", 2), ("mlp.up_proj", 2), ("mlp.down_proj", 2),
         ("input_layernorm", 1), ("post_attention_layernorm", 1))
ROWS, COLS = 1, 4  # a rank's block of every tensor: ROWS x COLS (2-D) or ROWS (1-D)
STEP = 2  # the step restored: steps 1 and 2 are recorded (keep_last=2)


# ---- the synthetic state -------------------------------------------------------------------


def params(T: int) -> tuple[list[tuple[str, int]], int]:
    """The parameters (name, dimensions) and how many of them (the first) have Adam state."""
    P = T // 3
    return [(f"model.layers.{i // 9}.{KINDS[i % 9][0]}.weight", KINDS[i % 9][1])
            for i in range(T - 2 * P)], P


def gshape(nd: int, R: int) -> list[int]:
    return [R * ROWS, COLS] if nd == 2 else [R * ROWS]


def offsets(nd: int, r: int) -> list[int]:
    return [r * ROWS, 0] if nd == 2 else [r * ROWS]


def write_items(T: int, R: int, r: int) -> list:
    """Rank ``r``'s items for the engine's ``write_part``, as ``dcp.Writer.write_data``
    makes them from its plan: every DTensor's block as a chunk, and on rank 0 the 0-dim
    ``step`` of every parameter with state (``_tier_local.save_part``: small plain tensors
    on rank 0; ``STEPS_SPREAD``: of the parameters whose index is ``r`` mod R, as DCP's
    deduplication and the tiered save before it spread them)."""
    import numpy as np

    ps, P = params(T)
    arr = {2: np.zeros((ROWS, COLS), np.float32), 1: np.zeros(ROWS, np.float32), 0: np.zeros((), np.float32)}
    items = [(f"model.{n}", "F32", arr[nd], (gshape(nd, R), offsets(nd, r))) for n, nd in ps]
    for i, (n, nd) in enumerate(ps[:P]):
        for k in ("exp_avg", "exp_avg_sq"):
            items.append((f"optim/{n}/{k}", "F32", arr[nd], (gshape(nd, R), offsets(nd, r))))
        if (i % R == r) if STEPS_SPREAD else r == 0:
            items.append((f"optim/{n}/step", "F32", arr[0], ([], [])))
    return items


#: Whether the synthetic parts spread the steps over the ranks (``--steps-spread``).
STEPS_SPREAD = bool(os.environ.get("BENCH_TIER_META_STEPS_SPREAD"))


def part_writer():
    """The tiered save's DCP writer factory (``_tier_local.part_writer``; earlier
    ``tiered._part_writer``)."""
    try:
        from ckptstore.torch._tier_local import part_writer as pw
    except ImportError:
        from ckptstore.torch.tiered import _part_writer as pw
    return pw


def fake_rank(rank: int, world: int):
    """torch's ``fake`` process group as rank ``rank`` of ``world`` (nothing is ever sent) and
    a 1-D CPU mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def model_and_optimizer(T: int, R: int, mesh) -> tuple:
    """The rank's model (every parameter a DTensor sharded by rows) and an Adam whose state
    holds ``step``, ``exp_avg``, ``exp_avg_sq`` for the first parameters, as after a step."""
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Shard

    specs = {}

    def dt(nd: int):
        local = torch.zeros((ROWS, COLS) if nd == 2 else (ROWS,))
        if nd not in specs:
            g = gshape(nd, R)
            specs[nd] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(g),
                                           stride=(COLS, 1) if nd == 2 else (1,))._spec
        return DTensor(local, specs[nd], requires_grad=False)

    ps, P = params(T)
    root = nn.Module()
    plist = []
    for name, nd in ps:
        m = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        p = nn.Parameter(dt(nd))
        m.register_parameter(leaf, p)
        plist.append((p, nd))
    opt = torch.optim.Adam([p for p, _ in plist], lr=1e-3)
    for p, nd in plist[:P]:
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": dt(nd), "exp_avg_sq": dt(nd)}
    return root, opt


# ---- measuring ------------------------------------------------------------------------------


def reset_peak() -> bool:
    """Reset this process's VmHWM to its VmRSS (``clear_refs`` 5); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


#: CPU seconds of the named phases of this process, printed by :func:`out` as ``<name>_cpu_s``.
CPU: dict = {}
#: VmHWM (bytes) seen each time a phase reset it: with the current VmHWM, the peak of a span
#: of phases (:func:`span_peak`).
HWM: list = []


def span_peak(mark: int) -> int:
    """The process's peak RSS since ``len(HWM)`` was ``mark`` (bytes)."""
    return max(HWM[mark:] + [status_kib("VmHWM") * 1024])


class Phase:
    """A timed phase: ``s`` seconds (wall), ``cpu`` (this process's CPU time, every thread),
    ``held`` (VmRSS after - before) and ``peak`` (VmHWM in the phase - VmRSS before) in
    bytes. ``name``: its CPU time goes into the child's figures as ``<name>_cpu_s``."""

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __enter__(self) -> "Phase":
        HWM.append(status_kib("VmHWM") * 1024)
        self.rss0 = status_kib("VmRSS") * 1024
        reset_peak()
        self.c0 = time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        if self.name:
            CPU[self.name] = self.cpu
        self.held = status_kib("VmRSS") * 1024 - self.rss0
        self.peak = max(status_kib("VmHWM") * 1024 - self.rss0, self.held)


def gather_buffer(make, n: int, scratch: str) -> tuple[bytearray, int, list]:
    """The buffer every receiving rank of ``all_gather_object`` (or the destination of
    ``gather_object``) allocates, filled: ``n`` slots, each the largest pickle's size, slot
    ``i`` holding ``make(i)`` (the pickle rank ``i`` sends). The pickles are made one at a
    time and kept in a file under ``scratch`` (tmpfs: outside this process's RSS) until the
    largest is known; the buffer, its slot size and the pickles' sizes."""
    sizes = []
    with tempfile.TemporaryFile(dir=scratch) as f:
        for i in range(n):
            b = make(i)
            sizes.append(len(b))
            f.write(b)
        mx = max(sizes)
        buf = bytearray(mx * n)
        f.seek(0)
        for i, k in enumerate(sizes):
            f.readinto(memoryview(buf)[i * mx:i * mx + k])
    return buf, mx, sizes


def decode_gather(buf: bytearray, mx: int, sizes: list) -> list:
    """Every pickle of the buffer decoded, as ``_tensor_to_object`` does (a copy, then loads)."""
    return [pickle.loads(bytes(buf[i * mx:i * mx + n])) for i, n in enumerate(sizes)]


def gathered(make, n: int, scratch: str) -> dict:
    """A simulated all-gather of ``make(i)`` for ``i < n`` on one rank: the buffer, every
    pickle decoded; the figures and the objects (``held_bytes``: the buffer and the objects)."""
    buf, mx, sizes = gather_buffer(make, n, scratch)
    with Phase() as ph:
        objs = decode_gather(buf, mx, sizes)
    return {"buffer_bytes": len(buf), "payload_bytes": sum(sizes), "max_bytes": mx, "decode_s": ph.s,
            "decode_cpu_s": ph.cpu, "held_bytes": ph.held + len(buf), "objs": objs}


def out(fig: dict) -> None:
    fig.update({f"{k}_cpu_s": v for k, v in CPU.items()})
    fig["peak_rss_bytes"] = status_kib("VmHWM") * 1024
    print(json.dumps(fig))


# ---- the children -----------------------------------------------------------------------------


def case_info(case: str) -> dict:
    with open(os.path.join(case, "case.json")) as f:
        return json.load(f)


def child_build(case: str, R: int, T: int, rph: int) -> None:
    """Every rank's part (the engine's ``write_part``), and the manifest metadata the save's
    coordinator keeps (``_PartWriter.finish`` of the global metadata: it names every
    state-dict entry once, whatever the ranks)."""
    from ckptstore import _ckptstore, new_checkpoint_id

    ck = os.path.join(case, "ckpt")
    os.makedirs(ck)
    cid = new_checkpoint_id()
    t0 = time.perf_counter()
    part_bytes = []
    for r in range(R):
        part_bytes.append(len(_ckptstore.write_part(ck, cid, r, write_items(T, R, r), None)))
    build_s = time.perf_counter() - t0
    # The part descriptors, kept apart: a flat commit (under 100,000 chunks) removes them
    # from the checkpoint, and the record and the gathers need them.
    os.makedirs(os.path.join(case, "parts"))
    for r in range(R):
        n = f"part-{cid}-r{r}.json"
        os.link(os.path.join(ck, n), os.path.join(case, "parts", n))

    mesh = fake_rank(0, R)
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from ckptstore.torch import _sharded as _d

    model, opt = model_and_optimizer(T, R, mesh)
    sd, meta = _d.state_and_meta(model, opt, {"epoch": 3})
    w = part_writer()(ck, {_d.META_KEY: meta})
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=sd, storage_meta=w.storage_meta(), is_coordinator=True)
    _, md = planner.create_global_plan([planner.create_local_plan()])
    w.checkpoint_id = cid
    w.finish(md, [[WriteResult(index=MetadataIndex("__ckptstore.part__"), size_in_bytes=0, storage_data=b"")]])
    with open(os.path.join(case, "manifest_metadata.json"), "w") as f:
        json.dump(w.manifest_metadata, f)
    with open(os.path.join(case, "case.json"), "w") as f:
        json.dump({"R": R, "T": T, "rph": rph, "cid": cid}, f)
    out({"build_s": build_s, "part_bytes_max": max(part_bytes), "part_bytes_all": sum(part_bytes)})


def read_parts(case: str, cid: str, R: int) -> list:
    parts = []
    for r in range(R):
        with open(os.path.join(case, "parts", f"part-{cid}-r{r}.json"), "rb") as fh:
            parts.append(fh.read())
    return parts


def child_commit(case: str) -> None:
    """A host's commit of the stage in a fast-tier restore (``_tier_restore.restore_fast``):
    every part read, then ``ckptstore.commit`` with the record's metadata."""
    from ckptstore import commit

    c = case_info(case)
    ck = os.path.join(case, "ckpt")
    with open(os.path.join(case, "manifest_metadata.json")) as f:
        mm = json.load(f)
    base = status_kib("VmRSS") * 1024
    reset_peak()
    with Phase("read_parts") as rd:
        parts = read_parts(case, c["cid"], c["R"])
    with Phase("commit") as cm:
        info = commit(ck, c["cid"], parts=parts, world_size=c["R"], metadata=mm)
    peak = status_kib("VmHWM") * 1024
    man = os.path.join(ck, "manifest.json")
    out({"read_parts_s": rd.s, "parts_bytes": sum(len(p) for p in parts), "commit_s": cm.s,
         "commit_peak_over_parts_bytes": cm.peak, "peak_over_start_bytes": peak - base,
         "base_rss_bytes": base, "root_bytes": os.path.getsize(man) if os.path.exists(man) else None,
         "two_level": bool(info.get("two_level", info.get("layout") == "two_level")),
         "commit_info_keys": sorted(info)})


SRC_RE = re.compile(r"^(?:part-[0-9a-f]+-r(\d+)\.json|shard-[0-9a-f]+-r(\d+)-\d+\.safetensors)$")


def hosts_of(R: int, rph: int) -> list:
    return [list(range(h, min(h + rph, R))) for h in range(0, R, rph)]


def child_record(case: str) -> None:
    """Every rank's files with size and CRC32, the record (as ``CheckpointManager._write``
    builds it), written and read back by ``LocalTier``; the tier then holds steps 1 and 2
    with host 0's files (its own ranks' and its ring predecessor's, linked) for ``scan``."""
    from ckptstore.torch._tier_local import INDEX, LocalTier
    from ckptstore.torch._tier_wire import crc_file

    c = case_info(case)
    R, rph, cid = c["R"], c["rph"], c["cid"]
    ck = os.path.join(case, "ckpt")
    with open(os.path.join(case, "manifest_metadata.json")) as f:
        mm = json.load(f)
    names: dict = {}
    where = {}
    for d in (ck, os.path.join(case, "parts")):
        for n in os.listdir(d):
            m = SRC_RE.match(n)
            if m and cid in n:
                names.setdefault(int(m.group(1) or m.group(2)), []).append(n)
                where[n] = os.path.join(d, n)
    t0 = time.perf_counter()
    all_files = {r: {n: list(crc_file(where[n])) for n in sorted(names[r])} for r in range(R)}
    crc_s = time.perf_counter() - t0
    hosts = hosts_of(R, rph)
    with Phase("record_build") as build:
        record = {"version": 1, "step": STEP, "checkpoint_id": cid, "world_size": R, "saved_at": time.time(),
                  "hosts": hosts, "replicas": 1, "files": {str(r): f for r, f in all_files.items()},
                  "metadata": mm}
        body = json.dumps(record, sort_keys=True).encode()
    tier = LocalTier(os.path.join(case, "tier"), 2)
    with Phase("record_write") as write:
        for step in (1, STEP):  # the step's directory is there: the local write made it
            os.makedirs(tier.step_dir(step), exist_ok=True)
            tier.record(step, dict(record, step=step))
    CPU["record_write"] /= 2
    with Phase("record_parse") as parse:
        back = tier.load_record(STEP)
    assert back["files"] == record["files"]
    blob = pickle.dumps(record)
    with Phase("record_unpickle") as unp:
        pickle.loads(blob)
    # Host 0's local tier: its own ranks' files and its ring predecessor's (replicas=1).
    for step in (1, STEP):
        for h in sorted({0, len(hosts) - 1}):
            d = tier.src_dir(step, h)
            os.makedirs(d)
            for r in hosts[h]:
                for n in all_files[r]:
                    os.link(where[n], os.path.join(d, n))
    with open(os.path.join(case, "all_files.json"), "w") as f:
        json.dump(all_files, f)
    files_json = len(json.dumps(record["files"], sort_keys=True))
    meta_json = len(json.dumps(record["metadata"], sort_keys=True))
    out({"crc_s": crc_s, "record_bytes": len(body), "record_files_bytes": files_json,
         "record_metadata_bytes": meta_json, "record_build_s": build.s, "record_write_s": write.s / 2,
         "record_parse_s": parse.s, "record_held_bytes": parse.held, "record_pickle_bytes": len(blob),
         "record_unpickle_s": unp.s, "index_bytes": os.path.getsize(os.path.join(tier.root, INDEX))})


def child_scan(case: str) -> None:
    """Host 0's scan, then the restore's all-gather ``(host, scan or None, persisted)`` of
    every rank, decoded on one rank: every host's scan is host 0's with its own ranks."""
    from ckptstore.torch._tier_local import LocalTier

    c = case_info(case)
    R, rph = c["R"], c["rph"]
    hosts = hosts_of(R, rph)
    tier = LocalTier(os.path.join(case, "tier"), 2)
    with Phase("scan") as sc:
        held = tier.scan(crc=False)
    assert held[STEP]["good"] == sorted(set(hosts[0]) | set(hosts[-1])), held[STEP]["good"]

    def make(r: int) -> bytes:  # what rank r contributes: its host's scan if it leads it
        h = r // rph
        if r != hosts[h][0]:
            return pickle.dumps((h, None, None))
        mine = sorted(set(hosts[h]) | set(hosts[h - 1]))
        return pickle.dumps((h, {s: dict(e, good=mine) for s, e in held.items()}, [] if r == 0 else None))

    own = len(make(0))
    g = gathered(make, R, case)
    g.pop("objs")
    out({"scan_s": sc.s, "scan_pickle_bytes": own, **{f"holdings_{k}": v for k, v in g.items()}})


def child_plan(case: str, rank: int) -> None:
    """One rank's restore plan against the committed stage (``_sharded._prepare``,
    ``_sharded._plan``), its ``Metadata`` measured apart, its byte ranges and their gather."""
    c = case_info(case)
    R, T, rph, cid = c["R"], c["T"], c["rph"], c["cid"]
    ck = os.path.join(case, "ckpt")
    mesh = fake_rank(rank, R)
    import torch  # noqa: F401

    from ckptstore import _ckptstore
    from ckptstore.torch import _sharded as _d
    from ckptstore.torch.dcp import Reader, _plan_ranges

    model, opt = model_and_optimizer(T, R, mesh)
    with Phase("metadata_json") as mj:
        rr = _ckptstore.Checkpoint(ck, lazy=True)
        text = rr.metadata_json()
        meta_all = json.loads(text)
        del rr
    # Each measure of memory below is of objects made on fresh memory (nothing freed before
    # them that they could reuse): the Metadata first, kept while the plan is made.
    with Phase("read_metadata") as rm:
        md = Reader(ck).read_metadata()
    chunks = sum(len(getattr(v, "chunks", ())) for v in md.state_dict_metadata.values())
    with Phase("metadata_pickle") as pk:
        blob = pickle.dumps(md)
    with open(os.path.join(case, "metadata.pickle"), "wb") as f:  # for the save's broadcast (`rank`)
        f.write(blob)
    md_pickle = len(blob)
    del blob
    with Phase("prepare") as pr:
        prep = _d._prepare(ck, meta_all, cid, model, opt, True, False)
    with Phase("plan") as pl:
        _d._plan(prep, None)
    items = len(prep.plan.items)
    plan_cells = sum(len(getattr(v, "chunks", ())) for v in prep.planner.metadata.state_dict_metadata.values())
    # A restore where host `rank // rph` was replaced: its ranks' shards are placeholders;
    # the whole chunks that are one destination each come straight from peers (each rank
    # sends its list of them to its senders, point to point), the rest as byte ranges.
    from ckptstore.torch._tier_restore import _direct_items, _split_key

    lost = rank // rph
    with open(os.path.join(case, "all_files.json")) as f:
        all_files = json.load(f)
    placeholders = {n for r in hosts_of(R, rph)[lost] for n in all_files[str(r)] if not n.startswith("part-")}
    with Phase("ranges") as rg:
        into = _direct_items(prep, placeholders)
        direct = [(k, *_split_key(k), int(q[3].size)) for k, (_, q) in sorted(into.items())]
        need = [(os.path.basename(p), b, e)
                for p, b, e in _plan_ranges(prep.reader, prep.plan, {id(ri) for ri, _ in into.values()})]
    wants = len(json.dumps(direct))
    parts_read = prep.reader.parts_read()
    prep.reader.reset()
    del prep, md, into
    # The plan's gather (``restore_fast``): each rank's host, the size of its ranges' list
    # and its number of direct items; the lists themselves go to every leader (each rank of
    # the replaced host sends its own, as large as this rank's).
    blob = json.dumps(need).encode() if need else b""
    mine = pickle.dumps((lost, len(blob), None, len(direct)))
    g = gathered(lambda r: mine if r // rph == lost else pickle.dumps((r // rph, 0, None, 0)), R, case)
    g.pop("objs")
    g["leader_lists_bytes"] = len(hosts_of(R, rph)[lost]) * len(blob)
    out({"metadata_json_bytes": len(text), "metadata_json_s": mj.s, "read_metadata_s": rm.s,
         "read_metadata_held_bytes": rm.held, "metadata_chunks": chunks,
         "metadata_pickle_bytes": md_pickle, "metadata_pickle_s": pk.s, "prepare_s": pr.s,
         "plan_s": pl.s, "plan_held_bytes": pl.held, "plan_peak_bytes": pl.peak, "plan_items": items,
         "plan_metadata_chunks": plan_cells, "direct_items": len(direct), "direct_wants_bytes": wants,
         "ranges": len(need), "ranges_s": rg.s, "parts_read": list(parts_read),
         "ranges_json_bytes": len(blob), **{f"ranges_gather_{k}": v for k, v in g.items()}})


def save_planner(T: int, R: int, rank: int, ck: str):
    """The rank's state dict, the tiered save's writer and DCP's default save planner set up as
    ``dcp.save`` sets them up; the local plan (timed by the caller)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptstore.torch import _sharded as _d

    mesh = fake_rank(rank, R)
    model, opt = model_and_optimizer(T, R, mesh)
    t0 = time.perf_counter()
    sd, meta = _d.state_and_meta(model, opt, {"epoch": 3})
    sm_s = time.perf_counter() - t0
    w = part_writer()(ck, {_d.META_KEY: meta})
    planner = DefaultSavePlanner()
    return sd, w, planner, sm_s


def local_plan(sd, w, planner, rank: int):
    planner.set_up_planner(state_dict=sd, storage_meta=w.storage_meta(), is_coordinator=rank == 0)
    w.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return w.prepare_local_plan(planner.create_local_plan())


_SIZES: dict = {}


def _size(nd: int, r: int):
    """Rank ``r``'s block offsets in ``nd`` dimensions, a ``torch.Size`` (made once)."""
    import torch

    if (nd, r) not in _SIZES:
        _SIZES[(nd, r)] = torch.Size(offsets(nd, r))
    return _SIZES[(nd, r)]


def shifted(item, r: int):
    """A write item of rank 0's plan as rank ``r`` has it (its block's offsets)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if item.type != WriteItemType.SHARD:
        return item
    td = item.tensor_data
    off = _size(len(td.size), r)
    return WriteItem(index=MetadataIndex(item.index.fqn, off), type=item.type,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=td.chunk.sizes),
                                                 properties=td.properties, size=td.size))


def shifted_result(res, r: int):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    off = res.index.offset
    if off is None or len(off) == 0:
        return res
    return WriteResult(index=MetadataIndex(res.index.fqn, _size(len(off), r)),
                       size_in_bytes=res.size_in_bytes, storage_data=res.storage_data)


def write_results(w, planner, plan, rank: int, cid: str, scratch: str) -> list:
    """``write_data`` of the rank's final plan into a scratch directory (the engine writes
    its part there): the WriteResults it returns, the part descriptor the last."""
    import dataclasses

    plan = dataclasses.replace(plan, storage_data={"ckptstore_checkpoint_id": cid, "rank": rank})
    w.reset(scratch)
    return w.write_data(planner.finish_plan(plan), planner).value()


def status_gathered(case: str, R: int) -> dict:
    """The manager's all-gather after the local write, on one rank: what every rank gives
    (its files, its error, a leader its tier's usage when a local budget is set: none here)
    decoded. The record, with the manifest metadata, is broadcast apart (``record``)."""
    with open(os.path.join(case, "all_files.json")) as f:
        all_files = json.load(f)
    return gathered(lambda r: pickle.dumps((all_files[str(r)], None, None)), R, case)


def child_rank(case: str, rank: int) -> None:
    """One rank's side of the tiered save (``_write``): DCP's steps, then the manager's."""
    c = case_info(case)
    R, T, cid = c["R"], c["T"], c["cid"]
    ck = os.path.join(case, "ckpt")
    sd, w, planner, sm_s = save_planner(T, R, rank, ck)
    with Phase("local_plan") as lp:
        plan = local_plan(sd, w, planner, rank)
    sent = pickle.dumps(plan)
    # The plan back from the coordinator: this rank's items less the `step`s another rank
    # writes (deduplicated), with the writer's storage data.
    from torch.distributed.checkpoint.planner import WriteItemType

    ps, P = params(T)
    mine = {f"optim/{n}/step" for i, (n, _) in enumerate(ps[:P]) if ((i % R == rank) if STEPS_SPREAD else rank == 0)}
    import dataclasses

    final = dataclasses.replace(plan, items=[i for i in plan.items if i.type == WriteItemType.SHARD
                                             or i.index.fqn in mine])
    back = pickle.dumps(dataclasses.replace(final, storage_data={"ckptstore_checkpoint_id": cid, "rank": rank}))
    scratch = tempfile.mkdtemp(dir=case, prefix="scratch-")
    with Phase("write_data") as wd:
        results = write_results(w, planner, final, rank, cid, scratch)
    res_blob = pickle.dumps(results)
    shutil.rmtree(scratch)
    # The end of dcp.save: the coordinator's global Metadata broadcast to every rank (the
    # committed checkpoint's, as `plan` pickled it: the same chunks, the same planner data).
    with open(os.path.join(case, "metadata.pickle"), "rb") as f:
        blob = f.read()
    with Phase("metadata_unpickle") as mb:
        md = pickle.loads(blob)
    md_bytes = len(blob)
    del md, blob
    g = status_gathered(case, R)
    g.pop("objs")
    with open(os.path.join(case, "tier", f"step-{STEP:08d}", "commit.json"), "rb") as f:
        rec_blob = pickle.dumps(json.loads(f.read()))
    with Phase("record_unpickle") as rb:
        pickle.loads(rec_blob)
    sp = save_part_alone(case, R, sd, w.user_metadata)
    out({**sp, "state_and_meta_s": sm_s, "local_plan_s": lp.s, "local_plan_items": len(plan.items),
         "local_plan_pickle_bytes": len(sent), "final_plan_pickle_bytes": len(back), "write_data_s": wd.s,
         "results_pickle_bytes": len(res_blob), "metadata_bcast_bytes": md_bytes, "metadata_unpickle_s": mb.s,
         "metadata_held_bytes": mb.held, "metadata_peak_bytes": mb.peak,
         **{f"status_{k}": v for k, v in g.items()},
         "record_bcast_bytes": len(rec_blob), "record_unpickle_s": rb.s})


def save_part_alone(case: str, R: int, sd: dict, user_metadata: dict) -> dict:
    """The tiered save as it runs now (``_tier_local.save_part``: each rank plans its part
    alone, no coordinator): this rank's state dict ``sd`` (its manifest metadata
    ``user_metadata``, as ``save_planner`` made them) written into a scratch directory as rank 0
    (which also builds the manifest metadata, so the rank with the most to do), its two
    all-gathers (the digest with rank 0's checkpoint id, then the errors) answered as
    every rank would answer them; ``dcp.save`` must not be called. Its time, CPU, peak RSS
    and gather buffers."""
    try:
        from ckptstore.torch._tier_local import save_part
    except ImportError:  # an earlier version: dcp.save's coordinator only
        return {}
    scratch = tempfile.mkdtemp(dir=case, prefix="scratch-")
    w = part_writer()(scratch, user_metadata)
    sizes: list = []

    def gather(obj):  # every rank gives what this one gives (the same digest; no error)
        sizes.append(R * len(pickle.dumps(obj)))
        return [obj] * R

    def dcp_save():
        raise AssertionError("save_part fell back to dcp.save: the ranks' entries differ")

    with Phase("save_part") as sp:
        err = save_part(sd, w, 0, R, gather, dcp_save)
    if err:
        raise SystemExit(f"save_part: {err}")
    meta_bytes = len(json.dumps(w.manifest_metadata, sort_keys=True))
    shutil.rmtree(scratch)
    return {"save_part_s": sp.s, "save_part_peak_bytes": sp.peak, "save_part_gather_bytes": max(sizes),
            "save_part_manifest_metadata_bytes": meta_bytes}


def child_coord(case: str) -> None:
    """The coordinator (rank 0) of the tiered save's ``dcp.save``: the gathers, the global
    plan, the scatter, ``finish`` (``_PartWriter``: no commit), the Metadata's pickle. Its
    peak RSS is taken over all of it from before the plans' gather buffer."""
    c = case_info(case)
    R, T, cid = c["R"], c["T"], c["cid"]
    ck = os.path.join(case, "ckpt")
    import dataclasses

    sd, w, planner, _ = save_planner(T, R, 0, ck)
    plan0 = local_plan(sd, w, planner, 0)
    base = status_kib("VmRSS") * 1024
    mark = len(HWM)
    figs: dict = {}
    buf, mx, sizes = gather_buffer(
        lambda r: pickle.dumps(dataclasses.replace(plan0, items=[shifted(i, r) for i in plan0.items])), R, case)
    figs["plans_gather_bytes"] = len(buf)
    with Phase("plans_gather") as ph:
        plans = decode_gather(buf, mx, sizes)
    del buf
    figs["plans_gather_s"] = ph.s
    with Phase("global_plan") as ph:
        plans, metadata = planner.create_global_plan(plans)
        plans = w.prepare_global_plan(plans)
    figs["global_plan_s"] = ph.s
    with Phase("scatter") as ph:
        scattered = [pickle.dumps(p) for p in plans]
    figs["scatter_s"] = ph.s
    figs["scatter_bytes"] = sum(len(x) for x in scattered)
    del scattered
    # Every rank's write results: rank 0's own (its write_data into a scratch directory),
    # the others' the same with their offsets, each with its own part descriptor.
    scratch = tempfile.mkdtemp(dir=case, prefix="scratch-")
    res0 = write_results(w, planner, plans[0], 0, w.checkpoint_id, scratch)
    shutil.rmtree(scratch)

    def results_of(r: int) -> bytes:
        with open(os.path.join(case, "parts", f"part-{cid}-r{r}.json"), "rb") as fh:
            part = fh.read()
        return pickle.dumps([shifted_result(x, r) for x in res0[:-1]]
                            + [dataclasses.replace(res0[-1], storage_data=part)])

    buf, mx, sizes = gather_buffer(results_of, R, case)
    figs["results_gather_bytes"] = len(buf)
    with Phase("results_gather") as ph:
        results = decode_gather(buf, mx, sizes)
    del buf
    figs["results_gather_s"] = ph.s
    with Phase("finish") as ph:
        w.finish(metadata, results)
    figs["finish_s"] = ph.s
    assert w.manifest_metadata is not None
    with Phase("metadata_pickle") as ph:
        blob = pickle.dumps(metadata)
    figs["metadata_pickle_s"] = ph.s
    figs["metadata_bcast_bytes"] = len(blob)
    # The coordinator's own work (the collectives' transfers and the other ranks' work not
    # included): the sum of its phases.
    steps = ("plans_gather", "global_plan", "scatter", "results_gather", "finish", "metadata_pickle")
    figs["coord_s"] = sum(figs[f"{k}_s"] for k in steps)
    figs["coord_cpu_s"] = sum(CPU[k] for k in steps)
    figs["peak_over_start_bytes"] = span_peak(mark) - base
    figs["base_rss_bytes"] = base
    out(figs)


# ---- the parent: cases, fits, the table ---------------------------------------------------------


def run_child(args: list) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_case(R: int, T: int, rph: int, ranks_side: bool, coord: bool, base: str, only: set) -> dict:
    """One size: built, then measured by the children (``ranks_side``: every child but the
    coordinator; ``coord``: the coordinator; ``only``: if not empty, those children alone;
    ``plan`` before ``rank``, ``record`` before ``scan`` and ``rank``, which use their files)."""
    case = tempfile.mkdtemp(dir=base, prefix=f"bench-tier-meta-{R}x{T}-")
    res: dict = {"R": R, "T": T}
    try:
        steps = [("build", [R, T, rph])]
        if ranks_side:
            steps += [("commit", []), ("record", []), ("scan", []), ("plan", [R // 2]),
                      ("rank", [max(R // 2 - 1, 0)])]
        if coord:
            steps.append(("coord", []))
        steps = [st for st in steps if st[0] == "build" or not only or st[0] in only]
        for name, extra in steps:
            t0 = time.perf_counter()
            res[name] = run_child([name, case, *extra])
            print(f"  {R} x {T}: {name} {time.perf_counter() - t0:.1f} s, peak RSS "
                  f"{res[name]['peak_rss_bytes'] / MiB:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(case, ignore_errors=True)
    return res


#: The table's rows: (group, quantity, child, key, kind, model, goal). ``kind``: "B" bytes,
#: "s" seconds; ``model``: how the quantity grows with R at fixed T ("lin", "quad");
#: ``goal``: (limit, unit) or None.
ROWS_SPEC = [
    ("record", "step record (commit.json): bytes every host writes", "record", "record_bytes", "B", "lin", "rank"),
    ("record", "  of which every rank's files", "record", "record_files_bytes", "B", "lin", None),
    ("record", "  of which the manifest metadata (DCP's, the torch meta)", "record", "record_metadata_bytes", "B",
     "lin", None),
    ("record", "record: build + json.dumps", "record", "record_build_s", "s", "lin", None),
    ("record", "record: write (commit.json, index.json, fsync)", "record", "record_write_s", "s", "lin", None),
    ("record", "record: read back (load_record: CRC + json.loads)", "record", "record_parse_s", "s", "lin", None),
    ("record", "record: broadcast to every rank (pickle)", "rank", "record_bcast_bytes", "B", "lin", "rank"),
    ("holdings", "a host's scan (scan(crc=False)): time", "scan", "scan_s", "s", "lin", None),
    ("holdings", "a host's scan: its pickle (what it all-gathers)", "scan", "scan_pickle_bytes", "B", "lin", None),
    ("holdings", "holdings all-gather: buffer on every rank (world x largest)", "scan", "holdings_buffer_bytes",
     "B", "quad", "rank"),
    ("holdings", "holdings all-gather: decoded objects held on every rank", "scan", "holdings_held_bytes", "B",
     "quad", "rank"),
    ("holdings", "holdings all-gather: decode on every rank", "scan", "holdings_decode_s", "s", "quad", None),
    ("plan", "manifest metadata (metadata_json) every rank parses: bytes", "plan", "metadata_json_bytes", "B",
     "lin", "rank"),
    ("plan", "DCP Metadata, whole (as dcp.load's coordinator reads it): objects held", "plan",
     "read_metadata_held_bytes", "B", "lin", None),
    ("plan", "DCP Metadata: its pickle", "plan", "metadata_pickle_bytes", "B", "lin", None),
    ("plan", "DCP Metadata: read_metadata time", "plan", "read_metadata_s", "s", "lin", None),
    ("plan", "_prepare (checks, fresh DTensors)", "plan", "prepare_s", "s", "lin", None),
    ("plan", "_plan (read_metadata of the rank's cells + DCP load planner): time", "plan", "plan_s", "s", "lin",
     None),
    ("plan", "_plan: memory held after it (its Metadata, planner, plan: RSS growth)", "plan",
     "plan_held_bytes", "B", "lin", "rank"),
    ("plan", "direct items' wants, sent to the senders (JSON, point to point)", "plan", "direct_wants_bytes",
     "B", "lin", "rank"),
    ("plan", "plan's all-gather (a replaced host; sizes, errors): buffer per rank", "plan",
     "ranges_gather_buffer_bytes", "B", "lin", "rank"),
    ("plan", "byte ranges a leader receives (the replaced host's ranks' lists)", "plan",
     "ranges_gather_leader_lists_bytes", "B", "lin", "rank"),
    ("restore commit", "host leader: read every part descriptor", "commit", "read_parts_s", "s", "lin", None),
    ("restore commit", "host leader: part descriptors read (bytes)", "commit", "parts_bytes", "B", "lin", None),
    ("restore commit", "host leader: ckptstore.commit of the stage", "commit", "commit_s", "s", "lin", None),
    ("restore commit", "host leader: read + commit", "commit", "read_commit_s", "s", "lin", "time"),
    ("restore commit", "host leader: peak RSS over its start", "commit", "peak_over_start_bytes", "B", "lin",
     "coord"),
    ("save, a rank", "local plan: build", "rank", "local_plan_s", "s", "lin", None),
    ("save, a rank", "local plan sent to the coordinator (pickle)", "rank", "local_plan_pickle_bytes", "B", "lin",
     None),
    ("save, a rank", "plan back from the coordinator (pickle)", "rank", "final_plan_pickle_bytes", "B", "lin", None),
    ("save, a rank", "write results sent (pickle, with the part descriptor)", "rank", "results_pickle_bytes", "B",
     "lin", None),
    ("save, a rank", "tiered save, each rank alone (save_part, rank 0's share): time", "rank", "save_part_s", "s",
     "lin", "time"),
    ("save, a rank", "save_part: peak RSS over its start (the state's plan and part, its metadata)", "rank",
     "save_part_peak_bytes", "B", "lin", "coord"),
    ("save, a rank", "save_part: largest all-gather buffer (digest and checkpoint id; errors)", "rank",
     "save_part_gather_bytes", "B", "lin", "rank"),
    ("save, a rank", "dcp.save (distributed.save; the tiered save before save_part): global Metadata "
     "broadcast at its end, bytes", "rank", "metadata_bcast_bytes", "B", "lin", None),
    ("save, a rank", "  the same: objects held on every rank", "rank", "metadata_held_bytes", "B", "lin", None),
    ("save, a rank", "global Metadata broadcast: unpickle", "rank", "metadata_unpickle_s", "s", "lin", None),
    ("save, a rank", "manager's files all-gather: buffer per rank", "rank", "status_buffer_bytes", "B", "lin",
     "rank"),
    ("save, a rank", "manager's files all-gather: decode", "rank", "status_decode_s", "s", "lin", None),
    ("dcp.save coordinator", "gather of the local plans: buffer", "coord", "plans_gather_bytes", "B", "lin", None),
    ("dcp.save coordinator", "gather of the local plans: decode", "coord", "plans_gather_s", "s", "lin", None),
    ("dcp.save coordinator", "create_global_plan + prepare_global_plan", "coord", "global_plan_s", "s", "lin", None),
    ("dcp.save coordinator", "scatter of the plans: pickles", "coord", "scatter_s", "s", "lin", None),
    ("dcp.save coordinator", "gather of the write results: buffer", "coord", "results_gather_bytes", "B", "lin", None),
    ("dcp.save coordinator", "gather of the write results: decode", "coord", "results_gather_s", "s", "lin", None),
    ("dcp.save coordinator", "finish (_PartWriter) + Metadata pickle", "coord", "finish_pickle_s", "s", "lin", None),
    ("dcp.save coordinator", "dcp.save's coordinator (the tiered save's before save_part; distributed.save's): "
     "gathers, plan, scatter, finish", "coord", "coord_s", "s", "lin", None),
    ("dcp.save coordinator", "coordinator: peak RSS over its start", "coord", "peak_over_start_bytes", "B", "lin",
     None),
]

GOALS = {"rank": (16 * MiB, "<= 16 MiB per rank"), "time": (10.0, "<= 10 s"), "coord": (GiB, "<= 1 GiB")}


def derived(res: dict) -> None:
    """Sums the table shows that no child prints."""
    cm = res.get("commit")
    if cm:
        cm["read_commit_s"] = cm["read_parts_s"] + cm["commit_s"]
        cm["read_commit_cpu_s"] = cm["read_parts_cpu_s"] + cm["commit_cpu_s"]
    co = res.get("coord")
    if co:
        co["finish_pickle_s"] = co["finish_s"] + co["metadata_pickle_s"]
        co["finish_pickle_cpu_s"] = co["finish_cpu_s"] + co["metadata_pickle_cpu_s"]



def fit(xs: list, ys: list, model: str, at: int) -> tuple:
    """Least squares of ``ys`` over ``xs`` with coefficients >= 0 (constant, R, and R x R for
    ``quad`` with 3 sizes or more: the best of every subset of them whose solution has none
    negative, so that a quantity that does not grow stays flat), evaluated at ``at``: the
    value, the coefficients (constant first) and the largest relative residual."""
    import itertools

    import numpy as np

    x = np.array(xs, float)
    y = np.array(ys, float)
    basis = [np.ones_like(x), x] + ([x * x] if model == "quad" and len(xs) >= 3 else [])
    best = None
    for k in range(1, len(basis) + 1):
        for cols in itertools.combinations(range(len(basis)), k):
            a = np.stack([basis[c] for c in cols], axis=1)
            sol = np.linalg.lstsq(a, y, rcond=None)[0]
            if (sol < 0).any():
                continue
            err = float(((a @ sol - y) ** 2).sum())
            if best is None or err < best[0] - 1e-12 * abs(err):
                coef = [0.0] * len(basis)
                for c, v in zip(cols, sol):
                    coef[c] = float(v)
                best = (err, coef)
    coef = best[1] if best else [float(y.mean())] + [0.0] * (len(basis) - 1)
    pred = sum(c * x ** i for i, c in enumerate(coef))
    resid = max((abs(p - v) / abs(v) if v else 0.0) for p, v in zip(pred, ys))
    return float(sum(c * at ** i for i, c in enumerate(coef))), coef, float(resid)


def fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "B":
        if abs(v) >= 10 * GiB:
            return f"{v / GiB:.0f} GiB"
        if abs(v) >= GiB:
            return f"{v / GiB:.2f} GiB"
        if abs(v) >= MiB:
            return f"{v / MiB:.1f} MiB"
        return f"{v / 1024:.1f} KiB"
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def table(cases: list, R: int, T: int) -> list:
    """Each quantity at ``R`` (measured there, or fitted over the sizes measured), its goal
    and verdict; printed, and returned as rows. A time is judged by the smaller of its wall
    and CPU time: the VM is shared and loaded (the load is printed), and a phase alone on a
    quiet machine takes about its CPU time."""
    rows = []
    for group, what, child, key, kind, model, _goal in ROWS_SPEC:
        row = {"group": group, "quantity": what, "key": f"{child}.{key}", "kind": kind}
        for sub, k in (("", key), ("cpu_", key[:-2] + "_cpu_s" if kind == "s" else None)):
            pts = [(c["R"], c[child][k]) for c in cases if k and child in c and c[child].get(k) is not None]
            if not pts:
                continue
            row[sub + "points"] = {str(x): y for x, y in pts}
            direct = [y for x, y in pts if x == R]
            if direct:
                row.update({sub + "value": direct[0], sub + "how": "measured"})
            elif len(pts) >= 2:
                v, coef, resid = fit([x for x, _ in pts], [y for _, y in pts], model, R)
                row.update({sub + "value": v, sub + "how": f"{'quadratic' if coef[2:] and coef[2] else 'linear'} fit "
                            f"over R = {','.join(str(x) for x, _ in pts)} (largest residual {100 * resid:.0f}%)",
                            sub + "coef": coef})
        if "value" not in row:
            continue
        rows.append(row)
    # distributed.save's coordinator: the save's coordinator, then the commit of every part.
    by = {r["key"]: r for r in rows}
    co, cm = by.get("coord.coord_s"), by.get("commit.commit_s")
    if co and cm:
        rows.insert(rows.index(co) + 1, {
            "group": co["group"], "quantity": "distributed.save's coordinator: that + the commit (the row above)",
            "key": "coord+commit", "kind": "s", "value": co["value"] + cm["value"],
            "cpu_value": co["cpu_value"] + cm["cpu_value"], "points": {}, "how": "the sum of the two rows",
            "judge": "time"})
    for row in rows:
        goal = row.pop("judge", None) or next((g[6] for g in ROWS_SPEC if f"{g[2]}.{g[3]}" == row["key"]), None)
        if goal:
            judged = min(v for v in (row["value"], row.get("cpu_value")) if v is not None)
            lim, text = GOALS[goal]
            row.update(goal=text, ok=judged <= lim)
    sizes = sorted({c["R"] for c in cases})
    print(f"\nthe tiered manager's metadata at {R} ranks x {T} tensors (measured at R = "
          f"{', '.join(map(str, sizes))}; times: wall, CPU in brackets):")
    print(f"| {'quantity':<74} | {'value':>22} | {'goal':<18} | {'':<4} | how")
    print(f"|{'-' * 76}|{'-' * 24}|{'-' * 20}|{'-' * 6}|-----")
    last = None
    for r in rows:
        if r["group"] != last:
            print(f"| [{r['group']}]")
            last = r["group"]
        verdict = "" if "ok" not in r else ("PASS" if r["ok"] else "MISS")
        v = fmt(r["value"], r["kind"])
        if r.get("cpu_value") is not None:
            v += f" ({fmt(r['cpu_value'], 's')})"
        print(f"| {r['quantity']:<74} | {v:>22} | {r.get('goal', ''):<18} | {verdict:<4} | {r['how']}")
    if any(len(r["points"]) > 1 or r["how"] != "measured" for r in rows):
        print("\nthe measured points (R: value; CPU time in brackets) behind the fits:")
        for r in rows:
            if not r["points"]:
                continue
            pts = ", ".join(f"{x}: {fmt(y, r['kind'])}" + (f" ({fmt(r['cpu_points'][x], 's')})"
                                                           if x in r.get("cpu_points", {}) else "")
                            for x, y in r["points"].items())
            print(f"  {r['key']:<38} {pts}")
    return rows


def child_main(argv: list) -> None:
    what, case, *rest = argv
    n = [int(x) for x in rest]
    if not os.environ.get("BENCH_TIER_META_GC"):
        # Without the cyclic collector: objects go when their last reference does, as they
        # would; only the collector's passes over the heap are left out (see --gc).
        gc.disable()
    {"build": lambda: child_build(case, *n), "commit": lambda: child_commit(case),
     "record": lambda: child_record(case), "scan": lambda: child_scan(case),
     "plan": lambda: child_plan(case, *n), "rank": lambda: child_rank(case, *n),
     "coord": lambda: child_coord(case)}[what]()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024, help="the job's ranks (the figures are for it)")
    ap.add_argument("--tensors", type=int, default=10000, help="sharded tensors, each rank a block of every one")
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--at", default=None,
                    help="rank counts measured, comma-separated (default: --ranks when R x T <= 1.3 million, "
                         "else 32,64,128); with several, each quantity is fitted and evaluated at --ranks")
    ap.add_argument("--coord-at", default=None,
                    help="rank counts at which the save's coordinator is run (default: --ranks when R x T <= "
                         "400,000, else 16,32: it holds every rank's plan, about 1.3 KiB an item)")
    ap.add_argument("--steps-spread", action="store_true",
                    help="the parts spread the Adam steps over the ranks (dcp.save's deduplication; the tiered save "
                         "before it wrote small plain tensors on rank 0)")
    ap.add_argument("--gc", action="store_true",
                    help="keep Python's cyclic garbage collector on in the children (default: off, objects "
                         "still freed by reference counting; with it the DCP phases took 2-7x longer here)")
    ap.add_argument("--only", default="",
                    help="measure only these children, comma-separated (commit, record, scan, plan, rank, coord; "
                         "rank needs record and plan, scan needs record)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                    help="where each case's files go (removed after it)")
    ap.add_argument("--json", default=None, help="write every figure here")
    a = ap.parse_args()
    small = a.ranks * a.tensors
    at = sorted({int(x) for x in a.at.split(",")}) if a.at else [a.ranks] if small <= 1_300_000 else [32, 64, 128]
    cat = (sorted({int(x) for x in a.coord_at.split(",")}) if a.coord_at
           else [a.ranks] if small <= 400_000 else [16, 32])
    if a.gc:
        os.environ["BENCH_TIER_META_GC"] = "1"
    if a.steps_spread:
        os.environ["BENCH_TIER_META_STEPS_SPREAD"] = "1"
    print(f"R x T = {a.ranks} x {a.tensors}, {a.ranks_per_host} ranks a host; measuring at R = {at}, the save's "
          f"coordinator at R = {cat}; garbage collector {'on' if a.gc else 'off'}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    cases = []
    for R in sorted(set(at) | set(cat)):
        c = run_case(R, a.tensors, a.ranks_per_host, R in at, R in cat, a.dir, set(filter(None, a.only.split(","))))
        derived(c)
        cases.append(c)
    rows = table(cases, a.ranks, a.tensors)
    goals = [r for r in rows if "ok" in r]
    print(f"\ngoals: {sum(r['ok'] for r in goals)} PASS, {sum(not r['ok'] for r in goals)} MISS "
          f"(load {os.getloadavg()[0]:.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "at": at, "cases": cases, "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
