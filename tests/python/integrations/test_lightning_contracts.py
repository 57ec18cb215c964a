"""ckptstore.integrations.lightning: the contracts Lightning's own code relies on.

* the plug-in pickles (``torch.save(trainer)``, spawn launches): settings kept, no lock or
  thread carried over, a save in flight waited for (never lost), a background save's error
  raised; a Trainer using it pickles, and ``strategy="ddp_spawn"`` runs;
* plain ``torch.save`` files load (``fabric.load_raw`` of a pretrained state dict, a run begun
  with Lightning's default IO resumed), with ``torch.load(weights_only=True)`` unless opted in,
  and the load is logged;
* ``LightningModule.load_from_checkpoint`` of a ckptstore checkpoint: weights and hparams;
  everything else still goes to Lightning's own loader;
* ``map_location`` callables returning ``None`` (``torch.load``'s "default placement", what
  Lightning's ``_default_map_location`` returns for CPU tensors) keep the tensor.
"""

from __future__ import annotations

import collections
import io as _io
import logging
import pickle
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptstore.errors import CheckpointError, InvalidArgumentError
from ckptstore.integrations import lightning as ckl
from ckptstore.integrations.lightning import CheckpointIO, OptimizerCheck, PickleNotAllowedError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_train as lt  # noqa: E402
from test_lightning import Opaque, _clone, assert_same  # noqa: E402

warnings.filterwarnings("ignore", module="lightning")


def _state(module) -> dict:
    return collections.OrderedDict((k, v.detach().clone()) for k, v in module.state_dict().items())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def rank_zero_log():
    """The messages of Lightning's rank_zero_info (its logger is chosen at import time)."""
    import lightning_utilities.core.rank_zero as rz

    logger = rz.log
    rec = _Records()
    old = logger.level
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        yield rec.messages
    finally:
        logger.removeHandler(rec)
        logger.setLevel(old)


# ---- 1. pickling -------------------------------------------------------------------------


def test_the_plugin_pickles_and_its_copy_saves_and_loads(tmp_path):
    io = CheckpointIO(async_save=True, allow_pickle=True, max_in_flight=2, max_shard_size=1 << 20, cleanup="background")
    io.save_checkpoint({"w": torch.arange(6.0)}, tmp_path / "a.ckpt")  # a thread, a lock, buffers
    copy = pickle.loads(pickle.dumps(io))
    assert type(copy) is CheckpointIO and copy is not io
    for attr in ("allow_pickle", "async_save", "max_in_flight", "max_shard_size", "cleanup", "saves"):
        assert getattr(copy, attr) == getattr(io, attr), attr
    assert copy._saver is None and copy._pending == {} and copy._lock is not io._lock
    # The copy works on its own (its own lock, a new background thread at its first save).
    copy.save_checkpoint({"w": torch.ones(3), "o": Opaque(4)}, tmp_path / "b.ckpt")
    got = copy.load_checkpoint(tmp_path / "b.ckpt")
    assert got["o"] == Opaque(4)
    assert_same(got["w"], torch.ones(3))
    copy.teardown()
    # The original goes on too.
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), {"w": torch.arange(6.0)})
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "c.ckpt")
    io.teardown()
    assert_same(CheckpointIO().load_checkpoint(tmp_path / "c.ckpt"), {"w": torch.zeros(2)})


def test_pickling_waits_for_the_save_in_flight(tmp_path):
    """A save held on its background thread (until `release` is set): pickling returns only
    once it is committed, so the copy never stands for a save that could still be lost."""
    io = CheckpointIO(async_save=True)
    release = threading.Event()
    saver = io._ensure_saver()
    save = saver.save
    saver.save = lambda location, obj: save(location, obj, after=release)
    path = tmp_path / "held.ckpt"
    io.save_checkpoint({"w": torch.full((4,), 3.0)}, path)
    assert not (path / ckl.MANIFEST).exists()  # held: nothing committed yet

    seen = {}

    def dump() -> None:
        seen["data"] = pickle.dumps(io)
        seen["committed"] = (path / ckl.MANIFEST).is_file()

    t = threading.Thread(target=dump)
    t.start()
    t.join(1.0)  # an implementation that does not wait has finished by now, uncommitted
    release.set()
    t.join()
    assert seen["committed"] is True
    assert_same(pickle.loads(seen["data"]).load_checkpoint(path), {"w": torch.full((4,), 3.0)})
    io.teardown()


def test_pickling_raises_a_background_save_error(tmp_path):
    in_the_way = tmp_path / "file.ckpt"
    in_the_way.write_bytes(b"a file where the checkpoint directory would go")
    io = CheckpointIO(async_save=True)
    io.save_checkpoint({"w": torch.ones(3)}, in_the_way)  # fails on the background thread
    with pytest.raises(CheckpointError):
        pickle.dumps(io)
    pickle.loads(pickle.dumps(io))  # reported: pickles now
    io.teardown()


def test_a_trainer_using_the_plugin_pickles(tmp_path):
    io = CheckpointIO(async_save=True)
    trainer = lt.make_trainer(str(tmp_path), 1, "sync", -1, extra_callbacks=[OptimizerCheck()])
    trainer.strategy.checkpoint_io = io
    for data in (pickle.dumps(trainer), _torch_save(trainer)):
        copy = pickle.loads(data) if isinstance(data, bytes) else torch.load(data, weights_only=False)
        cio = copy.strategy.checkpoint_io
        assert type(cio) is CheckpointIO and cio.async_save and cio is not io
    # The unpickled Trainer trains and checkpoints through its copy of the plug-in.
    copy = pickle.loads(pickle.dumps(trainer))
    torch.manual_seed(0)
    model = lt.Net()
    copy.fit(model, lt.data())
    last = tmp_path / "ckpts" / "last.ckpt"
    assert (last / ckl.MANIFEST).is_file()
    assert_same(CheckpointIO().load_checkpoint(last)["state_dict"], _state(model), "state_dict")


def _torch_save(obj) -> _io.BytesIO:
    buf = _io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_ddp_spawn_runs_with_the_plugin(tmp_path):
    """strategy="ddp_spawn" pickles the Trainer (and its plug-in) into a spawned process,
    which trains and saves; Lightning hands the final weights back to this process through
    the plug-in (a temporary checkpoint saved there, loaded and removed here)."""
    import torch.multiprocessing as mp

    if "spawn" not in mp.get_all_start_methods():
        pytest.skip("the spawn start method is not available on this platform")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp_spawn",
        max_epochs=1,
        plugins=[CheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = lt.Net()
    before = _state(model)
    trainer.fit(model, lt.data())
    last = tmp_path / "ckpts" / "last.ckpt"
    assert (last / ckl.MANIFEST).is_file()
    saved = CheckpointIO().load_checkpoint(last)
    assert saved["global_step"] == 6
    # The spawned process trained; its weights came back here, equal to its checkpoint's.
    assert not torch.equal(before["net.0.weight"], model.net[0].weight.detach())
    assert_same(_state(model), saved["state_dict"], "state_dict")


# ---- 2. torch.save files -----------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 2, bias=False)
        self.register_buffer("count", torch.tensor(7))


def test_fabric_load_raw_of_a_torch_save_state_dict(tmp_path, rank_zero_log):
    torch.manual_seed(5)
    pretrained = Tiny()
    f = tmp_path / "pretrained.pt"
    torch.save(pretrained.state_dict(), f)
    want = _state(pretrained)

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[CheckpointIO()])
    torch.manual_seed(6)
    model = fabric.setup(Tiny())
    assert not torch.equal(model.a.weight.detach(), want["a.weight"])
    fabric.load_raw(f, model)
    assert_same(_state(model.module), want, "state_dict")
    assert any("pretrained.pt" in m and "torch.save" in m for m in rank_zero_log), rank_zero_log
    # Lightning's weights_only=True changes nothing for a weights-only file.
    torch.manual_seed(6)
    model = fabric.setup(Tiny())
    fabric.load_raw(f, model, weights_only=True)
    assert_same(_state(model.module), want, "state_dict")


def test_a_torch_save_file_that_needs_pickle_is_refused_unless_opted_in(tmp_path):
    f = tmp_path / "objects.pt"
    torch.save({"w": torch.ones(2), "o": Opaque(9)}, f)
    with pytest.raises(PickleNotAllowedError, match=r"objects\.pt.*weights_only=True.*allow_pickle=True") as e:
        CheckpointIO().load_checkpoint(f)
    assert isinstance(e.value, InvalidArgumentError)
    with pytest.raises(PickleNotAllowedError, match="Lightning asked for weights_only=True"):
        CheckpointIO(allow_pickle=True).load_checkpoint(f, weights_only=True)
    got = CheckpointIO(allow_pickle=True).load_checkpoint(f)
    assert got["o"] == Opaque(9)
    assert_same(got["w"], torch.ones(2))
    # Not a torch.save file at all: an error naming the file, not a crash.
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00\x01 not a checkpoint")
    with pytest.raises(InvalidArgumentError, match="junk.ckpt"):
        CheckpointIO().load_checkpoint(junk)
    with pytest.raises(InvalidArgumentError, match="junk.ckpt"):
        CheckpointIO(allow_pickle=True).load_checkpoint(junk)


def test_a_torch_save_file_map_location(tmp_path):
    f = tmp_path / "sd.pt"
    torch.save({"w": torch.arange(4.0)}, f)
    got = CheckpointIO().load_checkpoint(f, map_location=lambda storage, loc: None)
    assert_same(got, {"w": torch.arange(4.0)})
    got = CheckpointIO().load_checkpoint(f, map_location="cpu")
    assert_same(got, {"w": torch.arange(4.0)})


def test_trainer_resumes_a_run_begun_with_the_default_io(tmp_path, rank_zero_log):
    """The migration path: a Trainer with Lightning's default TorchCheckpointIO saves; a
    Trainer with ckptstore's CheckpointIO resumes from that file: model, optimizer,
    scheduler and loops exactly as saved, and trains on."""
    torch.manual_seed(0)
    stock = lt.make_trainer(str(tmp_path / "stock"), 1, "torch", -1)
    stock.fit(lt.Net(), lt.data())
    src = tmp_path / "stock" / "ckpts" / "epoch=0-step=6.ckpt"
    assert src.is_file()
    saved = torch.load(src, weights_only=True)

    starts = []

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            starts.append((_state(pl_module), _clone(trainer.optimizers[0].state_dict()), trainer.global_step))

    torch.manual_seed(1)
    model = lt.Net()
    trainer = lt.make_trainer(str(tmp_path / "switched"), 2, "sync", -1, extra_callbacks=[AtStart()])
    trainer.fit(model, lt.data(), ckpt_path=str(src))
    ((params, opt_state, step),) = starts
    assert_same(params, saved["state_dict"], "state_dict")
    assert_same(opt_state["state"], saved["optimizer_states"][0]["state"], "optimizer state")
    assert opt_state["param_groups"] == saved["optimizer_states"][0]["param_groups"]
    assert step == 6
    assert trainer.global_step == 12
    assert any(str(src) in m and "torch.save" in m for m in rank_zero_log), rank_zero_log
    last = tmp_path / "switched" / "ckpts" / "last.ckpt"
    assert (last / ckl.MANIFEST).is_file()  # the next saves are ckptstore checkpoints


# ---- 3. LightningModule.load_from_checkpoint ------------------------------------------------


def _trained(tmp_path, **hparams) -> tuple:
    torch.manual_seed(0)
    model = lt.Net(**hparams)
    trainer = lt.make_trainer(str(tmp_path), 1, "sync", -1)
    trainer.fit(model, lt.data())
    return model, tmp_path / "ckpts" / "last.ckpt"


def test_load_from_checkpoint_of_a_ckptstore_checkpoint(tmp_path):
    model, last = _trained(tmp_path, lr=0.03, hidden=12)
    assert (last / ckl.MANIFEST).is_file()
    loaded = lt.Net.load_from_checkpoint(last)
    assert type(loaded) is lt.Net
    assert dict(loaded.hparams) == {"lr": 0.03, "hidden": 12}
    assert loaded.net[0].out_features == 12
    assert_same(_state(loaded), _state(model), "state_dict")
    loaded = lt.Net.load_from_checkpoint(str(last), map_location="cpu", lr=0.5)  # kwargs override hparams
    assert loaded.hparams.lr == 0.5 and loaded.hparams.hidden == 12
    assert_same(_state(loaded), _state(model), "state_dict")

    # Anything else is Lightning's own load, unchanged: a torch.save file,
    f = tmp_path / "stock.ckpt"
    torch.save(_stock_dict(model), f)
    assert_same(_state(lt.Net.load_from_checkpoint(f)), _state(model), "state_dict")
    # an open file,
    with open(f, "rb") as fh:
        assert_same(_state(lt.Net.load_from_checkpoint(fh)), _state(model), "state_dict")
    # a directory that is not a ckptstore checkpoint (Lightning's error).
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(IsADirectoryError):
        lt.Net.load_from_checkpoint(tmp_path / "plain_dir")


def _stock_dict(model) -> dict:
    return {
        "state_dict": _state(model),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": L.__version__,
    }


def test_the_helper_needs_no_plugin(tmp_path, monkeypatch):
    import lightning.pytorch.core.saving as saving

    model, last = _trained(tmp_path, hidden=10)
    # Without the patch (a script that never built a CheckpointIO): Lightning's own error.
    monkeypatch.setattr(saving, "pl_load", saving.pl_load._ckptstore_original)
    with pytest.raises(IsADirectoryError):
        lt.Net.load_from_checkpoint(last)
    loaded = ckl.load_from_checkpoint(lt.Net, last)
    assert loaded.hparams.hidden == 10
    assert_same(_state(loaded), _state(model), "state_dict")
    lt.Net.load_from_checkpoint(last)  # installed now


def test_the_patched_loader_falls_through_for_s3_it_cannot_read(monkeypatch):
    """An s3:// location the engine cannot open goes to Lightning's own loader, as before the
    patch (no S3 server needed: the engine's open is stubbed)."""
    from ckptstore.errors import CheckpointIOError, CheckpointNotFoundError

    calls = []

    def lightning_load(path, map_location=None, weights_only=None):
        calls.append((path, map_location, weights_only))
        return {"loaded by": "lightning"}

    routing = ckl._load_from_checkpoint  # where the routing loader looks up the engine's open
    pl_load = routing._routing_loader(lightning_load)
    for err in (CheckpointNotFoundError("no manifest"), CheckpointIOError("no credentials")):

        def refuse(location, err=err, **kw):  # the engine's open(location, lazy=True)
            raise err

        monkeypatch.setattr(routing, "_open", refuse)
        assert pl_load("s3://bkt/stock.ckpt", map_location="cpu", weights_only=True) == {"loaded by": "lightning"}
    assert calls == [("s3://bkt/stock.ckpt", "cpu", True)] * 2
    assert pl_load("https://example.invalid/x.ckpt") == {"loaded by": "lightning"}  # never opened


def test_load_from_checkpoint_unpickles_only_with_weights_only_false(tmp_path):
    model, last = _trained(tmp_path)
    ck = CheckpointIO().load_checkpoint(last)
    ck["callbacks"]["Custom"] = {"obj": Opaque(2)}
    pickled = tmp_path / "pickled.ckpt"
    CheckpointIO(allow_pickle=True).save_checkpoint(ck, pickled)
    with pytest.raises(PickleNotAllowedError, match="pickled.ckpt.*weights_only=False"):
        lt.Net.load_from_checkpoint(pickled)
    with pytest.raises(PickleNotAllowedError, match="weights_only=False"):
        lt.Net.load_from_checkpoint(pickled, weights_only=True)
    loaded = lt.Net.load_from_checkpoint(pickled, weights_only=False)  # torch.load's opt-in
    assert_same(_state(loaded), _state(model), "state_dict")


# ---- 4. map_location callables returning None ---------------------------------------------


def test_map_location_callable_returning_none_keeps_the_tensors(tmp_path):
    from lightning.pytorch.core.saving import _default_map_location

    ck = {"state_dict": collections.OrderedDict(w=torch.randn(3, 2), n=torch.tensor(5)), "step": 4,
          "rng": torch.randint(0, 255, (8,), dtype=torch.uint8)}
    path = tmp_path / "m.ckpt"
    io = CheckpointIO()
    io.save_checkpoint(ck, path)
    for ml in (lambda t, loc: None, _default_map_location):
        assert_same(io.load_checkpoint(path, map_location=ml), ck)
    # A callable's tensor is used as it is; None mixed with tensors, per tensor.
    got = io.load_checkpoint(path, map_location=lambda t, loc: t.double() if t.dtype == torch.float32 else None)
    assert got["state_dict"]["w"].dtype == torch.float64
    assert torch.equal(got["state_dict"]["w"], ck["state_dict"]["w"].double())
    assert_same(got["rng"], ck["rng"])
    assert_same(got["state_dict"]["n"], ck["state_dict"]["n"])
