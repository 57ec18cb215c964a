"""``install``: an engine made by ``deepspeed.initialize`` checkpoints through ckptstore (its
checkpoint engine set, its ``save_checkpoint`` / ``load_checkpoint`` wrapped; the package
docs)."""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional

from ...errors import InvalidArgumentError
from ...torch.internal import decided_once, optimizer_class
from .._common import keep_live_hyper_hook
from ._engine import CheckpointEngine


def _base_optimizer(engine: Any) -> Any:
    """The torch optimizer that runs under DeepSpeed's wrappers (ZeRO, FP16, BF16)."""
    opt = getattr(engine, "basic_optimizer", None)
    if opt is None:
        opt = getattr(engine, "optimizer", None)
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            opt = inner
    return opt


def _latest_tag(engine: Any, load_dir: str) -> Optional[str]:
    universal = bool(getattr(engine, "load_universal_checkpoint", lambda: False)())
    path = os.path.join(load_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as fd:
        return fd.read().strip()


def install(engine: Any, *, allow_pickle: bool = False, max_shard_size: Optional[int] = None,
            non_blocking: bool = False, prefetch: bool = True,
            allow_optimizer_change: bool = False) -> CheckpointEngine:
    """Make ``engine`` (what ``deepspeed.initialize`` returned) checkpoint through
    ckptstore; return the :class:`CheckpointEngine`.

    ``non_blocking``: see :class:`CheckpointEngine`. Sets ``engine.checkpoint_engine`` and
    wraps, on this engine object only,
    ``save_checkpoint`` (``latest`` is written by the checkpoint engine, atomically, at the
    commit; every file records the optimizer class) and ``load_checkpoint`` (with
    ``prefetch``, every file of the tag this rank reads is loaded and CRC-checked before
    DeepSpeed applies any of them; a tag saved by another optimizer class is refused with
    :class:`ckptstore.IncompatibleStateError` before anything changes, unless
    ``allow_optimizer_change``: package docstring). Installing again replaces the
    checkpoint engine and keeps one wrapper.
    """
    stage_of = getattr(engine, "zero_optimization_stage", None)
    stage = stage_of() if callable(stage_of) else None
    if stage is not None and int(stage) >= 3:
        raise InvalidArgumentError(
            "ckptstore.integrations.deepspeed.install: ZeRO stage 3 is not supported. DeepSpeed "
            "reads the files of a ZeRO-3 tag itself where no checkpoint engine is asked: a "
            "load_checkpoint without optimizer states (load_optimizer_states=False) rebuilds "
            "the module with zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint, which "
            "torch.loads every rank's files (and so does the zero_to_fp32.py script), and these "
            "would be ckptstore checkpoint directories. Keep DeepSpeed's own checkpoint engine "
            "for ZeRO-3 (do not call install), or use ZeRO stage 0, 1 or 2 with install.")
    ce = CheckpointEngine(getattr(engine, "_config", None), allow_pickle=allow_pickle,
                          max_shard_size=max_shard_size, non_blocking=non_blocking,
                          allow_optimizer_change=allow_optimizer_change)
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, CheckpointEngine):
        old.cleanup()
    engine.checkpoint_engine = ce
    save_orig = getattr(engine, "_ckptstore_save_checkpoint", None) or engine.save_checkpoint
    load_orig = getattr(engine, "_ckptstore_load_checkpoint", None) or engine.load_checkpoint
    engine._ckptstore_save_checkpoint = save_orig
    engine._ckptstore_load_checkpoint = load_orig

    @functools.wraps(save_orig)
    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Any:
        cur = engine.checkpoint_engine
        if not isinstance(cur, CheckpointEngine):  # replaced since: DeepSpeed's own way
            return save_orig(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                             save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
        cur._save_latest = bool(save_latest)
        base = _base_optimizer(engine)
        cur._optimizer_class = None if base is None else optimizer_class(base)
        try:
            return save_orig(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                             save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            cur._save_latest = None
            cur._optimizer_class = None

    @functools.wraps(load_orig)
    def load_checkpoint(load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        cur = engine.checkpoint_engine
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states,
                      load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if not isinstance(cur, CheckpointEngine):
            return load_orig(load_dir, tag=tag, **kwargs)
        cur.wait()  # a save still in flight is published first
        base = _base_optimizer(engine)
        checks = base is not None and load_optimizer_states and not load_module_only
        cur._expect_class = optimizer_class(base) if checks else None
        cur._class_changed = False
        hook = None
        if checks and cur.allow_optimizer_change and hasattr(base, "register_load_state_dict_pre_hook"):
            hook = base.register_load_state_dict_pre_hook(_keep_live_hyper(cur))
        try:
            return _load_checked(load_dir, tag, kwargs, cur)
        finally:
            cur._expect_class = None
            cur._class_changed = False
            if hook is not None:
                hook.remove()

    def _load_checked(load_dir: str, tag: Any, kwargs: Dict[str, Any], cur: CheckpointEngine) -> Any:
        load_optimizer_states = kwargs["load_optimizer_states"]
        load_module_only = kwargs["load_module_only"]
        if tag is None:
            # The tag ``latest`` names is read by the first rank alone and handed to the
            # others: on a shared file system a host's caches may still show the ``latest``
            # a rename replaced (or none), and ranks would load different tags or deadlock.
            resolved = decided_once(lambda: _latest_tag(engine, load_dir),
                                    what=f"reading the latest tag of {load_dir}")
        else:
            resolved = str(tag)
        if resolved is None:  # DeepSpeed warns and returns (None, None)
            return load_orig(load_dir, tag=None, **kwargs)
        if not prefetch:
            return load_orig(load_dir, tag=resolved if tag is None else tag, **kwargs)
        dp_rank = None
        group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
        elastic = bool(getattr(engine, "zero_elastic_checkpoint", lambda: False)())
        if group is not None and not elastic:
            from deepspeed import comm as dist

            dp_rank = dist.get_rank(group=group)
        try:
            cur.prefetch(os.path.join(load_dir, resolved), dp_rank=dp_rank,
                         optimizer_states=load_optimizer_states and not load_module_only)
            return load_orig(load_dir, tag=resolved, **kwargs)
        finally:
            cur.release()

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    return ce


def _keep_live_hyper(ce: CheckpointEngine) -> Any:
    """A ``register_load_state_dict_pre_hook`` hook for the base optimizer: after an allowed
    change of class (``ce._class_changed``), each group of the state dict DeepSpeed hands
    it gets the live group's hyperparameters for the settings it lacks."""

    def hook(optimizer: Any, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        if not ce._class_changed:
            return None
        return keep_live_hyper_hook(optimizer, state_dict)

    return hook
