"""ckptstore.integrations.deepspeed: DeepSpeed 0.19 (CPU, one process, ZeRO 0-2).

The training runs are subprocesses of deepspeed_worker.py (each a fresh process with its own
``deepspeed.initialize``; DeepSpeed JIT-builds its CPU comm op once into the torch extensions
cache, ``TORCH_EXTENSIONS_DIR`` or the default, which every process reuses). The commit
protocol and the stored types are also tested in this process, on the checkpoint engine
alone (no process group). DeepSpeed missing is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import collections
import fractions
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402,F401 - a missing DeepSpeed fails the module
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

from ckptstore._faults import POINTS  # noqa: E402
from ckptstore.errors import ChecksumError, InvalidArgumentError  # noqa: E402
from ckptstore.integrations import deepspeed as ckds  # noqa: E402
from ckptstore.integrations._tree import PickleNotAllowedError  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "deepspeed_worker.py"
STEPS, MORE = 3, 3
TAG = f"global_step{STEPS}"
ZERO_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"


# ---- helpers -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(mode: str, out: Path, *, stage: int = 1, dirs=(), kill_at: str = "",
               expect_rc: int = 0, non_blocking: bool = False, optimizer: str = "adamw",
               default_engine: bool = False, args=()) -> dict:
    env = dict(os.environ)
    env.pop("CKPTSTORE_FAULT", None)
    # DeepSpeed's JIT build of its CPU comm op needs ninja from the venv on PATH.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, str(WORKER), "--mode", mode, "--stage", str(stage), "--out", str(out),
           "--port", str(_free_port()), "--steps", str(STEPS), "--more", str(MORE)]
    for d in dirs:
        cmd += ["--dir", str(d)]
    if kill_at:
        cmd += ["--kill-at", kill_at]
    if non_blocking:
        cmd.append("--non-blocking")
    cmd += ["--optimizer", optimizer]
    if default_engine:
        cmd.append("--default-engine")
    cmd += list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-40:])
    assert r.returncode == expect_rc, f"{' '.join(cmd)}: exit {r.returncode}\n{tail}"
    return torch.load(out, weights_only=False)


def run_ranks(mode: str, out: Path, world: int, *, stage: int, dirs, args=()) -> list:
    """``world`` worker processes of one job (one port), started together (each with the
    worker's ``args`` besides); their reports."""
    env = dict(os.environ)
    env.pop("CKPTSTORE_FAULT", None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["DS_ACCELERATOR"] = "cpu"
    port = _free_port()
    procs = []
    for r in range(world):
        cmd = [sys.executable, str(WORKER), "--mode", mode, "--stage", str(stage),
               "--out", f"{out}.rank{r}", "--port", str(port), "--rank", str(r), "--world", str(world),
               "--steps", str(STEPS), "--more", str(MORE)] + [a for d in dirs for a in ("--dir", str(d))]
        procs.append(subprocess.Popen(cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # a rank that failed leaves its peers in a collective: end them
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        tail = "\n".join(log.splitlines()[-30:])
        assert p.returncode == 0, f"{mode} rank {r}: exit {p.returncode}\n{tail}"
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for part in ("params", "tensors"):
        g, w = got[part], want[part]
        assert sorted(g) == sorted(w), f"{what}: {part} names differ: {sorted(set(g) ^ set(w))}"
        bad = [n for n in w if not same_tensor(g[n], w[n])]
        assert not bad, f"{what}: {part} differ bitwise: {bad}"
    assert got["values"] == want["values"], what
    assert got["global_steps"] == want["global_steps"], what
    assert got["global_samples"] == want["global_samples"], what


def flip_byte(ckpt_dir: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s data in its shard (safetensors layout)."""
    import ckptstore

    with ckptstore.open(ckpt_dir) as ck:
        shard = ckpt_dir / ck.info(tensor)["file"]
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    at = 8 + n + (begin + end) // 2
    raw[at] ^= 0x01
    shard.write_bytes(bytes(raw))


def same_obj(a, b, path="") -> None:
    """Structural equality with types (tensors bit for bit, nan equal to nan)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert same_tensor(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same_obj(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_obj(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, (LossScaler, DynamicLossScaler, argparse.Namespace)):
        same_obj(vars(a), vars(b), path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ---- training runs (module-scoped: each process once) --------------------------------------

_runs: dict = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepspeed")


#: ZeRO stage -> whether its run saves non-blocking (stage 1: the save returns after the
#: snapshot copy and training goes on while it is written; 0 and 2 save blocking, as do the
#: kill runs). One run per stage keeps the DeepSpeed processes of this file to eleven.
NON_BLOCKING = {0: False, 1: True, 2: False}


def stage_run(work: Path, stage: int):
    """(checkpoint dir, train_save report, resume report) of ZeRO ``stage``."""
    non_blocking = NON_BLOCKING[stage]
    key = (stage, non_blocking)
    if key not in _runs:
        name = f"zero{stage}{'_nb' if non_blocking else ''}"
        d = work / name
        train = run_worker("train_save", work / f"train_{name}.pt", stage=stage, dirs=[d],
                           non_blocking=non_blocking)
        resume = run_worker("resume", work / f"resume_{name}.pt", stage=stage, dirs=[d])
        _runs[key] = (d, train, resume)
    return _runs[key]


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["zero0", "zero1-nonblocking", "zero2"])
def test_resume_in_new_process_is_bit_identical(work, stage):
    d, train, resume = stage_run(work, stage)
    assert (d / "latest").read_text() == TAG
    # Non-blocking (ZeRO-1): the saving process trained on while the files were written;
    # the checkpoint holds the state at the save, not a later one.
    assert resume["load_path"] == str(d / TAG / MODEL_FILE)
    # Right after the load: exactly the state at the save (params, optimizer incl. the ZeRO
    # FP32 partition and base state, scheduler, counters) ...
    assert_same_state(resume["loaded"], train["at_save"], f"ZeRO-{stage} loaded vs saved")
    # ... and after more steps, the uninterrupted run's.
    assert_same_state(resume["final"], train["final"], f"ZeRO-{stage} resumed vs uninterrupted")
    assert resume["final"]["global_steps"] == STEPS + MORE
    n_tensors = len(train["final"]["tensors"])
    assert n_tensors >= (3 if stage else 12), n_tensors  # the optimizer state was compared


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_live_optimizer_state_the_checkpoint_does_not_name_is_gone(work, stage):
    _d, train, resume = stage_run(work, stage)
    if stage == 0:
        # The torch AdamW holds state per parameter: the live one had state for the extra
        # head (trained before the load), the checkpoint names none for it.
        assert "extra.weight" in resume["before_load"]["live_state_of"]
        assert "extra.weight" not in train["at_save"]["live_state_of"]
        assert resume["loaded"]["live_state_of"] == train["at_save"]["live_state_of"]
        assert resume["loaded"]["live_state_count"] == 4
    else:
        # ZeRO 1/2: the base optimizer holds one state entry per flat partition, and every
        # checkpoint names it; the live entry carried an extra state the checkpoint lacks.
        assert any("ckptstore_stray" in k for k in resume["before_load"]["tensors"])
        assert resume["stray_present"] is False
        assert not any("ckptstore_stray" in k for k in resume["loaded"]["tensors"])


def test_each_file_is_a_committed_checkpoint_cli_opens_it(work, ckpt):
    d, _train, _resume = stage_run(work, 1)
    assert (d / "latest").read_text() == TAG
    assert sorted(os.listdir(d / TAG)) == [MODEL_FILE, ZERO_FILE]
    assert not [n for n in os.listdir(d) if "ckptstore" in n], os.listdir(d)  # no leftovers
    for name, tensor in [(MODEL_FILE, "module/a.weight"),
                         (ZERO_FILE, "optimizer_state_dict/single_partition_of_fp32_groups/0")]:
        path = d / TAG / name
        assert (path / "ckpt-manifest.json").is_file()
        r = ckpt("verify", path, expect=0)
        assert r.stdout.startswith("ok:"), r.stdout
        r = ckpt("inspect", path, expect=0)
        assert tensor in r.stdout, r.stdout
        assert "ckptstore.tree" in r.stdout  # the JSON part (ds_config, ds_version, ...)


def test_two_ranks_zero1_each_writes_its_partition_resume_bit_identical(work):
    # Two processes of one job: each rank writes its own ZeRO file into the one staging
    # directory, rank 0 publishes after a barrier; each rank's resume reads (and checks)
    # the model file and its own partition only.
    d = work / "two_ranks"
    train = run_ranks("train_save", work / "two_train.pt", 2, stage=1, dirs=[d])
    assert (d / "latest").read_text() == TAG
    assert sorted(os.listdir(d / TAG)) == [MODEL_FILE, ZERO_FILE, "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resume = run_ranks("resume", work / "two_resume.pt", 2, stage=1, dirs=[d])
    for r in range(2):
        assert_same_state(resume[r]["loaded"], train[r]["at_save"], f"rank {r} loaded vs saved")
        assert_same_state(resume[r]["final"], train[r]["final"], f"rank {r} resumed vs uninterrupted")
        assert resume[r]["stray_present"] is False
    # The two ranks held different partitions (so each really read its own file).
    part = "optimizer/single_partition_of_fp32_groups/0"
    assert not same_tensor(train[0]["at_save"]["tensors"][part], train[1]["at_save"]["tensors"][part])
    # Rank 1's client caches still show the ``latest`` that a rename replaced, naming a tag
    # gone since (a shared file system): the tag is read by rank 0 alone and handed to rank 1
    # (issue 52), so both resume the same tag; before, rank 1 looked for the old one.
    stale = run_ranks("resume", work / "two_stale.pt", 2, stage=1, dirs=[d], args=["--stale-latest", "global_step0"])
    for r in range(2):
        assert stale[r]["load_path"] == resume[r]["load_path"], r
        assert_same_state(stale[r]["loaded"], train[r]["at_save"], f"rank {r} loaded (stale latest) vs saved")


# ---- SIGKILL during a save -------------------------------------------------------------------

KILL_POINTS = ["save", "publish", "latest"]
#: The kill runs: each seam with a blocking save, and ``publish`` reached on the background
#: thread of a non-blocking save.
KILL_RUNS = [(p, False) for p in KILL_POINTS] + [("publish", True)]
KILL_IDS = [p + ("-nonblocking" if nb else "") for p, nb in KILL_RUNS]


def test_a_run_begun_with_deepspeeds_default_engine_resumes_after_install(work):
    """ZeRO-1 trained and saved by DeepSpeed's own engine (torch.save files), then switched:
    an engine with install loads the tag `latest` names (torch.load(weights_only=True) with
    DeepSpeed's classes, no pickle opt-in), a warning says so, and the run ends bit for bit
    where the uninterrupted one did."""
    d = work / "default_engine"
    train = run_worker("train_save", work / "train_default.pt", stage=1, dirs=[d], default_engine=True)
    assert (d / "latest").read_text() == TAG
    assert (d / TAG / MODEL_FILE).is_file() and (d / TAG / ZERO_FILE).is_file()  # torch.save files
    resume = run_worker("resume", work / "resume_default.pt", stage=1, dirs=[d])
    assert resume["load_path"] == str(d / TAG / MODEL_FILE)
    assert_same_state(resume["loaded"], train["at_save"], "default engine: loaded vs saved")
    assert_same_state(resume["final"], train["final"], "default engine: resumed vs uninterrupted")
    said = [m for m in resume["log"] if "default checkpoint engine" in m]
    assert len(said) == 1 and str(d / TAG) in said[0] and "weights_only=True" in said[0], resume["log"]


@pytest.mark.parametrize("stage,frozen", [(0, ()), (2, ()), (2, ("--freeze", "--exclude-frozen"))],
                         ids=["zero0", "zero2", "zero2-frozen-excluded"])
def test_partial_loads_end_where_deepspeeds_default_engine_ends(work, stage, frozen):
    """DeepSpeed's partial loads (``load_module_only``, ``load_optimizer_states=False``,
    ``load_lr_scheduler_states=False`` and both), the usual start of a fine-tuning run: the
    same run saved once by DeepSpeed's default engine and once through ckptstore, each then
    loaded partially by a fresh process of its kind (after steps of its own before each
    load). Every state after every load is the default engine's, bit for bit: what a flag
    leaves alone stays, what it loads comes from the checkpoint. Also with a frozen first
    layer saved with ``exclude_frozen_parameters=True`` (moved in the loading process before
    the loads: it stays where it is, as with the default engine)."""
    runs = {}
    tag = f"{stage}{'f' if frozen else ''}"
    for kind, default in (("stock", True), ("ours", False)):
        d = work / f"partial_{kind}_zero{tag}"
        run_worker("train_save", work / f"partial_train_{kind}{tag}.pt", stage=stage, dirs=[d],
                   default_engine=default, args=frozen)
        runs[kind] = run_worker("partial", work / f"partial_{kind}{tag}.pt", stage=stage, dirs=[d],
                                default_engine=default, args=frozen[:1])["partial"]
    assert len(runs["ours"]) == len(runs["stock"]) == 4
    for theirs, ours in zip(runs["stock"], runs["ours"]):
        what = f"ZeRO-{stage} {ours['kw']}"
        assert ours["kw"] == theirs["kw"]
        assert_same_state(ours["before"], theirs["before"], f"{what}: before the load")
        assert_same_state(ours["after"], theirs["after"], f"{what}: after the load")
        assert not all(same_tensor(ours["before"]["params"][n], ours["after"]["params"][n])
                       for n in ours["after"]["params"]), f"{what}: the load changed no parameter"
        if frozen:  # the excluded frozen layer stays as the loading process moved it
            assert same_tensor(ours["before"]["params"]["a.weight"], ours["after"]["params"]["a.weight"]), what


def test_install_refuses_zero3_saying_why_and_what_to_use(work):
    """ZeRO-3's load without optimizer states reads the tag's files itself
    (zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint): install refuses a ZeRO-3 engine
    up front, naming that and the alternatives, and leaves its checkpoint engine alone."""
    r = run_worker("zero3_install", work / "zero3.pt", stage=3)
    assert r["stage"] == 3
    assert r["error"] is not None and r["error"]["type"] == "ckptstore.errors.InvalidArgumentError"
    msg = r["error"]["message"]
    for part in ("ZeRO stage 3 is not supported", "get_fp32_state_dict_from_zero_checkpoint",
                 "do not call install", "ZeRO stage 0, 1 or 2"):
        assert part in msg, msg
    assert r["engine_unchanged"] and r["engine_class"] != "CheckpointEngine", r


@pytest.fixture(scope="module")
def killed(work):
    """Per kill point: a dir with tag A committed and a second save killed at that point,
    the killed process's report, and one fresh process's load of every dir."""
    assert {f"deepspeed.{p}" for p in KILL_POINTS} == {p for p in POINTS if p.startswith("deepspeed.")}
    dirs, reports = {}, {}
    for (point, nb), run in zip(KILL_RUNS, KILL_IDS):
        d = work / f"killed_{run}"
        reports[run] = run_worker("kill", work / f"kill_{run}.pt", dirs=[d], kill_at=point,
                                  expect_rc=-signal.SIGKILL, non_blocking=nb)
        dirs[run] = d
    # What is on disk right after the kill, before anything else touches it.
    listing = {p: (sorted(os.listdir(d)), (d / "latest").read_text()) for p, d in dirs.items()}
    loads = run_worker("load_only", work / "killed_load.pt", dirs=list(dirs.values()))
    return dirs, reports, listing, {load["dir"]: load for load in loads["loads"]}


@pytest.mark.parametrize("run", KILL_IDS)
def test_sigkill_during_save_previous_tag_resumes(killed, run):
    dirs, reports, listing, loads = killed
    point = run.split("-")[0]
    d = dirs[run]
    names, latest = listing[run]
    assert latest == TAG  # `latest` did not move
    new_tag = f"global_step{STEPS + 1}"
    if point == "latest":
        assert new_tag in names  # published, complete, but not named by `latest`
        assert sorted(os.listdir(d / new_tag)) == [MODEL_FILE, ZERO_FILE]
    else:
        assert new_tag not in names, names  # nothing of the killed tag is visible
        assert f".{new_tag}.ckptstore-staging" in names, names
    load = loads[str(d)]
    assert load["latest"] == TAG
    assert load["path"] == str(d / TAG / MODEL_FILE)
    assert_same_state(load["state"], reports[run]["at_save"], f"killed at {run}")


# ---- a change of optimizer class (AdamW saved, SGD live) -------------------------------------


@pytest.mark.parametrize("stage", [0, 1], ids=["zero0", "zero1-nonblocking"])
def test_another_optimizer_class_is_refused_unless_allowed(work, stage):
    from ckptstore.errors import IncompatibleStateError

    d, train, _resume = stage_run(work, stage)  # saved by AdamW (ZeRO-1: a non-blocking save)
    rep = run_worker("changed", work / f"changed_zero{stage}.pt", stage=stage, dirs=[d], optimizer="sgd")
    err = rep["error"]
    assert err is not None, "the load of an AdamW tag into SGD did not fail"
    assert err["type"] == f"{IncompatibleStateError.__module__}.{IncompatibleStateError.__qualname__}", err["trace"]
    assert "optimizer is AdamW, the live optimizer is SGD" in err["message"], err["message"]
    assert MODEL_FILE in err["message"], err["message"]
    # Refused before DeepSpeed applied anything: the SGD engine's whole state is as it was.
    assert_same_state(rep["after"], rep["before"], f"ZeRO-{stage} live state after the refusal")
    assert rep["before"]["global_steps"] == 2

    # With the opt-in: the model, counters and the AdamW state are restored as saved, each
    # group keeps SGD's momentum (the checkpoint's groups lack it), and the next steps run.
    loaded, saved = rep["loaded"], train["at_save"]
    assert rep["load_path"] == str(d / TAG / MODEL_FILE)
    assert rep["base_class"] == "SGD"
    bad = [n for n in saved["params"] if not same_tensor(loaded["params"][n], saved["params"][n])]
    assert not bad, bad
    assert loaded["global_steps"] == STEPS and loaded["global_samples"] == saved["global_samples"]
    moments = [n for n in saved["tensors"] if n.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and all(same_tensor(loaded["tensors"][n], saved["tensors"][n]) for n in moments), moments
    for g in rep["groups"]:
        assert g["momentum"] == 0.9 and g["dampening"] == 0 and g["nesterov"] is False, g
        assert tuple(g["betas"]) == (0.9, 0.999) and g["weight_decay"] == 0.01, g  # the checkpoint's
    assert rep["final"]["global_steps"] == STEPS + MORE
    assert "momentum_buffer" in rep["final_state_names"]  # SGD stepped
    assert not all(same_tensor(rep["final"]["params"][n], loaded["params"][n]) for n in loaded["params"])


# ---- one flipped byte --------------------------------------------------------------------------


def test_flipped_byte_fails_naming_tensor_live_state_unchanged(work, ckpt):
    src, _train, _resume = stage_run(work, 1)
    cases = [(ZERO_FILE, "optimizer_state_dict/base_optimizer_state/state/0/exp_avg"),
             (MODEL_FILE, "module/b.weight")]
    dirs = []
    for i, (name, tensor) in enumerate(cases):
        d = work / f"flipped{i}"
        shutil.copytree(src, d)
        flip_byte(d / TAG / name, tensor)
        r = ckpt("verify", d / TAG / name, expect=1)
        assert tensor in r.stdout + r.stderr
        dirs.append(d)
    rep = run_worker("corrupt", work / "corrupt.pt", dirs=dirs)
    before = rep["before"]
    for (name, tensor), attempt in zip(cases, rep["attempts"]):
        err = attempt["error"]
        assert err is not None, f"{name}: the load did not fail"
        assert err["type"] == f"{ChecksumError.__module__}.{ChecksumError.__qualname__}", err["trace"]
        assert tensor in err["message"], err["message"]
        assert name in err["message"], err["message"]
        # The ZeRO file is read after the model file: the model was still not touched.
        assert_same_state(attempt["after"], before, f"live state after a failed load of {name}")


# ---- the checkpoint engine alone (this process, no process group) --------------------------


def _info(save_dir: Path, tag: str, save_latest: bool = True) -> CheckpointCommitInfo:
    return CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=save_latest)


def _save_tag(ce, save_dir: Path, tag: str, files: dict, *, commit: bool = True) -> None:
    info = _info(save_dir, tag)
    ce.create(info)
    ce.makedirs(str(save_dir / tag), exist_ok=True)
    for name, obj in files.items():
        ce.save(state_dict=obj, path=str(save_dir / tag / name))
    if commit:
        assert ce.commit(info) is True


def deepspeed_like() -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, generator=g)
    dyn = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=100, min_scale=1, delayed_shift=2,
                            consecutive_hysteresis=False, raise_error_at_min_scale=True,
                            dtype=torch.float16)
    return {
        "module": collections.OrderedDict([("l.weight", w), ("l.bias", torch.zeros(4))]),
        "tied": w,  # the same tensor twice
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(scale=1),
            "dyn": dyn,
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [collections.OrderedDict([("l.weight", fragment_address(numel=12, start=0))])],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0),
                                                   "exp_avg": torch.randn(16, generator=g)}},
                                     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
            "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        },
        "param_shapes": [collections.OrderedDict([("l.weight", torch.Size([4, 3]))])],
        "args": argparse.Namespace(lr=0.1, name="run", layers=[1, 2]),
        "ds_config": {"train_batch_size": 4, "zero_optimization": {"stage": 2}},
        "ds_version": deepspeed.__version__,
        "odd": {"$deepspeed": "a caller's key", "nan": float("nan"), "b": b"\x00\x01", 7: "int key"},
        "none": None,
    }


def test_commit_protocol_nothing_visible_before_commit(tmp_path):
    ce = ckds.CheckpointEngine()
    (tmp_path / "latest").write_text("older")
    info = _info(tmp_path, "t1")
    ce.create(info)
    ce.makedirs(str(tmp_path / "t1"), exist_ok=True)
    obj = deepspeed_like()
    ce.save(state_dict=obj, path=str(tmp_path / "t1" / MODEL_FILE))
    assert not (tmp_path / "t1").exists()  # staged, not visible
    assert (tmp_path / "latest").read_text() == "older"
    ce.commit(info)
    assert (tmp_path / "latest").read_text() == "t1"
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1"]
    back = ce.load(str(tmp_path / "t1" / MODEL_FILE), map_location=lambda s, loc: s)
    same_obj(back, obj)
    assert back["tied"] is back["module"]["l.weight"]
    assert back["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
    assert back["optimizer_state_dict"]["dyn"].dtype is torch.float16


def test_save_latest_false_leaves_latest(tmp_path):
    ce = ckds.CheckpointEngine()
    _save_tag(ce, tmp_path, "a", {MODEL_FILE: {"x": torch.ones(2)}})
    info = _info(tmp_path, "b", save_latest=False)
    ce.create(info)
    ce.save(state_dict={"x": torch.zeros(2)}, path=str(tmp_path / "b" / MODEL_FILE))
    ce.commit(info)
    assert (tmp_path / "latest").read_text() == "a"
    assert same_tensor(ce.load(str(tmp_path / "b" / MODEL_FILE))["x"], torch.zeros(2))


def test_resave_same_tag_replaces_it_whole(tmp_path):
    ce = ckds.CheckpointEngine()
    _save_tag(ce, tmp_path, "t", {MODEL_FILE: {"x": torch.ones(2)}, "old_only.pt": {"y": 1}})
    _save_tag(ce, tmp_path, "t", {MODEL_FILE: {"x": torch.full((2,), 7.0)}})
    assert sorted(os.listdir(tmp_path / "t")) == [MODEL_FILE]  # the old tag's files are gone
    assert same_tensor(ce.load(str(tmp_path / "t" / MODEL_FILE))["x"], torch.full((2,), 7.0))
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


def test_next_save_removes_a_killed_saves_staging(tmp_path):
    ce = ckds.CheckpointEngine()
    _save_tag(ce, tmp_path, "t1", {MODEL_FILE: {"x": torch.ones(2)}})
    _save_tag(ckds.CheckpointEngine(), tmp_path, "t2", {MODEL_FILE: {"x": torch.ones(2)}}, commit=False)
    assert ".t2.ckptstore-staging" in os.listdir(tmp_path)
    _save_tag(ce, tmp_path, "t3", {MODEL_FILE: {"x": torch.ones(2)}})
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1", "t3"]


def test_object_only_pickle_stores_is_refused_unless_opted_in(tmp_path):
    class Custom:
        def __init__(self) -> None:
            self.v = 3

    ce = ckds.CheckpointEngine()
    info = _info(tmp_path, "t")
    ce.create(info)
    with pytest.raises(PickleNotAllowedError, match=r"client/custom.*Custom"):
        ce.save(state_dict={"x": torch.ones(2), "client": {"custom": Custom()}},
                path=str(tmp_path / "t" / MODEL_FILE))
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()

    trusting = ckds.CheckpointEngine(allow_pickle=True)
    _save_tag(trusting, tmp_path, "t", {MODEL_FILE: {"x": torch.ones(2), "c": fractions.Fraction(1, 3)}})
    assert trusting.load(str(tmp_path / "t" / MODEL_FILE))["c"] == fractions.Fraction(1, 3)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        ckds.CheckpointEngine().load(str(tmp_path / "t" / MODEL_FILE))


def test_default_engine_file_loads_weights_only_else_needs_the_pickle_opt_in(tmp_path):
    """A torch.save file of DeepSpeed's default engine: DeepSpeed's own values load with
    torch.load(weights_only=True); an object of any other class needs allow_pickle."""
    path = tmp_path / MODEL_FILE
    saved = {"x": torch.arange(3), "scaler": LossScaler(scale=1), "stage": ZeroStageEnum(2),
             "args": argparse.Namespace(lr=0.1)}
    torch.save(saved, path)
    same_obj(ckds.CheckpointEngine().load(str(path)), saved)
    odd = tmp_path / "odd" / MODEL_FILE
    odd.parent.mkdir()
    torch.save({"x": torch.arange(3), "odd": fractions.Fraction(1, 3)}, odd)
    with pytest.raises(PickleNotAllowedError, match=r"weights_only=True.*allow_pickle=True"):
        ckds.CheckpointEngine().load(str(odd))
    back = ckds.CheckpointEngine(allow_pickle=True).load(str(odd))
    assert same_tensor(back["x"], torch.arange(3)) and back["odd"] == fractions.Fraction(1, 3)


def test_commit_without_its_create_is_refused(tmp_path):
    ce = ckds.CheckpointEngine()
    with pytest.raises(InvalidArgumentError, match="without its create"):
        ce.commit(_info(tmp_path, "t"))
    ce.create(_info(tmp_path, "t"))
    with pytest.raises(InvalidArgumentError, match="without its create"):
        ce.commit(_info(tmp_path, "other"))


def test_save_outside_a_tag_is_its_own_committed_checkpoint(tmp_path):
    # save_16bit_model: create(tag), save(<save_dir>/pytorch_model.bin), commit: no tag dir.
    ce = ckds.CheckpointEngine()
    info = _info(tmp_path, "global_step9", save_latest=False)
    ce.create(info)
    ce.makedirs(str(tmp_path), exist_ok=True)
    ce.save({"w": torch.ones(3)}, str(tmp_path / "pytorch_model.bin"))
    ce.commit(info)
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]
    assert same_tensor(ce.load(str(tmp_path / "pytorch_model.bin"))["w"], torch.ones(3))


def test_non_blocking_engine_snapshots_then_publishes_in_background(tmp_path):
    ce = ckds.CheckpointEngine(non_blocking=True)
    ce._save_latest = True  # as install()'s save_checkpoint wrapper sets it
    x = torch.arange(6, dtype=torch.float32)
    for tag, value in (("t1", 1.0), ("t2", 2.0)):
        x.fill_(value)
        info = _info(tmp_path, tag, save_latest=False)  # what the wrapper hands DeepSpeed
        ce.create(info)
        ce.save(state_dict={"x": x, "step": tag}, path=str(tmp_path / tag / MODEL_FILE))
        x.fill_(-1.0)  # the live tensor changes as soon as save returns
        ce.commit(info)
        ce.wait()
        assert (tmp_path / "latest").read_text() == tag
        back = ce.load(str(tmp_path / tag / MODEL_FILE))
        assert same_tensor(back["x"], torch.full((6,), value)) and back["step"] == tag
    assert list(ce._savers) == [MODEL_FILE]  # one snapshot buffer set, reused by t2
    ce.cleanup()
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1", "t2"]


def test_optimizer_class_is_recorded_with_each_file_and_checked_at_load(tmp_path):
    import ckptstore
    from ckptstore.errors import IncompatibleStateError

    ce = ckds.CheckpointEngine()
    ce._optimizer_class = "AdamW"  # as install()'s save_checkpoint wrapper sets it
    obj = {"module": collections.OrderedDict(w=torch.ones(2)), "client": {"k": 1}}
    _save_tag(ce, tmp_path, "t", {MODEL_FILE: obj})
    path = tmp_path / "t" / MODEL_FILE
    with ckptstore.open(path) as ck:
        assert ck.keys() == ["module/w"]  # tensor names unchanged
    same_obj(ce.load(str(path)), obj)  # the record is not part of the object
    ce._expect_class = "SGD"  # as install()'s load_checkpoint wrapper sets it
    with pytest.raises(IncompatibleStateError, match="optimizer is AdamW, the live optimizer is SGD") as e:
        ce.load(str(path))
    assert MODEL_FILE in str(e.value) and e.value.group is None
    ce._expect_class = "AdamW"
    same_obj(ce.load(str(path)), obj)
    assert ce._class_changed is False
    ce._expect_class, ce.allow_optimizer_change = "SGD", True
    same_obj(ce.load(str(path)), obj)
    assert ce._class_changed is True

    # A caller's key of that name is the caller's (escaped), never read as the record.
    theirs = {"$deepspeed.optimizer_class": "not ours", "x": torch.zeros(3)}
    plain = ckds.CheckpointEngine()
    _save_tag(plain, tmp_path, "u", {MODEL_FILE: theirs})
    plain._expect_class = "SGD"
    same_obj(plain.load(str(tmp_path / "u" / MODEL_FILE)), theirs)  # no class recorded: unchecked


@pytest.mark.parametrize("marker", [
    {"$deepspeed": "object", "class": "os.system", "state": {}},  # not in the fixed table
    {"$deepspeed": "enum", "class": "ZeroStageEnum", "value": 99},
    {"$deepspeed": "dataclass", "class": "fragment_address", "fields": {"bogus": 1}},
    {"$deepspeed": "object", "class": "LossScaler", "state": [1, 2]},
    {"$deepspeed": "namespace", "vars": 3},
    {"$deepspeed": "no such kind"},
])
def test_malformed_stored_deepspeed_value_is_refused_naming_the_file(tmp_path, marker):
    from ckptstore.integrations._tree import save_tree

    path = tmp_path / MODEL_FILE
    save_tree(path, {"x": torch.ones(2), "bad": marker})  # as a hostile writer would
    with pytest.raises(InvalidArgumentError, match=MODEL_FILE):
        ckds.CheckpointEngine().load(str(path))


def test_publish_failure_is_a_ckptstore_error_and_latest_stays(tmp_path, monkeypatch):
    from ckptstore import atomic
    from ckptstore.errors import CheckpointIOError

    ce = ckds.CheckpointEngine()
    _save_tag(ce, tmp_path, "a", {MODEL_FILE: {"x": torch.ones(2)}})

    def failing_rename(src, dst):
        raise CheckpointIOError("rename: Input/output error (injected)")

    monkeypatch.setattr(atomic, "publish_dir", failing_rename)  # the engine calls atomic.publish_dir
    info = _info(tmp_path, "b")
    ce.create(info)
    ce.save(state_dict={"x": torch.zeros(2)}, path=str(tmp_path / "b" / MODEL_FILE))
    with pytest.raises(CheckpointIOError, match=r"publishing tag 'b'.*injected") as e:
        ce.commit(info)
    assert str(tmp_path / "b") in str(e.value)
    assert not (tmp_path / "b").exists()
    assert (tmp_path / "latest").read_text() == "a"


def test_non_blocking_save_that_fails_midway_leaves_the_next_save_clean(tmp_path):
    ce = ckds.CheckpointEngine(non_blocking=True)
    ce._save_latest = True
    _save_tag(ce, tmp_path, "a", {MODEL_FILE: {"x": torch.ones(2)}})
    ce.wait()
    info = _info(tmp_path, "b", save_latest=False)
    ce.create(info)
    ce.save(state_dict={"x": torch.zeros(1 << 16)}, path=str(tmp_path / "b" / MODEL_FILE))  # in flight
    with pytest.raises(PickleNotAllowedError):
        ce.save(state_dict={"obj": fractions.Fraction(1, 2)}, path=str(tmp_path / "b" / ZERO_FILE))
    # DeepSpeed never commits "b"; the next save waits for b's writer, then clears its staging.
    _save_tag(ce, tmp_path, "c", {MODEL_FILE: {"x": torch.full((2,), 3.0)}})
    ce.wait()
    assert sorted(os.listdir(tmp_path)) == ["a", "c", "latest"]
    assert (tmp_path / "latest").read_text() == "c"
    assert same_tensor(ce.load(str(tmp_path / "c" / MODEL_FILE))["x"], torch.full((2,), 3.0))
