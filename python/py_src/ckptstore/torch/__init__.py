"""PyTorch helpers: save and restore a model and its optimizer with ckptstore.

``torch`` is imported on first use, so ``import ckptstore`` never needs it.

::

    import ckptstore.torch as ct

    ct.save("run/ckpt", model, optimizer, extra={"epoch": 3, "rng": torch.get_rng_state()})
    ...
    extra = ct.load("run/ckpt", model, optimizer)   # in place; returns the extra dict

What is stored (one atomic, durable checkpoint):

* every entry of ``model.state_dict()`` (parameters and persistent buffers) under its
  state-dict name, read straight from the tensors' memory (no copy for CPU tensors);
* the optimizer's ``state_dict()``: parameter groups with their hyperparameters, and every
  per-parameter state tensor (0-dim ``step`` included) as ``optim/<param>/<state>``, with
  parameters **named by their model names** (``model.named_parameters()``), so that a
  checkpoint does not depend on parameter order. Without a model, parameters are named
  by position (``param.<i>``);
* ``extra``: tensors and arrays as ``extra/<key>`` tensors, everything else as JSON in the
  manifest metadata.

Restoring is all or nothing: :func:`load` checks that the checkpoint fits (every model
entry present with its shape; for the optimizer the rule of
:func:`ckptstore.check_optimizer_fit`: the same optimizer class, the same number of
parameter groups, each naming the same parameters, in any order, with the same shapes) and
reads and CRC-checks every tensor it will use before it changes anything (the optimizer
state straight into fresh ``torch.empty`` tensors, CRC checked on the way). It then replaces the optimizer
state whole through
``optimizer.load_state_dict`` (no copy; state the checkpoint does not name is gone) and
copies the model tensors in place under ``torch.no_grad()``.
"""

from __future__ import annotations

from ._items import EXTRA_PREFIX, META_KEY
from ._saveload import load, save
from .manager import CheckpointManager, SaveHandle

__all__ = ["save", "load", "META_KEY", "EXTRA_PREFIX", "CheckpointManager", "SaveHandle"]
