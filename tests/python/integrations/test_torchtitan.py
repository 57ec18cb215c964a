"""ckptstore.integrations.torchtitan.CheckpointManager driven the way TorchTitan 0.3's
Trainer drives its checkpoint manager (tests/python/integrations/torchtitan_job.py: TorchTitan's
OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader, a train state, a tiny
model built in code). TorchTitan's Trainer itself is not run: it builds its model from a
model registry, tokenizer and Hugging Face dataset, which this CPU suite does not download.

Fresh processes: the script (world size 1) for resume and SIGKILL, dist_helpers' gloo jobs
for FSDP2. The tests fail (never skip) when TorchTitan is not installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchtitan  # noqa: F401 - a missing framework fails the module, never skips it

import ckptstore
import dist_helpers as dh
import torchtitan_job as tj
from ckptstore.integrations.torchtitan import (
    STATE_KEY,
    CheckpointManager,
    PickleNotAllowedError,
    step_name,
)

JOB = str(Path(__file__).with_name("torchtitan_job.py"))
STEPS = 10  # the schedule's length (warmup 2, cosine decay): lr is not 0 at step 6


# ---- helpers ---------------------------------------------------------------------------------


def run_job(folder, out, *, until, mode="disabled", keep=0, env=None, expect_rc=0, no_load=False,
            args=(), stderr=None):
    """One process of the job; its snapshot. ``args``: more of the script's flags;
    ``stderr``: a list that gets the process's stderr."""
    cmd = [sys.executable, JOB, "--folder", str(folder), "--out", str(out), "--until", str(until),
           "--steps", str(STEPS), "--mode", mode, "--keep", str(keep), *args]
    if no_load:
        cmd.append("--no-load")
    e = dict(os.environ)
    e.pop("CKPTSTORE_FAULT", None)
    e.update(env or {})
    r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=180)
    assert r.returncode == expect_rc, f"rc {r.returncode}, expected {expect_rc}:\n{r.stderr[-3000:]}"
    if stderr is not None:
        stderr.append(r.stderr)
    return torch.load(out, weights_only=False) if expect_rc == 0 else None


def assert_same(got: dict, want: dict, what: str = "") -> None:
    """Bit-identical: tensors by dtype, shape and bytes; everything else by ==."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        a, b = got[k], want[k]
        if isinstance(b, dict):
            assert_same(a, b, f"{what}/{k}")
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), (what, k)
            assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.dtype, b.dtype)
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (what, k)
        else:
            assert a == b, (what, k, a, b)


def state_of(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k != "loaded_step"}


def flip_in(step_dir: Path, tensor: str) -> str:
    """Flip one data byte of the stored chunk of global tensor ``tensor`` (a stored
    safetensors tensor named ``<tensor>@<offsets>~r<rank>``); returns the chunk's name."""
    ck = ckptstore.open(step_dir)
    shards = [Path(f) for f in ck.shard_files]
    ck.close()
    for f in shards:
        raw = bytearray(f.read_bytes())
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + hlen])
        names = [n for n in header if n != "__metadata__" and n.split("@")[0] == tensor]
        if names:
            start, _ = header[names[0]]["data_offsets"]
            raw[8 + hlen + start] ^= 0x40
            f.write_bytes(bytes(raw))
            return names[0]
    raise AssertionError(f"no stored chunk of {tensor} in {shards}")


def committed(folder) -> list:
    return ckptstore.CheckpointManager(folder).steps()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Steps 1-6 in one process (saves at 2, 4, 6 along the way)."""
    d = tmp_path_factory.mktemp("full")
    snap = run_job(d / "ck", d / "out.pt", until=6)
    assert snap["loaded_step"] is None and snap["train_state"]["step"] == 6
    return snap


# ---- resume in a new process ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_in_new_process_is_bit_identical(tmp_path, uninterrupted, mode):
    """Steps 1-4 (saves at 2 and 4), then a new process resumes from the latest step and
    trains 5-6: parameters, AdamW state, hyperparameters, the scheduler, the dataloader's
    state and the train state equal the uninterrupted run's bit for bit."""
    ck = tmp_path / "ck"
    first = run_job(ck, tmp_path / "a.pt", until=4, mode=mode)
    assert first["train_state"]["step"] == 4
    assert committed(ck) == [2, 4]
    resumed = run_job(ck, tmp_path / "b.pt", until=6, mode=mode)
    assert resumed["loaded_step"] == 4
    assert_same(state_of(resumed), state_of(uninterrupted))
    assert resumed["lr"]["lrs"][0] > 0.0  # the schedule is mid-way, not at its end


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_holds_the_state_of_its_step(tmp_path, mode):
    """Training goes on while the background save of step 2 runs (steps 3-4 change every
    tensor): the checkpoint of step 2 restores the state at step 2."""
    job = tj.build(str(tmp_path / "ck"), mode=mode, steps=STEPS)
    tj.train(job, 2)
    at_2 = tj.snapshot(job)
    assert job.checkpointer.save_future is not None  # in flight
    tj.train(job, 4, load=False)
    job.checkpointer.close()
    assert not torch.equal(job.model.l1.weight, at_2["params"]["l1.weight"])
    other = tj.build(str(tmp_path / "ck"), mode=mode, steps=STEPS)
    assert other.checkpointer.load(step=2)
    assert_same(state_of(tj.snapshot(other)), state_of(at_2))


# ---- a job switched from TorchTitan's own manager --------------------------------------------


def test_steps_of_torchtitans_own_manager_resume_and_count_for_keep_latest_k(tmp_path):
    """A job checkpointed by TorchTitan's own manager (DCP, ``step-N``: steps 2, 4, 6) is
    switched to ckptstore with step 6 gone: the newest step, stock step 4, resumes as
    TorchTitan resumes it (a log line says so), and steps 5-6 end bit for bit where the stock
    run did. Retention (keep 2) counts both kinds: saving step 6 removes stock step 2; a
    later job loads stock step 4 by ``load(step=4)``, resumes ckptstore step 6 (newer than
    stock step 4) by default, and saving step 8 removes stock step 4."""
    ck = tmp_path / "ck"
    late = ["--use-late"]  # TorchTitan's manager cannot resume a parameter without state
    stock = run_job(ck, tmp_path / "stock.pt", until=6, args=["--stock", *late])
    assert sorted(os.listdir(ck)) == ["step-2", "step-4", "step-6"]
    assert (ck / "step-4" / ".metadata").is_file() and committed(ck) == []
    (ck / "step-6").rename(tmp_path / "step-6-away")
    log = []
    resumed = run_job(ck, tmp_path / "resumed.pt", until=6, keep=2, args=late, stderr=log)
    assert resumed["loaded_step"] == 4
    assert "resumed step 4 from" in log[0] and "TorchTitan's own manager" in log[0], log[0][-2000:]
    assert_same(state_of(resumed), state_of(stock))
    assert sorted(n for n in os.listdir(ck) if "step-" in n) == [step_name(6), "step-4"]

    job = tj.build(str(ck), steps=STEPS, keep=2)
    with pytest.raises(ckptstore.CheckpointNotFoundError, match=r"TorchTitan's own: \[4\]"):
        job.checkpointer.load(step=2)
    assert job.checkpointer.load(step=4) and job.checkpointer.loaded_step == 4  # load_step: stock
    assert job.checkpointer.load() and job.checkpointer.loaded_step == 6  # the newest of both
    assert_same(tj.snapshot(job)["params"], stock["params"])
    tj.train(job, 8, load=False)
    assert sorted(n for n in os.listdir(ck) if "step-" in n) == [step_name(6), step_name(8)]
    # initial_load_path may name a stock step: its model only.
    fresh = tj.build(str(tmp_path / "fresh"), steps=STEPS, initial_load_path=str(tmp_path / "step-6-away"))
    assert fresh.checkpointer.load() and fresh.checkpointer.loaded_step is None
    assert_same(tj.snapshot(fresh)["params"], stock["params"])
    assert fresh.train_state.step == 0


def test_a_data_loader_with_an_empty_state_resumes_from_stock_and_own_steps(tmp_path):
    """Issue 53: TorchTitan's own checkpoint tests use a data loader whose ``state_dict()``
    is ``{}``; its manager saves nothing for it and resumes such a step. So does ckptstore's:
    a stock step 2 after the switch (before: "the checkpoint holds no state 'dataloader'"),
    then its own step 4, each bit-identical to the run that saved it, the data loader handed
    its empty state as DCP hands it."""
    ck = str(tmp_path / "ck")
    stock = tj.build(ck, stock=True, empty_dataloader=True, steps=STEPS)
    stock.model.use_late = True  # TorchTitan's manager cannot resume a parameter without state
    tj.train(stock, 2)
    stock.checkpointer.close()
    assert sorted(os.listdir(ck)) == ["step-2"]
    job = tj.build(ck, empty_dataloader=True, steps=STEPS)
    job.model.use_late = True
    assert job.checkpointer.load() and job.checkpointer.loaded_step == 2
    assert job.dataloader.loaded == 1
    assert_same(state_of(tj.snapshot(job)), state_of(tj.snapshot(stock)))
    tj.train(job, 4, load=False)
    job.checkpointer.close()
    again = tj.build(ck, empty_dataloader=True, steps=STEPS)
    again.model.use_late = True
    assert again.checkpointer.load() and again.checkpointer.loaded_step == 4
    assert_same(state_of(tj.snapshot(again)), state_of(tj.snapshot(job)))


def test_stock_dcp_metadata_naming_other_globals_is_refused(tmp_path):
    """DCP's ``.metadata`` is a pickle: a stock step whose metadata names a global DCP
    metadata is not made of is refused (PickleNotAllowedError) before anything changes,
    and its non-tensor values are read with torch.load(weights_only=True)."""
    import pickle
    from fractions import Fraction

    ck = tmp_path / "ck"
    step = ck / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(pickle.dumps({"odd": Fraction(1, 3)}))
    job = tj.build(str(ck), steps=STEPS)
    before = tj.snapshot(job)
    with pytest.raises(PickleNotAllowedError, match=r"fractions\.Fraction"):
        job.checkpointer.load()
    assert_same(state_of(tj.snapshot(job)), state_of(before))
    job.checkpointer.allow_pickle = True  # read with pickle: then it is not DCP metadata
    with pytest.raises(ckptstore.CheckpointError, match="not DCP metadata"):
        job.checkpointer.load()
    assert job.checkpointer.loaded_step is None


# ---- SIGKILL during a save ------------------------------------------------------------------


@pytest.mark.parametrize("point", ["write", "commit"])
def test_sigkill_during_save_resumes_the_previous_step(tmp_path, uninterrupted, point):
    """The process SIGKILLs itself inside the save of step 4 (``write``: before its part is
    written; ``commit``: every part written, before the manifest). Step 2 stays the latest
    committed step, the manager's own latest-step logic resumes it, and training to step 6
    ends where the uninterrupted run did."""
    ck = tmp_path / "ck"
    run_job(ck, tmp_path / "a.pt", until=6, env={"CKPTSTORE_FAULT": f"torchtitan.{point}:4"},
            expect_rc=-signal.SIGKILL)
    assert committed(ck) == [2]
    listed = {e["step"]: e["committed"] for e in ckptstore.CheckpointManager(ck).list()}
    assert listed.get(2) is True and listed.get(4, False) is False
    resumed = run_job(ck, tmp_path / "b.pt", until=6)
    assert resumed["loaded_step"] == 2
    assert_same(state_of(resumed), state_of(uninterrupted))
    assert committed(ck) == [2, 4, 6]  # step 4 written again over the dead attempt


# ---- the ColossalAI scenario -----------------------------------------------------------------


def test_optimizer_state_the_checkpoint_does_not_name_is_gone(tmp_path):
    """Step 2 is saved while ``late`` has no AdamW state (unused so far). Then ``late`` is
    used and trained: the live optimizer holds state for it. Loading step 2 restores
    exactly step 2's state: ``late``'s state is gone, not merged into the restored one."""
    job = tj.build(str(tmp_path / "ck"), steps=STEPS)
    tj.train(job, 2)
    at_2 = tj.snapshot(job)
    assert not any(k.startswith("state.late.") for k in at_2["optimizer"])
    job.model.use_late = True
    tj.train(job, 4, load=False)
    opt = job.optimizers.optimizers[0]
    assert job.model.late.weight in opt.state and "exp_avg" in opt.state[job.model.late.weight]
    assert job.checkpointer.load(step=2)
    assert job.model.late.weight not in opt.state
    assert job.model.late.bias not in opt.state
    assert_same(state_of(tj.snapshot(job)), state_of(at_2))


# ---- a change of optimizer class (AdamW saved, SGD live) ---------------------------------------


def test_another_optimizer_class_is_refused_unless_allowed(tmp_path):
    """Step 2 saved by AdamW; a job whose optimizer is SGD (momentum 0.9) trains a step and
    loads it: refused naming both classes, with the whole live state as it was. With
    ``allow_optimizer_change``: the model and the rest resume as saved, SGD keeps its
    momentum, gets no AdamW moments, and steps."""
    folder = tmp_path / "ck"
    adamw = tj.build(str(folder), steps=STEPS)
    tj.train(adamw, 2)
    at_2 = tj.snapshot(adamw)
    assert ckptstore.open(folder / step_name(2)).metadata[STATE_KEY]["optimizer_class"] == "AdamW"

    sgd = tj.build(str(folder), steps=STEPS, optimizer="SGD")
    tj.train(sgd, 1, load=False)  # the live SGD has state (a momentum buffer) to keep
    before = tj.snapshot(sgd)
    assert any(k.endswith(".momentum_buffer") for k in before["optimizer"])
    with pytest.raises(ckptstore.IncompatibleStateError, match="optimizer is AdamW, the live optimizer is SGD") as e:
        sgd.checkpointer.load(step=2)
    assert str(folder / step_name(2)) in str(e.value)
    assert_same(state_of(tj.snapshot(sgd)), state_of(before))
    assert sgd.checkpointer.loaded_step is None

    allowed = tj.build(str(folder), steps=STEPS, optimizer="SGD", allow_optimizer_change=True)
    assert allowed.checkpointer.allow_optimizer_change is True
    tj.train(allowed, 1, load=False)
    assert allowed.checkpointer.load(step=2)
    now = tj.snapshot(allowed)
    for part in ("params", "train_state", "dataloader"):
        assert_same(now[part], at_2[part], part)
    assert now["lr"]["last_epoch"] == at_2["lr"]["last_epoch"] and now["lr"]["lrs"] == at_2["lr"]["lrs"]
    opt = allowed.optimizers.optimizers[0]
    assert type(opt) is torch.optim.SGD
    for g in opt.param_groups:
        assert g["momentum"] == 0.9 and g["weight_decay"] == 0.1  # its own; the checkpoint's
    assert not opt.state  # AdamW's moments are not SGD's; its momentum starts fresh
    tj.train(allowed, 3, load=False)
    assert allowed.train_state.step == 3
    assert all("momentum_buffer" in st for st in opt.state.values()) and len(opt.state) > 0
    assert not torch.equal(allowed.model.l1.weight.detach(), at_2["params"]["l1.weight"])


# ---- a flipped byte ---------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["l1.weight", "optimizer.state.out.weight.exp_avg_sq"])
def test_flipped_byte_fails_naming_the_tensor_and_changes_nothing(tmp_path, ckpt, victim):
    folder = tmp_path / "ck"
    job = tj.build(str(folder), steps=STEPS)
    tj.train(job, 4)
    before = tj.snapshot(job)
    chunk = flip_in(folder / step_name(2), victim)
    with pytest.raises(ckptstore.ChecksumError, match=victim.replace(".", r"\.")) as e:
        job.checkpointer.load(step=2)
    assert str(folder / step_name(2)) in str(e.value) or chunk in str(e.value)
    assert_same(state_of(tj.snapshot(job)), state_of(before))
    r = ckpt("verify", folder / step_name(2), expect=1)
    assert victim in r.stdout + r.stderr
    assert job.checkpointer.load(step=4)  # the undamaged step still loads
    assert_same(state_of(tj.snapshot(job)), state_of(before))


@pytest.mark.parametrize("bad", [{"$dict": 5}, {"$bytes": "not base64!"}, {"$frob": 1}])
def test_malformed_stored_state_fails_naming_the_checkpoint(tmp_path, bad):
    """A manifest (with a correct CRC) whose non-tensor state was tampered with: the load
    fails with a CheckpointError naming the step's path, and nothing changes."""
    import ckpt_helpers as h

    folder = tmp_path / "ck"
    job = tj.build(str(folder), steps=STEPS)
    tj.train(job, 4)
    before = tj.snapshot(job)

    def mutate(m):
        m["metadata"][STATE_KEY]["states"]["lr_scheduler"] = bad

    h.rewrite_manifest(folder / step_name(2), mutate)
    with pytest.raises(ckptstore.CheckpointError, match=step_name(2)):
        job.checkpointer.load(step=2)
    assert_same(state_of(tj.snapshot(job)), state_of(before))


def test_a_step_written_with_the_old_tensor_tag_loads(tmp_path):
    """A step whose stored state names its tensors with ``{"$t": name}`` (the form written
    before format-spec/values.md) loads exactly as the same step in the current form."""
    import ckpt_helpers as h

    folder = tmp_path / "ck"
    job = tj.build(str(folder), steps=STEPS)
    tj.train(job, 4)
    assert job.checkpointer.load(step=2)
    want = tj.snapshot(job)
    renamed = []

    def old(v):
        if isinstance(v, list):
            return [old(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$tensor" in v:
            renamed.append(v["$tensor"])
            return {"$t": v["$tensor"]}
        return {k: old(x) for k, x in v.items()}

    def mutate(m):
        meta = m["metadata"][STATE_KEY]
        meta["states"] = old(meta["states"])

    h.rewrite_manifest(folder / step_name(2), mutate)
    assert "l1.weight" in renamed and any(n.startswith("optimizer.state.") for n in renamed)
    other = tj.build(str(folder), steps=STEPS)
    assert other.checkpointer.load(step=2)
    assert_same(state_of(tj.snapshot(other)), state_of(want))


# ---- ckpt verify / inspect, keep-latest-k ----------------------------------------------------


def test_ckpt_tools_open_it_and_keep_latest_k(tmp_path, ckpt):
    folder = tmp_path / "ck"
    job = tj.build(str(folder), steps=STEPS, keep=2)
    tj.train(job, 6)
    assert committed(folder) == [4, 6]
    assert sorted(n for n in os.listdir(folder) if "step-" in n) == [step_name(4), step_name(6)]
    ckpt("verify", folder / step_name(6), expect=0)
    out = ckpt("inspect", folder / step_name(6), expect=0).stdout
    for name in ("l1.weight", "optimizer.state.l1.weight.exp_avg", "optimizer.state.emb.weight.step"):
        assert name in out, name
    ls = json.loads(ckpt("ls", folder, "--json", expect=0).stdout)
    assert ls["latest"] == 6
    # A reader's lease keeps its step through retention (the engine's manager).
    with ckptstore.CheckpointManager(folder).lease(4):
        tj.train(job, 8, load=False)
        assert committed(folder) == [4, 6, 8]
    tj.train(job, 9, load=False)
    job.checkpointer.save(10)  # the interval's next save: retention after its commit
    assert committed(folder) == [8, 10]
    # The non-tensor state is JSON in the manifest: no pickle anywhere.
    meta = ckptstore.open(folder / step_name(10)).metadata[STATE_KEY]
    assert meta["step"] == 10 and meta["states"]["train_state"] == {"step": 9, "ntokens_seen": 9 * 4 * tj.SEQ}
    assert meta["states"]["lr_scheduler"] == {"last_epoch": 9}
    assert meta["states"]["optimizer"]["param_groups.l1.weight.betas"] == {"$tuple": [0.9, 0.95]}
    assert set(meta["states"]["dataloader"]) == {"dp_rank_0", "world_size"}
    assert not any(n.startswith("dcp.bytes/") for n in ckptstore.open(folder / step_name(10)).keys())


def test_non_json_state_needs_allow_pickle(tmp_path):
    """A state value that is neither JSON, bytes nor a tensor (a Fraction) is refused at
    save naming its entry; with allow_pickle it is stored, and loading it needs the opt-in
    again (nothing changes when it is refused)."""
    from fractions import Fraction

    class Holder(torch.distributed.checkpoint.stateful.Stateful):
        def __init__(self):
            self.value = {"odd": Fraction(1, 3), "n": 1}

        def state_dict(self):
            return dict(self.value)

        def load_state_dict(self, sd):
            self.value = dict(sd)

    job = tj.build(str(tmp_path / "ck"), steps=STEPS)
    job.checkpointer.states["extra"] = Holder()
    tj.train(job, 1)
    with pytest.raises(PickleNotAllowedError, match=r"extra\.odd: .*Fraction"):
        job.checkpointer.save(2)
    assert committed(tmp_path / "ck") == []
    job.checkpointer.allow_pickle = True
    job.checkpointer.save(2)
    h = Holder()
    h.value = {}
    other = tj.build(str(tmp_path / "ck"), steps=STEPS)
    other.checkpointer.states["extra"] = h
    with pytest.raises(PickleNotAllowedError, match="trust"):
        other.checkpointer.load()
    assert h.value == {}
    other.checkpointer.allow_pickle = True
    assert other.checkpointer.load()
    assert h.value == {"odd": Fraction(1, 3), "n": 1}


# ---- model-only export -> ckpt consolidate -> Hugging Face directory ------------------------------


def test_model_only_export_consolidates_to_a_hugging_face_directory(tmp_path, ckpt):
    from safetensors.torch import load_file

    folder = tmp_path / "ck"
    job = tj.build(str(folder), steps=4, export_dtype="bfloat16")
    tj.train(job, 4)  # step 4 is the last: a model-only export in bfloat16
    export = folder / step_name(4)
    names = ckptstore.open(export).keys()
    assert not any(n.startswith("optimizer.") for n in names)
    hf = tmp_path / "hf"
    ckpt("consolidate", export, "--out", hf, expect=0)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    want = {k: v.detach().to(torch.bfloat16) for k, v in job.model.state_dict().items()}
    assert set(index["weight_map"]) == set(want)
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(str(hf / f)))
    assert_same(got, want)
    # Resuming from an export is refused with a clear error (it has no training state).
    other = tj.build(str(folder), steps=4)
    with pytest.raises(ckptstore.CheckpointError, match="model-only export"):
        other.checkpointer.load()
    assert other.checkpointer.load(step=2)  # the full step before it resumes


def test_initial_load_path_loads_the_model_only(tmp_path):
    """An empty folder with ``initial_load_path`` (TorchTitan's fine-tuning start): the
    model comes from that checkpoint, nothing else does, and the run's own steps win once
    it has some."""
    src = tj.build(str(tmp_path / "src"), steps=STEPS)
    tj.train(src, 2)
    at_2 = tj.snapshot(src)
    job = tj.build(str(tmp_path / "run"), steps=STEPS, initial_load_path=str(tmp_path / "src" / step_name(2)))
    fresh = tj.snapshot(job)
    assert job.checkpointer.load()
    now = tj.snapshot(job)
    assert_same(now["params"], at_2["params"])
    assert now["train_state"] == fresh["train_state"] and now["lr"] == fresh["lr"]
    assert now["dataloader"] == fresh["dataloader"]
    assert_same(now["optimizer"], fresh["optimizer"])
    assert job.checkpointer.loaded_step is None
    # The run's own steps win once it has some: a restart with the same arguments resumes its
    # step 2, not the initial weights (TorchTitan's
    # test_initial_load_path_ignored_when_folder_has_valid_checkpoints).
    tj.train(job, 2, load=False)
    job.checkpointer.close()
    mine = tj.snapshot(job)
    again = tj.build(str(tmp_path / "run"), steps=STEPS, initial_load_path=str(tmp_path / "src" / step_name(2)))
    assert again.checkpointer.load() and again.checkpointer.loaded_step == 2
    assert_same(state_of(tj.snapshot(again)), state_of(mine))


def test_load_only_never_saves_and_the_first_step_is_saved_when_asked(tmp_path):
    """TorchTitan's ``load_only`` (evaluation: resume, never save) and
    ``enable_first_step_checkpoint`` (step 1 saved besides the interval's steps), as its own
    manager's tests assert them (test_load_only_prevents_saving,
    test_enable_first_step_checkpoint)."""
    first = tj.build(str(tmp_path / "first"), steps=STEPS, enable_first_step_checkpoint=True)
    tj.train(first, 4)
    first.checkpointer.close()
    assert committed(tmp_path / "first") == [1, 2, 4]
    shutil.copytree(tmp_path / "first", tmp_path / "eval")
    ev = tj.build(str(tmp_path / "eval"), steps=STEPS, load_only=True)
    tj.train(ev, 8)  # resumes step 4, trains to 8, saves nothing
    ev.checkpointer.close()
    assert ev.checkpointer.loaded_step == 4 and ev.train_state.step == 8
    assert committed(tmp_path / "eval") == [1, 2, 4]


# ---- FSDP2: save on 2 ranks, resume on 1 ------------------------------------------------------


def job_fsdp2_save(rank, world, folder):
    job = tj.build(folder, rank=rank, world=world, fsdp=True, steps=STEPS)
    from torch.distributed.tensor import DTensor

    assert isinstance(job.model.l1.weight, DTensor)
    tj.train(job, 2)
    job.checkpointer.close()
    return tj.snapshot(job)


def job_resume_1(rank, world, folder):
    job = tj.build(folder, rank=rank, world=world, steps=STEPS, exclude=["dataloader"])
    assert job.checkpointer.load(step=-1)
    return tj.snapshot(job)


def test_fsdp2_save_on_2_resume_on_1(tmp_path):
    folder = str(tmp_path / "ck")
    saved = dh.results(2, job_fsdp2_save, folder)
    assert committed(folder) == [2]
    # Both ranks' dataloader states are in the checkpoint (merged by key).
    dl = ckptstore.open(Path(folder) / step_name(2)).metadata[STATE_KEY]["states"]["dataloader"]
    assert set(dl) == {"dp_rank_0", "dp_rank_1", "world_size"} and dl["world_size"] == 2
    assert_same(state_of(saved[0])["params"], state_of(saved[1])["params"])  # gathered whole
    (one,) = dh.results(1, job_resume_1, folder)
    assert one["loaded_step"] == 2
    for part in ("params", "optimizer", "lr", "train_state"):
        assert_same(one[part], saved[0][part], part)


def job_fsdp2_keep_2(rank, world, folder):
    """FSDP2 on 2 ranks with ``keep_latest_k=2``: steps 2, 4 and 6 saved; what the folder
    holds after each save, as each rank sees it."""
    job = tj.build(folder, rank=rank, world=world, fsdp=True, steps=STEPS, keep=2)
    seen = []
    job.it = iter(job.dataloader)
    job.checkpointer.load(step=-1)
    while job.train_state.step < 6:
        tj.train_step(job)
        if job.train_state.step % 2 == 0:
            job.checkpointer.maybe_wait_for_saving()
            import torch.distributed as dist

            dist.barrier()
            seen.append(committed(folder))
    job.checkpointer.close()
    return seen


def test_fsdp2_keep_latest_k_on_two_ranks_keeps_the_newest_steps(tmp_path):
    """Retention in a multi-rank job (TorchTitan's test_nonzero_rank_does_not_purge_or_save:
    only the coordinator purges): with ``keep_latest_k=2`` (TorchTitan's least) on 2 ranks,
    after each save both ranks see exactly the newest two steps."""
    folder = str(tmp_path / "ck")
    seen = dh.results(2, job_fsdp2_keep_2, folder)
    assert seen[0] == seen[1] == [[2], [2, 4], [4, 6]], seen


# ---- a rank whose listing is stale (a shared file system's client caches) --------------------


def job_save_2_and_4(rank, world, folder):
    job = tj.build(folder, rank=rank, world=world, fsdp=True, steps=STEPS)
    tj.train(job, 2)
    at_2 = tj.snapshot(job)
    tj.train(job, 4, load=False)
    job.checkpointer.close()
    return at_2, tj.snapshot(job)


def job_resume_with_stale_views(rank, world, folder, points):
    """For each ``(stale_rank, view)``: a fresh job whose rank ``stale_rank`` lists the
    folder as a host with stale caches would (``none``: no step; ``older``: not the newest),
    then ``load(step=-1)`` on every rank."""
    out = []
    for stale_rank, view in points:
        job = tj.build(folder, rank=rank, world=world, fsdp=True, steps=STEPS)
        if rank == stale_rank:
            steps = job.checkpointer._steps
            seen = {"none": [], "older": steps.steps()[:-1]}[view]
            steps.steps = lambda seen=seen: list(seen)
            steps.stock_steps = lambda: {}
        loaded = job.checkpointer.load(step=-1)
        snap = tj.snapshot(job)
        job.checkpointer.close()
        out.append((loaded, snap))
    return out


@pytest.mark.parametrize("seed", [0])
def test_a_rank_with_a_stale_listing_resumes_the_step_the_first_rank_chose(tmp_path, seed):
    """Issue 52: the step to resume is chosen by the first rank alone. One rank at a time sees
    the folder as stale client caches would show it (no step, or not the newest), the points
    in a seeded order: both ranks resume the same step, the one rank 0 saw, bit-identical to
    what was saved at it (or both start fresh); before, the ranks chose apart and the one
    that loaded waited in a collective the other never joined."""
    folder = str(tmp_path / "ck")
    saved = dh.results(2, job_save_2_and_4, folder)
    assert committed(folder) == [2, 4]
    points = [(r, v) for r in (0, 1) for v in ("none", "older")]
    random.Random(seed).shuffle(points)
    got = dh.results(2, job_resume_with_stale_views, folder, points)
    for i, (stale_rank, view) in enumerate(points):
        want = 4 if stale_rank == 1 else {"none": None, "older": 2}[view]
        for rank in (0, 1):
            loaded, snap = got[rank][i]
            where = f"{(stale_rank, view)} rank {rank}"
            assert loaded is (want is not None) and snap["loaded_step"] == want, where
            if want is not None:
                at = saved[rank][0 if want == 2 else 1]
                for part in ("params", "optimizer", "lr", "train_state"):
                    assert_same(snap[part], at[part], f"{where} {part}")
                assert snap["dataloader"] == at["dataloader"], where


# ---- s3:// ------------------------------------------------------------------------------------

from test_s3 import s3  # noqa: E402,F401 - the s3s-fs server fixture (fails if not installed)


def test_s3_folder_saves_resumes_and_keeps_latest_k(s3, tmp_path, ckpt_bin, monkeypatch):
    monkeypatch.setenv("CKPT_BIN", str(ckpt_bin))
    url = "s3://bkt/titan/run"
    job = tj.build(url, steps=STEPS, keep=2)
    tj.train(job, 6)
    at_6 = tj.snapshot(job)
    assert job.checkpointer.committed_steps() == [4, 6]
    assert not os.path.exists("s3:")
    on_server = sorted(os.listdir(os.path.join(s3, "bkt", "titan", "run")))
    assert step_name(6) in on_server
    other = tj.build(url, steps=STEPS, keep=2)
    assert other.checkpointer.load()
    assert other.checkpointer.loaded_step == 6
    assert_same(state_of(tj.snapshot(other)), state_of(at_6))


def test_trainer_config_selects_it():
    from torchtitan.trainer import Trainer

    cfg = Trainer.Config(checkpoint=CheckpointManager.Config(enable=True, async_mode="async"))
    assert cfg.checkpoint._owner is CheckpointManager
    with pytest.raises(ValueError, match="async_mode"):
        CheckpointManager.Config(enable=True, async_mode="nope")  # type: ignore[arg-type]


def test_hf_export_of_torchtitan_llama3_loads_with_from_pretrained(tmp_path, ckpt):
    """TorchTitan's own Llama 3 (its ``debugmodel`` flavor, 6.2M parameters, built in
    code) with its state-dict adapter: the last step with ``last_save_in_hf=True`` writes
    the model under Hugging Face's names in bfloat16, ``ckpt consolidate`` makes a Hugging
    Face directory of it, and ``LlamaForCausalLM.from_pretrained`` loads every weight bit
    for bit (config.json written by the test: TorchTitan keeps no HF config)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.models.llama3 import Llama3StateDictAdapter, model_registry
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model_registry("debugmodel").model
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lrs = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=4)
    adapter = Llama3StateDictAdapter(cfg, None)
    mgr = CheckpointManager.Config(
        enable=True, folder=str(tmp_path / "ck"), interval=10, last_save_in_hf=True,
        export_dtype="bfloat16",
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lrs,
            states={}, sd_adapter=adapter, base_folder="")
    assert mgr.save(4, last_step=True)
    mgr.close()
    hf = tmp_path / "hf"
    ckpt("consolidate", tmp_path / "ck" / step_name(4), "--out", hf, expect=0)
    want = {k: v.detach().to(torch.bfloat16) for k, v in adapter.to_hf(model.state_dict()).items()}
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    attn = cfg.layers[0].attention
    LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=want["model.layers.0.mlp.up_proj.weight"].shape[0],
        num_hidden_layers=len(cfg.layers), num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads or attn.n_heads, tie_word_embeddings=False,
    ).save_pretrained(hf)
    loaded = LlamaForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    got = dict(loaded.state_dict())
    assert_same(got, want)
