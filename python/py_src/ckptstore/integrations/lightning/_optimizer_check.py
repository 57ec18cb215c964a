"""The optimizer class under Lightning's stock strategies: recorded at save and checked at
resume by the :class:`OptimizerCheck` callback (the package docs)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from lightning.pytorch.callbacks import Callback as _Callback

from ...torch.internal import optimizer_class
from .._common import check_optimizer_class, keep_live_hyper_hook
from ._base import _location
from ._model_parallel import ModelParallelStrategy


class OptimizerCheck(_Callback):
    """A Lightning callback that refuses to resume a checkpoint saved by another optimizer
    class (package docs), for :class:`CheckpointIO` under Lightning's stock strategies.

    It records ``type(optimizer).__name__`` of each of the Trainer's optimizers (seen through
    ``LightningOptimizer``) as its callback state at every save, and at a resume raises
    :class:`ckptstore.IncompatibleStateError` naming both classes once the Trainer has built
    its optimizers and before Lightning loads their state (nor the schedulers', the loops'
    or any step). Lightning's stock strategies have already loaded the model's weights at
    that point (they do so before creating the optimizers). ``allow_optimizer_change=True``
    lets a deliberate change through: the checkpoint's optimizer state is loaded, each group
    with the live group's hyperparameters for the settings the checkpoint's lacks. A
    checkpoint without this callback's state is resumed unchecked. Under
    :class:`ModelParallelStrategy` (which checks, before anything changes, with its own
    ``allow_optimizer_change``) and strategies that restore the optimizer themselves, it
    records but does not check.
    """

    def __init__(self, *, allow_optimizer_change: bool = False) -> None:
        self.allow_optimizer_change = bool(allow_optimizer_change)
        self._trainer: Any = None
        self._saved: Optional[list] = None
        self._checked = False
        self._hooks: list = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        self._saved = None
        self._checked = False
        self._remove_hooks()

    def state_dict(self) -> Dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.optimizers:
            return {}
        return {"optimizer_classes": [optimizer_class(o) for o in trainer.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        classes = state_dict.get("optimizer_classes") if isinstance(state_dict, dict) else None
        self._saved = list(classes) if isinstance(classes, (list, tuple)) else None
        self._checked = False
        trainer = self._trainer
        if trainer is not None and trainer.optimizers:
            # A strategy that restores after its setup: the optimizers exist already.
            self._check(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning's stock strategies: the optimizers were created in strategy.setup; their
        # state, the schedulers' and the loops' are restored right after this hook.
        self._check(trainer)

    def _check(self, trainer: Any) -> None:
        if self._saved is None or self._checked or trainer.state.fn != "fit":
            return  # only fit restores optimizer state
        self._checked = True
        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy) or not strategy.lightning_restore_optimizer:
            return  # the strategy restores the optimizers itself (ours checks there)
        where = "" if trainer.ckpt_path is None else _location(trainer.ckpt_path)
        for i, opt in enumerate(trainer.optimizers):
            saved = self._saved[i] if i < len(self._saved) else None
            changed = check_optimizer_class(
                optimizer_class(opt), saved, self.allow_optimizer_change,
                f"{where} (optimizer {i})" if where else f"optimizer {i}",
            )
            if changed:
                self._hooks.append(opt.register_load_state_dict_pre_hook(keep_live_hyper_hook))

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._remove_hooks()  # the optimizer state is restored by now

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove_hooks()

