"""A TorchTitan-shaped training job for tests/python/integrations/test_torchtitan.py.

It drives ckptstore's TorchTitan checkpoint manager the way TorchTitan's ``Trainer`` does,
with TorchTitan's own components (``OptimizersContainer`` with AdamW, ``LRSchedulersContainer``
with warmup + cosine decay, ``ParallelAwareDataloader`` over a stateful dataset, a train
state ``Stateful``) around a tiny language model built in code: ``config.checkpoint.build(
...)``, ``load(step)`` before the data iterator is made, then per step ``zero_grad``,
forward/backward, ``maybe_wait_for_staging()``, ``optimizers.step()``,
``lr_schedulers.step()``, ``save(step, last_step=...)``.

Run as a script it is one fresh process of a training run (world size 1, gloo on a
``HashStore``), and writes the state it ends with to ``--out`` (``torch.save``: a file of
the test's own making).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from torchtitan.components.checkpointer import CheckpointManager as StockCheckpointManager

from ckptstore.integrations.torchtitan import CheckpointManager

VOCAB = 32
DIM = 16
SEQ = 9


class TinyLM(nn.Module):
    """Embedding, a residual MLP, a norm, an output head; ``late`` is used only once
    ``use_late`` is set (a parameter that has no optimizer state until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, DIM)
        self.late = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + torch.tanh(self.l1(h))
        if self.use_late:
            h = h + self.late(h)
        return self.out(self.norm(h))


class Tokens(IterableDataset, Stateful):
    """Sample ``i`` of rank ``r`` is a fixed function of ``(r, i)``; the state is ``i``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.i = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            yield torch.randint(0, VOCAB, (SEQ,), generator=g)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, sd: dict) -> None:
        self.i = sd["i"]


class NoStateDataloader(ParallelAwareDataloader):
    """A data loader with no state to keep (``state_dict()`` is ``{}``), as the dummy data
    loader of TorchTitan's checkpoint tests; ``loaded`` counts its ``load_state_dict`` calls."""

    loaded = 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        assert sd == {}, sd
        self.loaded += 1


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


class SGDOptimizersContainer(OptimizersContainer):
    """TorchTitan's container with ``torch.optim.SGD`` among its factories (TorchTitan 0.3
    builds Adam, AdamW and DistMuon; its docs have users subclass it for others)."""

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "SGD":
            return torch.optim.SGD
        return OptimizersContainer._resolve_optimizer_factory(name)


#: ``build(optimizer=...)``: the optimizer's name and settings of its one param group.
OPTIMIZERS = {
    "AdamW": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    "SGD": {"lr": 1e-2, "momentum": 0.9},
}


@dataclass
class Job:
    model: TinyLM
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    train_state: TrainState
    checkpointer: CheckpointManager
    steps: int
    it: Any = None


def build(
    folder: str,
    *,
    mode: str = "disabled",
    steps: int = 6,
    interval: int = 2,
    keep: int = 0,
    rank: int = 0,
    world: int = 1,
    fsdp: bool = False,
    exclude: Optional[list] = None,
    last_save_model_only: bool = True,
    export_dtype: str = "float32",
    optimizer: str = "AdamW",
    stock: bool = False,
    empty_dataloader: bool = False,
    **checkpoint_config: Any,
) -> Job:
    torch.manual_seed(0)
    model = TinyLM()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt_config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r".*", optimizer_name=optimizer, optimizer_kwargs=dict(OPTIMIZERS[optimizer]))
        ],
        implementation="for-loop",
    )
    if optimizer == "AdamW":
        optimizers = opt_config.build(model_parts=[model])
    else:
        optimizers = SGDOptimizersContainer(opt_config, model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine").build(
        optimizers=optimizers, training_steps=steps
    )
    # ``empty_dataloader``: a data loader whose state_dict() is {} (TorchTitan's own tests').
    loader_class = NoStateDataloader if empty_dataloader else ParallelAwareDataloader
    dataloader = loader_class(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    train_state = TrainState()
    # ``stock``: TorchTitan's own manager (DCP, ``step-N``), the job before its switch.
    config_class = StockCheckpointManager.Config if stock else CheckpointManager.Config
    config = config_class(
        enable=True,
        folder=folder,
        interval=interval,
        keep_latest_k=keep,
        async_mode=mode,  # type: ignore[arg-type]
        exclude_from_loading=list(exclude or []),
        last_save_model_only=last_save_model_only,
        export_dtype=export_dtype,  # type: ignore[arg-type]
        **checkpoint_config,
    )
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder="",
    )
    return Job(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer, steps)


def train_step(job: Job) -> None:
    """One step of TorchTitan's ``Trainer.train`` loop body."""
    job.train_state.step += 1
    job.optimizers.zero_grad()
    batch = next(job.it)
    x, y = batch[:, :-1], batch[:, 1:]
    loss = F.cross_entropy(job.model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    job.checkpointer.maybe_wait_for_staging()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.train_state.ntokens_seen += batch.numel()
    job.checkpointer.save(job.train_state.step, last_step=job.train_state.step == job.steps)


def train(job: Job, until: int, load: bool = True) -> None:
    if load:
        job.checkpointer.load(step=-1)
    job.it = iter(job.dataloader)
    while job.train_state.step < min(until, job.steps):
        train_step(job)


def _full(v: Any) -> Any:
    if isinstance(v, DTensor):
        return v.full_tensor().detach().clone()
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v


def snapshot(job: Job) -> dict:
    """Everything TorchTitan checkpoints, as plain values (DTensors gathered whole)."""
    params = {n: _full(p) for n, p in job.model.state_dict().items()}
    optim = {k: _full(v) for k, v in job.optimizers.state_dict().items()}
    return {
        "params": params,
        "optimizer": optim,
        "lr": {
            "last_epoch": job.lr_schedulers.schedulers[0].last_epoch,
            "lrs": [g["lr"] for o in job.optimizers for g in o.param_groups],
            "last_lr": [list(s.get_last_lr()) for s in job.lr_schedulers],
        },
        "dataloader": job.dataloader.state_dict(),
        "train_state": job.train_state.state_dict(),
        "loaded_step": getattr(job.checkpointer, "loaded_step", None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--mode", default="disabled")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--until", type=int, default=6)
    ap.add_argument("--keep", type=int, default=0)
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--stock", action="store_true", help="TorchTitan's own checkpoint manager")
    ap.add_argument("--use-late", action="store_true", help="train `late` from the first step")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    job = build(a.folder, mode=a.mode, steps=a.steps, keep=a.keep, stock=a.stock)
    # TorchTitan's own manager cannot resume a step saved while a parameter had no optimizer
    # state (its optimizer state dict then names state the checkpoint lacks): its runs use
    # every parameter from the first step.
    job.model.use_late = a.use_late
    train(job, a.until, load=not a.no_load)
    job.checkpointer.close()
    torch.save(snapshot(job), a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
