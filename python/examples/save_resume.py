"""Save a PyTorch model and its optimizer, then resume training from the checkpoint.

    python python/examples/save_resume.py [DIR]

The resumed run ends bit for bit where an uninterrupted run ends: the model, the Adam
moments and step counters, and the ``extra`` values (the epoch, the RNG state) all come
back. ``ckptstore.torch.load`` checks every byte's CRC32 and the optimizer's fit before it
changes anything, and replaces the optimizer state whole.
"""

from __future__ import annotations

import sys
import tempfile

import torch

import ckptstore.torch as ct


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main(path: str) -> None:
    # The uninterrupted run: 20 steps.
    model, opt = make()
    torch.manual_seed(1)
    train(model, opt, 20)
    want = [p.detach().clone() for p in model.parameters()]

    # The interrupted one: 10 steps, a checkpoint, a new process's worth of fresh objects.
    model, opt = make()
    torch.manual_seed(1)
    train(model, opt, 10)
    ct.save(path, model, opt, extra={"epoch": 10, "rng": torch.get_rng_state()})

    model, opt = make(seed=123)  # different weights: the load replaces them
    extra = ct.load(path, model, opt)
    torch.set_rng_state(extra["rng"])
    train(model, opt, 20 - extra["epoch"])

    same = all(torch.equal(a, b) for a, b in zip(want, model.parameters()))
    print(f"resumed at step {extra['epoch']}: bit-identical to the uninterrupted run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(f"{d}/ckpt")
