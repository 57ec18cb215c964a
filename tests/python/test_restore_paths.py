"""Issue 16: the single-pass restore paths (Checkpoint.verify_tensors, copy_into,
load_optimizer(release=True)) and ckptstore.torch.load's direct copy into model memory,
next to its fallback (non-contiguous tensors, other dtypes). Behaviour only, no timing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.torch as ct


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
    ck.copy_into([(n, d) for n, d in dst.items()], release=True)
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
