"""ckptstore.open / ckptstore.save / ckptstore.torch.save / load on s3:// URLs, against a real
S3 server (s3s-fs on a free loopback port, started here and killed at the end). The tests
fail (never skip) when s3s-fs is not installed, saying how to install it."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

import ckptstore
import ckpt_helpers as h

KEY, SECRET = "ckpttestkey", "ckpttestsecret0123456789"


@pytest.fixture(scope="module")
def s3():
    data = tempfile.mkdtemp()
    os.mkdir(os.path.join(data, "bkt"))
    try:
        proc, port = h.start_s3s_fs(data, KEY, SECRET)
    except h.S3sFsError as e:
        pytest.fail(str(e), pytrace=False)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "CKPT_S3_MAX_RETRIES": "2",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield data
    finally:
        h.restore_env(old)
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def test_numpy_round_trip_on_s3(s3):
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((64, 32), dtype=np.float32),
        "ids": np.arange(10, dtype=np.int64),
        "t": rng.standard_normal((8, 8)).astype(np.float16).T,  # strided
    }
    info = ckptstore.save("s3://bkt/np/one", tensors, metadata={"k": 1})
    assert info["tensors"] == 3
    ck = ckptstore.open("s3://bkt/np/one")
    assert sorted(ck.keys()) == ["ids", "t", "w"]
    for k, v in tensors.items():
        assert ck[k].tobytes() == np.ascontiguousarray(v).tobytes()
    assert ck.metadata["k"] == 1
    ck.verify()
    # The objects are on the server (a bucket is a directory of s3s-fs), not in the cwd.
    assert not os.path.exists("s3:")
    assert any(n.startswith("shard-") for n in os.listdir(os.path.join(s3, "bkt", "np", "one")))


def test_one_reader_class_lazy_or_downloaded(s3):
    """`ckptstore.open(url, lazy=True)` is the same `Checkpoint` class as the downloading
    open, over shards fetched on read: the same catalog, the same bytes (fresh writable
    arrays, CRC-checked as they land), regions and `read_into`; damage is caught by the
    read that touches it; the zero-copy primitives say they need resident bytes."""
    rng = np.random.default_rng(1)
    tensors = {
        "w": rng.standard_normal((300, 70), dtype=np.float32),
        "b": rng.standard_normal(70).astype(np.float16),
        "step": np.array(7, dtype=np.int64),
    }
    url = "s3://bkt/lazy/one"
    ckptstore.save(url, tensors, metadata={"run": "lazy"})
    full = ckptstore.open(url)
    lazy = ckptstore.open(url, lazy=True)
    assert type(lazy) is type(full) is ckptstore.Checkpoint
    assert full.resident and not lazy.resident
    assert lazy.keys() == full.keys() and len(lazy) == len(full) and "w" in lazy
    assert lazy.metadata == full.metadata and lazy.checkpoint_id == full.checkpoint_id
    assert lazy.info("w")["crc32"] == full.info("w")["crc32"]
    assert lazy.info("w")["file"].startswith("s3://bkt/lazy/one/shard-")
    for k, v in tensors.items():
        a = lazy[k]
        assert a.flags.writeable and a.tobytes() == v.tobytes() == full[k].tobytes()
        assert a.shape == v.shape and a.dtype == v.dtype
    got = lazy.read(["w", "step"])
    assert got["w"].tobytes() == tensors["w"].tobytes()
    r = lazy.read_region("w", [10, 5], [3, 4])
    assert r.tobytes() == np.ascontiguousarray(tensors["w"][10:13, 5:9]).tobytes()
    out = np.zeros(3 * 4 * 4, np.uint8)
    lazy.verify_regions([("w", [10, 5], [3, 4])])
    lazy.read_into([("w", [10, 5], [3, 4], out)])
    assert out.tobytes() == r.tobytes()
    assert lazy.byte_ranges([("w", [0, 0], [1, 1])]) == []
    assert lazy.verify() == full.verify()
    with pytest.raises(ckptstore.InvalidArgumentError, match="lazy=True"):
        lazy.load_optimizer()
    with pytest.raises(ckptstore.InvalidArgumentError, match="lazy=True"):
        lazy.copy_into_unchecked([("b", np.zeros(140, np.uint8))])
    # The old private name is the same class, opened lazily.
    rr = ckptstore._ckptstore.RegionReader(url)
    assert isinstance(rr, ckptstore.Checkpoint) and not rr.resident

    # Damage one byte of w's data on the server: the open still succeeds (headers are
    # intact), every read that touches w fails naming it, b still reads.
    shard = next(n for n in os.listdir(os.path.join(s3, "bkt", "lazy", "one")) if n.startswith("shard-"))
    path = os.path.join(s3, "bkt", "lazy", "one", shard)
    off = lazy.info("w")
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        # The last byte of the file lies in the last tensor in file order; find w's bytes
        # from the stored offsets through the plain safetensors header.
        import json as _json
        n = int.from_bytes(data[:8], "little")
        hdr = _json.loads(data[8:8 + n])
        b0 = 8 + n + hdr["w"]["data_offsets"][0]
        data[b0 + 1234] ^= 0x40
        f.seek(0)
        f.write(data)
    damaged = ckptstore.open(url, lazy=True)
    with pytest.raises(ckptstore.ChecksumError, match='"w"'):
        damaged["w"]
    with pytest.raises(ckptstore.ChecksumError):
        damaged.verify()
    assert damaged["b"].tobytes() == tensors["b"].tobytes()
    assert off["nbytes"] == tensors["w"].nbytes


def test_unsupported_scheme_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        ckptstore.save("gs://b/p", {"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="not supported"):
        ckptstore.open("gs://b/p")


def test_torch_save_load_on_s3(s3):
    torch = pytest.importorskip("torch")
    import ckptstore.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    ct.save("s3://bkt/torch/step1", model, opt, extra={"epoch": 3})

    model2 = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    extra = ct.load("s3://bkt/torch/step1", model2, opt2)
    assert extra["epoch"] == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for n in s1[k]:
            assert torch.equal(torch.as_tensor(s1[k][n]), torch.as_tensor(s2[k][n]))


# ---- torch.distributed.checkpoint and FSDP2 on s3:// (spawned gloo ranks) ------------------

_AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
        "AWS_ALLOW_HTTP", "CKPT_S3_MAX_RETRIES")


def _aws_env() -> dict:
    """The server's settings, handed to spawned ranks explicitly (a forkserver started
    before the fixture would not have them in its environment)."""
    return {k: os.environ[k] for k in _AWS if k in os.environ}


def job_dcp_save_s3(rank, world, url, env):
    os.environ.update(env)
    import torch.distributed.checkpoint as dcp

    import test_dcp as td
    from ckptstore.torch.dcp import Writer

    dcp.save(td.state_dict(world), storage_writer=Writer(url))
    return True


def job_dcp_load_s3(rank, world, url, env):
    os.environ.update(env)
    import torch.distributed.checkpoint as dcp

    import test_dcp as td
    from ckptstore.torch.dcp import Reader

    sd = td.empty_state_dict(world)
    dcp.load(sd, storage_reader=Reader(url))
    return td.check_state(sd)


def job_fsdp2_s3(rank, world, url, env):
    os.environ.update(env)
    import ckptstore.torch.distributed as ctd
    import test_torch_distributed as tt

    m, o = tt.build(world, 0, "Adam")
    tt.train(m, o, 0, 2, rank)
    ctd.save(url, m, o, extra={"epoch": 2})
    saved = tt.snapshot(m, o)
    m2, o2 = tt.build(world, 1, "Adam")
    tt.train(m2, o2, 7, 2, rank)  # its own state, to be replaced
    extra = ctd.load(url, m2, o2)
    return tt.same(saved, tt.snapshot(m2, o2)), extra["epoch"]


def test_dcp_save_world_2_load_worlds_1_and_3_on_s3(s3):
    """dcp.save with ckptstore's Writer on 2 ranks to an s3:// URL (each rank uploads its
    shards and part, the coordinator PUTs the manifest last), dcp.load with the Reader
    (ranged GETs of the blocks each rank's boxes touch) on 1 and on 3 ranks: every
    full_tensor() bit-identical. It is an ordinary ckptstore checkpoint on the server."""
    pytest.importorskip("torch")
    import dist_helpers as dh

    url = "s3://bkt/dcp/world2"
    assert dh.results(2, job_dcp_save_s3, url, _aws_env()) == [True, True]
    assert not os.path.exists("s3:")
    names = sorted(os.listdir(os.path.join(s3, "bkt", "dcp", "world2")))
    # The manifest and both ranks' shards; the part objects were removed by the commit.
    assert "ckpt-manifest.json" in names, names
    assert {n.split("-r")[-1].split("-")[0] for n in names if n.startswith("shard-")} == {"0", "1"}, names
    assert not any(n.startswith("part-") for n in names), names
    ck = ckptstore.open(url)
    ck.verify()
    for world in (1, 3):
        assert dh.results(world, job_dcp_load_s3, url, _aws_env()) == [[]] * world


def test_fsdp2_save_load_on_s3(s3):
    """ckptstore.torch.distributed.save / load of an FSDP2 model with Adam on 2 ranks through
    an s3:// URL: parameters and optimizer state gathered bit-identical, extra returned."""
    pytest.importorskip("torch")
    import dist_helpers as dh

    for bad, epoch in dh.results(2, job_fsdp2_s3, "s3://bkt/fsdp/adam", _aws_env()):
        assert bad == [] and epoch == 2


def test_copy_files_into_an_s3_prefix(s3, tmp_path):
    """ckptstore.atomic.copy_files (the tiered manager's persist upload) onto s3://: each
    object whole and checked; a file that changed since its record is refused."""
    import zlib

    from ckptstore import atomic

    (tmp_path / "a.bin").write_bytes(os.urandom(9 << 20))  # more than one 8 MiB chunk
    (tmp_path / "b.json").write_bytes(b"{}")
    files = [(n, (tmp_path / n).stat().st_size, zlib.crc32((tmp_path / n).read_bytes())) for n in ("a.bin", "b.json")]
    atomic.copy_files(tmp_path, "s3://bkt/copied", files)
    for n, _, _ in files:
        with open(os.path.join(s3, "bkt", "copied", n), "rb") as f:
            assert f.read() == (tmp_path / n).read_bytes()
    name, size, crc = files[1]
    with pytest.raises(ckptstore.ChecksumError):
        atomic.copy_files(tmp_path, "s3://bkt/copied2", [(name, size, crc ^ 1)])
    assert not os.path.exists(os.path.join(s3, "bkt", "copied2", name))
