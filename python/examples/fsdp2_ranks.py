"""FSDP2 across ranks: every rank saves its own shards of one checkpoint, and a job of
another size loads it (here: saved on 2 ranks, loaded on 3), each rank reading only the
boxes it needs.

    python python/examples/fsdp2_ranks.py [DIR]

Runs its ranks as local processes over gloo (CPU). In a real job, call ``ctd.save`` and
``ctd.load`` on every rank after ``init_process_group``, as ``job`` below does.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptstore.torch.distributed as ctd


def build(world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def job(rank: int, world: int, port: int, path: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt = build(world)
        if mode == "save":
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).pow(2).mean()
            loss.backward()
            opt.step()
            ctd.save(path, model, opt, extra={"step": 1})
        else:
            extra = ctd.load(path, model, opt)
            assert extra == {"step": 1}
        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, path: str, mode: str, out: str) -> dict:
    mp.start_processes(job, args=(world, free_port(), path, mode, out), nprocs=world, start_method="spawn")
    return torch.load(out)


def main(d: str) -> None:
    saved = run(2, f"{d}/ckpt", "save", f"{d}/saved.pt")
    loaded = run(3, f"{d}/ckpt", "load", f"{d}/loaded.pt")
    same = all(torch.equal(saved[n], loaded[n]) for n in saved)
    print(f"saved on 2 ranks, loaded on 3: bit-identical: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
