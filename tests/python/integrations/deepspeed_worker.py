"""One DeepSpeed training process for tests/python/integrations/test_deepspeed.py.

One CPU process of ``--world`` (default 1; DS_ACCELERATOR=cpu, ``--rank``, a free loopback
port given by the test), a small MLP built here, AdamW (torch_adam), WarmupLR, ZeRO stage given.
The data of step ``i`` on rank ``r`` is drawn from a generator seeded with ``i`` and ``r`` (the engine's
``global_steps``), so a resumed run sees the same batches as an uninterrupted one.

Modes (``--mode``), each writing a ``torch.save`` report to ``--out``:

* ``train_save``: train ``--steps`` steps (ZeRO-0: then drop the optimizer state of the
  extra head), save through ckptstore (tag ``global_step<N>``), snapshot (``at_save``), train ``--more`` steps, snapshot (``final``: the uninterrupted run).
* ``resume``: train 2 steps on other data through the extra head (so the live model and
  optimizer hold state the checkpoint does not name; for ZeRO, whose base optimizer state is
  one entry per flat partition, an injected extra state entry), then ``load_checkpoint`` (the tag ``latest`` names),
  snapshot (``loaded``, with what the live optimizer holds), train ``--more``, snapshot
  (``final``).
* ``kill``: train, save tag A (waited for when ``--non-blocking``), snapshot (``at_save``,
  written out at once), train one more step, arm the kill seam at ``--kill-at`` and save
  again: the process SIGKILLs itself (non-blocking: on the publishing thread).
* ``load_only``: ``load_checkpoint`` each ``--dir`` in turn; snapshot each and its ``latest``.
* ``corrupt``: train ``--steps`` on other data, snapshot (``before``), ``load_checkpoint``
  each ``--dir`` (expected to fail), recording the exception and a snapshot after each.
* ``changed`` (with ``--optimizer sgd``: the live optimizer is SGD, momentum 0.9, where the
  checkpoint's is AdamW): train 2 steps on other data, snapshot (``before``), then
  ``load_checkpoint`` (expected to be refused: the error and a snapshot ``after``), then
  install again with ``allow_optimizer_change=True`` and load (snapshot ``loaded``, the base
  optimizer's groups), train ``--more`` steps (``final``, the state names the base
  optimizer then holds).

* ``zero3_install``: a ZeRO-3 engine; ``install`` is expected to refuse it (the error, the
  stage, and whether the engine's checkpoint engine is unchanged).

``--optimizer`` (default ``adamw``): the optimizer of the config, ``adamw`` or ``sgd``.
``--default-engine``: no ``install`` (DeepSpeed's own ``torch.save`` engine: a run begun
before the switch to ckptstore). Every report holds ``log``: the messages of
``ckptstore.integrations.deepspeed``'s logger.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

MODEL_IN, HIDDEN, OUT = 8, 16, 4


def _env(port: int, rank: int, world: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))


def build(stage: int, non_blocking: bool = False, optimizer: str = "adamw", install: bool = True,
          freeze: bool = False):
    import deepspeed
    import torch

    from ckptstore.integrations import deepspeed as ckds

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(MODEL_IN, HIDDEN)
            self.b = torch.nn.Linear(HIDDEN, OUT)
            self.extra = torch.nn.Linear(HIDDEN, OUT)  # used only by the resume's live steps
            self.use_extra = False

        def forward(self, x):
            h = torch.relu(self.a(x))
            y = self.b(h)
            return y + self.extra(h) if self.use_extra else y

    torch.manual_seed(0)
    net = Net()
    if freeze:  # a frozen first layer (fine-tuning): no gradient, no optimizer state
        net.a.requires_grad_(False)
    opt_cfg = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
    if optimizer == "sgd":
        opt_cfg = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
    cfg = {
        "train_batch_size": 4,
        "optimizer": opt_cfg,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000000,
    }
    if optimizer == "sgd":
        cfg["zero_allow_untested_optimizer"] = True  # ZeRO's list of tested optimizers lacks SGD
    params = [p for p in net.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=params, config=cfg)
    if install:
        ckds.install(engine, non_blocking=non_blocking)
    return engine, net


def step(engine, seed_offset: int = 0) -> None:
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(seed_offset + 100000 * rank + int(engine.global_steps))
    x = torch.randn(4 // world, MODEL_IN, generator=g)
    y = torch.randn(4 // world, OUT, generator=g)
    loss = (engine(x) - y).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _flat(o, prefix, tensors, values) -> None:
    import torch

    if isinstance(o, torch.Tensor):
        tensors[prefix] = o.detach().clone()
    elif isinstance(o, dict):
        for k, v in o.items():
            _flat(v, f"{prefix}/{k}", tensors, values)
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            _flat(v, f"{prefix}/{i}", tensors, values)
    else:
        values[prefix] = repr(o)


def snapshot(engine) -> dict:
    """Parameters, the optimizer's state dict (ZeRO: flat FP32 partition and base state),
    the base optimizer's live state keys, the scheduler and the step counters."""
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    tensors: dict = {}
    values: dict = {}
    _flat(engine.optimizer.state_dict(), "optimizer", tensors, values)
    _flat(engine.lr_scheduler.state_dict(), "lr_scheduler", tensors, values)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch one
    ids = {id(p): n for n, p in engine.module.named_parameters()}
    live = sorted(ids.get(id(p), f"<tensor numel={p.numel()}>") for p in base.state)
    return {"params": params, "tensors": tensors, "values": values, "live_state_of": live,
            "live_state_count": len(base.state), "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples)}


#: The partial loads of mode ``partial``, in order (DeepSpeed's ``load_checkpoint`` flags).
PARTIAL_LOADS = [
    {"load_module_only": True},
    {"load_optimizer_states": False},
    {"load_lr_scheduler_states": False},
    {"load_optimizer_states": False, "load_lr_scheduler_states": False},
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--dir", action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=3)
    ap.add_argument("--kill-at", default="")
    ap.add_argument("--non-blocking", action="store_true")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--freeze", action="store_true", help="the first layer frozen")
    ap.add_argument("--exclude-frozen", action="store_true",
                    help="train_save: save_checkpoint(exclude_frozen_parameters=True)")
    ap.add_argument("--stale-latest", default="",
                    help="resume: rank 1 reads this tag from `latest` (a host's stale client caches)")
    ap.add_argument("--default-engine", action="store_true",
                    help="DeepSpeed's own checkpoint engine (no install): a run before its switch")
    args = ap.parse_args()
    _env(args.port, args.rank, args.world)
    import logging

    import torch

    from ckptstore.integrations import deepspeed as ckds

    report: dict = {"log": []}

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            report["log"].append(record.getMessage())

    logging.getLogger(ckds.__name__).addHandler(Keep(level=logging.INFO))
    if args.mode == "zero3_install":
        # install refuses ZeRO-3 and leaves the engine as it was.
        engine, _net = build(3, install=False)
        before = engine.checkpoint_engine
        try:
            ckds.install(engine)
            report["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            report["error"] = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}
        report["stage"] = int(engine.zero_optimization_stage())
        report["engine_unchanged"] = engine.checkpoint_engine is before
        report["engine_class"] = type(engine.checkpoint_engine).__name__
        torch.save(report, args.out)
        return 0
    engine, net = build(args.stage, args.non_blocking, args.optimizer, install=not args.default_engine,
                        freeze=args.freeze)
    if args.mode == "train_save":
        for _ in range(args.steps):
            step(engine)
        if args.stage == 0:
            # The checkpoint will name no optimizer state for the extra head (as for a
            # parameter that never had a gradient); both runs then restart its state.
            for p in net.extra.parameters():
                engine.optimizer.state.pop(p, None)
        engine.save_checkpoint(args.dir[0], exclude_frozen_parameters=args.exclude_frozen)
        report["at_save"] = snapshot(engine)
        for _ in range(args.more):  # non-blocking: while the save may still be writing
            step(engine)
        report["final"] = snapshot(engine)
        if isinstance(engine.checkpoint_engine, ckds.CheckpointEngine):
            engine.checkpoint_engine.wait()
    elif args.mode == "resume":
        net.use_extra = True
        for _ in range(2):
            step(engine, seed_offset=5000)
        net.use_extra = False
        if args.stage > 0:
            # ZeRO: the base optimizer holds one flat partition per group, which every
            # checkpoint names, so give the live state an entry the checkpoint lacks.
            for st in engine.optimizer.optimizer.state.values():
                st["ckptstore_stray"] = torch.ones(3)
        report["before_load"] = snapshot(engine)
        if args.stale_latest and args.rank == 1:
            from ckptstore.integrations.deepspeed import _install

            _install._latest_tag = lambda _engine, _dir: args.stale_latest
        path, client = engine.load_checkpoint(args.dir[0])
        report["load_path"] = path
        report["client_state_keys"] = sorted(client)
        report["loaded"] = snapshot(engine)
        if args.stage > 0:
            report["stray_present"] = any("ckptstore_stray" in st
                                          for st in engine.optimizer.optimizer.state.values())
        for _ in range(args.more):
            step(engine)
        report["final"] = snapshot(engine)
    elif args.mode == "kill":
        for _ in range(args.steps):
            step(engine)
        engine.save_checkpoint(args.dir[0])
        report["at_save"] = snapshot(engine)
        engine.checkpoint_engine.wait()  # tag A published before the seam is armed
        torch.save(report, args.out)
        step(engine)
        os.environ["CKPTSTORE_FAULT"] = f"deepspeed.{args.kill_at}"
        engine.save_checkpoint(args.dir[0])
        engine.checkpoint_engine.wait()  # non-blocking: the publish (and its seams) runs on a thread
        print("NOT KILLED", file=sys.stderr)
        return 3
    elif args.mode == "load_only":
        report["loads"] = []
        for d in args.dir:
            path, _client = engine.load_checkpoint(d)
            with open(os.path.join(d, "latest")) as fd:
                latest = fd.read()
            report["loads"].append({"dir": d, "path": path, "latest": latest, "state": snapshot(engine)})
    elif args.mode == "corrupt":
        for _ in range(args.steps):
            step(engine, seed_offset=9000)
        report["before"] = snapshot(engine)
        report["attempts"] = []
        for d in args.dir:
            try:
                engine.load_checkpoint(d)
                err = None
            except Exception as e:  # noqa: BLE001 - recorded for the test
                err = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                       "name": getattr(e, "name", None), "trace": traceback.format_exc()}
            report["attempts"].append({"dir": d, "error": err, "after": snapshot(engine)})
    elif args.mode == "partial":
        # DeepSpeed's partial loads, one after another on one engine (each after steps of its
        # own, so that what a load leaves alone differs from the checkpoint).
        report["partial"] = []
        if args.freeze:  # what a load leaves alone shows: the frozen layer moved since the save
            import torch

            with torch.no_grad():
                net.a.weight.add_(1.0)
        for i, kw in enumerate(PARTIAL_LOADS):
            for _ in range(2):
                step(engine, seed_offset=3000 + 100 * i)
            before = snapshot(engine)
            if args.freeze:  # the saved module lacks the frozen layer (exclude_frozen_parameters)
                kw = {**kw, "load_module_strict": False}
            path, _client = engine.load_checkpoint(args.dir[0], **kw)
            report["partial"].append({"kw": kw, "path": path, "before": before, "after": snapshot(engine)})
    elif args.mode == "changed":
        for _ in range(2):
            step(engine, seed_offset=7000)
        report["before"] = snapshot(engine)
        try:
            engine.load_checkpoint(args.dir[0])
            report["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            report["error"] = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                               "trace": traceback.format_exc()}
        report["after"] = snapshot(engine)
        ckds.install(engine, allow_optimizer_change=True)
        path, _client = engine.load_checkpoint(args.dir[0])
        report["load_path"] = path
        report["loaded"] = snapshot(engine)
        base = engine.basic_optimizer
        report["base_class"] = type(base).__name__
        report["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        for _ in range(args.more):
            step(engine)
        report["final"] = snapshot(engine)
        report["final_state_names"] = sorted({k for st in base.state.values() for k in st})
    else:
        print(f"unknown mode {args.mode}", file=sys.stderr)
        return 2
    torch.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dist_helpers import end_process

    end_process(main())
