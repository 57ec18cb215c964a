"""Checkpoints on S3: a training loop's manager with its steps under an ``s3://`` prefix,
and one tensor read back from a step without downloading the rest.

    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=... \\
        python python/examples/s3.py s3://BUCKET/PREFIX

The server and credentials come from the usual AWS environment variables (add
``AWS_ALLOW_HTTP=true`` for a plain-HTTP endpoint such as a local test server). A save uploads
the shards, then PUTs the manifest last: an interrupted save commits nothing.
"""

from __future__ import annotations

import sys

import torch

import ckptstore
import ckptstore.torch as ct


def main(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with ct.CheckpointManager(root, keep_last=2) as mgr:
        for step in range(1, 4):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, model, opt, extra={"step": step})
        mgr.wait()
        print(f"steps on {root}: {mgr.steps()}")

        fresh = torch.nn.Linear(64, 64)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
        step = mgr.restore_latest(fresh, fresh_opt)  # downloaded, every CRC checked
        same = torch.equal(fresh.weight, model.weight)
        print(f"restored step {step}, bit-identical: {same}")

        # A few rows of one tensor: ranged GETs of just those bytes, CRC-checked.
        with ckptstore.open(mgr.step_dir(step), lazy=True) as ck:
            rows = ck.read_region("weight", (0, 0), (2, 64))
        equal = torch.equal(torch.from_numpy(rows), model.weight[:2].detach())
        print(f"read 2 rows of 'weight' lazily: equal: {equal}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith("s3://"):
        sys.exit("usage: python s3.py s3://BUCKET/PREFIX (the server from the AWS_* environment)")
    main(sys.argv[1])
