"""Helper of test_lightning.py: FSDP2 (DTensor) training with ckptstore's
ModelParallelStrategy on the CPU (gloo), one rank of a job the test launches (it sets
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK: Lightning then takes the
processes as given and creates none).

    python lightning_fsdp.py save   CKPT MAX_EPOCHS DUMP    # train, save CKPT, dump the state
    python lightning_fsdp.py resume CKPT MAX_EPOCHS DUMP    # resume from CKPT, dump the state
    python lightning_fsdp.py damaged CKPT MAX_EPOCHS DUMP   # the resume must fail: dump the
                                                            # error and the model state after
    python lightning_fsdp.py changed CKPT MAX_EPOCHS DUMP OPT          # as damaged: another
                                                            # optimizer class must be refused
    python lightning_fsdp.py changed_allowed CKPT MAX_EPOCHS DUMP OPT  # resume it with
                                                            # allow_optimizer_change=True

OPT (default ``adam``): the optimizer, ``adam``, ``adamw`` or ``sgd`` (momentum 0.9).

The dump (rank 0, torch.save; the test's own comparison file) holds the gathered (full)
model state dict and the full optimizer state dict (keyed by parameter name), the global
step, and the rest of the checkpoint as the strategy returned it on resume.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import lightning as L
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from ckptstore.integrations.lightning import ModelParallelStrategy

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    def __init__(self, opt: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
        self.loaded: dict = {}
        self.opt = opt
        self.at_train_start: dict = {}

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def on_train_start(self):
        # Right after the resume, before any step: the model and the optimizer's groups.
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        opt = self.trainer.optimizers[0]
        msd = get_model_state_dict(self.trainer.strategy.model, options=full)
        self.at_train_start = {
            # Copies: on one rank the full tensors may be the parameters' own memory.
            "model": {k: v.detach().clone() for k, v in msd.items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        }

    def on_load_checkpoint(self, checkpoint):
        self.loaded = {k: v for k, v in checkpoint.items() if k in ("epoch", "global_step", "loops", "extra")}

    def on_save_checkpoint(self, checkpoint):
        # A tensor and some JSON in the rest of the dict (the stock strategy pickles it).
        checkpoint["extra"] = {"marker": torch.arange(5, dtype=torch.int16), "note": ("a", 1)}


def main() -> int:
    mode, ckpt, max_epochs, dump = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    opt = sys.argv[5] if len(sys.argv) > 5 else "adam"
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g))
    dl = torch.utils.data.DataLoader(ds, batch_size=8)
    model = Net(opt)
    must_fail = mode in ("damaged", "changed")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1,
            allow_optimizer_change=mode == "changed_allowed",
        ),
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    error = None
    try:
        trainer.fit(model, dl, ckpt_path=None if mode == "save" else ckpt)
    except Exception as e:  # noqa: BLE001 - reported in the dump
        if not must_fail:
            raise
        error = f"{type(e).__name__}: {e}"
    if must_fail and error is None:
        raise SystemExit(f"the resume ({mode}) did not fail")
    if mode == "save":
        trainer.save_checkpoint(ckpt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(trainer.strategy.model, options=full)
    live = trainer.optimizers[0]
    # The live optimizer as it is (get_optimizer_state_dict would give a stateless one state).
    live_state = {k: sorted(v) for k, v in live.state.items()}
    osd = None if error else get_optimizer_state_dict(trainer.strategy.model, live, options=full)
    if trainer.global_rank == 0:
        torch.save(
            {"model": msd, "optimizer": osd, "global_step": trainer.global_step, "loaded": model.loaded,
             "error": error, "live_state_keys": list(live_state.values()),
             "optimizer_class": type(live).__name__, "at_train_start": model.at_train_start},
            dump,
        )
    trainer.strategy.barrier()
    print("done", trainer.global_rank, trainer.global_step, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dist_helpers import end_process

    end_process(main())
