"""The tiered manager's wire (ckptstore.torch._tier_wire.transfer) between real gloo ranks
on loopback: every item moves in chunks, all ranks of a ring sending and receiving at once,
with the chunk size made small so that items of 0, 1, exactly one, one-plus-one and many
chunks and byte ranges that start mid-file all occur in a few KiB. Checked bit for bit,
whether an item is received into one buffer or written chunk by chunk at its offset; a
writer that fails keeps nothing more of its item, every other item still arrives and the
error is raised once the peer is done (the ranks stay in step: a barrier follows).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import dist_helpers as dh  # noqa: E402

CHUNK = 1000
SIZES = [0, 1, CHUNK, CHUNK + 1, 4 * CHUNK + 321]


def _bytes(rank: int, size: int) -> bytes:
    return bytes((rank * 131 + i * 7 + size) % 251 for i in range(size))


def _ring(rank, world, root, fail_key):
    import torch.distributed as dist

    from ckptstore.torch import _tier_wire as w

    w.CHUNK = CHUNK
    mine = os.path.join(root, f"r{rank}")
    os.makedirs(mine)
    items = []
    for z in SIZES:
        p = os.path.join(mine, f"f{z}")
        with open(p, "wb") as f:
            f.write(_bytes(rank, z))
        items.append((f"f{z}", p))
    big = os.path.join(mine, f"f{SIZES[-1]}")
    items += [("w:mid", big, 7, 2 * CHUNK + 500), ("w:one", big, 3 * CHUNK, CHUNK), ("mid", big, 999, 2)]
    sink = os.path.join(mine, "sink")
    with open(sink, "wb") as f:
        f.truncate(8 * CHUNK)
    got, header, chunks = {}, [], []

    def receive(inc, key, data):
        if key is None:
            header.append([list(x) for x in inc.files])
        else:
            got[key] = None if data is None else bytes(data.numpy())

    def dest(key, size):
        if not key.startswith("w:"):
            return None
        at = {"w:mid": 0, "w:one": 4 * CHUNK}[key]

        def write(offset, chunk):
            chunks.append((key, offset, chunk.numel()))
            if key == fail_key:
                raise OSError(28, "No space left on device")
            with open(sink, "r+b") as f:
                f.seek(at + offset)
                f.write(chunk.numpy().tobytes())
        return write

    err = None
    try:
        w.transfer(items, None, (rank + 1) % world, (rank - 1) % world, 4096, None, receive, dest)
    except OSError as e:
        err = str(e)
    dist.barrier()
    with open(sink, "rb") as f:
        sunk = f.read()
    return {"got": got, "header": header, "chunks": chunks, "sunk": sunk, "err": err}


def _expected(src: int) -> dict:
    big = _bytes(src, SIZES[-1])
    want = {f"f{z}": _bytes(src, z) for z in SIZES}
    want["mid"] = big[999:1001]
    return want, big


def test_transfer_moves_every_item_in_chunks_bit_for_bit(tmp_path):
    world = 3
    res = dh.results(world, _ring, str(tmp_path), None)
    for r, out in enumerate(res):
        src = (r - 1) % world
        want, big = _expected(src)
        assert out["err"] is None
        assert out["header"] == [[[f"f{z}", z] for z in SIZES] + [["w:mid", 2500], ["w:one", CHUNK], ["mid", 2]]]
        assert {k: v for k, v in out["got"].items() if not k.startswith("w:")} == want
        assert out["got"]["w:mid"] is None and out["got"]["w:one"] is None  # written, not handed over
        assert out["sunk"][:2500] == big[7:2507] and out["sunk"][4 * CHUNK:5 * CHUNK] == big[3 * CHUNK:4 * CHUNK]
        # a range of 2.5 chunks is written as 3, in order, at their offsets
        assert [c for c in out["chunks"] if c[0] == "w:mid"] == [("w:mid", 0, 1000), ("w:mid", 1000, 1000),
                                                                 ("w:mid", 2000, 500)]


def test_a_failing_writer_keeps_nothing_more_and_the_rest_still_arrives(tmp_path):
    world = 2
    res = dh.results(world, _ring, str(tmp_path), "w:mid")
    for r, out in enumerate(res):
        want, big = _expected((r - 1) % world)
        assert "No space left on device" in out["err"]
        assert [c for c in out["chunks"] if c[0] == "w:mid"] == [("w:mid", 0, 1000)]  # then discarded
        assert {k: v for k, v in out["got"].items() if not k.startswith("w:")} == want
        assert out["sunk"][4 * CHUNK:5 * CHUNK] == big[3 * CHUNK:4 * CHUNK]  # the next range written
        assert out["sunk"][:2500] == bytes(2500)


def test_an_arrival_is_written_at_its_offsets_with_its_crc_taken_on_the_way(tmp_path):
    import zlib

    from ckptstore.errors import CheckpointError
    from ckptstore.torch._tier_local import check_arrival
    from ckptstore.torch._tier_wire import Arrival

    data = bytes(range(256)) * 40
    a = Arrival(str(tmp_path / "f"))
    for b in range(0, len(data), 3000):
        a.write(b, torch.frombuffer(bytearray(data[b:b + 3000]), dtype=torch.uint8))
    got = a.finish()
    assert got == (len(data), zlib.crc32(data))
    assert (tmp_path / "f").read_bytes() == data
    check_arrival("f", got, {"f": [len(data), zlib.crc32(data)]}, 1)
    with pytest.raises(CheckpointError, match="f from host 1: size or CRC32 differs from the record"):
        check_arrival("f", got, {"f": [len(data), zlib.crc32(data) ^ 1]}, 1)
    # a file that exists is never overwritten; the error comes out of finish, once
    b = Arrival(str(tmp_path / "f"))
    b.write(0, torch.zeros(4, dtype=torch.uint8))
    b.write(4, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(FileExistsError):
        b.finish()
    assert (tmp_path / "f").read_bytes() == data


def test_small_items_share_messages_and_large_ones_move_alone_in_chunks():
    from ckptstore.torch import _tier_wire as w

    old = w.CHUNK
    w.CHUNK = 1000  # small: under 62 bytes
    try:
        got = w._messages([0, 61, 62, 5, 0, 2500, 40] + [30] * 40 + [1])
    finally:
        w.CHUNK = old
    assert got[:4] == [[(0, 0, 0), (1, 0, 61)], [(2, 0, 62)], [(3, 0, 5), (4, 0, 0)],
                       [(5, 0, 1000)]]
    assert got[4:6] == [[(5, 1000, 1000)], [(5, 2000, 500)]]
    # 40 + 30 * 40 + 1 bytes of small items: packs of at most 1000 bytes, each item whole
    packs = got[6:]
    assert [i for m in packs for i, _, _ in m] == list(range(6, 48))
    assert all(sum(z for _, _, z in m) <= 1000 for m in packs) and len(packs) == 2
    assert all(b == 0 for m in packs for _, b, _ in m)


def _packed(rank, world, root, fail_key):
    """Rank 0 sends rank 1 many small byte ranges (some into a writer, one failing, one past
    the end of its file) around one large item."""
    import torch.distributed as dist

    from ckptstore.torch import _tier_wire as w

    w.CHUNK = CHUNK
    src = os.path.join(root, "src")
    items = []
    if rank == 0:
        with open(src, "wb") as f:
            f.write(_bytes(0, 5000))
        items = [(f"s{k}", src, 97 * k, k % 50) for k in range(45)]
        items.insert(20, ("big", src, 10, 3000))
        items += [("w:a", src, 11, 33), ("w:fail", src, 1, 20), ("w:b", src, 4990, 10), ("short", src, 4995, 9)]
    got, written = {}, {}

    def receive(inc, key, data):
        if key is not None:
            got[key] = None if data is None else bytes(data.numpy())

    def dest(key, size):
        if not key.startswith("w:"):
            return None

        def write(offset, chunk):
            if key == fail_key:
                raise OSError(28, "No space left on device")
            written[key] = written.get(key, b"") + chunk.numpy().tobytes()
        return write

    err = None
    try:
        w.transfer(items, None, 1 if rank == 0 else None, 0 if rank == 1 else None, 4096, None, receive, dest)
    except OSError as e:
        err = str(e)
    dist.barrier()
    return {"got": got, "written": written, "err": err}


def test_packed_small_items_arrive_bit_for_bit_into_buffers_and_writers(tmp_path):
    sender, receiver = dh.results(2, _packed, str(tmp_path), "w:fail")
    data = _bytes(0, 5000)
    assert "shorter" in sender["err"]  # "short" asks for 9 bytes of the last 5: sent as zeros
    assert "No space left on device" in receiver["err"]
    want = {f"s{k}": data[97 * k:97 * k + k % 50] for k in range(45)}
    want.update({"big": data[10:3010], "short": bytes(9), "w:a": None, "w:fail": None, "w:b": None})
    assert receiver["got"] == want
    assert receiver["written"] == {"w:a": data[11:44], "w:b": data[4990:5000]}
