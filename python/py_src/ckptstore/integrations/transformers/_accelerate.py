"""Accelerate: what ``Accelerator.save_state`` stores for one process, as one committed
ckptstore checkpoint (the package docs)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ... import atomic
from ... import open as _open
from ...errors import InvalidArgumentError
from ._checkpoint import _naming, _read_tree, _restore, _rng_state, _set_rng_state, save_checkpoint


def _accelerate_parts(accelerator: Any) -> tuple:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
        DistributedType.XLA,
    ):
        raise InvalidArgumentError(
            f"ckptstore save_state/load_state: {accelerator.distributed_type} is not supported "
            "(use Accelerator.save_state)"
        )
    if accelerator.num_processes != 1:
        raise InvalidArgumentError(
            "ckptstore save_state/load_state: one process only (got "
            f"{accelerator.num_processes}); use Accelerator.save_state"
        )
    if len(accelerator._models) != 1 or len(accelerator._optimizers) > 1:
        raise InvalidArgumentError(
            "ckptstore save_state/load_state: exactly one prepared model and at most one "
            f"optimizer (got {len(accelerator._models)} and {len(accelerator._optimizers)})"
        )
    model = accelerator.unwrap_model(accelerator._models[0], keep_torch_compile=False)
    opt = accelerator._optimizers[0] if accelerator._optimizers else None
    return model, opt


def save_state(
    accelerator: Any,
    output_dir: "str | os.PathLike[str]",
    *,
    allow_pickle: bool = False,
    max_shard_size: Optional[int] = None,
) -> str:
    """What ``accelerator.save_state(output_dir)`` saves (one process: model, optimizer,
    schedulers, stateful dataloaders, grad scaler, RNG states, ``accelerator.step``, objects
    registered for checkpointing) as one committed ckptstore checkpoint in ``output_dir``,
    atomically replacing one there. Returns ``output_dir``."""
    model, opt = _accelerate_parts(accelerator)
    tree: Dict[str, Any] = {
        "step": accelerator.step,
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [
            dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
            for dl in accelerator._dataloaders
        ],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "rng": [_rng_state()],
    }
    atomic.make_dirs(output_dir)
    save_checkpoint(
        output_dir,
        model,
        opt,
        tree,
        kind="accelerate-state",
        allow_pickle=allow_pickle,
        max_shard_size=max_shard_size,
    )
    accelerator.project_configuration.iteration += 1
    return os.fspath(output_dir)


def load_state(
    accelerator: Any,
    input_dir: "str | os.PathLike[str]",
    *,
    allow_pickle: bool = False,
    allow_optimizer_change: bool = False,
) -> None:
    """Restore what :func:`save_state` saved into the prepared objects of ``accelerator``.
    Everything is read and checked (names, shapes, counts, the optimizer class unless
    ``allow_optimizer_change``, every CRC32) before the model or the optimizer changes; the
    optimizer state is replaced whole."""
    model, opt = _accelerate_parts(accelerator)
    where = os.fspath(input_dir)
    with _naming(where, "loading the state from"):
        tree = _read_tree(input_dir, allow_pickle)
    for what, live in (
        ("schedulers", accelerator._schedulers),
        ("dataloaders", accelerator._dataloaders),
        ("custom", accelerator._custom_objects),
    ):
        if len(tree.get(what) or []) != len(live):
            raise InvalidArgumentError(
                f"{where!r} holds {len(tree.get(what) or [])} {what}, the accelerator has {len(live)}"
            )
    with _naming(where, "loading the state from"):
        with _open(input_dir) as ck:
            if opt is not None and not ck.has_optimizer:
                raise InvalidArgumentError("it holds no optimizer state")
        _restore(os.fspath(input_dir), model, opt, allow_optimizer_change=allow_optimizer_change)
    for s, st in zip(accelerator._schedulers, tree["schedulers"]):
        s.load_state_dict(st)
    for dl, st in zip(accelerator._dataloaders, tree["dataloaders"]):
        if st is not None:
            dl.load_state_dict(st)
    if accelerator.scaler is not None and tree.get("scaler") is not None:
        accelerator.scaler.load_state_dict(tree["scaler"])
    for o, st in zip(accelerator._custom_objects, tree["custom"]):
        o.load_state_dict(st)
    accelerator.step = tree["step"]
    _set_rng_state(tree["rng"][0])


def _accelerator_class() -> Any:
    import accelerate

    class Accelerator(accelerate.Accelerator):
        """:class:`accelerate.Accelerator` whose ``save_state`` / ``load_state`` are
        :func:`save_state` / :func:`load_state` (an explicit directory is required; hooks
        registered with ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
        are not called)."""

        def save_state(
            self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kw: Any
        ) -> str:
            if output_dir is None:
                raise InvalidArgumentError("ckptstore Accelerator.save_state needs output_dir")
            return save_state(self, output_dir, **kw)

        def load_state(self, input_dir: Optional[str] = None, load_kwargs: Any = None, **kw: Any) -> None:
            if input_dir is None:
                raise InvalidArgumentError("ckptstore Accelerator.load_state needs input_dir")
            load_state(self, input_dir, **kw)

    return Accelerator

