#!/usr/bin/env python3
"""Benchmark (not a test): the Hugging Face Trainer's checkpoints, stock against ckptstore
(:class:`ckptstore.integrations.transformers.Trainer`), on the same model in the same run.

The model: a ``LlamaForCausalLM`` built in code (default hidden 1024, intermediate 2816,
4 layers, 16 heads, vocabulary 8192: 68.2M FP32 parameters, 0.25 GiB, plus AdamW's two
states: 0.76 GiB of model + optimizer state), trained on the CPU (``use_cpu=True``, batch 1,
32 tokens).

* **blocked**: the time the training loop spends in ``Trainer._save_checkpoint`` (the
  step is blocked for all of it: both Trainers save synchronously), median over the saves
  of one run (``--saves``, one every step, ``save_total_limit=2`` so the rotation is in
  it too). Stock writes ``model.safetensors`` + ``optimizer.pt`` (``torch.save``) +
  scheduler/RNG/trainer state and fsyncs nothing; ckptstore fsyncs every file and the
  directories (its checkpoint is durable when the call returns). ``stock+fsync`` adds an
  fsync of every file of the stock checkpoint and its directory after the call, for a
  like-for-like durable save.
* **resume**: a fresh process per measurement (``--child``): from its spawn to the end of
  the first resumed optimizer step (imports, model construction, ``train(resume_from_
  checkpoint=...)``, the step), and the part from the ``train`` call to the end of that
  step. ``cold``: the checkpoint's files are evicted from the page cache first
  (``posix_fadvise(DONTNEED)`` after an fsync, ``bench_util.evict``); ``hot``: read once
  first. Best of ``--repeat``, each figure on its own. ``restore``: from the ``train`` call to
  ``on_train_begin`` (model, optimizer and scheduler restored; the Trainer's own setup,
  about 0.3 s of ``gc.collect`` among it, included for both).

Ratios: stock time / ckptstore time (> 1: ckptstore faster).

    python python/benches/bench_transformers.py [--dir DIR] [--saves 4] [--repeat 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
from bench_util import (  # noqa: E402  (the shared file and timing helpers)
    copy_seconds,
    evict,
    files_of,
    fsync_path,
    keep_best,
    raw_read,
    run_json,
    state_bytes,
)
# Import the installed ckptstore, not the source tree beside this script (no native module).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

T_SPAWN = float(os.environ.get("BENCH_T_SPAWN", "nan"))
import torch  # noqa: E402
import transformers  # noqa: E402

from ckptstore.integrations.transformers import Trainer as CkTrainer  # noqa: E402


SEQ = 32


def make_model(small: bool):
    torch.manual_seed(0)
    if small:
        cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=704,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=4, max_position_embeddings=SEQ)
    else:
        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                                       num_hidden_layers=4, num_attention_heads=16,
                                       num_key_value_heads=16, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def timed(cls, fsync: bool):
    class Timed(cls):
        save_times: list = []
        snapshot_times: list = []

        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            if getattr(self, "ckptstore_async", False):
                self.ckptstore_wait()  # the previous save (blocking the step too)
                t1 = time.perf_counter()
                super()._save_checkpoint(model, trial)
                t2 = time.perf_counter()
                self.snapshot_times.append(t2 - t1)
                self.save_times.append(t2 - t0)
                return
            super()._save_checkpoint(model, trial)
            if fsync:
                d = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
                fsync_path(d)
                fsync_path(self.args.output_dir)
            self.save_times.append(time.perf_counter() - t0)

    return Timed


def trainer_for(way: str, out: str, max_steps: int, save_steps: int, small: bool, **kw):
    cls = {"stock": transformers.Trainer, "stock+fsync": transformers.Trainer, "ckptstore": CkTrainer,
           "ckptstore-async": CkTrainer}[way]
    extra = {"ckptstore_async": True} if way == "ckptstore-async" else {}
    model = make_model(small)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
        save_total_limit=2, per_device_train_batch_size=1, learning_rate=1e-4, use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, report_to="none", logging_strategy="no",
        disable_tqdm=True, **kw)
    return timed(cls, way == "stock+fsync")(model=model, args=args,
                                            train_dataset=Tokens(model.config.vocab_size), **extra)


def child(way: str, path: str, small: bool) -> None:
    """Resume from ``path`` in this fresh process; print timestamps after the first step."""
    t_imported = time.time()
    out = os.path.dirname(path)
    step = int(path.rsplit("-", 1)[1])
    marks = {}

    class First(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks["begin"] = time.time()

        def on_step_end(self, args, state, control, **kw):
            marks["first_step_end"] = time.time()
            print(json.dumps({"spawn_to_step_s": marks["first_step_end"] - T_SPAWN,
                              "train_to_step_s": marks["first_step_end"] - marks["train"],
                              "restore_s": marks["begin"] - marks["train"],
                              "imports_s": t_imported - T_SPAWN}), flush=True)
            os._exit(0)

    trainer = trainer_for(way, out, step + 1, 10**6, small)
    trainer.add_callback(First())
    marks["train"] = time.time()
    trainer.train(resume_from_checkpoint=path)
    raise SystemExit("no step was taken")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 10 MiB model, to try the script")
    ap.add_argument("--child", nargs=2, metavar=("WAY", "PATH"))
    ap.add_argument("--resume-only", action="store_true",
                    help="reuse the checkpoints of an earlier run in --dir (no save figures)")
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.small)

    root = a.dir or tempfile.mkdtemp(prefix="bench_hf_")
    ways = ["stock", "stock+fsync", "ckptstore", "ckptstore-async"]
    snapshot = {}
    memcpy = None
    blocked = {}
    last = {}
    nbytes = 0
    for way in ways if not a.resume_only else []:
        out = os.path.join(root, way.replace("+", "_"))
        shutil.rmtree(out, ignore_errors=True)
        tr = trainer_for(way, out, a.saves, 1, a.small)
        tr.train()
        nbytes = state_bytes(tr.model, tr.optimizer)
        blocked[way] = statistics.median(tr.save_times)
        if tr.snapshot_times:
            snapshot[way] = statistics.median(tr.snapshot_times)
        if memcpy is None:  # the state copied once into existing buffers, best of 3
            src = list(tr.model.state_dict().values()) + [
                t for st in tr.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
            memcpy = copy_seconds(src)
            del src
        last[way] = os.path.join(out, f"checkpoint-{a.saves}")
        print(f"save {way}: blocked {[round(t, 3) for t in tr.save_times]} s", flush=True)
        del tr
    for way in ways[:3]:
        last.setdefault(way, os.path.join(root, way.replace("+", "_"), f"checkpoint-{a.saves}"))
    size = f"{nbytes / 2**30:.3f} GiB" if nbytes else "(from the earlier run)"
    print(f"model + AdamW state: {size}; {os.cpu_count()} CPUs; torch "
          f"{torch.__version__}, transformers {transformers.__version__}", flush=True)

    resume = {}
    for cache in ("cold", "hot"):
        for _ in range(a.repeat):
            for way in ("stock", "ckptstore"):
                path = last[way]
                if cache == "cold":
                    for f in files_of(path):
                        evict(f)
                else:
                    raw_read(path)
                env = dict(os.environ, BENCH_T_SPAWN=repr(time.time()))
                got = run_json([sys.executable, os.path.abspath(__file__), "--child", way, path]
                               + (["--small"] if a.small else []),
                               f"{way} {cache} resume failed", env=env)
                print(f"  resume {cache} {way}: {got}", flush=True)
                keep_best(resume, (cache, way), got)

    print("\n| figure | stock | stock+fsync | ckptstore | stock / ckptstore | stock+fsync / ckptstore |")
    print("| --- | --- | --- | --- | --- | --- |")
    b = blocked
    if b:
        for way in ("ckptstore", "ckptstore-async"):
            print(f"| step blocked by a save (median), {way} s | {b['stock']:.3f} | "
                  f"{b['stock+fsync']:.3f} | {b[way]:.3f} | {b['stock'] / b[way]:.2f} | "
                  f"{b['stock+fsync'] / b[way]:.2f} |")
        if "ckptstore-async" in snapshot:
            print(f"\nnon-blocking: snapshot (median) {snapshot['ckptstore-async']:.3f} s; with the wait "
                  f"for the previous save {b['ckptstore-async']:.3f} s; one copy of the state into "
                  f"existing buffers {memcpy:.3f} s: snapshot / copy = "
                  f"{snapshot['ckptstore-async'] / memcpy:.2f}")
    for cache in ("cold", "hot"):
        for key, label in (("spawn_to_step_s", "spawn to first resumed step"),
                           ("train_to_step_s", "train() to first resumed step"),
                           ("restore_s", "train() to on_train_begin (the restore)")):
            s, c = resume[(cache, "stock")][key], resume[(cache, "ckptstore")][key]
            print(f"| {cache}: {label} s | {s:.3f} | | {c:.3f} | {s / c:.2f} | |")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
