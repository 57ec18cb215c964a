"""ckptstore.integrations.lightning: the contracts Lightning's own code relies on.

* the plug-in pickles (``torch.save(trainer)``, spawn launches): settings kept, no lock or
  thread carried over, a save in flight waited for (never lost), a background save's error
  raised; a Trainer using it pickles, and ``strategy="ddp_spawn"`` runs;
"""

from __future__ import annotations

import collections
import io as _io
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
