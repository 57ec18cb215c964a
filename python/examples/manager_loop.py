"""The checkpoint manager in a training loop: a save every few steps that does not stop
training (the state is copied, then written in the background), retention, and a restart
that resumes from the newest committed step.

    python python/examples/manager_loop.py [ROOT]

Each step is a directory ``ROOT/step-<8 digits>``; ``keep_last=2`` keeps the two newest.
A crash at any moment leaves every committed step whole: ``restore_latest`` takes the newest.
"""

from __future__ import annotations

import sys
import tempfile

import torch

import ckptstore.torch as ct

STEPS, EVERY = 12, 4


def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run(root: str, start_fresh: bool) -> torch.Tensor:
    model, opt = make()
    with ct.CheckpointManager(root, keep_last=2) as mgr:
        start = 0
        if not start_fresh:
            resumed, extra = mgr.restore_latest(model, opt, return_extra=True)
            if resumed is not None:
                start = extra["next_step"]
                print(f"resumed from step {resumed}")
        for i in range(start, STEPS):
            step(model, opt, i)
            if (i + 1) % EVERY == 0:
                mgr.save(i + 1, model, opt, extra={"next_step": i + 1})  # returns at once
        mgr.wait()
        print(f"committed steps kept: {mgr.steps()}")
    return model.weight.detach().clone()


def main(root: str) -> None:
    want = run(f"{root}/uninterrupted", start_fresh=True)
    # A run that stops after step 8 (its checkpoints stay), then a restart.
    model, opt = make()
    with ct.CheckpointManager(f"{root}/run", keep_last=2) as mgr:
        for i in range(8):
            step(model, opt, i)
            if (i + 1) % EVERY == 0:
                mgr.save(i + 1, model, opt, extra={"next_step": i + 1})
    got = run(f"{root}/run", start_fresh=False)
    same = torch.equal(want, got)
    print(f"restarted run bit-identical to the uninterrupted one: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
