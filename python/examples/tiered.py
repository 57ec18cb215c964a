"""Tiered checkpoints: every save lands in each host's fast local tier (a node-local disk,
or ``/dev/shm``), is copied to a peer host, and every ``persist_every`` steps to a
persistent tier (a shared directory or ``s3://``). A host lost with its disk is restored
from its peer's copy, without touching the persistent tier.

    python python/examples/tiered.py [DIR]

Two ranks stand for two hosts (each with a local directory of its own). After three saves,
host 1's local tier is wiped (a replaced machine) and the job restarts: every rank restores
the newest step, host 1's part from host 0's replica, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptstore.torch.distributed import CheckpointManager


def job(rank: int, world: int, port: int, d: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # replicated, as under DDP: every rank holds the same model
        model = torch.nn.Linear(16, 16)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        local, persistent = f"{d}/host{rank}", f"{d}/persistent"
        with CheckpointManager(local, persistent, persist_every=2, replicas=1, keep_last=2) as mgr:
            if mode == "train":
                for step in range(1, 4):
                    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
                    model(x).pow(2).mean().backward()
                    opt.step()
                    mgr.save(step, model, opt, extra={"step": step})  # returns once copied
                    opt.zero_grad()
                mgr.wait()
                torch.save(model.state_dict(), f"{d}/want{rank}.pt")
            else:
                step = mgr.restore_latest(model, opt)
                want = torch.load(f"{d}/want{rank}.pt")
                same = all(torch.equal(want[k], v) for k, v in model.state_dict().items())
                print(f"rank {rank}: restored step {step} from the {mgr.last_tier} tier, bit-identical: {same}",
                      flush=True)
                if not same:
                    raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(d: str) -> None:
    for mode in ("train", "restore"):
        if mode == "restore":
            shutil.rmtree(f"{d}/host1")  # host 1 replaced: its local tier is gone
            os.makedirs(f"{d}/host1")
        mp.start_processes(job, args=(2, free_port(), d, mode), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
