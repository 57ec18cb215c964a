"""The optimizer compatibility rule (format-spec/optimizer.md §Compatibility), one Rust
implementation (``ckptstore::optim::check_compatible``) behind every restore path:
``ckptstore.torch.load``, ``ckptstore.torch.distributed.load`` (a 1-process gloo group)
and the torch ``CheckpointManager``'s ``restore`` / ``restore_latest``.

* An AdamW checkpoint restored into ``SGD(momentum=0.9)`` is refused with
  ``IncompatibleStateError`` naming both classes, nothing changed; with
  ``allow_optimizer_change=True`` it is restored and the next ``step()`` works.
* A live optimizer whose groups list the same parameters in another order is accepted,
  every state landing on its parameter by name.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402
import ckptstore.torch.distributed as ctd  # noqa: E402
import dist_helpers as dh  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 3)
        self.fc2 = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def trained_adamw(seed=0):
    torch.manual_seed(seed)
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    train(m, o, 2, seed)
    return m, o


def fresh(seed, cls="sgd", order="forward"):
    """A live model and optimizer with state of their own (one step)."""
    torch.manual_seed(seed)
    m = Net()
    params = list(m.parameters())
    if order == "reversed":
        params = params[::-1]
    if cls == "sgd":
        o = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    else:
        o = torch.optim.AdamW(params, lr=0.03)
    train(m, o, 1, seed + 100)
    return m, o


def snapshot(m, o):
    names = {id(p): n for n, p in m.named_parameters()}
    out = {f"model/{n}": t.detach().clone() for n, t in m.state_dict().items()}
    for p, st in o.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    out["hyper"] = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    return out


def differ(a, b):
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return sorted(bad)


def assert_class_refused(err):
    """The refusal names both classes and the opt-in, at no group or parameter."""
    msg = str(err)
    assert "AdamW" in msg and "SGD" in msg and "allow_optimizer_change" in msg, msg
    assert err.group is None and err.param == "", (err.group, err.param)


def check_sgd_after_change(m, o, saved):
    """What an allowed AdamW -> SGD restore leaves: the model and AdamW's state restored by
    name, the checkpoint's lr, SGD's own momentum kept; and the next step works."""
    names = {id(p): n for n, p in m.named_parameters()}
    for n, t in m.state_dict().items():
        assert torch.equal(t, saved[f"model/{n}"]), n
    for p in m.parameters():
        n = names[id(p)]
        assert torch.equal(o.state[p]["exp_avg"], saved[f"optim/{n}/exp_avg"]), n
        assert "momentum_buffer" not in o.state[p], n  # the replaced state is gone
    (g,) = o.param_groups
    assert g["lr"] == 0.01 and g["weight_decay"] == 0.1  # the checkpoint's
    assert g["momentum"] == 0.9  # the live group's: AdamW's groups have none
    train(m, o, 1, 5)  # KeyError: 'momentum' before the live settings were kept
    assert all("momentum_buffer" in o.state[p] for p in m.parameters())


def check_permuted(m, o, saved):
    """A restore into an optimizer listing the parameters in reverse order: each state on
    its own parameter, the live order kept."""
    names = {id(p): n for n, p in m.named_parameters()}
    assert [names[id(p)] for p in o.param_groups[0]["params"]] == [
        n for n, _ in m.named_parameters()
    ][::-1]
    for p in m.parameters():
        n = names[id(p)]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o.state[p][k], saved[f"optim/{n}/{k}"]), (n, k)
    assert o.param_groups[0]["lr"] == 0.01
    train(m, o, 1, 6)


# ---- the rule itself, through the bindings -------------------------------------------------


def test_check_optimizer_fit_is_the_rust_rule():
    live = [[("w", (2, 3)), ("b", (3,))]]
    ckptstore.check_optimizer_fit(live, [[("b", [3]), ("w", [2, 3])]])  # any order
    cases = [
        ([[("w", [2, 3])]], 0, "b", None, 'the optimizer\'s has ["b"] that the checkpoint\'s lacks'),
        ([[("w", [2, 3]), ("b", [3]), ("c", [1])]], 0, "c", None, '["c"] that the optimizer\'s lacks'),
        ([[("w", [3, 2]), ("b", [3])]], 0, "w", None, "shape [3, 2] in the checkpoint, [2, 3] in the optimizer"),
        ([[("w", [2, 3])], [("b", [3])]], None, "", None, "the checkpoint has 2 parameter group(s), the optimizer 1"),
        ([[("w", None), ("b", [3])]], 0, "w", None, "records no shape"),
        ([[("w", [2, 3]), ("b", [3])]], None, "", "AdamW", "the checkpoint's optimizer is AdamW, the live optimizer is SGD"),
        ([5], None, "", None, "malformed"),
        ([[("w", "2x3")]], None, "", None, "malformed"),
        ([[("w", [2, 3]), ("b", [3])]], None, "", 7, "malformed"),
    ]
    for saved, group, param, saved_class, want in cases:
        with pytest.raises(ckptstore.IncompatibleStateError) as ei:
            ckptstore.check_optimizer_fit(
                live, saved, live_class="SGD", saved_class=saved_class
            )
        assert want in str(ei.value), (saved, str(ei.value))
        assert (ei.value.group, ei.value.param) == (group, param), (saved, str(ei.value))
    # The class: allowed as a deliberate change; unknown on either side: not compared.
    saved = [[("w", [2, 3]), ("b", [3])]]
    ckptstore.check_optimizer_fit(live, saved, live_class="SGD", saved_class="AdamW", allow_optimizer_change=True)
    ckptstore.check_optimizer_fit(live, saved, live_class="SGD")
    # A malformed live side is a bad argument.
    with pytest.raises(ckptstore.InvalidArgumentError):
        ckptstore.check_optimizer_fit([[("w", "x")]], saved)


# ---- ckptstore.torch.load --------------------------------------------------------------------


@pytest.fixture
def adamw_ckpt(tmp_path):
    m, o = trained_adamw()
    ct.save(tmp_path / "ck", m, o)
    return tmp_path / "ck", snapshot(m, o)


def test_load_refuses_another_optimizer_class_unless_allowed(adamw_ckpt):
    path, saved = adamw_ckpt
    m, o = fresh(1)
    before = snapshot(m, o)
    with pytest.raises(ckptstore.IncompatibleStateError) as ei:
        ct.load(path, m, o)
    assert_class_refused(ei.value)
    assert differ(before, snapshot(m, o)) == []  # nothing changed: neither model nor optimizer
    # Opted in: restored.
    ct.load(path, m, o, allow_optimizer_change=True)
    check_sgd_after_change(m, o, saved)
    # The same class is restored without the opt-in.
    m2, o2 = fresh(2, cls="adamw")
    ct.load(path, m2, o2)
    assert differ(saved, snapshot(m2, o2)) == []


def test_load_accepts_a_permuted_group(adamw_ckpt):
    path, saved = adamw_ckpt
    m, o = fresh(3, cls="adamw", order="reversed")
    ct.load(path, m, o)
    check_permuted(m, o, saved)
    # The engine's layout path applies the same rule.
    m, o = fresh(3, cls="adamw", order="reversed")
    ct.load(path, m, o, layout="f32")
    check_permuted(m, o, saved)


# ---- the manager --------------------------------------------------------------------------


def test_manager_restores_refuse_another_class_unless_allowed(tmp_path):
    mgr = ct.CheckpointManager(tmp_path / "run", keep_last=2)
    m, o = trained_adamw()
    saved = snapshot(m, o)
    mgr.save(3, m, o, blocking=True)

    m1, o1 = fresh(1)
    before = snapshot(m1, o1)
    with pytest.raises(ckptstore.IncompatibleStateError) as ei:
        mgr.restore(3, m1, o1)
    assert_class_refused(ei.value)
    with pytest.raises(ckptstore.IncompatibleStateError) as ei:
        mgr.restore_latest(m1, o1)
    assert_class_refused(ei.value)
    assert differ(before, snapshot(m1, o1)) == []
    assert mgr.restore_latest(m1, o1, allow_optimizer_change=True) == 3
    check_sgd_after_change(m1, o1, saved)

    m2, o2 = fresh(1)
    mgr.restore(3, m2, o2, allow_optimizer_change=True)
    check_sgd_after_change(m2, o2, saved)

    m3, o3 = fresh(4, cls="adamw", order="reversed")
    assert mgr.restore_latest(m3, o3) == 3
    check_permuted(m3, o3, saved)
    mgr.close()


# ---- ckptstore.torch.distributed.load, one rank of a gloo group ---------------------------


def job_distributed(rank, world, base):
    m, o = trained_adamw()
    saved = snapshot(m, o)
    path = os.path.join(base, "dist")
    ctd.save(path, m, o)
    out = {}

    m1, o1 = fresh(1)
    before = snapshot(m1, o1)
    try:
        ctd.load(path, m1, o1)
        out["refused"] = None
    except ckptstore.IncompatibleStateError as e:
        assert_class_refused(e)
        out["refused"] = str(e)
    out["unchanged"] = differ(before, snapshot(m1, o1))
    ctd.load(path, m1, o1, allow_optimizer_change=True)
    check_sgd_after_change(m1, o1, saved)

    m2, o2 = fresh(3, cls="adamw", order="reversed")
    ctd.load(path, m2, o2)
    check_permuted(m2, o2, saved)
    return out


def test_distributed_load_refuses_another_class_unless_allowed(tmp_path):
    (out,) = dh.results(1, job_distributed, str(tmp_path))
    assert out["refused"] is not None and "AdamW" in out["refused"]
    assert out["unchanged"] == []
