"""A tiny LlamaForCausalLM trained by ckptstore's Trainer (test_transformers.py).

Imported by the tests, and run as a script to resume in a new process::

    python transformers_train.py OUT_DIR MAX_STEPS SAVE_STEPS RESUME DUMP

RESUME is a checkpoint path, ``true`` (the latest) or ``none``; the final state (parameters,
optimizer state, scheduler state, RNG states) is written to DUMP (``torch.save`` of plain
tensors and lists, read back with ``weights_only=True``).
"""

from __future__ import annotations

import random
import sys
from typing import Any, Dict, Optional

import numpy as np
import torch
import transformers

from ckptstore.integrations.transformers import Trainer

VOCAB = 64
SEQ = 16
N_SAMPLES = 24  # batch 4: 6 steps an epoch


def make_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,  # training consumes the torch RNG: its restore matters
    )
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = N_SAMPLES, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_args(out: str, max_steps: int, save_steps: int, **kw: Any) -> Any:
    base = dict(
        output_dir=out,
        max_steps=max_steps,
        save_steps=save_steps,
        save_strategy="steps",
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.01,
        use_cpu=True,
        seed=42,
        data_seed=7,
        dataloader_num_workers=0,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def make_trainer(out: str, max_steps: int, save_steps: int, cls: Any = Trainer, **kw: Any) -> Any:
    trainer_kw = {k: kw.pop(k) for k in list(kw) if k in ("optimizers", "eval_dataset", "compute_metrics", "ckptstore_async", "ckptstore_allow_optimizer_change")}
    model = kw.pop("model", None) or make_model()
    return cls(model=model, args=make_args(out, max_steps, save_steps, **kw), train_dataset=Tokens(), **trainer_kw)


def dump(trainer: Any) -> Dict[str, Any]:
    """Everything a resume must restore, as plain tensors and lists."""
    opt = trainer.optimizer
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    ostate = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            ostate[f"{names[id(p)]}/{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    py = random.getstate()
    np_state = np.random.get_state()
    sched = trainer.lr_scheduler.state_dict()
    return {
        "params": {n: t.detach().clone() for n, t in trainer.model.state_dict().items()},
        "optim": ostate,
        "lr": [g["lr"] for g in opt.param_groups],
        "sched_last_epoch": sched["last_epoch"],
        "sched_last_lr": [float(x) for x in sched["_last_lr"]],
        "global_step": trainer.state.global_step,
        "rng_torch": torch.random.get_rng_state(),
        "rng_numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "rng_numpy_pos": np_state[2],
        "rng_python": torch.tensor(py[1], dtype=torch.int64),
    }


def main(argv: list) -> None:
    out, max_steps, save_steps, resume, dump_path = argv
    res: Optional[Any] = {"none": None, "true": True}.get(resume.lower(), resume)
    trainer = make_trainer(out, int(max_steps), int(save_steps))
    trainer.train(resume_from_checkpoint=res)
    torch.save(dump(trainer), dump_path)


if __name__ == "__main__":
    main(sys.argv[1:])
