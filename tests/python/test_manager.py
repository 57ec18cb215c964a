"""ckptstore.torch.CheckpointManager in real torch training loops: background saves with
retention and bit-exact resume, snapshots that later training cannot change, reused
snapshot buffers, errors of background saves, a training process SIGKILLed in the middle
of a background save (the writer's test pause points make it deterministic), leases
against retention, the CLI seeing the same steps, and the numpy-level manager.

Needs torch and the bindings in the venv (scripts/test.sh installs both)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.torch as ct

# How long a test waits for an event another thread or process announces (a generous
# bound on a shared machine: the tests never sleep to let something happen).
EVENT_TIMEOUT = 120.0


class Net(torch.nn.Module):
    """A small MLP with a buffer and a 0-dim parameter."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 3)
        self.temp = torch.nn.Parameter(torch.tensor(0.8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.fc2(torch.tanh(self.fc1(x))) * self.temp


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def adam(model, lr=0.01):
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.95), amsgrad=True)


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def fresh(seed=99):
    """Another model and optimizer (other weights, other learning rate, no state)."""
    torch.manual_seed(seed)
    m = Net()
    return m, adam(m, lr=0.5)


def state_by_name(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def capture(model, opt):
    """A deep copy of the live training state, to compare against later."""
    return copy.deepcopy(model.state_dict()), copy.deepcopy(state_by_name(model, opt)), [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]


def assert_state(model, opt, expected):
    msd, ost, groups = expected
    sd = model.state_dict()
    assert sd.keys() == msd.keys()
    for k in sd:
        assert sd[k].dtype == msd[k].dtype and torch.equal(sd[k], msd[k]), k
    live = state_by_name(model, opt)
    assert live.keys() == ost.keys()
    for p in live:
        assert live[p].keys() == ost[p].keys(), p
        for k, v in live[p].items():
            w = ost[p][k]
            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), f"{p}/{k}"
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def differs(model, expected):
    return any(not torch.equal(t, expected[0][k]) for k, t in model.state_dict().items())


def wait_for(event: threading.Event, what: str):
    assert event.wait(EVENT_TIMEOUT), f"timed out waiting for {what}"


# ---- the tests -------------------------------------------------------------------


def test_five_background_saves_keep_last_two_and_resume_bit_exact(tmp_path):
    torch.manual_seed(1234)
    data = batches(8)
    model = Net()
    opt = adam(model)
    saved = {}
    handles = []
    with ct.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 6):
            train(model, opt, data[step - 1 : step])
            handles.append(mgr.save(step, model, opt, extra={"step": step}))
            # Training goes on at once: the state of this step is what the save holds.
            saved[step] = capture(model, opt)
    assert all(h.done() for h in handles)
    assert [h.wait()["tensors"] > 0 for h in handles] == [True] * 5
    assert mgr.steps() == [4, 5]
    assert mgr.latest() == 5
    assert [e["step"] for e in mgr.list()] == [4, 5]  # nothing left over

    new, new_opt = fresh()
    assert mgr.restore_latest(new, new_opt) == 5
    assert_state(new, new_opt, saved[5])
    # The step before holds its own state, though the model changed while it was written.
    old, old_opt = fresh(seed=5)
    assert mgr.restore(4, old, old_opt) == {"step": 4}
    assert_state(old, old_opt, saved[4])

    train(model, opt, data[5:])  # uninterrupted
    train(new, new_opt, data[5:])  # resumed
    assert_state(new, new_opt, capture(model, opt))


def test_changes_right_after_save_returns_are_not_in_the_checkpoint(tmp_path):
    torch.manual_seed(7)
    data = batches(4, seed=3)
    model = Net()
    opt = adam(model)
    train(model, opt, data[:2])
    mgr = ct.CheckpointManager(tmp_path / "run")
    entered, release = threading.Event(), threading.Event()

    def hold(step):  # the background thread, after the snapshot, before the write
        entered.set()
        assert release.wait(EVENT_TIMEOUT)

    mgr._before_write = hold
    try:
        h = mgr.save(2, model, opt, extra={"w": model.fc1.weight})
        before = capture(model, opt)
        wait_for(entered, "the background save")
        # The write has not started: change every live tensor the save stores.
        train(model, opt, data[2:])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert differs(model, before) and not h.done()
    finally:
        release.set()
    h.wait()
    mgr.close()
    new, new_opt = fresh()
    extra = mgr.restore(2, new, new_opt)
    assert_state(new, new_opt, before)
    assert torch.equal(extra["w"], before[0]["fc1.weight"])


def test_snapshot_buffers_are_reused(tmp_path):
    torch.manual_seed(3)
    data = batches(3)
    model = Net()
    opt = adam(model)
    train(model, opt, data[:1])
    mgr = ct.CheckpointManager(tmp_path / "run", max_in_flight=1)
    mgr.save(1, model, opt).wait()
    (snap,) = mgr._saver._free
    bufs = {k: (id(b), b.data_ptr()) for k, b in snap.bufs.items()}
    allocations = snap.allocations
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
    )
    assert mgr.snapshot_nbytes == nbytes and allocations == len(bufs)

    train(model, opt, data[1:2])
    mgr.save(2, model, opt).wait()
    assert mgr._saver._free == [snap] and mgr._saver.buffer_sets == 1
    assert snap.allocations == allocations  # the second save allocated nothing
    assert {k: (id(b), b.data_ptr()) for k, b in snap.bufs.items()} == bufs
    new, new_opt = fresh()
    mgr.restore(2, new, new_opt)
    assert_state(new, new_opt, capture(model, opt))  # the reused buffers hold step 2
    mgr.close()


def test_max_in_flight_bounds_the_buffer_sets(tmp_path):
    torch.manual_seed(4)
    data = batches(3)
    model = Net()
    opt = adam(model)
    mgr = ct.CheckpointManager(tmp_path / "run", max_in_flight=2)
    entered, release = threading.Event(), threading.Event()

    def hold(step):
        if step == 1:
            entered.set()
            assert release.wait(EVENT_TIMEOUT)

    mgr._before_write = hold
    saved = {}
    try:
        train(model, opt, data[:1])
        h1 = mgr.save(1, model, opt)
        saved[1] = capture(model, opt)
        wait_for(entered, "the first save")
        train(model, opt, data[1:2])
        h2 = mgr.save(2, model, opt)  # a second set of buffers: both in flight
        saved[2] = capture(model, opt)
        assert [h.step for h in mgr.in_flight()] == [1, 2] and mgr._saver.buffer_sets == 2
    finally:
        release.set()
    h1.wait()
    h2.wait()
    train(model, opt, data[2:])
    mgr.save(3, model, opt).wait()
    saved[3] = capture(model, opt)
    assert mgr._saver.buffer_sets == 2  # the third save reused a set
    for step in (1, 2, 3):
        new, new_opt = fresh()
        mgr.restore(step, new, new_opt)
        assert_state(new, new_opt, saved[step])


def block_step(mgr, step):
    """Make the save of ``step`` fail, whoever runs the tests (root ignores permission
    bits): a regular file where the step's directory must go."""
    mgr.step_dir(step).write_bytes(b"not a directory")


def test_background_error_surfaces_from_wait_and_context_exit(tmp_path):
    torch.manual_seed(5)
    data = batches(2)
    model = Net()
    opt = adam(model)
    train(model, opt, data[:1])
    root = tmp_path / "run"
    mgr = ct.CheckpointManager(root, keep_last=2)
    mgr.save(1, model, opt).wait()
    at_1 = capture(model, opt)
    train(model, opt, data[1:])

    block_step(mgr, 2)
    h = mgr.save(2, model, opt)
    with pytest.raises(ckptstore.CheckpointIOError) as err:
        h.wait()
    assert "step-00000002" in str(err.value)
    assert h.done()
    mgr.wait()  # seen through the handle: not raised again
    assert mgr.steps() == [1] and mgr.latest() == 1

    # Leaving the context manager raises an error no one has waited for.
    block_step(mgr, 3)
    with pytest.raises(ckptstore.CheckpointIOError, match="step-00000003"):
        with ct.CheckpointManager(root, keep_last=2) as m2:
            m2.save(3, model, opt)
    assert m2.latest() == 1
    # ... and so does the next save (max_in_flight=1: it waits for the failed one).
    block_step(mgr, 4)
    mgr.save(4, model, opt)
    with pytest.raises(ckptstore.CheckpointIOError, match="step-00000004"):
        mgr.save(5, model, opt)
    mgr.close()

    # A failing body keeps its own exception, the save's error noted on it.
    block_step(mgr, 6)
    with pytest.raises(KeyError) as body:
        with ct.CheckpointManager(root) as m3:
            m3.save(6, model, opt)
            raise KeyError("body")
    assert any("step-00000006" in n for n in getattr(body.value, "__notes__", ["step-00000006"]))

    assert mgr.steps() == [1]
    new, new_opt = fresh()
    assert mgr.restore_latest(new, new_opt) == 1
    assert_state(new, new_opt, at_1)


CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    import ckptstore.torch as ct
    from test_manager import Net, adam, batches, train

    root, out = sys.argv[1], sys.argv[3]
    data = batches(4, seed=1)
    torch.manual_seed(0)
    model = Net()
    opt = adam(model)
    mgr = ct.CheckpointManager(root, keep_last=2)
    assert mgr.restore_latest(model, opt) == 1
    train(model, opt, data[1:2])
    h = mgr.save(2, model, opt)          # the writer stops at the pause point
    train(model, opt, data[2:3])         # training goes on meanwhile
    open(out, "w").write("trained")
    h.wait()                             # never returns: the test kills this process
    """
)


# Shards durable but no manifest yet; the step's manifest committed inside its
# `.tmp-step-` directory but the rename into place not done (the other two points of the
# writer fall in the same two states; each case starts a torch process, so two are run).
@pytest.mark.parametrize("point", ["before-manifest-rename", "after-manifest-rename"])
def test_sigkill_in_the_middle_of_a_background_save(tmp_path, point):
    root = tmp_path / "run"
    data = batches(4, seed=1)
    torch.manual_seed(0)
    model = Net()
    opt = adam(model)
    train(model, opt, data[:1])
    mgr = ct.CheckpointManager(root, keep_last=2)
    mgr.save(1, model, opt).wait()
    at_1 = capture(model, opt)

    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "trained"
    env = dict(os.environ, CKPTSTORE_TEST_PAUSE=point, CKPTSTORE_TEST_PAUSE_DIR=str(pause_dir))
    child = subprocess.Popen(
        [sys.executable, str(script), str(root), str(Path(__file__).parent), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        marker = pause_dir / point
        deadline = time.monotonic() + EVENT_TIMEOUT
        while not (marker.exists() and out.exists()):
            if child.poll() is not None:
                pytest.fail(f"the child exited ({child.returncode}) before pausing: {child.stderr.read().decode()}")
            assert time.monotonic() < deadline, f"the child did not reach {point}"
            time.sleep(0.05)  # polling for the announcement, not waiting for a state
        assert int(marker.read_text()) == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    # A new manager (as a new process would make): step 2 never happened.
    after = ct.CheckpointManager(root, keep_last=2)
    assert after.latest() == 1 and after.steps() == [1]
    leftovers = [e for e in after.list() if not e["committed"]]
    assert [e["step"] for e in leftovers] == [2] and ".tmp-step-2-" in str(leftovers[0]["path"])
    new, new_opt = fresh()
    assert after.restore_latest(new, new_opt) == 1
    assert_state(new, new_opt, at_1)
    # The next save of step 2 clears the leftover and commits.
    train(new, new_opt, data[1:2])
    after.save(2, new, new_opt).wait()
    assert after.steps() == [1, 2] and all(e["committed"] for e in after.list())


# ---- leases, the CLI, blocking saves, the numpy-level manager -----------------------------


def test_a_held_step_survives_retention_until_released(tmp_path):
    torch.manual_seed(6)
    model = Net()
    opt = adam(model)
    train(model, opt, batches(1))
    mgr = ct.CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, model, opt).wait()
    with mgr.lease(1) as lease:
        assert lease.held and lease.step == 1
        mgr.save(2, model, opt).wait()
        assert mgr.steps() == [1, 2]  # retention skipped the held step
        ck = ckptstore.open(lease.path)
        ck.verify()
    assert not lease.held
    mgr.save(3, model, opt).wait()
    assert mgr.steps() == [3]
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        mgr.lease(1)
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        mgr.restore(2, model, opt)


def test_cli_sees_the_same_steps(tmp_path, ckpt):
    torch.manual_seed(8)
    model = Net()
    opt = adam(model)
    root = tmp_path / "run"
    with ct.CheckpointManager(root, keep_every=10) as mgr:
        for step in (10, 15, 20, 25):
            train(model, opt, batches(1, seed=step))
            mgr.save(step, model, opt)
    assert mgr.steps() == [10, 15, 20, 25]  # keep_last=None keeps every step
    ls = json.loads(ckpt("ls", root, "--json", expect=0).stdout)
    assert ls["latest"] == 25 and [s["step"] for s in ls["steps"]] == [10, 15, 20, 25]
    assert all(s["committed"] for s in ls["steps"])
    gc = json.loads(ckpt("gc", root, "--keep", "1", "--every", "10", "--json", expect=0).stdout)
    assert gc["deleted"] == [15]
    assert mgr.steps() == [10, 20, 25]
    new, new_opt = fresh()
    assert mgr.restore_latest(new, new_opt) == 25
    assert_state(new, new_opt, capture(model, opt))


def test_blocking_save_and_restore_latest_on_an_empty_root(tmp_path):
    torch.manual_seed(9)
    model = Net()
    opt = adam(model)
    mgr = ct.CheckpointManager(tmp_path / "run", keep_last=3)
    new, new_opt = fresh()
    before = capture(new, new_opt)
    assert mgr.restore_latest(new, new_opt) is None
    assert mgr.restore_latest(new, new_opt, return_extra=True) == (None, {})
    assert_state(new, new_opt, before)
    train(model, opt, batches(1))
    h = mgr.save(7, model, opt, extra={"epoch": 2, "rng": torch.get_rng_state()}, blocking=True)
    assert h.done() and h.step == 7 and mgr.steps() == [7]
    assert mgr._saver.buffer_sets == 0  # a blocking save writes from the live tensors
    step, extra = mgr.restore_latest(new, new_opt, return_extra=True)
    assert step == 7 and extra["epoch"] == 2 and torch.equal(extra["rng"], torch.get_rng_state())
    assert_state(new, new_opt, capture(model, opt))
    # The step's directory is a plain ckptstore.torch checkpoint.
    other, other_opt = fresh(seed=1)
    ct.load(mgr.step_dir(7), other, other_opt)
    assert_state(other, other_opt, capture(model, opt))
    mgr.close()
    with pytest.raises(ckptstore.InvalidArgumentError, match="closed"):
        mgr.save(8, model, opt)


def test_invalid_arguments(tmp_path):
    with pytest.raises(ckptstore.InvalidArgumentError):
        ct.CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ckptstore.InvalidArgumentError):
        ct.CheckpointManager(tmp_path, keep_every=0)
    with pytest.raises(ckptstore.InvalidArgumentError):
        ct.CheckpointManager(tmp_path, max_in_flight=0)
    mgr = ct.CheckpointManager(tmp_path)
    model = Net()
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ckptstore.InvalidArgumentError):
            mgr.save(bad, model)
    # A snapshot that fails starts nothing and gives its slot back.
    with pytest.raises(ckptstore.InvalidTensorError):
        mgr.save(1, model, extra={"z": torch.zeros(2, dtype=torch.complex64)})
    assert mgr.in_flight() == [] and mgr.steps() == []
    mgr.save(1, model).wait()
    assert mgr.steps() == [1]


def test_numpy_level_manager(tmp_path):
    mgr = ckptstore.CheckpointManager(tmp_path / "np", keep_last=2, keep_every=100)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    opt = {
        "param_groups": [{"params": ["w"], "lr": 0.1}],
        "state": {"w": {"exp_avg": np.full((3, 4), 0.5, np.float32)}},
    }
    for step in (100, 150, 200, 250):
        info = mgr.save(step, {"w": w + step}, metadata={"step": step}, optimizer=opt)
        assert info["tensors"] == 2
    assert mgr.steps() == [100, 200, 250] and mgr.latest() == 250
    with mgr.lease(250) as lease:
        ck = ckptstore.open(lease.path)
        np.testing.assert_array_equal(ck["w"], w + 250)
        assert ck.metadata == {"step": 250}
        assert ck.load_optimizer()["param_groups"][0]["lr"] == 0.1
    assert mgr.gc() == {"deleted": [], "in_use": [], "interrupted_removed": 0, "swept": 0}
    assert mgr.step_dir(250) == Path(lease.path)


def test_a_manager_root_url_is_never_created_locally(tmp_path, monkeypatch):
    """A URL root is never a local directory (it used to create ``s3:/bucket/run``): an
    ``s3://`` root is the object-store manager (no request is made until a save or a
    listing), any other scheme is refused, in the engine's manager and the torch one."""
    import ckptstore.torch as ct

    monkeypatch.chdir(tmp_path)
    for make in (ckptstore.CheckpointManager, ct.CheckpointManager):
        mgr = make("s3://bucket/run", keep_last=2)
        assert mgr.root == "s3://bucket/run"
        assert mgr.step_dir(3) == "s3://bucket/run/step-00000003"
        with pytest.raises(ckptstore.InvalidArgumentError, match="gs://"):
            make("gs://bucket/run", keep_last=2)
    assert list(tmp_path.iterdir()) == []
