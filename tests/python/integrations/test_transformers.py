"""ckptstore.integrations.transformers: the Hugging Face Trainer (and Accelerate) on ckptstore.

A tiny LlamaForCausalLM (attention dropout on, so training consumes the torch RNG) trained on
the CPU with seed, data_seed and no dataloader workers: the stock Trainer resumes it bit for
bit (shared/reference/frameworks.md), so any difference here is ckptstore's.

* resume in a new process from ``checkpoint-4`` (mid-epoch): parameters, AdamW state,
  scheduler state and the python / numpy / torch RNG states equal an uninterrupted run's;
* the ColossalAI merge scenario: optimizer state for a parameter the checkpoint does not
  name is gone after the resume;
* SIGKILL during a save (the engine's pause point between the shards and the manifest, and
  this module's point between the commit and the publishing rename): no ``checkpoint-8``
  appears, ``get_last_checkpoint`` picks ``checkpoint-4``, and resuming from it gives the
  uninterrupted run's state;
* one flipped byte: ``ChecksumError`` naming the tensor, model and optimizer unchanged;
* ``ckpt verify`` / ``ckpt inspect`` open a checkpoint; ``ckpt consolidate`` of it loads
  with ``from_pretrained``; the final ``save_model`` loads with ``from_pretrained``;
* ``save_total_limit`` rotation with best-model keeping; Accelerate's save/load.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

import ckptstore
import ckptstore.integrations.transformers as hf
from ckptstore import atomic
from ckptstore.errors import ChecksumError, CorruptCheckpointError
from ckptstore.integrations._common import staging_name

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import transformers_train as tt  # noqa: E402

SCRIPT = HERE / "transformers_train.py"
EVENT_TIMEOUT = 120.0


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            assert_same(x, y, f"{what}{k}/")
        elif torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what}{k}"
            assert torch.equal(x, y), f"{what}{k} differs"
        else:
            assert x == y, f"{what}{k}: {x!r} != {y!r}"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """An uninterrupted run of 8 steps, checkpoints at 4 and 8, and its final state."""
    out = tmp_path_factory.mktemp("ref") / "run"
    trainer = tt.make_trainer(str(out), 8, 4)
    trainer.train()
    final = out / "final"
    trainer.save_model(str(final))
    return {"out": out, "dump": tt.dump(trainer), "final": final, "model": trainer.model}


def copy_checkpoint(ref, tmp_path, step: int = 4) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(ref["out"] / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out


def run_script(out: Path, resume: str, dump: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), "8", "4", resume, str(dump)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_checkpoints_are_committed_ckptstore_checkpoints(ref):
    out = ref["out"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".ckptstore-")], "leftovers"
    ck4 = out / "checkpoint-4"
    assert hf.is_ckptstore_checkpoint(ck4)
    # No stock files: the weights, optimizer, scheduler and RNG are in the checkpoint.
    for stock in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        assert not (ck4 / stock).exists(), stock
    with ckptstore.open(ck4) as ck:
        assert ck.kind == "ckptstore" and ck.has_optimizer
        tree = ck.metadata["ckptstore.tree"]["tree"][hf.TREE_ROOT]
        assert tree["trainer_state"] == (ck4 / "trainer_state.json").read_text()
        assert json.loads(tree["trainer_state"])["global_step"] == 4
        assert "hf.trainer/rng/0/cpu" in ck and ck.info("hf.trainer/rng/0/numpy/1")["dtype"] == "U32"
        assert "optim/model.layers.0.mlp.up_proj.weight/exp_avg" in ck
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-8")


def test_resume_in_a_new_process_is_bit_identical(ref, tmp_path):
    out = copy_checkpoint(ref, tmp_path)
    dump = tmp_path / "resumed.pt"
    child = run_script(out, str(out / "checkpoint-4"), dump)
    log = child.communicate(timeout=300)[0].decode(errors="replace")
    assert child.returncode == 0, log
    got = torch.load(dump, weights_only=True)
    assert got["global_step"] == 8
    assert_same(ref["dump"], got)
    # The resumed run wrote its own checkpoint-8 the same way.
    assert hf.is_ckptstore_checkpoint(out / "checkpoint-8")


class StopAfterSave(transformers.TrainerCallback):
    def on_save(self, args, state, control, **kw):
        control.should_training_stop = True


def test_a_stock_checkpoint_resumes_through_the_stock_code(ref, tmp_path, caplog):
    """A run begun with the stock Trainer (no ckptstore) is switched to ours:
    ``resume_from_checkpoint=True`` takes its newest checkpoint (checkpoint-4), the stock
    code loads it (safetensors, torch.load(weights_only=True)), a warning says so, and the
    run ends where ours does uninterrupted: the same training either way."""
    out = tmp_path / "run"
    stock = tt.make_trainer(str(out), 8, 4, cls=transformers.Trainer)
    stock.add_callback(StopAfterSave())
    stock.train()
    assert (out / "checkpoint-4" / "optimizer.pt").exists()
    assert not hf.is_ckptstore_checkpoint(out / "checkpoint-4")
    trainer = tt.make_trainer(str(out), 8, 4)
    with caplog.at_level("WARNING", logger=hf.__name__):
        trainer.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if r.name == hf.__name__]
    assert any(str(out / "checkpoint-4") in m and "checkpoint of the stock Trainer" in m for m in said), said
    assert_same(ref["dump"], tt.dump(trainer))
    assert hf.is_ckptstore_checkpoint(out / "checkpoint-8")


def test_non_blocking_saves_store_the_state_of_their_step(ref, tmp_path, monkeypatch):
    """ckptstore_async=True: each save snapshots into reused buffers and returns; the
    checkpoints written while training goes on equal the blocking run's, tensor for tensor.
    The write of checkpoint-4 is held until step 5 has changed every live tensor."""
    gate = threading.Event()
    write = hf._trainer._save_items  # the name the Trainer calls

    def held(path, items, max_shard_size):
        assert gate.wait(EVENT_TIMEOUT), "step 5 never ended"
        return write(path, items, max_shard_size)

    class Release(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                assert not (out / "checkpoint-4").exists()  # still being written
                gate.set()

    monkeypatch.setattr(hf._trainer, "_save_items", held)
    out = tmp_path / "run"
    trainer = tt.make_trainer(str(out), 8, 4, ckptstore_async=True)
    trainer.add_callback(Release())
    trainer.train()  # waits for the last save
    assert gate.is_set()
    assert_same(ref["dump"], tt.dump(trainer))
    (snap,) = trainer._ckptstore_saver._free  # the one buffer set, reused by every save
    for step in (4, 8):
        with ckptstore.open(out / f"checkpoint-{step}") as a, ckptstore.open(
            ref["out"] / f"checkpoint-{step}"
        ) as b:
            names = sorted(a.keys())
            assert names == sorted(b.keys())
            for n in names:
                assert np.array_equal(np.asarray(a[n]), np.asarray(b[n])), (step, n)
            ta, tb = (m.metadata["ckptstore.tree"]["tree"][hf.TREE_ROOT] for m in (a, b))
            assert json.loads(ta.pop("args"))["output_dir"] == str(out)  # the one difference
            tb.pop("args")
            assert ta == tb
    assert snap.allocations == len(names), "the second save allocated buffers again"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-8"]


def test_rng_states_round_trip_exactly(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.random(), np.random.standard_normal(), torch.rand(3)  # noqa: B018 - advance them
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    want = hf._checkpoint._rng_state()
    model = torch.nn.Linear(2, 2)
    hf.save_checkpoint(tmp_path / "c", model, None, {"rng": [want]}, kind="test")
    got = hf._checkpoint._read_tree(tmp_path / "c", allow_pickle=False)["rng"][0]
    assert type(got["python"]) is tuple and got["python"] == want["python"]
    g, w = got["numpy"], want["numpy"]
    assert type(g) is tuple and len(g) == len(w) == 5
    assert g[0] == w[0] and g[2:] == w[2:] and type(g[4]) is float
    assert g[1].dtype == w[1].dtype == np.uint32 and np.array_equal(g[1], w[1])
    assert torch.equal(got["cpu"], want["cpu"]) and got["cpu"].dtype == torch.uint8


def test_republishing_a_step_replaces_it_whole(tmp_path):
    """Saving checkpoint-N again (a run resumed before N) swaps the new one in."""
    model = torch.nn.Linear(2, 2)
    final = tmp_path / "checkpoint-3"
    for v in (1.0, 2.0):
        with torch.no_grad():
            model.weight.fill_(v)
        staging = tmp_path / staging_name("checkpoint-3")
        staging.mkdir()
        hf.save_checkpoint(staging, model, None, {"v": v}, kind="test")
        (staging / "trainer_state.json").write_text(str(v))
        atomic.publish_dir(staging, final)  # as the Trainer publishes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    assert (final / "trainer_state.json").read_text() == "2.0"
    with ckptstore.open(final) as ck:
        assert np.all(np.asarray(ck["weight"]) == 2.0)


def test_a_non_json_value_needs_the_pickle_opt_in(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(hf.PickleNotAllowedError, match=r"scheduler/fn.*builtins.function"):
        hf.save_checkpoint(tmp_path / "c", model, None, {"scheduler": {"fn": lambda: 1}}, kind="test")
    assert not (tmp_path / "c" / "ckpt-manifest.json").exists()
    hf.save_checkpoint(tmp_path / "c", model, None, {"x": {1, 2}, "s": slice(1, 2)}, kind="test", allow_pickle=True)
    with pytest.raises(hf.PickleNotAllowedError, match="allow_pickle"):
        hf._checkpoint._read_tree(tmp_path / "c", allow_pickle=False)
    assert hf._checkpoint._read_tree(tmp_path / "c", allow_pickle=True) == {"x": {1, 2}, "s": slice(1, 2)}


def test_optimizer_state_the_checkpoint_does_not_name_is_gone(tmp_path):
    """The ColossalAI scenario: the live optimizer holds state for a parameter (frozen,
    so it has none in the checkpoint); after the resume that state is gone."""

    def setup():
        model = tt.make_model()
        frozen = model.model.layers[1].mlp.down_proj.weight
        frozen.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the frozen one included
        return model, frozen, opt

    out = tmp_path / "run"
    model, frozen, opt = setup()
    tt.make_trainer(str(out), 2, 2, model=model, optimizers=(opt, None)).train()
    assert frozen not in opt.state and len(opt.state) > 10
    with ckptstore.open(out / "checkpoint-2") as ck:
        assert "optim/model.layers.1.mlp.down_proj.weight/exp_avg" not in ck
        saved_q = np.asarray(ck["optim/model.layers.0.self_attn.q_proj.weight/exp_avg"]).copy()

    model, frozen, opt = setup()
    q = model.model.layers[0].self_attn.q_proj.weight
    for p in (frozen, q):  # stale state a merging load would keep
        opt.state[p] = {"step": torch.tensor(9.0), "exp_avg": torch.full_like(p, 7.0), "exp_avg_sq": torch.ones_like(p)}
    seen = {}

    class Look(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            st = optimizer.optimizer.state if hasattr(optimizer, "optimizer") else optimizer.state
            seen["frozen"] = frozen in st
            seen["q"] = st[q]["exp_avg"].clone()

    trainer = tt.make_trainer(str(out), 3, 2, model=model, optimizers=(opt, None))
    trainer.add_callback(Look())
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert seen["frozen"] is False, "state of a parameter the checkpoint does not name survived"
    assert torch.equal(seen["q"], torch.from_numpy(saved_q))
    assert frozen not in opt.state  # still frozen: the step made none


def test_a_resume_into_another_optimizer_class_is_refused_unless_allowed(tmp_path):
    """A checkpoint saved with AdamW resumed by a Trainer whose optimizer is SGD: refused at
    the resume naming both classes, nothing changed (issue 27: before, SGD got AdamW's
    groups and its next step raised KeyError 'momentum'); with
    ckptstore_allow_optimizer_change=True it resumes, and SGD trains on."""
    out = tmp_path / "run"
    tt.make_trainer(str(out), 2, 2).train()

    def sgd_trainer(**kw):
        model = tt.make_model()
        # The Trainer's own two groups (weight decay, no weight decay), as AdamW had them.
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay]},
            {"params": [p for n, p in model.named_parameters() if n not in decay]},
        ]
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
        return tt.make_trainer(str(out), 3, 2, model=model, optimizers=(opt, None), **kw), model

    trainer, model = sgd_trainer()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ckptstore.IncompatibleStateError, match=r"AdamW.*SGD|SGD.*AdamW"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), f"{n} changed by a refused resume"
    trainer, _ = sgd_trainer(ckptstore_allow_optimizer_change=True)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert trainer.state.global_step == 3
    assert all("momentum_buffer" in st for st in trainer.optimizer.state.values())


def wait_for(marker: Path, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT
    while not marker.exists():
        if child.poll() is not None:
            pytest.fail(f"the child exited ({child.returncode}) before pausing: {child.stdout.read().decode()}")
        assert time.monotonic() < deadline, f"the child did not reach {marker.name}"
        time.sleep(0.05)  # polling for the announcement, not waiting for a state


# The engine's point (shards durable, no manifest yet) and this module's (committed in the
# staging directory, the rename to checkpoint-8 next).
@pytest.mark.parametrize("point", ["before-manifest-rename", "hf-before-publish"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_latest(ref, tmp_path, point):
    out = copy_checkpoint(ref, tmp_path)
    pause = tmp_path / "pause"
    pause.mkdir()
    env = dict(os.environ, CKPTSTORE_TEST_PAUSE=point, CKPTSTORE_TEST_PAUSE_DIR=str(pause))
    child = run_script(out, "true", tmp_path / "never.pt", env=env)
    try:
        wait_for(pause / point, child)
        assert int((pause / point).read_text()) == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-8" not in names
    leftovers = [n for n in names if n.startswith(".ckptstore-staging-checkpoint-8-")]
    assert len(leftovers) == 1, names
    assert (out / leftovers[0] / "ckpt-manifest.json").exists() == (point == "hf-before-publish")
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")

    trainer = tt.make_trainer(str(out), 8, 4)
    trainer.train(resume_from_checkpoint=True)
    assert_same(ref["dump"], tt.dump(trainer))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint-4", "checkpoint-8"], "the dead save's staging directory stays"


def tensor_offset(ckdir: Path, name: str) -> tuple:
    """(shard path, absolute byte offset of the tensor's data) from the safetensors header."""
    with ckptstore.open(ckdir) as ck:
        shard = ckdir / ck.info(name)["file"]
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return shard, 8 + n + header[name]["data_offsets"][0]


def capture(model, opt) -> dict:
    return {
        "params": {n: t.detach().clone() for n, t in model.state_dict().items()},
        "optim": {
            f"{i}/{k}": v.clone()
            for i, (p, st) in enumerate(opt.state.items())
            for k, v in st.items()
        },
        "lr": [g["lr"] for g in opt.param_groups],
    }


@pytest.mark.parametrize(
    "tensor", ["model.layers.0.mlp.up_proj.weight", "optim/model.layers.1.self_attn.q_proj.weight/exp_avg"]
)
def test_a_flipped_byte_fails_the_resume_and_changes_nothing(ref, tmp_path, tensor):
    out = copy_checkpoint(ref, tmp_path)
    shard, off = tensor_offset(out / "checkpoint-4", tensor)
    data = bytearray(shard.read_bytes())
    data[off + 5] ^= 0x10
    shard.write_bytes(bytes(data))

    trainer = tt.make_trainer(str(out), 8, 4)
    trainer.create_optimizer_and_scheduler(num_training_steps=8)  # train() keeps both
    opt = trainer.optimizer
    batch = tt.Tokens()[0]
    trainer.model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    opt.step()  # live state that a partial load would overwrite
    before = capture(trainer.model, opt)
    assert before["optim"]
    with pytest.raises(ChecksumError, match=re.escape(tensor)) as e:
        trainer.train(resume_from_checkpoint=True)
    assert str(out / "checkpoint-4") in str(e.value)
    assert_same(before, capture(trainer.model, opt))


class OrderLog(torch.nn.Module):
    """transformers' own test_resume_batch_order model: a buffer logs the order of the samples
    seen (it grows in forward), and load_state_dict resizes it to the checkpoint's first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(10, 10, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True):
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        self.data_order = torch.cat([self.data_order, input_ids[:, 0].long()])
        return {"loss": loss, "logits": logits}


class Ordered(torch.utils.data.Dataset):
    def __init__(self, n: int = 10) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 10, generator=g)
        self.x[:, 0] = torch.arange(n)  # the sample's index, logged by OrderLog
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def test_resume_goes_through_the_models_load_state_dict_override(tmp_path):
    """transformers' test_resume_batch_order with ours: the model's load_state_dict resizes a
    buffer before loading. Resuming from checkpoint-6 (epoch 2) runs it and ends with the
    data order of the uninterrupted run."""

    def run(out, resume=None):
        torch.manual_seed(42)
        args = tt.make_args(str(out), -1, 1, num_train_epochs=2, optim="sgd", learning_rate=0.1,
                            per_device_train_batch_size=2, lr_scheduler_type="constant", warmup_steps=0)
        trainer = hf.Trainer(model=OrderLog(), args=args, train_dataset=Ordered())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    base = tmp_path / "base"
    run(base)
    with ckptstore.open(base / "checkpoint-10") as ck:
        want = np.asarray(ck["data_order"]).copy()
    assert len(want) == 20 and sorted(want[:10]) == list(range(10))
    resumed = run(tmp_path / "resumed", resume=str(base / "checkpoint-6"))
    assert torch.equal(resumed.model.data_order, torch.from_numpy(want))
    with ckptstore.open(tmp_path / "resumed" / "checkpoint-10") as ck:
        assert np.array_equal(np.asarray(ck["data_order"]), want)


def test_resume_runs_load_state_dict_pre_hooks(ref, tmp_path):
    """A hook registered with register_load_state_dict_pre_hook runs on resume, with the
    checkpoint's tensors; the run still ends as the uninterrupted one."""
    out = copy_checkpoint(ref, tmp_path)
    seen = {}

    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        seen[prefix] = state_dict[prefix + "weight"].clone()

    model = tt.make_model()
    model.model.norm.register_load_state_dict_pre_hook(hook)
    trainer = tt.make_trainer(str(out), 8, 4, model=model)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert list(seen) == ["model.norm."]
    with ckptstore.open(out / "checkpoint-4") as ck:
        assert np.array_equal(seen["model.norm."].numpy(), np.asarray(ck["model.norm.weight"]))
    assert_same(ref["dump"], tt.dump(trainer))


def test_a_model_load_state_dict_that_raises_leaves_the_optimizer_as_it_was(ref, tmp_path):
    """Everything is checked and read first; if the model's own load_state_dict then
    raises, the optimizer gets its previous state back (the model's is the model's)."""
    out = copy_checkpoint(ref, tmp_path)
    trainer = tt.make_trainer(str(out), 8, 4)
    trainer.create_optimizer_and_scheduler(num_training_steps=8)
    opt = trainer.optimizer
    batch = tt.Tokens()[0]
    trainer.model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    opt.step()
    before = capture(trainer.model, opt)

    def refuse(state_dict, strict=True):
        raise RuntimeError("refused by the model")

    trainer.model.load_state_dict = refuse
    with pytest.raises(RuntimeError, match="refused by the model"):
        trainer.train(resume_from_checkpoint=True)
    assert_same(before, capture(trainer.model, opt))


def test_a_trainer_state_that_differs_from_the_committed_one_is_refused(ref, tmp_path):
    out = copy_checkpoint(ref, tmp_path)
    st = out / "checkpoint-4" / "trainer_state.json"
    st.write_text(st.read_text().replace('"global_step": 4', '"global_step": 5'))
    trainer = tt.make_trainer(str(out), 8, 4)
    with pytest.raises(CorruptCheckpointError, match="trainer_state.json"):
        trainer.train(resume_from_checkpoint=True)


def test_cli_opens_it_and_consolidate_loads_with_from_pretrained(ref, tmp_path, ckpt):
    ck4 = ref["out"] / "checkpoint-4"
    ckpt("verify", ck4, expect=0)
    info = json.loads(ckpt("inspect", ck4, "--json", expect=0).stdout)
    names = {t["name"] for t in info["tensors"]}
    assert "model.embed_tokens.weight" in names and "hf.trainer/rng/0/cpu" in names
    assert info["metadata"][hf.MARKER_KEY]["kind"] == "trainer-checkpoint"

    dst = tmp_path / "hf"
    ckpt("consolidate", ck4, "--out", dst, expect=0)
    shutil.copy(ck4 / "config.json", dst / "config.json")
    loaded = transformers.LlamaForCausalLM.from_pretrained(dst)
    got = loaded.state_dict()
    with ckptstore.open(ck4) as ck:
        model_names = ck.metadata["ckptstore.torch"]["model"]
        assert set(got) == set(model_names)
        for n in model_names:
            assert torch.equal(got[n], torch.from_numpy(np.asarray(ck[n]).copy())), n


def test_load_from_checkpoint_outside_train_restores_the_model(ref, tmp_path):
    trainer = tt.make_trainer(str(tmp_path / "run"), 8, 4)
    ck4 = ref["out"] / "checkpoint-4"
    trainer._load_from_checkpoint(str(ck4))
    with ckptstore.open(ck4) as ck:
        for n, t in trainer.model.state_dict().items():
            assert torch.equal(t, torch.from_numpy(np.asarray(ck[n]).copy())), n


def test_final_save_model_loads_with_from_pretrained(ref):
    loaded = transformers.LlamaForCausalLM.from_pretrained(ref["final"])
    assert_same({n: t for n, t in ref["model"].state_dict().items()}, dict(loaded.state_dict()))


def test_save_total_limit_keeps_the_latest_and_the_best(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-0").mkdir()  # not a ckptstore checkpoint: rotation leaves it alone
    (out / "checkpoint-0" / "model.safetensors").write_bytes(b"stock")
    scores = iter([1.0, 5.0, 2.0, 3.0, 4.0, 0.0])
    trainer = tt.make_trainer(
        str(out),
        6,
        1,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="score",
        greater_is_better=True,
        load_best_model_at_end=True,
        eval_dataset=tt.Tokens(n=4),
        compute_metrics=lambda p: {"score": next(scores)},
    )
    trainer.train()
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("final"))
    assert names == ["checkpoint-0", "checkpoint-2", "checkpoint-6"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    # load_best_model_at_end restored the best checkpoint's model.
    with ckptstore.open(out / "checkpoint-2") as ck:
        for n, t in trainer.model.state_dict().items():
            assert torch.equal(t, torch.from_numpy(np.asarray(ck[n]).copy())), n


def test_non_blocking_save_total_limit_1_ends_like_the_stock_trainer(tmp_path, monkeypatch):
    """save_total_limit=1 with a best checkpoint that is not the last: the stock Trainer ends
    with the best checkpoint alone. With ckptstore_async=True the last save (checkpoint-6)
    is still being written when training ends: its write is held until someone waits for
    it or until on_train_end (which the Trainer calls after its end-of-train cleanup), so the
    cleanup runs with that save in flight on every run, and the end state must still be the
    stock one."""

    def best_not_last(out, cls, **kw):
        scores = iter([1.0, 5.0, 2.0, 3.0, 4.0, 0.0])
        return tt.make_trainer(
            str(out), 6, 1, cls=cls, save_total_limit=1, eval_strategy="steps", eval_steps=1,
            metric_for_best_model="score", greater_is_better=True, load_best_model_at_end=True,
            eval_dataset=tt.Tokens(n=4), compute_metrics=lambda p: {"score": next(scores)}, **kw,
        )

    stock_out = tmp_path / "stock"
    best_not_last(stock_out, transformers.Trainer).train()
    stock = sorted(p.name for p in stock_out.iterdir())
    assert stock == ["checkpoint-2"]

    gate = threading.Event()
    events = []
    write = hf._trainer._save_items  # the name the Trainer calls

    def held(path, items, max_shard_size):
        if os.path.basename(path).startswith(".ckptstore-staging-checkpoint-6-"):
            assert gate.wait(EVENT_TIMEOUT), "nobody waited for checkpoint-6"
        return write(path, items, max_shard_size)

    class Held(hf.Trainer):
        last_save = None

        def _ckptstore_write(self, run_dir, name, final, *a):
            super()._ckptstore_write(run_dir, name, final, *a)
            if name == "checkpoint-6":
                (self.last_save,) = self._ckptstore_saver.in_flight()
                assert not self.last_save.done()

        def ckptstore_wait(self):
            if self.last_save is not None and not self.last_save.done():
                events.append("waited")
                gate.set()
            super().ckptstore_wait()

    class TrainEnd(transformers.TrainerCallback):
        def on_train_end(self, args, state, control, **kw):
            events.append("train_end")
            gate.set()

    monkeypatch.setattr(hf._trainer, "_save_items", held)
    out = tmp_path / "run"
    trainer = best_not_last(out, Held, ckptstore_async=True)
    trainer.add_callback(TrainEnd())
    trainer.train()
    assert events[0] == "waited", events  # the end of training waited for the last save
    assert sorted(p.name for p in out.iterdir()) == stock
    assert hf.is_ckptstore_checkpoint(out / "checkpoint-2")
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")


def test_accelerate_save_state_load_state(tmp_path):
    import accelerate

    def steps(acc, model, opt, sched, n):
        ds = tt.Tokens(n=8)
        for i in range(n):
            b = ds[i % len(ds)]
            loss = model(input_ids=b["input_ids"][None], labels=b["labels"][None]).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()

    class Counter:
        def __init__(self) -> None:
            self.n = 3

        def state_dict(self):
            return {"n": self.n, "t": torch.arange(4)}

        def load_state_dict(self, st):
            self.n = st["n"]

    acc = hf.Accelerator(cpu=True)
    model = tt.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    steps(acc, model, opt, sched, 2)
    d = tmp_path / "state"
    acc.save_state(str(d))
    assert not (d / "optimizer.bin").exists() and hf.is_ckptstore_checkpoint(d)
    counter.n = 10
    steps(acc, model, opt, sched, 2)
    want = capture(model, opt), sched.state_dict()["last_epoch"], torch.random.get_rng_state()

    # Damage first: nothing changes.
    shard, off = tensor_offset(d, "optim/lm_head.weight/exp_avg_sq")
    data = bytearray(shard.read_bytes())
    data[off] ^= 1
    shard.write_bytes(bytes(data))
    before = capture(model, opt)
    with pytest.raises(ChecksumError, match=re.escape("optim/lm_head.weight/exp_avg_sq")):
        acc.load_state(str(d))
    assert_same(before, capture(model, opt))
    data[off] ^= 1
    shard.write_bytes(bytes(data))

    acc.load_state(str(d))
    assert counter.n == 3 and sched.state_dict()["last_epoch"] == 2
    steps(acc, model, opt, sched, 2)
    assert_same(want[0], capture(model, opt))
    assert sched.state_dict()["last_epoch"] == want[1]
    assert torch.equal(torch.random.get_rng_state(), want[2])
    assert isinstance(acc, accelerate.Accelerator)


def test_resume_true_takes_the_newest_checkpoint_as_a_path_or_raises_the_trainers_error(ref, tmp_path, monkeypatch):
    """``resume_from_checkpoint=True``: the newest committed checkpoint is chosen once (by the
    first rank, ``decided_once``; here the only one) and handed to the Trainer as a path, so
    the stock ``get_last_checkpoint`` inside ``Trainer.train`` is never asked again (on a
    shared file system another rank's caches could answer otherwise). An output directory
    without one raises the Trainer's own error."""
    out = copy_checkpoint(ref, tmp_path)
    asked = []
    monkeypatch.setattr(transformers.trainer, "get_last_checkpoint",
                        lambda d: asked.append(d) or pytest.fail("the Trainer chose the checkpoint itself"))
    trainer = tt.make_trainer(str(out), 8, 4)
    trainer.train(resume_from_checkpoint=True)
    assert asked == [] and trainer.state.global_step == 8
    assert_same(tt.dump(trainer), ref["dump"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"No valid checkpoint found in output directory ({empty})")):
        tt.make_trainer(str(empty), 8, 4).train(True)


def test_rotation_after_the_switch_counts_the_stock_checkpoints_and_ends_as_stock(tmp_path):
    """Issue 53: a run begun with the stock Trainer (checkpoint-2 and checkpoint-4, its own
    format), resumed from checkpoint-4 with ckptstore's and ``save_total_limit=2``: rotation
    counts both kinds, as the stock Trainer counts every ``checkpoint-N``, and removes the
    stock ones as they are superseded; the run ends with the checkpoints (and the state) of
    a stock run of the same steps (before: the stock ones were never counted or removed)."""
    stock_out, full, mixed = tmp_path / "stock", tmp_path / "full", tmp_path / "mixed"
    stock = tt.make_trainer(str(stock_out), 8, 2, cls=transformers.Trainer, save_total_limit=2)
    stock.train()
    tt.make_trainer(str(full), 8, 2, cls=transformers.Trainer).train()  # the run before the switch
    mixed.mkdir()
    for n in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(full / n, mixed / n)
    trainer = tt.make_trainer(str(mixed), 8, 2, save_total_limit=2)
    trainer.train(resume_from_checkpoint=str(mixed / "checkpoint-4"))
    names = sorted(p.name for p in mixed.iterdir())
    assert names == sorted(p.name for p in stock_out.iterdir()) == ["checkpoint-6", "checkpoint-8"], names
    for n in names:
        ckptstore.open(mixed / n).verify()
    assert_same(tt.dump(trainer), tt.dump(stock))


@pytest.mark.parametrize("kw", [{"gradient_accumulation_steps": 2}, {"per_device_train_batch_size": 2}],
                         ids=["grad-accumulation", "batch-2"])
def test_resume_with_gradient_accumulation_is_bit_identical(tmp_path, kw):
    """The stock Trainer's resume contract with gradient accumulation
    (test_resume_training_with_gradient_accumulation), and with a batch size of 2 (the data
    skipped by other counts): a run resumed from checkpoint-4 (mid-epoch) trains steps 5-8
    only and ends bit for bit where the uninterrupted run with the same arguments ends."""
    full = tt.make_trainer(str(tmp_path / "full"), 8, 4, **kw)
    full.train()
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", part / "checkpoint-4")
    resumed = tt.make_trainer(str(part), 8, 4, **kw)
    steps = []

    class Count(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            steps.append(state.global_step)

    resumed.add_callback(Count())
    resumed.train(resume_from_checkpoint=True)
    assert steps == [5, 6, 7, 8]  # from the checkpoint on, not from the start
    assert resumed.state.global_step == full.state.global_step == 8
    assert_same(tt.dump(resumed), tt.dump(full))


def test_save_strategy_best_saves_what_the_stock_trainer_saves(tmp_path):
    """``save_strategy="best"`` (the stock Trainer's test_save_best_checkpoint): a checkpoint
    only at each new best score. The same run with the stock Trainer and with ckptstore's
    ends with the same checkpoint names and the same ``best_model_checkpoint``; ours are
    committed ckptstore checkpoints."""

    def run(out, cls):
        scores = iter([1.0, 5.0, 2.0, 3.0, 6.0, 0.0])
        t = tt.make_trainer(str(out), 6, 1, cls=cls, save_strategy="best", eval_strategy="steps", eval_steps=1,
                            metric_for_best_model="score", greater_is_better=True, eval_dataset=tt.Tokens(n=4),
                            compute_metrics=lambda p: {"score": next(scores)})
        t.train()
        return t

    stock, ours = run(tmp_path / "stock", transformers.Trainer), run(tmp_path / "ours", tt.Trainer)
    names = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "stock").iterdir()), names
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-5"], names
    assert Path(ours.state.best_model_checkpoint).name == Path(stock.state.best_model_checkpoint).name == "checkpoint-5"
    for n in names:
        ckptstore.open(tmp_path / "ours" / n).verify()


def test_pushes_during_training_carry_the_models_weights_as_the_stock_trainers_do(tmp_path, monkeypatch):
    """``push_to_hub`` with ``hub_strategy="every_save"`` (the Hub faked: no network): the
    stock Trainer's push copies model.safetensors and config.json from checkpoint-N into the
    output directory and uploads it; a ckptstore checkpoint-N has no such file, so before,
    the pushes carried no weights. Each push of ours uploads the same files as the stock
    Trainer's, and the last pushed weights equal the stock run's, bit for bit."""
    from concurrent.futures import Future

    from safetensors.torch import load_file

    uploads: dict = {}

    class FakeHub:
        def __init__(self, key):
            self.key = key

        def create_repo(self, name, **kw):
            return type("Repo", (), {"repo_id": f"me/{Path(str(name)).name}"})()

        def upload_folder(self, *, folder_path, ignore_patterns=(), **kw):
            names = sorted(n for n in os.listdir(folder_path) if not n.startswith(("_", "checkpoint-", ".")))
            if Path(folder_path).name.startswith("checkpoint-"):
                names = ["<checkpoint>"]
            uploads.setdefault(self.key, []).append(names)
            done: Future = Future()
            done.set_result(None)
            return done

    def run(out, cls, key):
        monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeHub(key))
        t = tt.make_trainer(str(out), 4, 2, cls=cls, push_to_hub=True, hub_model_id=f"me/{key}",
                            hub_strategy="every_save")
        t.train()
        return load_file(str(out / "model.safetensors"))

    stock = run(tmp_path / "stock", transformers.Trainer, "stock")
    ours = run(tmp_path / "ours", tt.Trainer, "ours")
    assert uploads["ours"] == uploads["stock"], uploads
    assert any("model.safetensors" in u for u in uploads["ours"]), uploads
    assert sorted(ours) == sorted(stock)
    for k in stock:
        assert torch.equal(ours[k], stock[k]), k
