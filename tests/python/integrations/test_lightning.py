"""ckptstore.integrations.lightning: Lightning 2.6 (Trainer and Fabric) checkpointing through
ckptstore, on the CPU.

* the checkpoint dict round-trips bit for bit (dtypes, shapes, nesting, tuples, int keys);
  pickle only with the opt-in, on both sides;
* a Trainer resumed in a new process from a ModelCheckpoint checkpoint ends bit-identical
  (parameters, AdamW state, LR scheduler, torch RNG) to an uninterrupted run;
* a process SIGKILLed inside a save (the engine's test pause point, announced by a file):
  `last.ckpt` still holds the previous checkpoint and `ckpt_path="last"` resumes it;
* one flipped byte: the resume fails naming the tensor, the live model and optimizer are
  unchanged (Trainer and Fabric);
* the ColossalAI scenario through Fabric: optimizer state for parameters the checkpoint
  does not name is gone after the load;
* `ckpt verify` / `ckpt inspect` open the checkpoints; top-k removal; non-blocking saves
  with reused snapshot buffers, whose errors teardown raises;
* FSDP2 (ModelParallelStrategy): saved on 2 ranks (gloo), resumed on 1, gathered state
  bit-identical.

Lightning is required: without it these tests fail at import (CI installs it).
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import lightning as L  # noqa: F401 - a missing framework fails the tests, never skips them
import ckpt_helpers as h
import ckptstore
from ckptstore.errors import CheckpointError, ChecksumError, InvalidArgumentError
from ckptstore.integrations.lightning import CheckpointIO, PickleNotAllowedError

from test_s3 import s3  # noqa: E402,F401 - the S3 server fixture (s3s-fs on a loopback port)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_train as lt  # noqa: E402

TRAIN = HERE / "lightning_train.py"
FSDP = HERE / "lightning_fsdp.py"
CHILD_TIMEOUT = 240

warnings.filterwarnings("ignore", module="lightning")


# ---- helpers -----------------------------------------------------------------------------


def assert_same(got, want, path="") -> None:
    """Bit-for-bit and type-for-type equality of nested checkpoint values."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{tuple(got.shape)}"
        assert got.device == want.device, path
        gb = got.detach().contiguous().reshape(-1).view(torch.uint8)
        wb = want.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(gb, wb), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}/{i}")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def snapshot(model, opt) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": _clone(opt.state_dict()),
    }


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return type(v)((k, _clone(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    return v


def run_train(*args, env=None, timeout=CHILD_TIMEOUT) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, str(TRAIN), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"lightning_train.py {args} failed ({r.returncode}):\n{r.stderr[-4000:]}"
    return r


def load_dump(p: Path) -> dict:
    return torch.load(p, weights_only=False)


def assert_dumps_equal(got: dict, want: dict, keys=("params", "optimizer", "scheduler", "rng", "global_step", "epoch")):
    for k in keys:
        assert_same(got[k], want[k], k)


def tensor_offset(ckpt_dir: Path, name: str) -> tuple[Path, int]:
    """(shard file, absolute offset of the first byte) of tensor ``name``."""
    m = h.read_manifest(ckpt_dir)
    for t in m["tensors"]:
        if t["name"] == name:
            return ckpt_dir / m["shards"][t["shard"]]["file"], t["offsets"][0]
    raise AssertionError(f"{name} not in {ckpt_dir}")


class Opaque:
    """A value only pickle can store (module level, so that it pickles)."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """A 4-epoch run keeping every epoch's checkpoint (and its final state dump)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_train(out, 4, "--top-k", "-1", "--dump", out / "final.pt")
    return out


# ---- the dict --------------------------------------------------------------------------


def test_round_trip_is_bit_for_bit(tmp_path, ckpt):
    from lightning.fabric.utilities.data import AttributeDict

    w = torch.randn(3, 4)
    ck = {
        "state_dict": collections.OrderedDict(
            [("a.weight", w), ("a.bf16", torch.randn(5).to(torch.bfloat16)), ("a.count", torch.tensor(7)),
             ("tied", w), ("empty", torch.empty(0, 3)), ("flag", torch.tensor([True, False]))]
        ),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}, 2: {"step": torch.tensor(1.0)}},
                "param_groups": [{"params": [0, 1, 2], "betas": (0.9, 0.999), "lr": 1e-3, "foreach": None,
                                  "nested": [(1, 2), [3, (4,)]]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": 3, "base_lrs": [0.1], "_last_lr": [0.1 * 0.7**3]}],
        "epoch": 3,
        "big": 2**70,
        "specials": [float("nan"), float("inf"), -float("inf"), -0.0, 5e-324],
        "blob": b"\x00\xffbytes",
        "keys": {1: "int", 2.5: "float", None: "none", True: "bool", "s": "str"},
        "hyper_parameters": AttributeDict(lr=0.02, hidden=16),
        "pytorch-lightning_version": "2.6.6",
    }
    io = CheckpointIO()
    path = tmp_path / "sub" / "epoch=3-step=12.ckpt"
    io.save_checkpoint(ck, path)
    assert (path / "ckpt-manifest.json").is_file()
    got = io.load_checkpoint(path)
    want = dict(ck, hyper_parameters={"lr": 0.02, "hidden": 16})  # dict subclasses come back plain
    assert_same(got, want)
    # Int keys stay ints (Lightning's optimizer state), tuples tuples, lists lists.
    assert list(got["optimizer_states"][0]["state"]) == [0, 2]
    assert type(got["optimizer_states"][0]["param_groups"][0]["betas"]) is tuple
    # A tensor held twice is stored once and comes back as one object.
    assert got["state_dict"]["tied"] is got["state_dict"]["a.weight"]
    assert "state_dict/tied" not in ckptstore.open(path).keys()
    # Tensors are fresh memory (writable, not the mapped file).
    got["state_dict"]["a.weight"].add_(1)
    ckpt("verify", path, expect=0)
    # storage_options is refused, as TorchCheckpointIO does.
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(ck, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_pickle_only_with_the_opt_in(tmp_path):
    ck = {"state_dict": {"w": torch.ones(2)}, "callbacks": {"MyCallback": {"obj": Opaque(3)}}}
    path = tmp_path / "p.ckpt"
    with pytest.raises(PickleNotAllowedError, match=r"callbacks/MyCallback/obj.*Opaque.*allow_pickle=True"):
        CheckpointIO().save_checkpoint(ck, path)
    assert not path.exists()  # nothing written
    assert issubclass(PickleNotAllowedError, InvalidArgumentError)

    CheckpointIO(allow_pickle=True).save_checkpoint(ck, path)
    with pytest.raises(PickleNotAllowedError, match="pickled value"):
        CheckpointIO().load_checkpoint(path)
    with pytest.raises(PickleNotAllowedError, match="pickled value"):  # weights_only wins
        CheckpointIO(allow_pickle=True).load_checkpoint(path, weights_only=True)
    got = CheckpointIO(allow_pickle=True).load_checkpoint(path)
    assert got["callbacks"]["MyCallback"]["obj"] == Opaque(3)
    assert_same(got["state_dict"]["w"], torch.ones(2))


def test_a_torch_save_file_loads_and_a_missing_path_is_not_found(tmp_path):
    # torch.save files load with torch.load(weights_only=True) (more in test_lightning_contracts.py).
    f = tmp_path / "old.ckpt"
    ck = {"state_dict": collections.OrderedDict(w=torch.randn(2, 3)), "epoch": 1}
    torch.save(ck, f)
    assert_same(CheckpointIO().load_checkpoint(f), ck)
    with pytest.raises(FileNotFoundError):
        CheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_s3_save_load_and_async(s3):
    ck = {"state_dict": collections.OrderedDict(w=torch.randn(16, 4)), "optimizer_states": [
        {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"params": [0], "betas": (0.9, 0.99)}]}],
        "epoch": 2}
    url = "s3://bkt/lightning/epoch=2-step=10.ckpt"
    io = CheckpointIO()
    io.save_checkpoint(ck, url)
    assert_same(io.load_checkpoint(url), ck)
    assert any(n.startswith("shard-") for n in os.listdir(os.path.join(s3, "bkt", "lightning", "epoch=2-step=10.ckpt")))
    aio = CheckpointIO(async_save=True)
    aio.save_checkpoint(ck, url + "-async")
    assert_same(aio.load_checkpoint(url + "-async"), ck)  # waits for the save in flight
    aio.teardown()
    # Removing needs fsspec's S3 support (s3fs); without it the checkpoint stays, with a warning.
    try:
        import s3fs  # noqa: F401

        has_s3fs = True
    except ImportError:
        has_s3fs = False
    if not has_s3fs:
        with pytest.warns(UserWarning, match="not removed.*s3fs"):
            io.remove_checkpoint(url)
        ckptstore.open(url).verify()
    io.remove_checkpoint("s3://bkt/lightning/missing.ckpt")  # nothing there: a no-op


# ---- Trainer: resume, kill, damage, CLI, top-k -------------------------------------------


def test_resume_in_a_new_process_is_bit_identical(uninterrupted, tmp_path):
    src = uninterrupted / "ckpts" / "epoch=1-step=12.ckpt"
    assert (src / "ckpt-manifest.json").is_file()  # written by ckptstore, not torch.save
    out = tmp_path / "resumed"
    run_train(out, 4, "--resume", src, "--top-k", "-1", "--dump", tmp_path / "resumed.pt")
    got, want = load_dump(tmp_path / "resumed.pt"), load_dump(uninterrupted / "final.pt")
    assert got["ckpt_path"] == str(src)
    assert got["global_step"] == 24
    assert_dumps_equal(got, want)
    # The resumed run's checkpoints equal the uninterrupted run's, tensor for tensor.
    a = ckptstore.open(out / "ckpts" / "epoch=3-step=24.ckpt")
    b = ckptstore.open(uninterrupted / "ckpts" / "epoch=3-step=24.ckpt")
    names = [n for n in b.keys() if not n.startswith("callbacks/ModelCheckpoint")]
    assert names and set(names) <= set(a.keys())
    for n in names:
        h.assert_bit_equal(a[n], b[n], n)


def test_a_run_begun_with_lightnings_own_io_switches_in_the_same_dirpath(tmp_path, ckpt):
    """Issue 53: epochs 0-1 saved by Lightning's own CheckpointIO (torch.save files: the
    top-1 and ``last.ckpt``), then the same ``dirpath`` resumed (``ckpt_path="last"``) with
    ckptstore's. The first save replaces the stock ``last.ckpt`` in one step (before: "create
    directory .../last.ckpt: File exists"), top-k rotation removes the stock file it
    supersedes, and the run ends where the stock run ends: the same state, bit for bit, and
    the same checkpoint names, each now a committed ckptstore checkpoint."""
    stock, mixed = tmp_path / "stock", tmp_path / "mixed"
    run_train(stock, 4, "--io", "torch", "--top-k", "1", "--dump", stock / "final.pt")
    run_train(mixed, 2, "--io", "torch", "--top-k", "1")
    assert (mixed / "ckpts" / "last.ckpt").is_file()
    run_train(mixed, 4, "--io", "sync", "--resume", "last", "--top-k", "1", "--dump", mixed / "final.pt")
    names = sorted(os.listdir(mixed / "ckpts"))
    assert names == sorted(os.listdir(stock / "ckpts")), names
    for n in names:
        ckpt("verify", str(mixed / "ckpts" / n), expect=0)
    assert_dumps_equal(load_dump(mixed / "final.pt"), load_dump(stock / "final.pt"))


def test_ddp_on_two_processes_resumes_bit_identical(tmp_path, ckpt):
    """Lightning's DDP on 2 processes (gloo, Lightning's own launcher): rank 0 saves through
    this CheckpointIO, every rank loads. A run stopped after 2 epochs and resumed from
    ``last`` ends bit-identical to an uninterrupted 4-epoch run (rank 0 whole; rank 1's model,
    optimizer, scheduler and counters: its RNG state is rank 0's after any resume, as with the
    stock IO, since the checkpoint holds one). Lightning's DDP checkpoint tests run it so."""
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(full, 4, "--devices", "2", "--dump", full / "final.pt")
    run_train(part, 2, "--devices", "2")
    run_train(part, 4, "--devices", "2", "--resume", "last", "--dump", part / "final.pt")
    assert_dumps_equal(load_dump(part / "final.pt"), load_dump(full / "final.pt"))
    assert_dumps_equal(load_dump(part / "final.pt.rank1"), load_dump(full / "final.pt.rank1"),
                       keys=("params", "optimizer", "scheduler", "global_step", "epoch"))
    names = sorted(os.listdir(part / "ckpts"))
    assert names == sorted(os.listdir(full / "ckpts")), names
    for n in names:
        ckpt("verify", str(part / "ckpts" / n), expect=0)


@pytest.mark.parametrize("io", ["sync", "async"])
def test_the_checkpoint_saved_on_an_exception_is_whole_before_the_exception_reaches_the_caller(tmp_path, io, ckpt):
    """``ModelCheckpoint(save_on_exception=True)`` (Lightning's test_model_checkpoint
    save-on-exception family): training raises at step 9; by the time ``fit`` re-raises, the
    checkpoint of that moment (and ``last.ckpt``) is committed, also with ``async_save`` (the
    teardown waits for it), and holds the model as it was at the exception, bit for bit."""
    from lightning.pytorch.callbacks import Callback

    class Boom(Callback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            if trainer.global_step == 9:
                raise RuntimeError("boom at step 9")

    torch.manual_seed(0)
    model = lt.Net()
    trainer = lt.make_trainer(str(tmp_path), 4, io, -1, extra_callbacks=[Boom()])
    trainer.checkpoint_callback.save_on_exception = True
    with pytest.raises(RuntimeError, match="boom at step 9"):
        trainer.fit(model, lt.data())
    d = tmp_path / "ckpts"
    at_9 = [n for n in os.listdir(d) if "step=9" in n]
    assert len(at_9) == 1 and (d / "last.ckpt").is_dir(), os.listdir(d)
    for n in (at_9[0], "last.ckpt"):
        ckpt("verify", str(d / n), expect=0)
        got = CheckpointIO().load_checkpoint(d / n)
        assert got["global_step"] == 9
        want = model.state_dict()
        assert sorted(got["state_dict"]) == sorted(want)
        for k, v in want.items():
            assert torch.equal(got["state_dict"][k], v), (n, k)


def test_checkpoints_open_with_the_cli(uninterrupted, ckpt):
    d = uninterrupted / "ckpts" / "last.ckpt"
    r = ckpt("verify", d, expect=0)
    assert "ok" in r.stdout
    r = ckpt("inspect", d, expect=0)
    for name in ("state_dict/net.0.weight", "optimizer_states/0/state/0/exp_avg_sq", "callbacks/RngState/torch_rng"):
        assert name in r.stdout, r.stdout


def test_sigkill_during_a_save_leaves_last_resumable(tmp_path):
    out = tmp_path / "run"
    last = out / "ckpts" / "last.ckpt"
    run_train(out, 1, "--top-k", "0", "--dump", tmp_path / "after1.pt")
    before = ckptstore.open(last).checkpoint_id

    # Epoch 2 in a new process, resumed from "last"; the save of its last.ckpt stops at the
    # engine's pause point (shards durable, new manifest not renamed in) and is killed there.
    pause = tmp_path / "pause"
    pause.mkdir()
    point = "before-manifest-rename"
    env = dict(os.environ, CKPTSTORE_TEST_PAUSE=point, CKPTSTORE_TEST_PAUSE_DIR=str(pause))
    child = subprocess.Popen(
        [sys.executable, str(TRAIN), str(out), "2", "--resume", "last", "--top-k", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marker = pause / point
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"the child exited ({child.returncode}) before pausing:\n{child.stderr.read().decode()[-4000:]}")
            assert time.monotonic() < deadline, f"the child did not reach {point}"
            time.sleep(0.05)  # polling for the announcement, not waiting for a state
        assert int(marker.read_text()) == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # The killed save left its files, but last.ckpt still commits to the epoch-1 checkpoint.
    leftovers = [n for n in os.listdir(last) if before not in n and n.startswith(("shard-", ".ckpt-tmp-"))]
    assert leftovers, os.listdir(last)
    assert ckptstore.open(last).checkpoint_id == before

    # Lightning's own "last" logic picks it, and it resumes exactly the epoch-1 state.
    run_train(out, 1, "--resume", "last", "--top-k", "0", "--dump", tmp_path / "resumed.pt")
    got, want = load_dump(tmp_path / "resumed.pt"), load_dump(tmp_path / "after1.pt")
    assert got["ckpt_path"] == str(last)
    assert_dumps_equal(got, want, keys=("params", "optimizer", "scheduler", "global_step"))
    assert got["global_step"] == 6


def test_flipped_byte_fails_the_resume_and_changes_nothing(uninterrupted, tmp_path):
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(uninterrupted / "ckpts" / "epoch=1-step=12.ckpt", damaged)
    name = "optimizer_states/0/state/2/exp_avg"
    shard, off = tensor_offset(damaged, name)
    h.flip_byte(shard, off + 5, 0x01)

    torch.manual_seed(5)
    model = lt.Net()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = lt.make_trainer(str(tmp_path / "out"), 4, "sync", -1)
    with pytest.raises(ChecksumError) as e:
        trainer.fit(model, lt.data(), ckpt_path=str(damaged))
    assert name in str(e.value), str(e.value)
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, before, "model")
    assert trainer.global_step == 0
    assert not (tmp_path / "out" / "ckpts").exists() or not os.listdir(tmp_path / "out" / "ckpts")


def test_top_k_removes_only_superseded_checkpoints(tmp_path):
    io = CheckpointIO()
    torch.manual_seed(0)
    trainer = lt.make_trainer(str(tmp_path), 4, "sync", 2)
    trainer.strategy.checkpoint_io = io
    trainer.fit(lt.Net(), lt.data())
    cb = trainer.checkpoint_callback
    d = tmp_path / "ckpts"
    kept = {Path(p).name for p in cb.best_k_models}
    assert len(kept) == 2
    assert set(os.listdir(d)) == kept | {"last.ckpt"}
    assert io.saves == 8  # 4 top-k saves (2 of them removed since) and 4 of last.ckpt
    for n in os.listdir(d):
        ckptstore.open(d / n).verify()

    # remove_checkpoint: a missing path is a no-op; a file torch.save wrote (a stock
    # checkpoint from before the switch) goes; what is neither that nor a committed ckptstore
    # checkpoint is refused and left in place.
    io.remove_checkpoint(d / "missing.ckpt")
    stock = tmp_path / "stock.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, stock)
    io.remove_checkpoint(stock)
    assert not stock.exists()
    f = tmp_path / "torch.ckpt"
    f.write_bytes(b"not ours")
    with pytest.raises(InvalidArgumentError, match="neither a committed ckptstore checkpoint"):
        io.remove_checkpoint(f)
    assert f.read_bytes() == b"not ours"
    plain = tmp_path / "plain.ckpt"
    plain.mkdir()
    (plain / "data.bin").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="neither a committed ckptstore checkpoint"):
        io.remove_checkpoint(plain)
    assert (plain / "data.bin").exists()
    victim = d / sorted(kept)[0]
    # What a removal killed between its rename and its delete leaves (ckptstore.atomic):
    # swept by the next removal, with nothing else of the directory touched.
    trash = d / ".epoch=0.ckpt.ckpt-trash-0123456789abcdef"
    trash.mkdir()
    (trash / "x").write_bytes(b"x")
    io.remove_checkpoint(victim)
    assert not victim.exists() and not trash.exists()
    assert set(os.listdir(d)) == (kept | {"last.ckpt"}) - {victim.name}


# ---- Fabric: damage leaves the live state, the ColossalAI scenario ------------------------


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 3)


def _fabric():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[CheckpointIO()])
    torch.manual_seed(3)
    model = TwoLayers()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


def _step(fabric, model, opt, use_b: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    y = model.a(x)
    loss = (model.b(y) ** 2).mean() if use_b else (y**2).mean()
    opt.zero_grad(set_to_none=True)
    fabric.backward(loss)
    opt.step()


def test_fabric_flipped_byte_leaves_model_and_optimizer_unchanged(tmp_path):
    fabric, model, opt = _fabric()
    for s in range(2):
        _step(fabric, model, opt, True, s)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    saved = snapshot(model, opt)
    _step(fabric, model, opt, True, 9)
    live = snapshot(model, opt)

    name = "optimizer/state/3/exp_avg_sq"
    shard, off = tensor_offset(path, name)
    h.flip_byte(shard, off, 0x80)
    with pytest.raises(ChecksumError) as e:
        fabric.load(path, {"model": model, "optimizer": opt})
    assert name in str(e.value) and "fabric.ckpt" in str(e.value), str(e.value)
    assert_same(snapshot(model, opt), live, "live state")

    h.flip_byte(shard, off, 0x80)  # repaired: the load restores the saved state exactly
    rest = fabric.load(path, {"model": model, "optimizer": opt})
    assert rest == {"step": 2}
    assert_same(snapshot(model, opt), saved, "restored state")


def test_colossalai_scenario_state_of_unnamed_params_is_gone(tmp_path):
    fabric, model, opt = _fabric()
    _step(fabric, model, opt, False, 0)  # only layer a gets gradients: state for a only
    assert len(opt.state) == 2
    path = tmp_path / "a_only.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    saved = snapshot(model, opt)
    _step(fabric, model, opt, True, 1)  # now the live optimizer holds state for b too
    b_params = list(model.b.parameters())
    assert all(p in opt.state for p in b_params)

    fabric.load(path, {"model": model, "optimizer": opt})
    assert len(opt.state) == 2
    assert not any(p in opt.state for p in b_params), "state for b survived the load (a merge)"
    assert_same(snapshot(model, opt), saved, "restored state")


# ---- non-blocking saves -----------------------------------------------------------------


def test_async_saves_reuse_their_buffers(tmp_path):
    io = CheckpointIO(async_save=True)
    seen = []

    class Probe(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pass

        def on_train_end(self, trainer, pl_module):
            io.wait()
            seen.append((io.snapshot_bytes, io.snapshot_allocations))

    torch.manual_seed(0)
    model = lt.Net()
    trainer = lt.make_trainer(str(tmp_path), 6, "async", -1, extra_callbacks=[Probe()])
    trainer.strategy.checkpoint_io = io
    trainer.fit(model, lt.data())
    assert io.saves == 12  # each epoch: its own checkpoint and last.ckpt
    last = tmp_path / "ckpts" / "last.ckpt"
    n_tensors = len(ckptstore.open(last).keys())
    ((nbytes, allocations),) = seen
    # One buffer set (max_in_flight=1), allocated by the first save and reused by the other 11.
    assert allocations == n_tensors, (allocations, n_tensors)
    assert nbytes > 0
    assert io.snapshot_bytes == 0  # teardown (end of fit) freed them
    got = CheckpointIO().load_checkpoint(last)
    assert_same(
        collections.OrderedDict((k, v) for k, v in got["state_dict"].items()),
        collections.OrderedDict((k, v.detach()) for k, v in model.state_dict().items()),
        "state_dict",
    )
    for p in os.listdir(tmp_path / "ckpts"):
        ckptstore.open(tmp_path / "ckpts" / p).verify()


def test_async_snapshot_is_taken_before_save_returns(tmp_path):
    io = CheckpointIO(async_save=True)
    t = torch.ones(1000)
    io.save_checkpoint({"state_dict": {"w": t}, "epoch": 1}, tmp_path / "a.ckpt")
    t.fill_(2.0)  # at once: the save holds its own copy
    io.save_checkpoint({"state_dict": {"w": t}, "epoch": 2}, tmp_path / "b.ckpt")
    got_a = io.load_checkpoint(os.path.relpath(tmp_path / "a.ckpt"))  # waits for that save (any spelling)
    got_b = io.load_checkpoint(tmp_path / "b.ckpt")
    assert_same(got_a, {"state_dict": {"w": torch.ones(1000)}, "epoch": 1})
    assert_same(got_b, {"state_dict": {"w": torch.full((1000,), 2.0)}, "epoch": 2})
    io.teardown()


def test_async_errors_surface_at_the_next_save_and_at_teardown(tmp_path):
    in_the_way = tmp_path / "file.ckpt"
    in_the_way.write_bytes(b"a file where the checkpoint directory would go")
    io = CheckpointIO(async_save=True)
    io.save_checkpoint({"w": torch.ones(3)}, in_the_way)  # fails on the background thread
    with pytest.raises(CheckpointError):
        io.teardown()
    assert in_the_way.read_bytes().startswith(b"a file")

    io.save_checkpoint({"w": torch.ones(3)}, in_the_way)
    with pytest.raises(CheckpointError):  # the next save raises the earlier one's error
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "ok.ckpt")
    io.teardown()  # reported already: nothing more to raise
    # Unpicklable values are refused on the caller's thread, before any copy.
    with pytest.raises(PickleNotAllowedError):
        io.save_checkpoint({"o": Opaque(1)}, tmp_path / "o.ckpt")
    io.teardown()


# ---- FSDP2 / ModelParallelStrategy --------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, *args) -> None:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
            RANK=str(r), LOCAL_RANK=str(r), NODE_RANK="0", OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen([sys.executable, str(FSDP), *map(str, args)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=CHILD_TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode, outs[r][1][-3000:] if r < len(outs) else "") for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"lightning_fsdp.py {args} failed: {bad}"


def test_fsdp2_save_on_two_ranks_resume_on_one(tmp_path, ckpt):
    ck = tmp_path / "fsdp.ckpt"
    _launch(2, "save", ck, 2, tmp_path / "saved.pt")
    m = h.read_manifest(ck)
    assert any("-r1-" in s["file"] for s in m["shards"]) and any("-r0-" in s["file"] for s in m["shards"])
    assert not (ck / "meta.pt").exists() and not (ck / ".metadata").exists()  # no DCP files
    # Nothing pickled: DCP got tensors only (its bytes items would be torch.save pickles).
    assert not [t["name"] for t in m["tensors"] if t["name"].startswith("dcp.bytes/")]
    ckpt("verify", ck, expect=0)

    _launch(1, "resume", ck, 2, tmp_path / "resumed.pt")
    saved, resumed = load_dump(tmp_path / "saved.pt"), load_dump(tmp_path / "resumed.pt")
    assert saved["global_step"] == resumed["global_step"] == 4  # 2 epochs of 2 steps per rank
    assert_same(dict(resumed["model"]), dict(saved["model"]), "model")
    assert_same(resumed["optimizer"]["state"], saved["optimizer"]["state"], "optimizer state")
    assert resumed["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    # The trained state is not the initial one (the comparison can fail).
    torch.manual_seed(0)
    sys.path.insert(0, str(HERE))
    import lightning_fsdp

    init = lightning_fsdp.Net().net.state_dict()
    assert not torch.equal(init["0.weight"], saved["model"]["net.0.weight"])
    # The rest of Lightning's dict came back through the manifest (no pickle).
    loaded = resumed["loaded"]
    assert loaded["global_step"] == 4 and loaded["epoch"] == 2
    assert_same(loaded["extra"], {"marker": torch.arange(5, dtype=torch.int16), "note": ("a", 1)}, "extra")
    assert math.isfinite(float(saved["model"]["net.2.bias"].sum()))

    # One flipped byte in rank 1's shard: the resume fails naming the tensor, and the model
    # keeps its initial parameters (every CRC is checked before any destination is written).
    m = h.read_manifest(ck)
    t = next(t for t in m["tensors"] if t["name"].startswith("optimizer_0.state.net.2.weight.exp_avg"))
    h.flip_byte(ck / m["shards"][t["shard"]]["file"], t["offsets"][0] + 2, 0x10)
    _launch(1, "damaged", ck, 2, tmp_path / "damaged.pt")
    damaged = load_dump(tmp_path / "damaged.pt")
    assert damaged["error"].startswith("ChecksumError") and t["name"] in damaged["error"], damaged["error"]
    assert str(ck) in damaged["error"]
    assert_same(dict(damaged["model"]), {f"net.{k}": v for k, v in init.items()}, "model after the failed resume")


# ---- a change of optimizer class (AdamW saved, SGD live) ------------------------------------


class SgdNet(lt.Net):
    """lt.Net resumed with another optimizer class: SGD with momentum (and its StepLR)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)}


def test_trainer_refuses_another_optimizer_class_unless_allowed(tmp_path):
    from ckptstore.integrations.lightning import OptimizerCheck

    torch.manual_seed(0)
    saver = lt.make_trainer(str(tmp_path / "adamw"), 1, "sync", -1, extra_callbacks=[OptimizerCheck()])
    saver.fit(lt.Net(), lt.data())
    src = tmp_path / "adamw" / "ckpts" / "last.ckpt"
    saved = CheckpointIO().load_checkpoint(src)
    assert saved["callbacks"]["OptimizerCheck"] == {"optimizer_classes": ["AdamW"]}  # recorded at save

    # Refused, naming both classes, before Lightning loads any optimizer, scheduler or loop
    # state and before a step. (Lightning's stock strategies load the weights before they
    # build the optimizers, so the model holds the checkpoint's weights by then.)
    torch.manual_seed(1)
    model = SgdNet()
    trainer = lt.make_trainer(str(tmp_path / "refused"), 2, "sync", -1, extra_callbacks=[OptimizerCheck()])
    with pytest.raises(ckptstore.IncompatibleStateError, match=r"optimizer is AdamW, the live optimizer is SGD") as e:
        trainer.fit(model, lt.data(), ckpt_path=str(src))
    assert str(src) in str(e.value)
    (opt,) = trainer.optimizers
    assert type(opt) is torch.optim.SGD and len(opt.state) == 0  # no state was loaded into it
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["momentum"] == 0.9
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 0
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert not (tmp_path / "refused" / "ckpts").exists()
    # What the check cannot prevent there (module docs): the weights were restored first.
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, dict(saved["state_dict"]), "model")

    # With the opt-in: resumed, SGD keeps its momentum (the checkpoint's groups lack it), and
    # the next steps run.
    torch.manual_seed(1)
    model = SgdNet()
    trainer = lt.make_trainer(
        str(tmp_path / "allowed"), 2, "sync", -1, extra_callbacks=[OptimizerCheck(allow_optimizer_change=True)]
    )
    starts = []

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            starts.append(_clone({k: v.detach() for k, v in pl_module.state_dict().items()}))

    trainer.callbacks.append(AtStart())
    trainer.fit(model, lt.data(), ckpt_path=str(src))
    assert_same(starts[0], dict(saved["state_dict"]), "model at the resume")
    assert trainer.global_step == 12  # 6 steps resumed from, 6 run after the change
    (opt,) = trainer.optimizers
    g = opt.param_groups[0]
    assert type(opt) is torch.optim.SGD and g["momentum"] == 0.9 and g["nesterov"] is False
    assert g["betas"] == (0.9, 0.999)  # the checkpoint's groups, as stored
    assert math.isclose(g["lr"], 0.02 * 0.7 * 0.7)  # the checkpoint's schedule went on
    for p in model.parameters():
        assert "momentum_buffer" in opt.state[p]  # SGD stepped
    assert not torch.equal(model.net[0].weight.detach(), starts[0]["net.0.weight"])
    # The new checkpoint records SGD, the class that saved it.
    last = CheckpointIO().load_checkpoint(tmp_path / "allowed" / "ckpts" / "last.ckpt")
    assert last["callbacks"]["OptimizerCheck"] == {"optimizer_classes": ["SGD"]}


def test_fsdp2_refuses_another_optimizer_class_before_anything_changes(tmp_path):
    ck = tmp_path / "adamw.ckpt"
    _launch(1, "save", ck, 1, tmp_path / "saved.pt", "adamw")
    assert ckptstore.open(ck).metadata["ckptstore.lightning"]["optimizer_classes"] == ["AdamW"]
    saved = load_dump(tmp_path / "saved.pt")

    # Refused naming both classes, before any state dict is built or anything is read: the
    # model keeps its initial parameters and the SGD optimizer has no state.
    _launch(1, "changed", ck, 2, tmp_path / "changed.pt", "sgd")
    changed = load_dump(tmp_path / "changed.pt")
    assert changed["error"].startswith("IncompatibleStateError"), changed["error"]
    assert "optimizer is AdamW, the live optimizer is SGD" in changed["error"], changed["error"]
    assert str(ck) in changed["error"]
    torch.manual_seed(0)
    sys.path.insert(0, str(HERE))
    import lightning_fsdp

    init = {f"net.{k}": v for k, v in lightning_fsdp.Net().net.state_dict().items()}
    assert_same(dict(changed["model"]), init, "model after the refusal")
    assert changed["optimizer_class"] == "SGD" and changed["live_state_keys"] == []
    assert changed["global_step"] == 0

    # With the opt-in: the model resumes exactly, SGD keeps its momentum, and it steps.
    _launch(1, "changed_allowed", ck, 2, tmp_path / "allowed.pt", "sgd")
    allowed = load_dump(tmp_path / "allowed.pt")
    start = allowed["at_train_start"]
    assert_same(dict(start["model"]), dict(saved["model"]), "model at the resume")
    (g,) = start["param_groups"]
    assert g["momentum"] == 0.9 and g["lr"] == 0.02 and g["weight_decay"] == 0.01  # live + checkpoint's
    assert allowed["global_step"] == saved["global_step"] + 4  # one more epoch of 4 steps
    assert allowed["live_state_keys"] and all(k == ["momentum_buffer"] for k in allowed["live_state_keys"])
    assert not torch.equal(allowed["model"]["net.0.weight"], saved["model"]["net.0.weight"])
