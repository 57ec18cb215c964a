"""Two-level multi-rank checkpoints from Python (format-spec/global.md §The two-level
manifest): ranks write their parts in this process with :func:`ckptstore.write_part`, the
coordinator commits with ``layout="two_level"``, and the root manifest names the part
descriptors, which stay in the directory and are loaded by readers on first use.

Every read is compared bit for bit with the global arrays the test built; the same
checkpoint is loaded through the torch DCP Reader (single process, and resharded onto two
ranks); a damaged part index fails only the regions its rank holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptstore
import ckpt_helpers as h

WORLD = 3
ROWS, COLS = 11, 6  # 11 rows: uneven splits over 2, 3 and 4 readers

#: The row-split global tensors: name -> dtype.
SPLIT = {"w": np.float32, "emb": ml_dtypes.bfloat16, "idx": np.int64}
#: Replicated tensors (every rank offers the whole tensor as one chunk).
BIAS = np.array([1.5, -2.25, 3.0, 0.125], np.float32)
STEP = np.array(42.0, np.float32)
#: The whole (not global) tensor, offered by rank 0 only.
TABLE = np.arange(5, dtype=np.uint8)

#: torch dtype names of every tensor, for the DCP metadata.
DCP_DTYPES = {"w": "float32", "emb": "bfloat16", "idx": "int64", "bias": "float32", "step": "float32", "table": "uint8"}


def global_array(name: str) -> np.ndarray:
    """The global tensor ``name`` (deterministic)."""
    x = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS)
    v = np.sin(x * 0.37 + len(name)) * 100
    dt = SPLIT[name]
    return (v.astype(np.int64) if dt is np.int64 else v).astype(dt)


def every_tensor() -> dict[str, np.ndarray]:
    out = {n: global_array(n) for n in SPLIT}
    out.update(bias=BIAS, step=STEP, table=TABLE)
    return out


def splits(n: int, parts: int) -> list[tuple[int, int]]:
    """Uneven contiguous splits of ``n`` into ``parts`` (first ones one larger)."""
    q, r = divmod(n, parts)
    out, at = [], 0
    for k in range(parts):
        size = q + (k < r)
        out.append((at, size))
        at += size
    return out


def rank_tensors(rank: int, world: int) -> dict:
    """Rank ``rank``'s rows of the split tensors, its copy of the replicated ``bias`` and
    ``step``, and (rank 0) the whole tensor ``table``."""
    r0, n = splits(ROWS, world)[rank]
    out: dict = {}
    for name in SPLIT:
        g = global_array(name)
        out[name] = ckptstore.Chunk(g[r0 : r0 + n], g.shape, (r0, 0))
    out["bias"] = ckptstore.Chunk(BIAS.copy(), BIAS.shape, (0,))
    out["step"] = ckptstore.Chunk(STEP.copy(), (), ())
    if rank == 0:
        out["table"] = TABLE
    return out


def dcp_metadata() -> dict:
    """The manifest metadata the DCP Writer stores (key ``torch.distributed.checkpoint``),
    written by hand: per state-dict entry its name, dtype and size. The chunk layout is not
    part of it (the Reader takes it from the manifest's global-tensor table)."""
    items = {
        n: {
            "kind": "tensor",
            "name": n,
            "dtype": DCP_DTYPES[n],
            "size": list(a.shape),
            "requires_grad": False,
            "strides": None,
        }
        for n, a in every_tensor().items()
    }
    return {
        "torch.distributed.checkpoint": {
            "version": 1,
            "dcp_version": None,
            "items": items,
            "planner_data": None,
            "storage_meta": None,
        },
        "step": 7,
    }


def write_parts(path: Path, world: int = WORLD) -> tuple[str, list[bytes]]:
    """Every rank's part, written in this process (small shards: several per rank)."""
    cid = ckptstore.new_checkpoint_id()
    parts = [
        ckptstore.write_part(path, cid, r, rank_tensors(r, world), max_shard_size=128)
        for r in range(world)
    ]
    return cid, parts


def build(path: Path, world: int = WORLD, **commit_kw) -> str:
    """A committed checkpoint in ``path``; returns its id."""
    path.mkdir(parents=True, exist_ok=True)
    cid, parts = write_parts(path, world)
    info = ckptstore.commit(path, cid, parts=parts, metadata=dcp_metadata(), **commit_kw)
    assert info["checkpoint_id"] == cid
    return cid


def part_files(path: Path) -> list[str]:
    return sorted(p.name for p in Path(path).glob("part-*.json"))


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.fixture(scope="module")
def two_level(tmp_path_factory) -> tuple[Path, str]:
    """The three-rank checkpoint committed with ``layout="two_level"``. Read-only."""
    path = tmp_path_factory.mktemp("two_level") / "ckpt"
    cid = build(path, layout="two_level")
    return path, cid


# ---- a. the Python reader ---------------------------------------------------------------


def test_root_names_the_parts_which_stay(two_level):
    path, cid = two_level
    m = h.read_manifest(path)
    assert m["features"] == ["global", "parts"]
    assert part_files(path) == [f"part-{cid}-r{r}.json" for r in range(WORLD)]
    assert [p["file"] for p in m["parts"]] == part_files(path)
    for p in m["parts"]:
        assert (path / p["file"]).stat().st_size == p["size"]
    # The root lists the whole tensor only; the chunk entries are in the parts.
    assert [t["name"] for t in m["tensors"]] == ["table"]
    assert all(g["chunks"] == [] for g in m["globals"])
    assert sorted(g["name"] for g in m["globals"]) == sorted([*SPLIT, "bias", "step"])


def test_every_tensor_reads_back_bit_for_bit(two_level):
    path, cid = two_level
    ck = ckptstore.open(path)
    assert ck.checkpoint_id == cid
    assert ck.metadata["step"] == 7
    want = every_tensor()
    assert sorted(ck.keys()) == sorted(want)
    g = ck.globals()
    assert g["w"] == ("F32", [ROWS, COLS]) and g["emb"] == ("BF16", [ROWS, COLS])
    assert g["step"] == ("F32", []) and "table" not in g
    assert ck.chunks("w") == [([r0, 0], [n, COLS]) for r0, n in splits(ROWS, WORLD)]
    assert ck.chunks("bias") == [([0], [4])], "replicas are one chunk"
    for name, a in want.items():
        got = ck[name]
        assert got.dtype == a.dtype and got.shape == a.shape, name
        assert bits(got) == bits(a), name
    every = ck.read()
    assert sorted(every) == sorted(want)
    for name, a in want.items():
        assert bits(every[name]) == bits(a), name
    v = ck.verify()
    assert v["checksummed"]


@pytest.mark.parametrize("readers", [1, 2, 3, 4])
def test_regions_for_m_readers(two_level, readers):
    path, _ = two_level
    ck = ckptstore.open(path)
    for name in SPLIT:
        g = global_array(name)
        for r0, n in splits(ROWS, readers):
            got = ck.read_region(name, (r0, 0), (n, COLS))
            assert got.dtype == g.dtype and got.shape == (n, COLS) and got.flags.writeable
            assert bits(got) == bits(g[r0 : r0 + n]), (name, r0, n)
        for c0, m in splits(COLS, readers):
            got = ck.read_region(name, (0, c0), (ROWS, m))
            assert bits(got) == bits(g[:, c0 : c0 + m]), (name, c0, m)
        # A box across every part boundary.
        got = ck.read_region(name, (1, 1), (ROWS - 2, COLS - 2))
        assert bits(got) == bits(g[1:-1, 1:-1])
    assert bits(ck.read_region("bias", (1,), (2,))) == bits(BIAS[1:3])
    assert ck.read_region("step", (), ()) == STEP


def test_file_rendezvous_commits_two_level(tmp_path):
    """commit without parts (the file rendezvous) goes through the same binding: it takes
    the layout too."""
    cid, _ = write_parts(tmp_path)
    ckptstore.commit(tmp_path, cid, world_size=WORLD, timeout=30, layout="two_level")
    assert h.read_manifest(tmp_path)["features"] == ["global", "parts"]
    assert part_files(tmp_path) == [f"part-{cid}-r{r}.json" for r in range(WORLD)]
    ck = ckptstore.open(tmp_path)
    for name, a in every_tensor().items():
        assert bits(ck[name]) == bits(a), name


# ---- b. the torch DCP Reader ------------------------------------------------------------


def _torch_of(a: np.ndarray):
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _torch_bits(t) -> bytes:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_dcp_reader_loads_the_two_level_checkpoint(two_level):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Reader

    path, _ = two_level
    want = every_tensor()
    sd = {n: torch.full(a.shape, -7, dtype=_torch_of(a).dtype) for n, a in want.items()}
    dcp.load(sd, storage_reader=Reader(path), no_dist=True)
    for n, a in want.items():
        assert sd[n].dtype == _torch_of(a).dtype and tuple(sd[n].shape) == a.shape, n
        assert _torch_bits(sd[n]) == bits(a), n
    # A state dict of some entries only: those are loaded, into strided destinations too.
    w_t = torch.zeros(COLS, ROWS).t()  # non-contiguous (ROWS, COLS)
    sd = {"w": w_t, "emb": torch.zeros(ROWS, COLS, dtype=torch.bfloat16)}
    dcp.load(sd, storage_reader=Reader(path), no_dist=True)
    assert _torch_bits(sd["w"]) == bits(want["w"])
    assert _torch_bits(sd["emb"]) == bits(want["emb"])


# Resharded loads need a process group: two gloo ranks (dist_helpers), CPU only.
LOAD_PLACEMENTS = {"w": "shard1", "emb": "shard0", "idx": "replicate"}


def job_load_resharded(rank, world, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptstore.torch.dcp import Reader

    mesh = init_device_mesh("cpu", (world,))
    pl = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
    dt = {"w": torch.float32, "emb": torch.bfloat16, "idx": torch.int64}
    sd = {
        n: distribute_tensor(torch.full((ROWS, COLS), -7, dtype=dt[n]), mesh, pl[p])
        for n, p in LOAD_PLACEMENTS.items()
    }
    sd["bias"] = torch.zeros(4)
    sd["step"] = torch.tensor(0.0)
    dcp.load(sd, storage_reader=Reader(path))
    out = {n: _torch_bits(sd[n].full_tensor()) for n in LOAD_PLACEMENTS}
    out["local_w"] = tuple(sd["w"].to_local().shape)
    out["bias"] = _torch_bits(sd["bias"])
    out["step"] = float(sd["step"])
    return out


def test_dcp_reader_reshards_onto_two_ranks(two_level):
    pytest.importorskip("torch")
    import dist_helpers as dh

    path, _ = two_level
    for rank, got in enumerate(dh.results(2, job_load_resharded, str(path))):
        for n in LOAD_PLACEMENTS:
            assert got[n] == bits(global_array(n)), (rank, n)
        assert got["local_w"] == (ROWS, COLS // 2)
        assert got["bias"] == bits(BIAS) and got["step"] == 42.0


# ---- c. a damaged part index -------------------------------------------------------------


def test_damaged_part_index_fails_only_what_it_holds(tmp_path):
    cid = build(tmp_path, layout="two_level")
    name1 = f"part-{cid}-r1.json"
    p1 = tmp_path / name1
    h.flip_byte(p1, p1.stat().st_size // 2, 0x20)
    # Open reads the root only.
    ck = ckptstore.open(tmp_path)
    (r0, n0), (r1, n1), (r2, n2) = splits(ROWS, WORLD)
    g = global_array("w")
    # Held by rank 1: the part error, naming the file.
    for read in (
        lambda: ck.read_region("w", (r1, 0), (1, COLS)),
        lambda: ck.read_region("emb", (r0, 0), (n0 + 1, COLS)),  # rows of ranks 0 and 1
        lambda: ck["w"],
        lambda: ck.verify(),
    ):
        with pytest.raises(ckptstore.PartError, match=name1) as ei:
            read()
        assert str(ei.value.part).endswith(name1), ei.value.part
        assert not isinstance(ei.value, ckptstore.MissingPartsError)
    # Held only by rank 0 (and rank 2): still read, bit for bit.
    assert bits(ck.read_region("w", (r0, 0), (n0, COLS))) == bits(g[r0 : r0 + n0])
    assert bits(ck.read_region("w", (r2, 2), (n2, 3))) == bits(g[r2:, 2:5])
    # The whole tensor is in the root, the replicated ones in the first copy's part.
    assert bits(ck["table"]) == bits(TABLE)
    assert bits(ck["bias"]) == bits(BIAS)
    assert ck["step"] == STEP
    # A fresh reader fails the same way (nothing cached across opens).
    with pytest.raises(ckptstore.PartError, match=name1):
        ckptstore.open(tmp_path).read_region("idx", (r1 + n1 - 1, 0), (1, 1))


def test_dcp_reader_reports_a_damaged_part_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Reader

    cid = build(tmp_path, layout="two_level")
    name1 = f"part-{cid}-r1.json"
    h.flip_byte(tmp_path / name1, 40, 0x01)
    sd = {"w": torch.full((ROWS, COLS), -7.0)}
    with pytest.raises(BaseException, match=name1):  # DCP may wrap it in CheckpointException
        dcp.load(sd, storage_reader=Reader(tmp_path), no_dist=True)
    assert bool((sd["w"] == -7.0).all())


# ---- d. the layout choice ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["flat", None])
def test_flat_and_default_layouts_give_a_flat_manifest(tmp_path, layout):
    cid, parts = write_parts(tmp_path)
    kw = {} if layout is None else {"layout": layout}
    ckptstore.commit(tmp_path, cid, parts=parts, **kw)
    m = h.read_manifest(tmp_path)
    assert m["features"] == ["global"]
    assert "parts" not in m and "grids" not in m
    assert len(next(g for g in m["globals"] if g["name"] == "w")["chunks"]) == WORLD
    assert part_files(tmp_path) == []
    ck = ckptstore.open(tmp_path)
    for name, a in every_tensor().items():
        assert bits(ck[name]) == bits(a), name


def test_auto_layout_by_name_is_flat_for_a_small_job(tmp_path):
    cid, parts = write_parts(tmp_path)
    ckptstore.commit(tmp_path, cid, parts=parts, layout="auto")
    assert h.read_manifest(tmp_path)["features"] == ["global"]


def test_two_level_without_chunks_commits_flat(tmp_path):
    """Parts holding only whole tensors have nothing to put in part indexes."""
    cid = ckptstore.new_checkpoint_id()
    parts = [ckptstore.write_part(tmp_path, cid, r, {f"t{r}": np.full(3, r, np.int32)}) for r in range(2)]
    ckptstore.commit(tmp_path, cid, parts=parts, layout="two_level")
    m = h.read_manifest(tmp_path)
    assert "parts" not in m.get("features", []) and "parts" not in m
    ck = ckptstore.open(tmp_path)
    assert ck["t1"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("bad", ["bogus", "TWO_LEVEL", "two-level", "", None, 2])
def test_unknown_layout_is_a_value_error_and_commits_nothing(tmp_path, bad):
    cid, parts = write_parts(tmp_path)
    with pytest.raises(ValueError, match=r'"auto", "flat" or "two_level"') as ei:
        ckptstore.commit(tmp_path, cid, parts=parts, layout=bad)
    assert isinstance(ei.value, ckptstore.InvalidArgumentError)
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.open(tmp_path)
    # The parts are intact: a commit with a valid layout still succeeds.
    ckptstore.commit(tmp_path, cid, parts=parts, layout="two_level")
    assert h.read_manifest(tmp_path)["features"] == ["global", "parts"]


def test_the_binding_checks_the_layout_too(tmp_path):
    from ckptstore import _ckptstore

    cid, parts = write_parts(tmp_path)
    with pytest.raises(ValueError, match=r"two_level.*got \"bogus\"") as ei:
        _ckptstore.commit(os.fspath(tmp_path), cid, parts, None, None, None, None, "bogus")
    assert isinstance(ei.value, ckptstore.InvalidArgumentError)
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.open(tmp_path)
    _ckptstore.commit(os.fspath(tmp_path), cid, parts, layout="flat")
    assert h.read_manifest(tmp_path)["features"] == ["global"]


# ---- e. what the bindings say about the layout -------------------------------------------


def part_size(path: Path, cid: str, rank: int) -> int:
    return (Path(path) / f"part-{cid}-r{rank}.json").stat().st_size


def test_flat_checkpoint_has_no_parts_and_no_grid(tmp_path):
    cid, parts = write_parts(tmp_path)
    ckptstore.commit(tmp_path, cid, parts=parts, layout="flat")
    ck = ckptstore.open(tmp_path)
    assert ck.two_level is False
    assert ck.grid_cells("w") is None, "a flat global has no grid"
    assert ck.grid_cells("table") is None, "a whole tensor has no grid"
    with pytest.raises(ckptstore.TensorNotFoundError):
        ck.grid_cells("nope")
    assert bits(ck.read_region("w", (0, 0), (ROWS, COLS))) == bits(global_array("w"))
    assert ck.parts_read() == (0, 0)


def test_grid_cells_come_from_the_root_alone(two_level):
    path, cid = two_level
    ck = ckptstore.open(path)
    assert ck.two_level is True
    # The catalog and the grid: no part index read.
    ck.keys(), ck.globals(), ck.shape_of("w"), ck.info("w")
    for name in SPLIT:
        assert ck.grid_cells(name) == [([r0, 0], [n, COLS]) for r0, n in splits(ROWS, WORLD)]
    assert ck.grid_cells("bias") == [([0], [4])]
    assert ck.grid_cells("step") == [([], [])]
    assert ck.grid_cells("table") is None
    with pytest.raises(ckptstore.TensorNotFoundError):
        ck.grid_cells("nope")
    assert ck.parts_read() == (0, 0)
    # Rank 1's rows: rank 1's part only, counted once however often it is used.
    (_, _), (r1, n1), _ = splits(ROWS, WORLD)
    for _ in range(2):
        got = ck.read_region("w", (r1, 0), (n1, COLS))
        assert bits(got) == bits(global_array("w")[r1 : r1 + n1])
    assert ck.parts_read() == (1, part_size(path, cid, 1))
    # chunks() needs every part holding a chunk of the tensor.
    ck.chunks("emb")
    assert ck.parts_read() == (WORLD, sum(part_size(path, cid, r) for r in range(WORLD)))


def test_grid_cells_within_boxes_are_the_cells_they_touch_each_once(two_level):
    path, _ = two_level
    ck = ckptstore.open(path)
    cells = [([r0, 0], [n, COLS]) for r0, n in splits(ROWS, WORLD)]
    (r0, n0), (r1, n1), (r2, n2) = splits(ROWS, WORLD)
    for name in SPLIT:
        assert ck.grid_cells(name, [([r1, 0], [n1, COLS])]) == [cells[1]], "a rank's own rows: its cell"
        assert ck.grid_cells(name, [([r1 + 1, 2], [1, 1])]) == [cells[1]], "inside one cell"
        assert ck.grid_cells(name, [([r1 - 1, 0], [2, 1])]) == cells[:2], "across a split"
        # Two boxes: the union, each cell once, in row-major order.
        assert ck.grid_cells(name, [([r2, 0], [1, 1]), ([0, 0], [ROWS, 1])]) == cells
        assert ck.grid_cells(name, [([r2, 0], [n2, 1]), ([r2 + 1, 3], [1, 1])]) == [cells[2]]
        assert ck.grid_cells(name, [([0, 0], [0, COLS])]) == [], "an empty box touches nothing"
        assert ck.grid_cells(name, [([ROWS, 0], [1, COLS])]) == [], "outside the tensor"
        assert ck.grid_cells(name, [([0, 0], [1, 1, 1])]) == [], "a box of another rank of index"
        assert ck.grid_cells(name, []) == []
        assert ck.grid_cells(name, None) == cells
    assert ck.grid_cells("bias", [([1], [2])]) == [([0], [4])]
    assert ck.grid_cells("step", [([], [])]) == [([], [])]
    assert ck.grid_cells("table", [([0], [1])]) is None, "a whole tensor has no grid"
    with pytest.raises(ckptstore.InvalidArgumentError):
        ck.grid_cells("w", [([-1, 0], [1, 1])])
    with pytest.raises(ckptstore.TensorNotFoundError):
        ck.grid_cells("nope", [([0], [1])])
    assert ck.parts_read() == (0, 0), "the cells come from the root alone"


def test_chunks_within_a_box_load_only_the_parts_holding_it(two_level):
    path, cid = two_level
    ck = ckptstore.open(path)
    (r0, n0), (r1, n1), _ = splits(ROWS, WORLD)
    assert ck.chunks("w", ([r1, 0], [n1, COLS])) == [([r1, 0], [n1, COLS])]
    assert ck.parts_read() == (1, part_size(path, cid, 1)), "rank 1's part alone"
    assert ck.chunks("w", ([r1 + 1, 1], [1, 2])) == [([r1, 0], [n1, COLS])], "inside one chunk"
    assert ck.chunks("w", ([r1 - 1, 0], [2, 1])) == [([r0, 0], [n0, COLS]), ([r1, 0], [n1, COLS])]
    assert ck.parts_read()[0] == 2
    for empty in (([0, 0], [0, COLS]), ([ROWS, 0], [1, 1]), ([0], [1]), ([2**64 - 1, 0], [2, 1])):
        assert ck.chunks("w", empty) == [], empty
    assert ck.chunks("table", ([0], [2])) == [([0], [5])], "a whole tensor: one chunk at the origin"
    with pytest.raises(ckptstore.TensorNotFoundError):
        ck.chunks("nope", ([0], [1]))
    with pytest.raises(ckptstore.InvalidArgumentError):
        ck.chunks("w", ([-1, 0], [1, 1]))


def test_byte_ranges_name_the_part_shards(two_level):
    """The prefetch hints of a two-level checkpoint name the parts' shard files (the root's
    shard list holds only the whole tensor's), inside the directory, within each file."""
    path, cid = two_level
    ck = ckptstore.open(path, lazy=True)  # local: mapped either way
    (r0, n0), (r1, n1), (r2, n2) = splits(ROWS, WORLD)
    root_shards = set(ck.shard_files)
    got = ck.byte_ranges([("w", (r1, 0), (n1, COLS))])
    assert got, "no prefetch hints for a part's chunk"
    assert ck.parts_read() == (1, part_size(path, cid, 1))
    for f, b, e in got:
        f = Path(f)
        assert f.parent == Path(path) and f.is_file(), f
        assert f not in root_shards, "the chunk lies in a part's shard"
        assert 0 <= b < e <= f.stat().st_size, (f, b, e)
    # Every rank's rows: at least one range per part (the parts write separate shards),
    # merged where they touch, sorted per file.
    every = ck.byte_ranges([(n, (0, 0), (ROWS, COLS)) for n in SPLIT])
    files = [Path(f) for f, _, _ in every]
    assert len(set(files)) >= WORLD
    for (f1, b1, e1), (f2, b2, e2) in zip(every, every[1:]):
        assert f1 != f2 or e1 < b2, "overlapping or touching ranges left unmerged"
    assert ck.parts_read()[0] == WORLD
    # A whole tensor: the root's own shard, as before.
    got = ck.byte_ranges([("table", (0,), (5,))])
    assert [Path(f) for f, _, _ in got] and all(Path(f) in root_shards for f, _, _ in got)
    # The hinted bytes hold the chunk: their total covers rank 1's rows of w.
    total = sum(e - b for _, b, e in ck.byte_ranges([("w", (r1, 0), (n1, COLS))]))
    assert total >= n1 * COLS * 4


# ---- f. DCP over a two-level checkpoint: only the parts a rank needs ----------------------


def test_dcp_reader_metadata_reads_the_root_only(two_level):
    pytest.importorskip("torch")
    from ckptstore.torch.dcp import Reader

    path, cid = two_level
    r = Reader(path)
    md = r.read_metadata()
    assert r.parts_read() == (0, 0), "read_metadata loaded part indexes"
    w = md.state_dict_metadata["w"]
    assert [(list(c.offsets), list(c.sizes)) for c in w.chunks] == [
        ([r0, 0], [n, COLS]) for r0, n in splits(ROWS, WORLD)
    ]
    assert [(list(c.offsets), list(c.sizes)) for c in md.state_dict_metadata["table"].chunks] == [
        ([0], [5])
    ]


@pytest.mark.parametrize(
    "names,parts",
    [(["table"], []), (["table", "bias", "step"], [0]), (["w"], [0, 1, 2]), (["idx", "table"], [0, 1, 2])],
)
def test_dcp_load_reads_only_the_parts_holding_its_tensors(two_level, names, parts):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Reader

    path, cid = two_level
    want = every_tensor()
    sd = {n: torch.full(want[n].shape, -7, dtype=_torch_of(want[n]).dtype) for n in names}
    r = Reader(path)
    dcp.load(sd, storage_reader=r, no_dist=True)
    for n in names:
        assert _torch_bits(sd[n]) == bits(want[n]), n
    assert r.parts_read() == (len(parts), sum(part_size(path, cid, p) for p in parts))


def test_dcp_load_is_not_failed_by_a_damaged_part_it_does_not_need(tmp_path):
    """Rank 1's part index damaged: a DCP load of tensors rank 1's part does not hold
    succeeds bit for bit (read_metadata used to load every part); one that needs it still
    fails naming it and writes nothing."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Reader

    cid = build(tmp_path, layout="two_level")
    name1 = f"part-{cid}-r1.json"
    h.flip_byte(tmp_path / name1, (tmp_path / name1).stat().st_size // 2, 0x20)
    want = every_tensor()
    names = ["table", "bias", "step"]
    sd = {n: torch.full(want[n].shape, -7, dtype=_torch_of(want[n]).dtype) for n in names}
    r = Reader(tmp_path)
    dcp.load(sd, storage_reader=r, no_dist=True)
    for n in names:
        assert _torch_bits(sd[n]) == bits(want[n]), n
    assert r.parts_read() == (1, part_size(tmp_path, cid, 0))
    sd = {"table": torch.zeros(5, dtype=torch.uint8), "idx": torch.full((ROWS, COLS), -7, dtype=torch.int64)}
    with pytest.raises(BaseException, match=name1):  # DCP may wrap it in CheckpointException
        dcp.load(sd, storage_reader=Reader(tmp_path), no_dist=True)
    assert bool((sd["idx"] == -7).all()) and bool((sd["table"] == 0).all())


def job_save_two_level_and_load_own_rows(rank, world, path):
    """Save row-split DTensors with ``Writer(layout="two_level")``, then load them back
    with the same split (each rank its own rows: its own part only) and column-split (every
    part)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.torch.dcp import Reader, Writer

    mesh = init_device_mesh("cpu", (world,))
    full = {n: _torch_of(global_array(n)) for n in SPLIT}
    sd = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    dcp.save(sd, storage_writer=Writer(path, layout="two_level", max_shard_size=128))
    out = {}
    for how, placement in (("rows", Shard(0)), ("cols", Shard(1))):
        sd = {n: distribute_tensor(torch.full_like(t, -7), mesh, [placement]) for n, t in full.items()}
        out[f"plan_{how}"] = plan_alone_both_ways(path, sd)
        r = Reader(path)
        dcp.load(sd, storage_reader=r)
        out[how] = {
            "full": {n: _torch_bits(sd[n].full_tensor()) for n in SPLIT},
            "local": {n: _torch_bits(sd[n].to_local()) for n in SPLIT},
            "parts_read": r.parts_read(),
            "checkpoint_id": r._open().checkpoint_id,
        }
    return out


def plan_alone_both_ways(path, sd) -> dict:
    """DCP's default load plan of ``sd`` made by this rank alone (as
    ``ckptstore.torch.distributed.load`` plans), with the whole ``Metadata`` and with the
    reader's ``wanted`` boxes (``_sharded._boxes``): each plan's read items, and the cells
    each ``Metadata`` lists."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptstore.torch._sharded import _boxes
    from ckptstore.torch.dcp import Reader

    got = {}
    for way in ("whole", "wanted"):
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dict(sd), None, False)
        r = Reader(path)
        if way == "wanted":
            r.wanted = _boxes(planner.state_dict)
        planner.metadata = md = r.read_metadata()
        items = [(i.type.name, i.dest_index.fqn, list(i.dest_index.offset or []), list(i.dest_offsets),
                  list(i.storage_index.offset or []), list(i.storage_offsets), list(i.lengths))
                 for i in planner.create_local_plan().items]
        got[way] = {"items": sorted(items), "cells": {n: len(md.state_dict_metadata[n].chunks) for n in SPLIT}}
        r.reset()
    return got


def test_dcp_writer_two_level_saves_and_each_rank_loads_its_own_part(tmp_path):
    pytest.importorskip("torch")
    import dist_helpers as dh

    path = tmp_path / "ckpt"
    res = dh.results(2, job_save_two_level_and_load_own_rows, str(path))
    m = h.read_manifest(path)
    assert m["features"] == ["global", "parts"]
    cid = m["checkpoint_id"]
    assert part_files(path) == [f"part-{cid}-r{r}.json" for r in range(2)]
    rows = splits(ROWS, 2)  # DTensor's Shard(0) of 11 rows over 2: 6 and 5, as splits()
    for rank, got in enumerate(res):
        for how in ("rows", "cols"):
            assert got[how]["checkpoint_id"] == cid
            for n in SPLIT:
                assert got[how]["full"][n] == bits(global_array(n)), (rank, how, n)
        r0, nr = rows[rank]
        for n in SPLIT:
            assert got["rows"]["local"][n] == bits(global_array(n)[r0 : r0 + nr]), (rank, n)
        # Its own rows: its own part, and no other.
        assert got["rows"]["parts_read"] == (1, part_size(path, cid, rank)), rank
        # Its columns of every row: both parts.
        assert got["cols"]["parts_read"] == (2, part_size(path, cid, 0) + part_size(path, cid, 1))
        # A rank planning alone with its wanted boxes: the same plan, from the cells it
        # touches only (its own rows: its own cell; its columns of every row: both).
        for how, cells in (("rows", 1), ("cols", 2)):
            plans = got[f"plan_{how}"]
            assert plans["wanted"]["items"] == plans["whole"]["items"] and plans["whole"]["items"], how
            assert plans["whole"]["cells"] == {n: 2 for n in SPLIT}
            assert plans["wanted"]["cells"] == {n: cells for n in SPLIT}, (rank, how)
    # The same checkpoint through the Python reader, bit for bit.
    ck = ckptstore.open(path)
    assert ck.two_level
    for n in SPLIT:
        assert bits(ck[n]) == bits(global_array(n)), n


@pytest.mark.parametrize("layout,features", [("two_level", ["global", "parts"]), ("flat", ["global"]), ("auto", ["global"])])
def test_dcp_writer_layout_single_process(tmp_path, layout, features):
    """``Writer(layout=...)`` reaches the commit; each layout loads back bit for bit (with a
    bytes item, stored as a whole tensor in the root)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from ckptstore.torch.dcp import Reader, Writer

    want = {n: _torch_of(global_array(n)) for n in SPLIT}
    sd = {**{n: t.clone() for n, t in want.items()}, "cfg": {"lr": 0.5}}
    w = Writer(tmp_path, layout=layout)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.commit_info["checkpoint_id"] == h.read_manifest(tmp_path)["checkpoint_id"]
    assert h.read_manifest(tmp_path)["features"] == features
    assert ckptstore.open(tmp_path).two_level is (layout == "two_level")
    back = {**{n: torch.full_like(t, -7) for n, t in want.items()}, "cfg": {"lr": None}}
    dcp.load(back, storage_reader=Reader(tmp_path), no_dist=True)
    for n, t in want.items():
        assert back[n].dtype == t.dtype and _torch_bits(back[n]) == _torch_bits(t), n
    assert back["cfg"] == {"lr": 0.5}


@pytest.mark.parametrize("bad", ["bogus", "TWO_LEVEL", "", None, 2])
def test_dcp_writer_refuses_an_unknown_layout(tmp_path, bad):
    pytest.importorskip("torch")
    from ckptstore.torch.dcp import Writer

    with pytest.raises(ValueError, match=r'"auto", "flat" or "two_level"') as ei:
        Writer(tmp_path, layout=bad)
    assert isinstance(ei.value, ckptstore.InvalidArgumentError)
    assert list(tmp_path.iterdir()) == []
