"""Multi-rank checkpoints from Python (format-spec/global.md): N real writer processes
each write their part of global tensors into one directory, one coordinator commits, and
M readers read any region back, compared bit for bit with the global arrays the test built.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import ml_dtypes
import numpy as np
import pytest

import ckptstore

ROWS, COLS = 10, 6
DTYPES = {
    "f32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f64": np.float64,
    "i64": np.int64,
}


def global_array(name: str) -> np.ndarray:
    """The global tensor ``name`` (deterministic, so every process builds the same)."""
    dt = DTYPES[name]
    x = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS)
    v = np.sin(x * 0.37 + len(name)) * 100
    return (v.astype(np.int64) if dt is np.int64 else v).astype(dt)


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
    """What rank ``rank`` of ``world`` holds: rows of the f32/bf16/i64 globals, columns of
    f16, 2-D blocks of f64 (world 4), a replicated 0-dim step and 1-element bias, and one
    whole tensor from rank 0 only."""
    out: dict = {}
    r0, n = splits(ROWS, world)[rank]
    for name in ("f32", "bf16", "i64"):
        g = global_array(name)
        out[name] = ckptstore.Chunk(g[r0 : r0 + n], g.shape, (r0, 0))
    c0, m = splits(COLS, world)[rank]
    g = global_array("f16")
    out["f16"] = ckptstore.Chunk(g[:, c0 : c0 + m], g.shape, (0, c0))  # strided view
    g = global_array("f64")
    if world == 4:
        (a, an), (b, bn) = splits(ROWS, 2)[rank // 2], splits(COLS, 2)[rank % 2]
        out["f64"] = ckptstore.Chunk(g[a : a + an, b : b + bn], g.shape, (a, b))
    else:
        # Two pieces per rank: its rows split at column 2.
        out["f64"] = [
            ckptstore.Chunk(g[r0 : r0 + n, :2], g.shape, (r0, 0)),
            ckptstore.Chunk(g[r0 : r0 + n, 2:], g.shape, (r0, 2)),
        ]
    out["step"] = ckptstore.Chunk(np.array(42.0, np.float32), (), ())
    out["bias"] = ckptstore.Chunk(np.array([1.5], np.float32), (1,), (0,))
    if rank == 0:
        out["meta.table"] = np.arange(5, dtype=np.uint8)
    return out


def _write(args) -> bytes:
    path, cid, rank, world = args
    return ckptstore.write_part(path, cid, rank, rank_tensors(rank, world), max_shard_size=512)


def write_parts(path, cid, world) -> list[bytes]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(world) as pool:
        return pool.map(_write, [(str(path), cid, r, world) for r in range(world)])


def check_all_regions(path, world_read: int):
    ck = ckptstore.open(path)
    assert ck.verify()["checksummed"]
    for name in DTYPES:
        g = global_array(name)
        assert np.array_equal(ck.read_region(name, (0, 0), g.shape).view(np.uint8), g.view(np.uint8))
        for r0, n in splits(ROWS, world_read):
            got = ck.read_region(name, (r0, 0), (n, COLS))
            assert got.dtype == g.dtype and got.flags.writeable
            assert np.array_equal(got.view(np.uint8), g[r0 : r0 + n].view(np.uint8)), name
        for c0, m in splits(COLS, world_read):
            got = ck.read_region(name, (0, c0), (ROWS, m))
            assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(g[:, c0 : c0 + m]).view(np.uint8))
    assert ck.read_region("step", (), ()) == np.float32(42.0)
    assert ck.read_region("bias", (0,), (1,)).tolist() == [1.5]
    assert ck["meta.table"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_n_writer_processes_commit_once_and_m_readers_reshard(tmp_path, world):
    cid = ckptstore.new_checkpoint_id()
    parts = write_parts(tmp_path, cid, world)
    # Nothing is committed before the commit.
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.open(tmp_path)
    if world % 2:
        info = ckptstore.commit(tmp_path, cid, parts=parts, metadata={"step": 7})
    else:
        info = ckptstore.commit(tmp_path, cid, world_size=world, timeout=30, metadata={"step": 7})
    assert info["checkpoint_id"] == cid
    assert not [f for f in os.listdir(tmp_path) if f.startswith("part-")]
    ck = ckptstore.open(tmp_path)
    assert ck.metadata == {"step": 7}
    g = ck.globals()
    assert g["f32"] == ("F32", [ROWS, COLS]) and g["step"] == ("F32", [])
    assert len(ck.chunks("f32")) == world
    # The replicated step: one chunk, the other ranks' copies as replicas.
    assert ck.chunks("step") == [([], [])]
    for m in (1, 2, 3, 4):
        check_all_regions(tmp_path, m)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_writer_processes_commit_a_two_level_root_read_by_any_split(tmp_path, world):
    """The same job committed as a two-level manifest (format-spec/global.md §The two-level
    manifest): the part descriptors stay, named by the root; regions of every split read
    back bit for bit, and one rank's own rows load its own part only."""
    cid = ckptstore.new_checkpoint_id()
    parts = write_parts(tmp_path, cid, world)
    if world % 2:
        ckptstore.commit(tmp_path, cid, parts=parts, layout="two_level")
    else:
        ckptstore.commit(tmp_path, cid, world_size=world, timeout=30, layout="two_level")
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("part-")) == [
        f"part-{cid}-r{r}.json" for r in range(world)
    ]
    for m in (1, 2, 3, 4):
        check_all_regions(tmp_path, m)
    ck = ckptstore.open(tmp_path)
    r0, n = splits(ROWS, world)[world - 1]
    g = global_array("f32")
    got = ck.read_region("f32", (r0, 0), (n, COLS))
    assert np.array_equal(got.view(np.uint8), g[r0 : r0 + n].view(np.uint8))
    assert ck["meta.table"].tolist() == [0, 1, 2, 3, 4]


def test_the_reader_presents_global_tensors_by_name(tmp_path):
    """keys / in / len / info / ck[name] speak of the logical checkpoint: each global
    tensor once by its name (read whole into a fresh, CRC-checked array), never the
    stored chunks (issue 23, finding 3); the chunk layout is behind chunks()."""
    world = 2
    cid = ckptstore.new_checkpoint_id()
    ckptstore.commit(tmp_path, cid, parts=write_parts(tmp_path, cid, world))
    ck = ckptstore.open(tmp_path)
    want = sorted([*DTYPES, "step", "bias", "meta.table"])
    assert sorted(ck.keys()) == want
    assert sorted(ck) == want and len(ck) == len(want)
    assert not [k for k in ck.keys() if "@" in k], ck.keys()
    for name in DTYPES:
        g = global_array(name)
        assert name in ck
        info = ck.info(name)
        assert info["global"] and info["chunks"] == len(ck.chunks(name)) > 1
        assert tuple(info["shape"]) == g.shape and info["nbytes"] == g.nbytes
        assert info["shard"] is None and info["file"] is None
        got = ck[name]
        assert got.dtype == g.dtype and got.shape == g.shape and got.flags.writeable
        assert np.array_equal(got.view(np.uint8), g.view(np.uint8)), name
        assert np.array_equal(ck.get(name, raw=True), g.reshape(-1).view(np.uint8))
    assert ck["step"] == np.float32(42.0) and ck["step"].shape == ()
    table = ck.info("meta.table")
    assert not table["global"] and table["chunks"] == 1 and table["file"].endswith(".safetensors")
    # A stored chunk's name is not a name of the checkpoint.
    assert "f32@0,0~r0" not in ck
    with pytest.raises(ckptstore.TensorNotFoundError):
        ck["f32@0,0~r0"]
    # read() of everything: globals assembled, whole tensors viewed, all checked first.
    every = ck.read()
    assert sorted(every) == want
    assert np.array_equal(every["f64"].view(np.uint8), global_array("f64").view(np.uint8))
    # A damaged chunk: reading its global raises naming the stored chunk, and nothing else.
    import ckpt_helpers as h

    shard, n, header, victim = next(
        (p, n, hd, k)
        for p in sorted(tmp_path.glob("*.safetensors"))
        for n, hd, _ in [h.shard_header(p)]
        for k in hd
        if k.startswith("f32@")
    )
    h.flip_byte(shard, 8 + n + header[victim]["data_offsets"][0])
    ck = ckptstore.open(tmp_path)
    with pytest.raises(ckptstore.ChecksumError, match=victim):
        ck["f32"]
    with pytest.raises(ckptstore.ChecksumError):
        ck.read()


def test_conflicts_and_missing_ranks_commit_nothing(tmp_path):
    cid = ckptstore.new_checkpoint_id()
    parts = write_parts(tmp_path, cid, 2)
    # Rank 2 of 3 never wrote: the rendezvous names it, nothing is committed.
    with pytest.raises(ckptstore.MissingPartsError, match=r"\[2\]"):
        ckptstore.commit(tmp_path, cid, world_size=3, timeout=0.2)
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.open(tmp_path)
    # A part of another save is refused.
    other = ckptstore.new_checkpoint_id()
    with pytest.raises(ckptstore.PartError):
        ckptstore.commit(tmp_path, other, parts=parts)
    # A damaged descriptor is refused.
    bad = bytearray(parts[1])
    bad[10] ^= 1
    with pytest.raises(ckptstore.CheckpointError):
        ckptstore.commit(tmp_path, cid, parts=[parts[0], bytes(bad)])
    ckptstore.commit(tmp_path, cid, parts=parts)
    check_all_regions(tmp_path, 3)


def test_replicas_with_different_bytes_are_refused(tmp_path):
    cid = ckptstore.new_checkpoint_id()
    p0 = ckptstore.write_part(tmp_path, cid, 0, {"s": ckptstore.Chunk(np.float32(1.0), (), ())})
    p1 = ckptstore.write_part(tmp_path, cid, 1, {"s": ckptstore.Chunk(np.float32(2.0), (), ())})
    with pytest.raises(ckptstore.PartError, match="ranks 0 and 1"):
        ckptstore.commit(tmp_path, cid, parts=[p0, p1])
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        ckptstore.open(tmp_path)


def test_bad_chunks_are_refused_before_writing(tmp_path):
    cid = ckptstore.new_checkpoint_id()
    with pytest.raises(ckptstore.InvalidTensorError):
        ckptstore.write_part(tmp_path, cid, 0, {"w": ckptstore.Chunk(np.zeros((3, 2), np.float32), (4, 2), (2, 0))})
    with pytest.raises(ckptstore.InvalidArgumentError):
        ckptstore.write_part(tmp_path, cid, 0, {"w": [np.zeros(3)]})
    assert not os.listdir(tmp_path) or all(f == ".ckpt-lock" for f in os.listdir(tmp_path))


def test_sharded_optimizer_state_commits_with_its_section(tmp_path):
    """Two ranks save their rows of Adam state; the coordinator commits the optimizer
    section naming the global tensors; the state loads whole and validates."""
    m = np.linspace(-1, 1, ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    cid = ckptstore.new_checkpoint_id()
    parts = []
    for rank, (r0, n) in enumerate(splits(ROWS, 2)):
        parts.append(
            ckptstore.write_part(
                tmp_path,
                cid,
                rank,
                {
                    "optim/w/exp_avg": ckptstore.Chunk(m[r0 : r0 + n], m.shape, (r0, 0)),
                    "optim/w/step": ckptstore.Chunk(np.float32(3), (), ()),
                },
            )
        )
    section = {
        "groups": [{"params": ["w"], "hyper": {"lr": 0.01}}],
        "params": [
            {
                "name": "w",
                "shape": [ROWS, COLS],
                "state": [
                    {"name": "exp_avg", "tensor": "optim/w/exp_avg", "encoding": "plain"},
                    {"name": "step", "tensor": "optim/w/step", "encoding": "plain"},
                ],
            }
        ],
    }
    bad = {**section, "params": [{**section["params"][0], "shape": [ROWS + 1, COLS]}]}
    with pytest.raises(ckptstore.OptimizerStateError, match="fits neither"):
        ckptstore.commit(tmp_path, cid, parts=parts, optimizer=bad)
    ckptstore.commit(tmp_path, cid, parts=parts, optimizer=section)
    ck = ckptstore.open(tmp_path)
    st = ck.load_optimizer()
    assert np.array_equal(st["state"]["w"]["exp_avg"], m)
    assert st["state"]["w"]["step"] == np.float32(3)
    assert st["param_groups"][0]["lr"] == 0.01
