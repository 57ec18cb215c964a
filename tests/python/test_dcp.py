"""ckptstore as the storage layer of torch.distributed.checkpoint (ckptstore.torch.dcp),
with real torch.distributed jobs: gloo, spawned processes, world sizes 1, 2 and 4 (a 2-D
mesh at 4) saving DTensor state dicts, worlds 1 to 4 loading them with other placements.
Every comparison is bit for bit against the global tensors the test built.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import ckptstore  # noqa: E402
import dist_helpers as dh  # noqa: E402
from ckptstore.torch.dcp import Reader, Writer  # noqa: E402

# name -> (shape, dtype)
SPECS = {
    "a": ((7, 5), torch.float32),
    "b": ((6, 9), torch.float32),
    "c": ((5, 3), torch.bfloat16),
    "d": ((3,), torch.float64),
}
CFG = {"lr": 0.5, "betas": (0.9, 0.99)}


def global_tensor(name: str, version: int = 0) -> "torch.Tensor":
    shape, dt = SPECS[name]
    n = int(np.prod(shape))
    x = torch.arange(n, dtype=torch.float64).reshape(shape)
    return (torch.sin(x * 0.731 + len(name) + version * 10) * 100).to(dt)


def save_placements(world: int):
    if world == 4:  # 2-D mesh (2, 2)
        return {
            "a": [Shard(0), Shard(1)],
            "b": [Replicate(), Shard(0)],
            "c": [Shard(1), Replicate()],
            "d": [Shard(0), Shard(0)],
        }
    return {"a": [Shard(0)], "b": [Shard(1)], "c": [Replicate()], "d": [Shard(0)]}


LOAD_PLACEMENTS = {"a": [Shard(1)], "b": [Shard(0)], "c": [Shard(0)], "d": [Replicate()]}


def mesh_for(world: int):
    if world == 4:
        return init_device_mesh("cpu", (2, 2))
    return init_device_mesh("cpu", (world,))


def state_dict(world: int, version: int = 0) -> dict:
    mesh = mesh_for(world)
    pl = save_placements(world)
    sd = {n: distribute_tensor(global_tensor(n, version), mesh, pl[n]) for n in SPECS}
    sd["step"] = torch.tensor(float(7 + version))
    sd["cfg"] = dict(CFG)
    return sd


def empty_state_dict(world: int, fill: float = -7.0) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for n, (shape, dt) in SPECS.items():
        sd[n] = distribute_tensor(torch.full(shape, fill, dtype=dt), mesh, LOAD_PLACEMENTS[n])
    sd["step"] = torch.tensor(fill)
    sd["cfg"] = {"lr": None, "betas": None}
    return sd


def check_state(sd: dict, version: int = 0) -> list[str]:
    bad = []
    for n in SPECS:
        full = sd[n].full_tensor()
        want = global_tensor(n, version)
        if full.dtype != want.dtype or not torch.equal(full.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
            bad.append(n)
    if sd["step"].item() != 7 + version:
        bad.append("step")
    if sd["cfg"] != CFG:
        bad.append("cfg")
    return bad


# ---- jobs (run in spawned ranks) -----------------------------------------------------------


def job_save(rank, world, base):
    sd = state_dict(world)
    dcp.save(sd, storage_writer=Writer(os.path.join(base, f"ours-{world}")))
    if world == 2:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(base, "fs-2")))
        fut = dcp.async_save(state_dict(world), storage_writer=Writer(os.path.join(base, "async-2")))
        fut.result()
    return True


def job_load(rank, world, base, dirs, reader_kw=None):
    bad = {}
    for d in dirs:
        sd = empty_state_dict(world)
        path = os.path.join(base, d)
        reader = dcp.FileSystemReader(path) if d.startswith("fs-") else Reader(path, **(reader_kw or {}))
        dcp.load(sd, storage_reader=reader)
        b = check_state(sd)
        if b:
            bad[d] = b
        for n in SPECS:  # resharded onto this world's placements
            assert sd[n].placements == tuple(LOAD_PLACEMENTS[n])
    return bad


def job_flipped(rank, world, path, reader_kw=None):
    sd = empty_state_dict(world)
    try:
        dcp.load(sd, storage_reader=Reader(path, **(reader_kw or {})))
        err = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        err = f"{type(e).__name__}: {e}"
    untouched = all(
        bool((sd[n].to_local().float() == -7.0).all()) for n in SPECS
    ) and sd["step"].item() == -7.0 and sd["cfg"] == {"lr": None, "betas": None}
    return err, untouched


def job_stray(rank, world, base):
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    def tensors_only(version):
        sd = state_dict(world, version)
        del sd["cfg"]
        return sd

    # An older save (version 1), then the current one (version 0), each with both writers.
    for version, sub in ((1, "old"), (0, "new")):
        sd = tensors_only(version)
        dcp.save(sd, storage_writer=Writer(os.path.join(base, f"ours-{sub}")))
        dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(
                os.path.join(base, f"hf-{sub}"), save_distributed=True
            ),
        )
    dist.barrier()
    if rank == 0:
        # The older save's shard lands in the current directory (a crashed or older save
        # that wrote there under another name).
        for sub in ("ours", "hf"):
            old = sorted(p for p in os.listdir(os.path.join(base, f"{sub}-old")) if p.endswith(".safetensors"))
            shutil.copy(os.path.join(base, f"{sub}-old", old[0]), os.path.join(base, f"{sub}-new", "shard-99999-stray.safetensors"))
    dist.barrier()
    out = {}
    for sub in ("ours", "hf"):
        sd = empty_state_dict(world)
        del sd["cfg"]
        path = os.path.join(base, f"{sub}-new")
        reader = Reader(path) if sub == "ours" else HuggingFaceStorageReader(path)
        try:
            dcp.load(sd, storage_reader=reader)
            wrong = [n for n in SPECS if not torch.equal(sd[n].full_tensor(), global_tensor(n, 0))]
            stale = [n for n in SPECS if torch.equal(sd[n].full_tensor(), global_tensor(n, 1))]
            out[sub] = ("loaded", wrong, stale)
        except BaseException as e:  # noqa: BLE001 - CheckpointException
            out[sub] = ("error", f"{type(e).__name__}: {str(e)[:300]}", None)
    return out


class DyingWriter(Writer):
    """Rank 1 dies right after writing its shards and part, inside write_data."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            os._exit(3)
        return fut


def job_dies(rank, world, path):
    dcp.save(state_dict(world, 0), storage_writer=Writer(path))
    first = ckptstore.open(path).checkpoint_id
    dist.barrier()
    t0 = time.monotonic()
    try:
        dcp.save(state_dict(world, 1), storage_writer=DyingWriter(path))
        return ("saved", None, None)
    except BaseException as e:  # noqa: BLE001 - gloo's error or DCP's CheckpointException
        elapsed = time.monotonic() - t0
        exc = type(e).__name__
    # The survivor: the directory still holds the first checkpoint, and it loads (in this
    # process alone: the group lost a member).
    ck = ckptstore.open(path)
    sd = {n: torch.zeros(SPECS[n][0], dtype=SPECS[n][1]) for n in SPECS}
    sd["step"] = torch.tensor(0.0)
    dcp.load(sd, storage_reader=Reader(path, all_or_nothing=False), no_dist=True)
    same = all(torch.equal(sd[n], global_tensor(n, 0)) for n in SPECS) and sd["step"].item() == 7
    return ("error", ck.checkpoint_id == first and same, elapsed, exc)


# ---- tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("dcp")
    for world in (1, 2, 4):
        dh.results(world, job_save, str(base))
    return base


DIRS = ["ours-1", "ours-2", "ours-4", "async-2", "fs-2"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_world_n_load_world_m(saved, world):
    """Saved with worlds 1, 2 and 4 (2-D mesh), by dcp.save and dcp.async_save; loaded with
    world M onto other placements: every full_tensor() bit-identical. torch's own
    FileSystemWriter/Reader on the same state gives the same tensors (cross-check)."""
    for rank_bad in dh.results(world, job_load, str(saved), DIRS):
        assert rank_bad == {}


def test_checkpoint_is_a_ckptstore_checkpoint(saved, ckpt, tmp_path):
    from safetensors.torch import load_file

    path = saved / "ours-4"
    ck = ckptstore.open(path)
    assert ck.kind == "ckptstore"
    assert ck.verify()["checksummed"]
    g = ck.globals()
    assert g["a"] == ("F32", [7, 5]) and g["d"] == ("F64", [3])
    assert len(ck.chunks("a")) == 4  # Shard(0) x Shard(1) on the 2x2 mesh
    np.testing.assert_array_equal(ck.read_region("a", [0, 0], [7, 5]), global_tensor("a").numpy())
    meta = ck.metadata["torch.distributed.checkpoint"]
    assert meta["items"]["cfg.lr"]["kind"] == "bytes"
    # No pickle on the tensor path: DCP's metadata is JSON in the manifest.
    assert not (path / ".metadata").exists()
    ckpt("inspect", path, expect=0)
    ckpt("verify", path, expect=0)
    out = tmp_path / "cons"
    ckpt("consolidate", path, "--out", out, expect=0)
    with ckptstore.open(out) as c2:
        np.testing.assert_array_equal(c2["a"], global_tensor("a").numpy())
        np.testing.assert_array_equal(c2["b"], global_tensor("b").numpy())
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    merged = {}
    for f in files:
        merged.update(load_file(str(out / f)))
    assert torch.equal(merged["d"], global_tensor("d"))
    assert torch.equal(merged["c"], global_tensor("c"))  # BF16, replicated on the save


def _flip_in(path: Path, prefix: str) -> str:
    """Flip one data byte of the first stored tensor named ``prefix...`` (a chunk) in its
    shard file; return its stored name."""
    import ckpt_helpers as h

    f, name, start = h.stored_tensor(path, prefix)
    h.flip_byte(f, start, 0x40)
    return name


def test_flipped_byte_fails_naming_the_tensor_and_changes_nothing(saved, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(saved / "ours-2", path)
    victim = _flip_in(path, "b@")
    res = dh.results(2, job_flipped, str(path))
    errs = [e for e, _ in res]
    assert all(e is not None for e in errs), errs
    assert any(victim in e for e in errs), errs
    assert all(untouched for _, untouched in res), "a rank wrote into its state dict"


@pytest.mark.parametrize("mode", ["fresh_destinations", "streaming"])
@pytest.mark.parametrize("world", [1, 2])
def test_one_pass_modes_load_bit_identical(saved, world, mode):
    """The one-pass reads (each block CRC-checked as it is copied): the same tensors as
    the default reader, from every save, resharded."""
    for rank_bad in dh.results(world, job_load, str(saved), DIRS[:-1], {mode: True}):
        assert rank_bad == {}


def test_flipped_byte_in_one_pass_modes(saved, tmp_path):
    """fresh_destinations: every rank raises (the ranks still agree), the damaged tensor
    named. streaming: the rank that read the damaged chunk raises, naming it and saying
    that its destinations are partly written; no agreement, so the other rank may load."""
    path = tmp_path / "ck"
    shutil.copytree(saved / "ours-2", path)
    victim = _flip_in(path, "b@")
    errs = [e for e, _ in dh.results(2, job_flipped, str(path), {"fresh_destinations": True})]
    assert all(e is not None for e in errs), errs
    assert any(victim in e for e in errs), errs
    assert any("another rank's checks failed" in e for e in errs if victim not in e) or all(
        victim in e for e in errs
    ), errs
    errs = [e for e, _ in dh.results(2, job_flipped, str(path), {"streaming": True})]
    hit = [e for e in errs if e is not None and victim in e]
    assert hit, errs
    assert all("partly written" in e and "must not be used" in e for e in hit), hit


def test_stray_shard_ignored_unlike_hf_reader(tmp_path):
    """A shard of an older save left in the directory: our Reader follows the committed
    manifest and ignores it; HuggingFaceStorageReader lists every *.safetensors file."""
    res = dh.results(2, job_stray, str(tmp_path))
    ours = res[0]["ours"]
    assert ours == ("loaded", [], []), ours
    hf = res[0]["hf"]
    # What HF does with the stray shard (recorded, whichever it is): it either fails, or
    # loads tensors that are not the ones saved last.
    print("HuggingFaceStorageReader with a stray shard:", hf)
    assert hf[0] == "error" or hf[1], hf


def test_rank_dies_during_write_data(tmp_path, ckpt):
    path = tmp_path / "ck"
    out, codes = dh.run(2, job_dies, str(path), allow_dead=(1,))
    assert codes[1] == 3
    ok, (what, intact, elapsed, exc) = out[0]
    assert what == "error", out[0]
    assert intact, "the first checkpoint must stay committed and load"
    # Bounded: gloo reports the closed connection; the process-group timeout is the bound.
    assert elapsed < dh.PG_TIMEOUT_S, elapsed
    # The dead attempt left its files (rank 1's shards and part): not committed...
    ck = ckptstore.open(path)
    cid = ck.checkpoint_id
    ck.close()
    leftovers = [f for f in os.listdir(path) if cid not in f and f.endswith((".safetensors", ".json")) and f != "ckpt-manifest.json"]
    assert leftovers, os.listdir(path)
    # ...and the next save collects them.
    sd = state_dict_plain(2)
    dcp.save(sd, storage_writer=Writer(path), no_dist=True)
    ck = ckptstore.open(path)
    names = os.listdir(path)
    assert not [f for f in leftovers if f in names], names
    assert all(ck.checkpoint_id in f for f in names if f.endswith(".safetensors"))


def state_dict_plain(version: int) -> dict:
    sd = {n: global_tensor(n, version) for n in SPECS}
    sd["step"] = torch.tensor(float(7 + version))
    return sd


def test_planned_byte_ranges_are_all_a_load_reads(saved, tmp_path):
    """_plan_ranges (what the tiered restore fetches) of DCP's default load plan: for a
    state dict of some tensors, the ranges cover less than the stored data, and a copy of
    the checkpoint with every other data byte zeroed (shard headers kept) still loads those
    tensors bit-identical, every byte read CRC-checked."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptstore.torch.dcp import _plan_ranges

    src = saved / "ours-4"
    cp = tmp_path / "ours-4"
    shutil.copytree(src, cp)
    want = {"a": torch.empty(SPECS["a"][0], dtype=SPECS["a"][1]),
            "d": torch.empty(SPECS["d"][0], dtype=SPECS["d"][1])}
    planner, reader = DefaultLoadPlanner(), Reader(cp)
    planner.set_up_planner(want, reader.read_metadata(), True)
    ranges = _plan_ranges(reader, planner.create_local_plan())
    reader.reset()
    assert ranges and all(os.path.dirname(f) == str(cp) for f, _, _ in ranges), ranges
    keep: dict = {}
    for f, b, e in ranges:
        keep.setdefault(os.path.basename(f), []).append((b, e))
    data = zeroed = 0
    for p in cp.iterdir():
        if not p.name.endswith(".safetensors"):
            continue
        raw = bytearray(p.read_bytes())
        head = 8 + int.from_bytes(raw[:8], "little")
        data += len(raw) - head
        mask = np.zeros(len(raw), dtype=bool)
        mask[:head] = True
        for b, e in keep.get(p.name, []):
            mask[b:e] = True
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        zeroed += int((~mask).sum())
        arr[~mask] = 0
        p.write_bytes(arr.tobytes())
    assert 0 < zeroed < data, (zeroed, data)
    dcp.load(want, storage_reader=Reader(cp, all_or_nothing=False), no_dist=True)
    for n in want:
        assert torch.equal(want[n], global_tensor(n, 0)), n
    # The check is real: a zeroed byte inside a planned range fails the load.
    f, b, _ = ranges[0]
    raw = bytearray(Path(f).read_bytes())
    raw[b] ^= 0xFF
    Path(f).write_bytes(bytes(raw))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="checksum mismatch"):
        dcp.load({k: torch.empty_like(v) for k, v in want.items()},
                 storage_reader=Reader(cp, all_or_nothing=False), no_dist=True)


def test_the_destination_of_a_read_item_is_the_one_the_planner_resolves(tmp_path):
    """``dcp._resolve`` (DCP's default planner's destination, found without its 0.5 ms
    runtime-protocol check) gives the tensor ``resolve_tensor`` gives, the same memory,
    shape and strides; a planner that overrides how it finds or narrows a destination is
    asked itself."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptstore.torch.dcp import _resolve

    src = {"w": torch.arange(12.0).reshape(3, 4), "s": torch.tensor(5.0), "v": torch.ones(7)}
    dcp.save(src, storage_writer=Writer(tmp_path / "ck"), no_dist=True)

    class Mine(DefaultLoadPlanner):
        def transform_tensor(self, read_item, tensor):
            return super().transform_tensor(read_item, tensor).clone()

    for cls in (DefaultLoadPlanner, Mine):
        sd = {k: torch.zeros_like(v) for k, v in src.items()}
        planner = cls()
        planner.set_up_planner(sd, Reader(tmp_path / "ck").read_metadata(), True)
        items = planner.create_local_plan().items
        assert len(items) == 3
        for ri in items:
            got, want = _resolve(planner, ri), planner.resolve_tensor(ri)
            assert (got.shape, got.stride()) == (want.shape, want.stride())
            live = sd[ri.dest_index.fqn].data_ptr()
            if cls is DefaultLoadPlanner:
                assert got.data_ptr() == want.data_ptr() == live
            else:  # the override's clone, not the state dict's memory
                assert live not in (got.data_ptr(), want.data_ptr()) and torch.equal(got, want)
