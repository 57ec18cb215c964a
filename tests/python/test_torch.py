"""ckptstore.torch against real torch optimizers: resume equivalence (SGD with momentum,
Adam, AdamW; float32 and float64; one and two parameter groups; a 0-dim parameter), the
ColossalAI scenario (restore replaces, never merges), all-or-nothing failures, parameter
order independence.

Needs torch and the bindings in the venv (scripts/test.sh installs both)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.torch as ct
from ckptstore.torch import _dtypes, _staging, _state
import ckpt_helpers as h

K_STEPS = 4  # steps before the checkpoint
MORE = 3  # steps after it


class Net(torch.nn.Module):
    """A small MLP with a buffer and a 0-dim parameter."""

    def __init__(self, dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5, dtype=dtype)
        self.fc2 = torch.nn.Linear(5, 3, dtype=dtype)
        self.temp = torch.nn.Parameter(torch.tensor(0.8, dtype=dtype))  # 0-dim
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.fc2(torch.tanh(self.fc1(x))) * self.temp


def batches(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)) for _ in range(n)]


def make_optimizer(kind, model, groups, lr_scale=1.0):
    if groups == 1:
        params = [{"params": list(model.parameters())}]
    else:
        params = [
            {"params": list(model.fc1.parameters())},
            {"params": list(model.fc2.parameters()) + [model.temp], "lr": 0.02 * lr_scale, "weight_decay": 0.01},
        ]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05 * lr_scale, momentum=0.9, nesterov=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01 * lr_scale, betas=(0.8, 0.95), amsgrad=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01 * lr_scale, weight_decay=0.1)
    raise ValueError(kind)


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def state_by_name(model, opt):
    """The optimizer state keyed by parameter name (order-free)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def assert_same(model_a, opt_a, model_b, opt_b):
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    a, b = state_by_name(model_a, opt_a), state_by_name(model_b, opt_b)
    assert a.keys() == b.keys()
    for p in a:
        assert a[p].keys() == b[p].keys(), p
        for k in a[p]:
            x, y = a[p][k], b[p][k]
            if torch.is_tensor(x):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{p}/{k}"
            else:
                assert x == y, f"{p}/{k}"
    ga = [{k: v for k, v in g.items() if k != "params"} for g in opt_a.param_groups]
    gb = [{k: v for k, v in g.items() if k != "params"} for g in opt_b.param_groups]
    assert ga == gb


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_resume_equivalence(tmp_path, kind, dtype, groups):
    torch.manual_seed(1234)
    data = batches(dtype, K_STEPS + MORE)
    ref = Net(dtype)
    ref_opt = make_optimizer(kind, ref, groups)
    train(ref, ref_opt, data[:K_STEPS])
    ct.save(tmp_path, ref, ref_opt, extra={"step": K_STEPS})

    # A fresh model (other weights) and optimizer (other learning rates) resume.
    torch.manual_seed(99)
    new = Net(dtype)
    new_opt = make_optimizer(kind, new, groups, lr_scale=3.0)
    extra = ct.load(tmp_path, new, new_opt)
    assert extra == {"step": K_STEPS}
    assert_same(ref, ref_opt, new, new_opt)
    if kind != "sgd":
        step = new_opt.state[new.temp]["step"]
        assert step.shape == () and step.dtype == torch.float32
        assert new_opt.state[new.temp]["exp_avg"].shape == ()  # 0-dim parameter's state

    train(ref, ref_opt, data[K_STEPS:])  # uninterrupted
    train(new, new_opt, data[K_STEPS:])  # resumed
    assert_same(ref, ref_opt, new, new_opt)


def test_state_is_matched_by_name_not_position(tmp_path):
    torch.manual_seed(0)
    data = batches(torch.float32, 5)
    ref = Net(torch.float32)
    ref_opt = torch.optim.Adam(list(ref.parameters()), lr=0.01)
    train(ref, ref_opt, data[:3])
    ct.save(tmp_path, ref, ref_opt)
    new = Net(torch.float32)
    new_opt = torch.optim.Adam(list(new.parameters())[::-1], lr=0.5)  # reversed order
    ct.load(tmp_path, new, new_opt)
    assert_same(ref, ref_opt, new, new_opt)
    train(ref, ref_opt, data[3:])
    train(new, new_opt, data[3:])
    assert_same(ref, ref_opt, new, new_opt)


def test_save_in_a_training_loop_cleans_up_in_the_background(tmp_path):
    """ct.save's default ``cleanup="background"``: each save returns committed, the next one
    waits for the previous cleanup, and at the end only the last checkpoint's files remain."""
    torch.manual_seed(0)
    data = batches(torch.float32, 4)
    model = Net(torch.float32)
    opt = torch.optim.Adam(list(model.parameters()), lr=0.01)
    seen = []
    for x in data:
        train(model, opt, [x])
        info = ct.save(tmp_path, model, opt)
        assert info["removed"] == 0
        seen.append({Path(p) for p in ckptstore.open(tmp_path).shard_files})
    ckptstore.wait_for_cleanup()
    left = set(Path(tmp_path).glob("shard-*"))
    assert left == seen[-1] and not any(left & s for s in seen[:-1])
    new = Net(torch.float32)
    new_opt = torch.optim.Adam(list(new.parameters()), lr=0.5)
    ct.load(tmp_path, new, new_opt)
    assert_same(model, opt, new, new_opt)


def test_colossalai_scenario_restore_replaces(tmp_path):
    """ColossalAI (PR #6550) merged a checkpoint into the live state: parameters absent
    from the checkpoint kept stale momentum. Saved before the first step, the checkpoint
    holds no state; loading it after training must leave none."""
    torch.manual_seed(5)
    data = batches(torch.float32, 4)
    model = Net(torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ct.save(tmp_path, model, opt)
    ck = ckptstore.open(tmp_path)
    assert ck.load_optimizer()["state"] == {}

    train(model, opt, data[:3])
    assert len(opt.state) == 5
    ct.load(tmp_path, model, opt)
    assert len(opt.state) == 0  # replaced, not merged

    fresh = Net(torch.float32)
    ct.load(tmp_path, fresh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    train(model, opt, data[3:])
    train(fresh, fresh_opt, data[3:])
    assert_same(model, opt, fresh, fresh_opt)


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_unchanged(model, opt, snap):
    msd, osd = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, msd[k]), k
    now = opt.state_dict()
    assert now["param_groups"] == osd["param_groups"]
    assert now["state"].keys() == osd["state"].keys()
    for i in now["state"]:
        for k, v in now["state"][i].items():
            assert torch.equal(v, osd["state"][i][k]), (i, k)


@pytest.fixture
def trained(tmp_path):
    torch.manual_seed(7)
    model = Net(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, batches(torch.float32, 2))
    ct.save(tmp_path / "ck", model, opt)
    return tmp_path / "ck"


def live(seed=11, steps=1, cls=Net):
    torch.manual_seed(seed)
    model = cls(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03)
    train(model, opt, batches(torch.float32, steps, seed=seed))
    return model, opt


def test_missing_parameter_changes_nothing(trained):
    class Bigger(Net):
        def __init__(self, dtype):
            super().__init__(dtype)
            self.extra = torch.nn.Linear(3, 3, dtype=dtype)

        def forward(self, x):
            return self.extra(super().forward(x))

    model, opt = live(cls=Bigger)
    snap = snapshot(model, opt)
    with pytest.raises(ckptstore.IncompatibleStateError, match="extra.weight"):
        ct.load(trained, model, opt)
    assert_unchanged(model, opt, snap)

    # An optimizer over other parameters than the checkpoint's: refused too.
    model2, _ = live()
    opt2 = torch.optim.AdamW([model2.fc1.weight], lr=0.1)
    train(model2, opt2, batches(torch.float32, 1))
    snap2 = snapshot(model2, opt2)
    with pytest.raises(ckptstore.IncompatibleStateError, match="group 0"):
        ct.load(trained, model2, opt2)
    assert_unchanged(model2, opt2, snap2)


def test_shape_mismatch_changes_nothing(trained):
    class Wider(Net):
        def __init__(self, dtype):
            super().__init__(dtype)
            self.fc2 = torch.nn.Linear(5, 4, dtype=dtype)

        def forward(self, x):
            return super().forward(x)[:, :3]

    model, opt = live(cls=Wider)
    snap = snapshot(model, opt)
    with pytest.raises(ckptstore.IncompatibleStateError, match="fc2.weight.*shape"):
        ct.load(trained, model, opt)
    assert_unchanged(model, opt, snap)


def test_group_count_mismatch_changes_nothing(trained):
    model, _ = live()
    opt = torch.optim.AdamW([{"params": [model.fc1.weight, model.fc1.bias]}, {"params": [model.fc2.weight, model.fc2.bias, model.temp]}], lr=0.1)
    snap = snapshot(model, opt)
    with pytest.raises(ckptstore.IncompatibleStateError, match="1 parameter group"):
        ct.load(trained, model, opt)
    assert_unchanged(model, opt, snap)


@pytest.mark.parametrize("target", ["optimizer", "model"])
def test_corrupt_shard_changes_nothing(trained, tmp_path, target):
    damaged = tmp_path / f"damaged-{target}"
    shutil.copytree(trained, damaged)
    m = h.read_manifest(damaged)
    name = "optim/fc2.weight/exp_avg_sq" if target == "optimizer" else "fc2.bias"
    t = next(t for t in m["tensors"] if t["name"] == name)
    h.flip_byte(damaged / m["shards"][t["shard"]]["file"], t["offsets"][0] + 1, 0x04)

    model, opt = live()
    snap = snapshot(model, opt)
    with pytest.raises(ckptstore.ChecksumError, match=name.replace(".", r"\.")):
        ct.load(damaged, model, opt)
    assert_unchanged(model, opt, snap)
    ct.load(trained, model, opt)  # the intact checkpoint still loads


def test_extra_dtypes_and_zero_copy_save(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    model.register_buffer("mask", torch.rand(4) > 0.5)
    extra = {
        "rng": torch.get_rng_state(),
        "table": np.arange(6, dtype=np.int32).reshape(2, 3),
        "betas": (0.9, 0.999),
        "bad_lr": float("nan"),
        "note": "ünïcode",
        "nested": {"a": [1, 2, {"b": None}]},
    }
    ct.save(tmp_path, model, extra=extra)
    ck = ckptstore.open(tmp_path)
    assert ck.info("weight")["dtype"] == "BF16" and ck.info("mask")["dtype"] == "BOOL"
    # What save hands the engine is a view of the tensor's memory, not a copy.
    _, wire, arr = _dtypes._to_numpy("weight", model.weight)
    assert wire == "BF16" and np.shares_memory(arr, model.weight.detach().view(torch.int16).numpy())

    new = torch.nn.Linear(4, 4).to(torch.bfloat16)
    new.register_buffer("mask", torch.zeros(4, dtype=torch.bool))
    got = ct.load(tmp_path, new)
    assert torch.equal(new.weight, model.weight) and torch.equal(new.mask, model.mask)
    assert torch.equal(got["rng"], extra["rng"]) and got["rng"].dtype == torch.uint8
    assert np.array_equal(got["table"].numpy(), extra["table"])
    assert got["betas"] == (0.9, 0.999) and np.isnan(got["bad_lr"])
    assert got["note"] == extra["note"] and got["nested"] == extra["nested"]
    got["rng"][0] = 1  # extra tensors are fresh, writable copies

    # strict: a checkpoint holding entries the model lacks is refused unless strict=False.
    smaller = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ckptstore.IncompatibleStateError, match="mask"):
        ct.load(tmp_path, smaller)
    ct.load(tmp_path, smaller, strict=False)
    assert torch.equal(smaller.weight, model.weight)


def test_optimizer_without_model_and_fused_layout(tmp_path):
    """Without a model, parameters are named by position; a torch checkpoint also loads
    through the numpy API in an FP16-scaled layout (and back into torch as float32)."""
    torch.manual_seed(4)
    model = Net(torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, batches(torch.float32, 2))
    ct.save(tmp_path / "pos", None, opt)
    names = ckptstore.open(tmp_path / "pos").load_optimizer()["param_groups"][0]["params"]
    assert names == [f"param.{i}" for i in range(5)]
    opt2 = torch.optim.Adam(Net(torch.float32).parameters(), lr=0.5)
    ct.load(tmp_path / "pos", None, opt2)
    assert opt2.param_groups[0]["lr"] == 0.01 and len(opt2.state) == 5

    ct.save(tmp_path / "named", model, opt)
    st = ckptstore.open(tmp_path / "named").load_optimizer({"exp_avg": "f16_scaled"})
    q = st["state"]["temp"]["exp_avg"]
    assert isinstance(q, ckptstore.F16Scaled) and q.q.shape == () and q.scale.shape == (1,)
    fresh = Net(torch.float32)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    ct.load(tmp_path / "named", fresh, fresh_opt, layout={"exp_avg": "f16_scaled"})
    got = fresh_opt.state[fresh.fc1.weight]["exp_avg"]
    want = opt.state[model.fc1.weight]["exp_avg"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * float(want.abs().max()))


# ---- CUDA destinations: pinned staging (issue 16) -----------------------------------------


def test_stage_batches_fit_keep_order_and_align():
    from ckptstore.torch._staging import _ALIGN, _batches

    sizes = [100, 300, 1, 256, 1024, 5, 1024]
    out = _batches(sizes, 1024)
    assert [i for b in out for i, _ in b] == list(range(len(sizes)))  # every item, in order
    for b in out:
        assert b[0][1] == 0
        for i, off in b:
            assert off % _ALIGN == 0 and off + sizes[i] <= 1024
        for (i, off), (_, nxt) in zip(b, b[1:]):
            assert nxt >= off + sizes[i]  # no overlap
    assert out == [[(0, 0), (1, 256), (2, 768)], [(3, 0)], [(4, 0)], [(5, 0)], [(6, 0)]]
    with pytest.raises(ckptstore.InvalidArgumentError):
        _batches([2048], 1024)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [64 << 20, 4096], ids=["one-batch", "many-batches+fallback"])
def test_cuda_restore_through_staging(tmp_path, monkeypatch, stage):
    # Patched where it is read (ckptstore.torch._staging), not on ckptstore.torch.
    monkeypatch.setattr(_staging, "_STAGE_BYTES", stage)
    torch.manual_seed(7)
    src = Net(torch.float32).cuda()
    opt = make_optimizer("adam", src, 2)
    train(src, opt, [(x.cuda(), y.cuda()) for x, y in batches(torch.float32, K_STEPS)])
    ct.save(tmp_path / "ck", src, opt)
    dst = Net(torch.float32).cuda()
    opt2 = make_optimizer("adam", dst, 2, lr_scale=3.0)
    train(dst, opt2, [(x.cuda(), y.cuda()) for x, y in batches(torch.float32, 1, seed=9)])
    direct = []
    real_direct_ok = _state._direct_ok
    monkeypatch.setattr(
        _state, "_direct_ok", lambda *a: direct.append(real_direct_ok(*a)) or direct[-1]
    )
    ct.load(tmp_path / "ck", dst, opt2)
    # CUDA state goes the single-pass way (fresh CUDA tensors filled through pinned staging).
    assert direct == [True]
    assert_same(src, opt, dst, opt2)
    for p in dst.parameters():
        for k, v in opt2.state[p].items():
            if k != "step":
                assert v.device == p.device, k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("target", ["optimizer", "model"])
def test_cuda_corrupt_shard_changes_nothing(tmp_path, target):
    torch.manual_seed(7)
    src = Net(torch.float32).cuda()
    opt = make_optimizer("adam", src, 2)
    train(src, opt, [(x.cuda(), y.cuda()) for x, y in batches(torch.float32, K_STEPS)])
    ck = tmp_path / "ck"
    ct.save(ck, src, opt)
    m = h.read_manifest(ck)
    name = "optim/fc2.weight/exp_avg_sq" if target == "optimizer" else "fc2.bias"
    t = next(t for t in m["tensors"] if t["name"] == name)
    h.flip_byte(ck / m["shards"][t["shard"]]["file"], t["offsets"][0] + 1, 0x04)
    dst = Net(torch.float32).cuda()
    opt2 = make_optimizer("adam", dst, 2, lr_scale=3.0)
    train(dst, opt2, [(x.cuda(), y.cuda()) for x, y in batches(torch.float32, 1, seed=9)])
    snap = snapshot(dst, opt2)
    with pytest.raises(ckptstore.ChecksumError, match=name.replace(".", r"\.")):
        ct.load(ck, dst, opt2)
    assert_unchanged(dst, opt2, snap)
