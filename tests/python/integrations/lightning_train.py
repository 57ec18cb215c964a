"""Helper of test_lightning.py: train a tiny model with a Lightning Trainer on the CPU,
checkpointing through ckptstore's CheckpointIO, and dump the final state for comparison.

    python lightning_train.py OUT_DIR MAX_EPOCHS [--resume PATH|last] [--io sync|async|torch]
                              [--top-k K] [--dump FILE]

Checkpoints go to OUT_DIR/ckpts (ModelCheckpoint: every epoch, save_last=True, top-k K,
-1 keeping all; K=0 only `last`). The dump (torch.save of plain tensors, the test's own
comparison file) holds the parameters, the optimizer and scheduler state dicts, the torch
RNG state, the global step and the checkpoint path the Trainer resumed from.

Deterministic: one seed, no shuffling, dropout drawing from the torch RNG, which a callback
checkpoints (Lightning does not), so a resume continues the same random stream.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ckptstore.integrations.lightning import CheckpointIO

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.02, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), torch.nn.Dropout(0.25), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": sched}


class RngState(Callback):
    """Checkpoints the torch RNG (a uint8 tensor: stored as a ckptstore tensor)."""

    def state_dict(self):
        return {"torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["torch_rng"])


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(48, 8, generator=g)
    y = torch.randn(48, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def make_trainer(out: str, max_epochs: int, io: str, top_k: int, extra_callbacks=(), devices: int = 1) -> L.Trainer:
    plugins = []
    if io == "sync":
        plugins = [CheckpointIO()]
    elif io == "async":
        plugins = [CheckpointIO(async_save=True)]
    ckpt = ModelCheckpoint(
        dirpath=os.path.join(out, "ckpts"),
        save_last=True,
        save_top_k=top_k,
        monitor="train_loss" if top_k > 0 else None,
        every_n_epochs=1,
    )
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        # Several devices: DDP over gloo, Lightning's launcher starting the other ranks as
        # processes of this script.
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=max_epochs,
        plugins=plugins,
        callbacks=[ckpt, RngState(), *extra_callbacks],
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def dump_state(trainer: L.Trainer, model: Net) -> dict:
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "ckpt_path": None if trainer.ckpt_path is None else os.path.abspath(trainer.ckpt_path),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("max_epochs", type=int)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--io", default="sync", choices=["sync", "async", "torch"])
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--devices", type=int, default=1)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = Net()
    trainer = make_trainer(a.out, a.max_epochs, a.io, a.top_k, devices=a.devices)
    trainer.fit(model, data(), ckpt_path=a.resume)
    if a.dump:  # each rank its own (DDP: rank 1's beside rank 0's)
        torch.save(dump_state(trainer, model), a.dump + (f".rank{trainer.global_rank}" if trainer.global_rank else ""))
    print("done", trainer.global_step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
