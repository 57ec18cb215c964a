"""The tiered mode of TorchTitan's manager (``local_folder`` set in the config): every save
through ckptstore's tiered manager (:class:`ckptstore.torch.distributed.CheckpointManager`),
the resume by its ``restore_latest`` (the package docs)."""

from __future__ import annotations

import binascii
from typing import Any, Optional

from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER

from ...errors import CheckpointError
from ._codec import _VERSION, STATE_KEY, _decode

#: ``extra`` key prefix of the tensors of the non-tensor state (``{"$tensor": name}`` in it).
TENSOR_PREFIX = STATE_KEY + "/"
#: Config fields of the tiered mode and their defaults (off: every field at its default).
TIERED_DEFAULTS = {
    "persist_every": 0, "replicas": 1, "local_keep_latest_k": 2, "tiered_timeout_seconds": None,
}


def check_config(cfg: Any) -> None:
    """``Config.__post_init__``'s checks of the tiered fields: settings of the untiered mode
    that would have no effect are refused, not ignored."""
    if not cfg.local_folder:
        set_ = [k for k, v in TIERED_DEFAULTS.items() if getattr(cfg, k) != v]
        if set_:
            raise ValueError(f"checkpoint.{set_[0]} applies to the tiered mode: set checkpoint.local_folder")
        return
    if "://" in cfg.local_folder:
        raise ValueError(f"checkpoint.local_folder must be a directory, got {cfg.local_folder!r}")
    if cfg.persist_every < 0:
        raise ValueError("checkpoint.persist_every cannot be negative")
    if cfg.persist_every % cfg.interval:
        raise ValueError(
            f"checkpoint.persist_every ({cfg.persist_every}) must be a multiple of checkpoint.interval "
            f"({cfg.interval}): only saved steps are persisted"
        )
    if cfg.replicas < 0:
        raise ValueError("checkpoint.replicas cannot be negative")
    if cfg.local_keep_latest_k < 1:
        raise ValueError("checkpoint.local_keep_latest_k must be at least 1")
    if cfg.tiered_timeout_seconds is not None and not cfg.tiered_timeout_seconds > 0:
        raise ValueError("checkpoint.tiered_timeout_seconds must be positive")
    refused = {
        "async_mode": cfg.async_mode != "disabled",  # the tiered manager's own saves
        "max_shard_size": cfg.max_shard_size is not None,
        "allow_optimizer_change": cfg.allow_optimizer_change,
        "load_step": cfg.load_step != -1,  # restore_latest: the newest step
    }
    for k, bad in refused.items():
        if bad:
            raise ValueError(f"checkpoint.{k} is not supported in the tiered mode (checkpoint.local_folder)")


def build(cfg: Any, local: str, persistent: str) -> Any:
    """The tiered manager (every rank: its constructor is collective); ``keep_latest_k`` is
    the persistent tier's retention (0: every step kept)."""
    from ...torch.distributed import CheckpointManager as Tiered

    kw: dict[str, Any] = {}
    if cfg.tiered_timeout_seconds is not None:
        kw["timeout"] = cfg.tiered_timeout_seconds
    return Tiered(
        local, persistent, persist_every=cfg.persist_every or None, replicas=cfg.replicas,
        keep_last=cfg.local_keep_latest_k, persist_keep_last=cfg.keep_latest_k or None, **kw,
    )


def model_and_optimizer(m: Any) -> tuple[Any, Any]:
    """The one model part and its one optimizer (what ``ckptstore.torch.distributed``
    saves); several of either (pipeline parallelism, several optimizer classes) are
    refused."""
    parts = m.states[MODEL].model
    if len(parts) != 1:
        raise ValueError(
            f"the tiered mode saves one model part, the job has {len(parts)} (pipeline parallel): "
            "unset checkpoint.local_folder"
        )
    opt = m.states.get(OPTIMIZER)
    inner = getattr(opt, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        if len(inner) != 1:
            raise ValueError(
                f"the tiered mode saves one optimizer, the job has {len(inner)}: unset "
                "checkpoint.local_folder"
            )
        opt = inner[0]
    return parts[0], opt


def save(m: Any, step: int, last_step: bool = False) -> None:
    """Save ``step``: the model and optimizer as ``ckptstore.torch.distributed`` stores them,
    the other states (train state, dataloader, schedulers) in ``extra``: their JSON skeleton
    (the ranks' merged, as in the untiered mode) under ``STATE_KEY``, their tensors under
    ``TENSOR_PREFIX + name``."""
    model, opt = model_and_optimizer(m)
    rest = {k: v for k, v in m.states.items() if k not in (MODEL, OPTIMIZER)}
    tensors, skeleton = m._split(m._flat_states(rest))
    extra: dict[str, Any] = {STATE_KEY: {"version": _VERSION, "step": int(step), "states": m._gathered(skeleton)}}
    extra.update({TENSOR_PREFIX + name: t for name, t in tensors.items()})
    m.tiered.save(step, model, opt, extra=extra, persist=True if last_step else None)  # the last one durable


def load(m: Any) -> Optional[int]:
    """Restore the newest step the tiers hold (model, optimizer unless excluded, then the
    other states); ``None`` when they hold none. The other states are decoded and checked
    against the job's before the model and the optimizer change (``check_extra``): a step
    whose rest is malformed or lacks one of the job's states is passed over."""
    for k in m.exclude_from_loading:
        if k not in m.states:
            raise ValueError(f"{k} not found in state_dict.")
    model, opt = model_and_optimizer(m)
    states = {
        k: v for k, v in m.states.items()
        if k not in (MODEL, OPTIMIZER) and k not in m.exclude_from_loading
    }
    decoded: dict[str, Any] = {}

    def check(extra: dict) -> None:
        decoded.clear()
        decoded.update(_values(m, states, extra))

    step = m.tiered.restore_latest(model, None if OPTIMIZER in m.exclude_from_loading else opt, check_extra=check)
    if step is None:
        return None
    for k, v in decoded.items():
        if isinstance(states[k], Stateful):
            states[k].load_state_dict(v)
        else:
            m.states[k] = v
    return step


def _values(m: Any, states: dict, extra: dict) -> dict:
    """The values of the job's other ``states`` in a step's ``extra`` (what :func:`save`
    stored), decoded; raises :class:`CheckpointError` for a step not saved by this manager,
    one lacking a state, or a malformed one."""
    where = f"{m.tiered!r}: the stored states"
    saved = extra.get(STATE_KEY)
    if not isinstance(saved, dict) or not isinstance(saved.get("states"), dict):
        raise CheckpointError(f"{where}: not a step of ckptstore's TorchTitan manager (no {STATE_KEY!r} in extra)")
    skeleton = saved["states"]
    absent = [k for k, v in states.items() if v is not None and k not in skeleton]
    if absent:
        raise CheckpointError(f"{where}: the checkpoint holds no state {absent[0]!r}")
    tensors = {k[len(TENSOR_PREFIX):]: v for k, v in extra.items() if k.startswith(TENSOR_PREFIX)}
    try:
        return _decode({k: skeleton[k] for k in states if k in skeleton}, tensors, m.allow_pickle, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, binascii.Error) as e:
        raise CheckpointError(f"{where}: the stored non-tensor state is malformed: {e!r}") from e
