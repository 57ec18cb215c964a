"""The tiered manager (ckptstore.torch.distributed.CheckpointManager, issue 39) selected from
the frameworks' own configuration, in real 2-rank gloo jobs on one machine:

* TorchTitan: ``CheckpointManager.Config(local_folder=..., persist_every=..., replicas=...,
  local_keep_latest_k=...)``: steps saved through the tiers; a new job resumes the newest
  step from the local tier, and, the local tier gone, from the persistent one (``folder``),
  bit-identical (parameters, AdamW state, schedulers, each rank's dataloader, train state) to
  an uninterrupted run;
* Lightning: ``ModelParallelStrategy(tiered={...})`` (FSDP2): ``ModelCheckpoint`` and
  ``fit(ckpt_path="last")`` unchanged, the steps saved through the tiers, the resume by
  ``restore_latest``, bit-identical to an uninterrupted run.

Both ranks share one local directory, so the job is one host: ``replicas=1`` drops to 0
with a warning, which the tests assert.

The frameworks are required: without them these tests fail at import.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import torchtitan  # noqa: F401 - a missing framework fails the module, never skips it
import lightning  # noqa: F401

import ckptstore
import dist_helpers as dh
import torchtitan_job as tj
from ckptstore.integrations.torchtitan import CheckpointManager, step_name

STEPS = 10  # the schedule's length (as test_torchtitan.py): lr is not 0 at step 6
REPLICAS_WARNING = "replicas=1 needs 2 hosts, the job has 1: 0 replica(s) kept"


def assert_same(got, want, what: str = "") -> None:
    """Bit-identical: tensors by dtype, shape and bytes; everything else by ==."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (what, sorted(set(got) ^ set(want)))
        for k in want:
            assert_same(got[k], want[k], f"{what}/{k}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what
    else:
        assert got == want, (what, got, want)


# ---- TorchTitan ---------------------------------------------------------------------------------


def titan_config(d: str) -> dict:
    """The tiered mode from TorchTitan's ``[checkpoint]`` config: ``folder`` is the persistent
    tier."""
    return {"local_folder": os.path.join(d, "local"), "persist_every": 4, "replicas": 1,
            "local_keep_latest_k": 2}


def titan_run(rank, world, d, until, load, tiered=True):
    """One job of 2 ranks (FSDP2): build from the config, load (as the Trainer does), train
    to ``until`` (saves every 2 steps), close; what it resumed, each rank's state, and the
    warnings of the build."""
    cfg = titan_config(d) if tiered else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = tj.build(os.path.join(d, "persistent"), rank=rank, world=world, fsdp=True,
                       steps=STEPS, **cfg)
    tier = None
    if load:
        job.checkpointer.load(step=-1)
        tier = job.checkpointer.tiered.last_tier if job.checkpointer.tiered else None
    tj.train(job, until, load=False)
    job.checkpointer.close()
    snap = tj.snapshot(job)
    return {"snap": snap, "tier": tier, "warnings": [str(w.message) for w in caught]}


def titan_first(rank, world, d):
    """The uninterrupted run (steps 1-6, untiered, in a folder of its own), then, in the
    same processes, the tiered run of steps 1-4 that the tests resume."""
    want = titan_run(rank, world, os.path.join(d, "plain"), 6, False, False)
    return want, titan_run(rank, world, d, 4, False)


def state_of(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k != "loaded_step"}


class Probe:
    """A Stateful of the job that no saved step holds."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("never loaded")


def titan_refused(rank, world, d):
    """A job with one more state than the steps hold: its load must fail with nothing
    changed (the model and optimizer are restored by the tiered manager, the other states
    after it: they are checked before anything changes)."""
    job = tj.build(os.path.join(d, "persistent"), rank=rank, world=world, fsdp=True, steps=STEPS, **titan_config(d))
    job.checkpointer.states["probe"] = Probe()
    before = tj.snapshot(job)
    err = None
    try:
        job.checkpointer.load(step=-1)
    except ckptstore.CheckpointError as e:
        err = str(e)
    after = tj.snapshot(job)
    job.checkpointer.close()
    return {"err": err, "before": before, "after": after}


def test_torchtitan_config_selects_the_tiered_manager(tmp_path):
    d = str(tmp_path)
    # Uninterrupted: steps 1-6. Then steps 1-4 through the tiers (saves at 2 and 4, step 4
    # also persisted); a new job resumes step 4 from the local tier and trains 5-6.
    want, first = zip(*dh.results(2, titan_first, d))
    assert all(REPLICAS_WARNING in " ".join(r["warnings"]) for r in first), first[0]["warnings"]
    assert first[0]["snap"]["train_state"]["step"] == 4
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == ["step-00000002", "step-00000004"]
    assert ckptstore.CheckpointManager(persistent).steps() == [4]  # persist_every=4
    with ckptstore.open(persistent / step_name(4)) as ck:  # an ordinary committed checkpoint
        assert ck.metadata["ckptstore.torch.distributed"]["extra"]["ckptstore.torchtitan"]
    resumed = dh.results(2, titan_run, d, 6, True)
    for r in range(2):
        assert resumed[r]["snap"]["loaded_step"] == 4 and resumed[r]["tier"] == "fast"
        # Each rank's own dataloader position, the train state, the scheduler, the
        # parameters and AdamW state (gathered whole) as if never interrupted.
        assert_same(state_of(resumed[r]["snap"]), state_of(want[r]["snap"]), f"rank {r}")
    assert resumed[0]["snap"]["lr"]["lrs"][0] > 0.0
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == ["step-00000004", "step-00000006"]

    # The local tier lost (RAM of a restarted host): step 4 comes back from ``folder``.
    shutil.rmtree(local)
    again = dh.results(2, titan_run, d, 6, True)
    for r in range(2):
        assert again[r]["snap"]["loaded_step"] == 4 and again[r]["tier"] == "persistent"
        assert_same(state_of(again[r]["snap"]), state_of(want[r]["snap"]), f"rank {r}")

    # A job with a state that no step holds: every step is passed over, and the job is left
    # as it was built (the model and the optimizer too: the states are checked first).
    refused = dh.results(2, titan_refused, d)
    for r in range(2):
        err = refused[r]["err"]
        assert err and "no step can be restored" in err and "the checkpoint holds no state 'probe'" in err, err
        assert "step 6: fast tier" in err and "step 4: persistent tier" in err, err
        assert_same(state_of(refused[r]["after"]), state_of(refused[r]["before"]), f"rank {r}")


def test_torchtitan_tiered_config_is_checked():
    """Settings the tiered mode cannot honour are refused when the config is made, and the
    tiered keys without ``local_folder`` too."""
    ok = CheckpointManager.Config(enable=True, local_folder="/dev/shm/ckpt", interval=10, persist_every=100)
    assert ok.local_folder == "/dev/shm/ckpt" and ok.replicas == 1 and ok.local_keep_latest_k == 2
    bad = [
        ({"persist_every": 100}, "set checkpoint.local_folder"),
        ({"local_folder": "x", "persist_every": 15}, "multiple of checkpoint.interval"),
        ({"local_folder": "x", "async_mode": "async"}, "async_mode is not supported"),
        ({"local_folder": "x", "load_step": 3}, "load_step is not supported"),
        ({"local_folder": "x", "local_keep_latest_k": 0}, "at least 1"),
        ({"local_folder": "s3://b/x"}, "must be a directory"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            CheckpointManager.Config(enable=True, interval=10, **kw)


# ---- Lightning ----------------------------------------------------------------------------------


class Opaque:
    """A value of Lightning's dict that only a pickle stores."""


def lightning_run(rank, world, d, max_epochs, resume, tiered=True, pickled=None):
    """One job of 2 ranks: lightning_fsdp.py's FSDP2 ``Net`` under ckptstore's
    ModelParallelStrategy, ``ModelCheckpoint(save_last=True)`` every epoch (2 steps per rank),
    ``fit(ckpt_path="last" if resume)``; the gathered model and optimizer state at the end,
    what the resume loaded, and the warnings. ``pickled`` (True or False): the dict gets an
    ``Opaque`` value, the strategy that ``allow_pickle``, and an error of ``fit`` is
    returned."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ckptstore.integrations.lightning import ModelParallelStrategy
    from lightning_fsdp import Net

    opts = {} if pickled is None else {"allow_pickle": pickled}
    if tiered:
        opts["tiered"] = {"local": os.path.join(d, "local"), "persistent": os.path.join(d, "persistent"),
                          "persist_every": 4, "replicas": 1, "keep_last": 2}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g))
    model = Net()
    if pickled is not None:
        saving = model.on_save_checkpoint
        model.on_save_checkpoint = lambda ck: (saving(ck), ck.__setitem__("opaque", Opaque()))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_epochs=max_epochs, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, **opts),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(d, "ckpts"), save_last=True, every_n_epochs=1)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=8), ckpt_path="last" if resume else None)
        except Exception as e:  # noqa: BLE001 - returned
            if pickled is None:
                raise
            error = f"{type(e).__name__}: {e}"
    full = StateDictOptions(full_state_dict=True)  # gathered whole on every rank
    msd = get_model_state_dict(trainer.strategy.model, options=full)
    osd = get_optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], options=full)
    return {
        "model": {k: v.detach().clone() for k, v in msd.items()}, "optimizer": osd["state"],
        "groups": osd["param_groups"], "global_step": trainer.global_step, "loaded": model.loaded,
        "at_train_start": model.at_train_start, "warnings": [str(w.message) for w in caught], "error": error,
    }


def lightning_first(rank, world, d):
    """The uninterrupted run (3 epochs, untiered), then the tiered run of 2 epochs."""
    want = lightning_run(rank, world, os.path.join(d, "plain"), 3, False, False)
    return want, lightning_run(rank, world, d, 2, False)


def test_lightning_strategy_option_selects_the_tiered_manager(tmp_path):
    d = str(tmp_path)
    want, first = zip(*dh.results(2, lightning_first, d))
    assert first[0]["global_step"] == 4
    assert any(REPLICAS_WARNING in w for w in first[0]["warnings"]), first[0]["warnings"]
    local, persistent, ckpts = tmp_path / "local", tmp_path / "persistent", tmp_path / "ckpts"
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == ["step-00000002", "step-00000004"]
    assert ckptstore.CheckpointManager(persistent).steps() == [4]
    # Lightning's paths hold pointers (no tensors); top-k removed the epoch-0 one.
    assert sorted(os.listdir(ckpts)) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    with ckptstore.open(ckpts / "last.ckpt") as ck:
        assert ck.metadata["ckptstore.lightning.tiered"] == {"version": 1, "step": 4}
        assert len(ck) == 0

    resumed = dh.results(2, lightning_run, d, 3, True)
    for r in range(2):
        got = resumed[r]
        assert got["loaded"]["global_step"] == 4 and got["loaded"]["epoch"] == 1
        assert_same(got["loaded"]["extra"], {"marker": torch.arange(5, dtype=torch.int16), "note": ("a", 1)})
        assert got["global_step"] == 6
        assert_same(got["model"], want[r]["model"], f"rank {r} model")
        assert_same(got["optimizer"], want[r]["optimizer"], f"rank {r} optimizer")
        assert got["groups"] == want[r]["groups"]
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == ["step-00000004", "step-00000006"]

    # The local tier lost: "last" (step 6, not persisted) resumes step 4 from the persistent
    # tier, with restore_latest's warning saying what was missing.
    shutil.rmtree(local)
    again = dh.results(2, lightning_run, d, 3, True)
    assert again[0]["loaded"]["global_step"] == 4 and again[0]["global_step"] == 6
    assert any("names step 6" in w and "persistent tier" in w for w in again[0]["warnings"]), again[0]["warnings"]
    assert_same(again[0]["model"], want[0]["model"], "model")
    assert_same(again[0]["optimizer"], want[0]["optimizer"], "optimizer")


def test_lightning_resume_refusing_every_steps_rest_leaves_the_model_untouched(tmp_path):
    """Steps whose rest holds a pickle, resumed without allow_pickle: each step is refused
    before the model and optimizer change (restore_latest's check_extra), so the failed
    resume leaves the model as it was built."""
    d = str(tmp_path)
    first = dh.results(2, lightning_run, d, 2, False, True, True)
    assert first[0]["error"] is None and first[0]["global_step"] == 4
    refused = dh.results(2, lightning_run, d, 3, True, True, False)
    from lightning_fsdp import Net

    torch.manual_seed(0)
    init = Net().state_dict()
    for r in range(2):
        err = refused[r]["error"]
        assert err and "no step can be restored" in err and "PickleNotAllowedError" in err, err
        assert "step 4: fast tier" in err and "step 2: fast tier" in err, err
        assert_same(refused[r]["model"], init, f"rank {r} model")


def test_lightning_tiered_option_is_checked():
    """The dict is the tiered manager's arguments, checked when the strategy is made."""
    from ckptstore.errors import InvalidArgumentError
    from ckptstore.integrations.lightning import ModelParallelStrategy

    ok = ModelParallelStrategy(tiered={"local": "/dev/shm/ckpt", "persist_every": 10, "timeout": 60})
    assert ok._tiered.args["timeout"] == 60 and ok._tiered.mgr is None  # made at first use
    for kw, msg in [
        ({"tiered": {"persistent": "run"}}, "at least 'local'"),
        ({"tiered": {"local": "x", "keep_latest_k": 2}}, "unknown argument 'keep_latest_k'"),
        ({"tiered": {"local": "x"}, "allow_optimizer_change": True}, "not supported in the tiered mode"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            ModelParallelStrategy(**kw)
