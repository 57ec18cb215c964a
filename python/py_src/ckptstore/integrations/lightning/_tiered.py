"""The tiered mode of :class:`ModelParallelStrategy` (``tiered={...}``): Lightning's saves go
to ckptstore's tiered manager (:class:`ckptstore.torch.distributed.CheckpointManager`), the
path Lightning names gets a pointer, and a resume from a pointer is ``restore_latest``
(the package docs)."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, Mapping, Optional

from ... import save as _save
from ...errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError
from ._rest import _DCP_EXTRA, _DCP_TREE_VERSION, DCP_TREE_KEY, build_rest, split_rest

#: Manifest metadata key of a pointer: the checkpoint (no tensors) written at the path
#: Lightning names, ``{"version": 1, "step": <global step>}``.
TIERED_KEY = "ckptstore.lightning.tiered"
_VERSION = 1
_PREFIX = _DCP_EXTRA + "/"  # ``extra`` keys of the tensors of the rest of the dict


def _manager_class() -> Any:
    from ...torch.distributed import CheckpointManager

    return CheckpointManager


class Tiered:
    """The tiered manager of one strategy, made on first use (its constructor is
    collective: every rank, once the process group is up) from ``args``, the arguments of
    :class:`ckptstore.torch.distributed.CheckpointManager`."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        if not isinstance(args, Mapping) or "local" not in args:
            raise InvalidArgumentError(
                "tiered= takes the arguments of ckptstore.torch.distributed.CheckpointManager as a "
                f"dict, at least 'local' (this host's tier), got {args!r}"
            )
        known = [p for p in inspect.signature(_manager_class().__init__).parameters if p != "self"]
        unknown = sorted(k for k in args if k not in known)
        if unknown:
            raise InvalidArgumentError(f"tiered={{...}}: unknown argument {unknown[0]!r} (known: {known})")
        self.args: Dict[str, Any] = dict(args)
        self.mgr: Any = None
        self.saved_step: Optional[int] = None  # the step last saved to the tiers
        self.in_fit = False  # between the strategy's setup and teardown

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled (spawn launches) with its arguments only: the copy makes its own manager."""
        return {"args": self.args, "mgr": None, "saved_step": None, "in_fit": False}

    def manager(self) -> Any:
        if self.mgr is None:
            self.mgr = _manager_class()(**self.args)
        return self.mgr

    @staticmethod
    def _parts(strategy: Any) -> tuple:
        """The model and its one optimizer (or none), as ckptstore.torch.distributed takes them."""
        opts = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
        if len(opts) > 1:
            raise InvalidArgumentError(
                f"the tiered mode saves one optimizer, the strategy has {len(opts)}: drop tiered="
            )
        return strategy.model, (opts[0] if opts else None)

    def save(self, strategy: Any, checkpoint: Dict[str, Any], location: str) -> None:
        """Every rank: save the step ``checkpoint["global_step"]`` to the tiers (once per
        step: a second path for the same step, ``last.ckpt``, gets its pointer only), then
        rank 0 writes the pointer at ``location``."""
        step = int(checkpoint.get("global_step", 0))
        if step != self.saved_step:
            model, opt = self._parts(strategy)
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            tree, tensors = split_rest({"rest": rest}, strategy.allow_pickle)
            extra: Dict[str, Any] = {DCP_TREE_KEY: tree}
            extra.update({_PREFIX + name: t for name, t in tensors.items()})
            mgr = self.manager()
            mgr.save(step, model, opt, extra=extra)  # raises an earlier save's error
            self.saved_step = step
            if not self.in_fit:
                mgr.wait()  # nothing will wait for it later (trainer.save_checkpoint after fit)
        if strategy.is_global_zero:
            _save(location, {}, metadata={TIERED_KEY: {"version": _VERSION, "step": step}})
        strategy.barrier("ckptstore.tiered.save")

    def load(self, strategy: Any, location: str, pointer: Any, allow_pickle: bool) -> Dict[str, Any]:
        """Every rank: ``restore_latest`` into the model and optimizer; the rest of the dict
        of the step restored, built (and so checked) before the model and optimizer change:
        a step whose rest cannot be built is passed over."""
        named = pointer.get("step") if isinstance(pointer, dict) else None
        model, opt = self._parts(strategy)
        mgr = self.manager()
        built: Dict[str, Any] = {}

        def check(extra: Dict[str, Any]) -> None:
            built["rest"] = _rest(extra, f"the rest of Lightning's dict ({mgr!r})", allow_pickle)

        step = mgr.restore_latest(model, opt, check_extra=check)
        if step is None:
            raise CheckpointNotFoundError(
                f"{location!r} points to step {named} of the tiered checkpoints, but no tier holds "
                f"a step ({mgr!r})"
            )
        if step != named:
            warnings.warn(
                f"ckptstore: {location!r} names step {named}; the tiered mode resumes the newest "
                f"step its tiers hold: step {step} ({mgr.last_tier} tier)",
                stacklevel=3,
            )
        self.saved_step = step
        return built["rest"]

    def close(self) -> None:
        """Wait for the saves in flight (a failed one's error raises) and close the manager."""
        self.in_fit = False
        mgr, self.mgr = self.mgr, None
        if mgr is not None:
            mgr.close()


def _rest(extra: Dict[str, Any], where: str, allow_pickle: bool) -> Dict[str, Any]:
    """The rest of Lightning's dict that :meth:`Tiered.save` stored in a step's ``extra``;
    raises :class:`CheckpointError` for a step not saved by the strategy or lacking a
    tensor, and the errors of ``build_rest``."""
    tree = extra.get(DCP_TREE_KEY)
    if not isinstance(tree, dict) or tree.get("version") != _DCP_TREE_VERSION:
        raise CheckpointError(f"{where}: not saved by ckptstore's ModelParallelStrategy")
    fresh = {name: extra.get(_PREFIX + name) for name in tree.get("tensors") or {}}
    missing = [name for name, t in fresh.items() if t is None]
    if missing:
        raise CheckpointError(f"{where}: the tensor {missing[0]!r} is missing")
    return build_rest(tree, fresh, where, allow_pickle)["rest"]
