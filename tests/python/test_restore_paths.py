"""Issue 16: the single-pass restore paths (Checkpoint.verify_tensors, copy_into,
load_optimizer(release=True)) and ckptstore.torch.load's direct copy into model memory,
next to its fallback (non-contiguous tensors, other dtypes). Behaviour only, no timing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.torch as ct
import ckpt_helpers as h


def _saved(tmp_path):
    rng = np.random.default_rng(7)
    arrays = {
        "a": rng.standard_normal((64, 33)).astype(np.float32),
        "b": rng.integers(-5, 5, size=(17,)).astype(np.int64),
        "c": rng.standard_normal((3, 4, 5)).astype(np.float64),
    }
    p = tmp_path / "ck"
    ckptstore.save(p, arrays)
    return p, arrays


def test_copy_into_is_exact_and_checks_lengths_first(tmp_path):
    p, arrays = _saved(tmp_path)
    ck = ckptstore.open(p)
    ck.verify_tensors(list(arrays), release=True)
    dst = {n: np.full(a.nbytes, 0xAB, dtype=np.uint8) for n, a in arrays.items()}
    ck.copy_into_unchecked([(n, d) for n, d in dst.items()], release=True)
    for n, a in arrays.items():
        assert dst[n].tobytes() == a.tobytes()
    # A wrong length anywhere in the list: nothing is written, the error names the tensor.
    fresh = {n: np.zeros(a.nbytes, dtype=np.uint8) for n, a in arrays.items()}
    short = np.zeros(arrays["c"].nbytes - 1, dtype=np.uint8)
    with pytest.raises(ckptstore.InvalidArgumentError, match='tensor "c"'):
        ck.copy_into([("a", fresh["a"]), ("b", fresh["b"]), ("c", short)])
    assert not fresh["a"].any() and not fresh["b"].any()
    with pytest.raises(KeyError):
        ck.verify_tensors(["a", "nope"])


def test_copy_ranges_into_copies_pieces_and_checks_ranges_first(tmp_path):
    # The way CUDA staging cuts a tensor larger than a pinned buffer.
    p, arrays = _saved(tmp_path)
    ck = ckptstore.open(p)
    want = arrays["a"].tobytes()
    got = np.zeros(len(want), dtype=np.uint8)
    step = 1000
    ck.copy_ranges_into_unchecked([("a", o, got[o : o + step]) for o in range(0, len(want), step)])
    assert got.tobytes() == want
    # A range past the end anywhere in the list: nothing is written.
    a = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ckptstore.InvalidArgumentError, match='tensor "a"'):
        ck.copy_ranges_into([("b", 0, a), ("a", len(want) - 4, np.zeros(8, dtype=np.uint8))])
    assert not a.any()
    with pytest.raises(KeyError):
        ck.copy_ranges_into([("nope", 0, a)])


def test_verify_tensors_names_the_damaged_tensor(tmp_path):
    p, arrays = _saved(tmp_path)
    ck = ckptstore.open(p)
    info = ck.info("b")
    shard = ck.shard_files[info["shard"]]
    ck.close()
    raw = bytearray(open(shard, "rb").read())
    needle = arrays["b"].tobytes()
    at = bytes(raw).find(needle)
    assert at >= 0
    raw[at + 3] ^= 0x40
    open(shard, "wb").write(bytes(raw))
    ck = ckptstore.open(p)
    ck.verify_tensors(["a", "c"])
    with pytest.raises(ckptstore.ChecksumError, match="b"):
        ck.verify_tensors(["a", "b", "c"], release=True)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)
        self.tr = torch.nn.Parameter(torch.randn(5, 7))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_torch_load_direct_and_fallback_copies_agree(tmp_path):
    torch.manual_seed(0)
    src = Mixed()
    src.steps += 9
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    for p in src.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ct.save(tmp_path / "ck", src, opt)

    dst = Mixed()
    # A non-contiguous parameter (a transposed view's storage) takes the fallback path.
    dst.tr = torch.nn.Parameter(torch.randn(7, 5).t())
    assert not dst.tr.is_contiguous()
    before_ptr = dst.lin.weight.data_ptr()
    dopt = torch.optim.Adam(dst.parameters(), lr=0.1)
    ct.load(tmp_path / "ck", dst, dopt)
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    # In place: the model keeps its memory.
    assert dst.lin.weight.data_ptr() == before_ptr
    for p, q in zip(src.parameters(), dst.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, dopt.state[q][k]), k
    # The restored optimizer state is writable memory of its own (the step writes it).
    for p in dst.parameters():
        p.grad = torch.ones_like(p)
    dopt.step()


# ---- the single pass: fresh tensors filled with their CRC checked on the way ----------------


def test_fill_and_verify_is_exact_and_checks_names_and_lengths_first(tmp_path):
    p, arrays = _saved(tmp_path)
    ck = ckptstore.open(p)
    dst = {n: np.full(a.nbytes, 0xAB, dtype=np.uint8) for n, a in arrays.items()}
    ck.fill_and_verify([("a", dst["a"]), ("c", dst["c"])], ["b"], release=True)
    assert dst["a"].tobytes() == arrays["a"].tobytes()
    assert dst["c"].tobytes() == arrays["c"].tobytes()
    assert not (dst["b"] != 0xAB).any()  # verified only, never written
    fresh = np.zeros(arrays["a"].nbytes, dtype=np.uint8)
    short = np.zeros(arrays["c"].nbytes - 1, dtype=np.uint8)
    with pytest.raises(ckptstore.InvalidArgumentError, match='tensor "c"'):
        ck.fill_and_verify([("a", fresh), ("c", short)])
    with pytest.raises(KeyError):
        ck.fill_and_verify([("a", fresh)], ["nope"])
    assert not fresh.any()  # nothing read or written before the names and lengths passed


def test_fill_and_verify_names_the_damaged_tensor_in_either_list(tmp_path):
    p, arrays = _saved(tmp_path)
    m = h.read_manifest(p)
    t = next(t for t in m["tensors"] if t["name"] == "b")
    h.flip_byte(p / m["shards"][t["shard"]]["file"], t["offsets"][0] + 3, 0x40)
    ck = ckptstore.open(p)
    a = np.zeros(arrays["a"].nbytes, dtype=np.uint8)
    ck.fill_and_verify([("a", a)], ["c"])
    with pytest.raises(ckptstore.ChecksumError, match='"b"'):
        ck.fill_and_verify([("a", a), ("b", np.zeros(arrays["b"].nbytes, dtype=np.uint8))])
    with pytest.raises(ckptstore.ChecksumError, match='"b"'):
        ck.fill_and_verify([("a", a)], ["c", "b"], release=True)


def _trained_mixed(tmp_path, **opt_kw):
    torch.manual_seed(1)
    src = Mixed()
    opt = torch.optim.Adam(src.parameters(), lr=0.1, **opt_kw)
    for p in src.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ct.save(tmp_path / "ck", src, opt, extra={"noise": torch.arange(5, dtype=torch.int16)})
    return src, opt


def test_optimizer_plan_describes_without_reading(tmp_path):
    src, opt = _trained_mixed(tmp_path)
    plan = ckptstore.open(tmp_path / "ck").optimizer_plan()
    assert [g["params"] for g in plan["param_groups"]] == [["tr", "lin.weight", "lin.bias"]]
    assert plan["param_groups"][0]["lr"] == 0.1
    assert plan["param_shapes"]["tr"] == (5, 7)
    e = plan["state"]["tr"]["exp_avg"]
    assert e["encoding"] == "plain" and e["dtype"] == "F32" and e["shape"] == (5, 7)
    assert e["tensor"] == "optim/tr/exp_avg" and e["scale"] is None
    assert plan["state"]["tr"]["step"]["shape"] == ()
    ckptstore.save(tmp_path / "plain", {"x": np.zeros(3, np.float32)})
    assert ckptstore.open(tmp_path / "plain").optimizer_plan() is None


def test_direct_restore_installs_the_filled_tensors_without_a_copy(tmp_path, monkeypatch):
    src, opt = _trained_mixed(tmp_path)
    dst = Mixed()
    dopt = torch.optim.Adam(dst.parameters(), lr=0.5)
    handed = {}
    real = dopt.load_state_dict

    def spy(sd):
        handed.update(sd)
        real(sd)

    monkeypatch.setattr(dopt, "load_state_dict", spy)
    extra = ct.load(tmp_path / "ck", dst, dopt)
    assert torch.equal(extra["noise"], torch.arange(5, dtype=torch.int16))
    params = list(dst.parameters())
    for i, p in enumerate(params):
        for k, v in dopt.state[p].items():
            # The very tensor the engine filled: load_state_dict copied nothing.
            assert v.data_ptr() == handed["state"][i][k].data_ptr(), k
            assert torch.equal(v, opt.state[list(src.parameters())[i]][k]), k
    assert dopt.param_groups[0]["lr"] == 0.1


def test_other_dtypes_take_the_general_path(tmp_path):
    """A float64 model restored from float32 state: load_state_dict casts the state (the
    direct path would hand it float32), the model is cast by copy_."""
    src, opt = _trained_mixed(tmp_path)
    dst = Mixed().double()
    dopt = torch.optim.Adam(dst.parameters(), lr=0.5)
    ct.load(tmp_path / "ck", dst, dopt)
    for p, q in zip(src.parameters(), dst.parameters()):
        assert q.dtype == torch.float64 and torch.equal(p.double(), q)
        for k, v in opt.state[p].items():
            w = dopt.state[q][k]
            assert torch.equal(v.to(w.dtype), w), k
            if k != "step":
                assert w.dtype == torch.float64


def test_damaged_extra_tensor_changes_nothing(tmp_path):
    src, opt = _trained_mixed(tmp_path)
    p = tmp_path / "ck"
    m = h.read_manifest(p)
    t = next(t for t in m["tensors"] if t["name"] == "extra/noise")
    h.flip_byte(p / m["shards"][t["shard"]]["file"], t["offsets"][0], 0x01)
    torch.manual_seed(5)
    dst = Mixed()
    dopt = torch.optim.Adam(dst.parameters(), lr=0.5)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ckptstore.ChecksumError, match="extra/noise"):
        ct.load(p, dst, dopt)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert len(dopt.state) == 0 and dopt.param_groups[0]["lr"] == 0.5
