"""ckptstore inside the training frameworks: one package per framework, each a one-line switch.

* :mod:`ckptstore.integrations.lightning` - PyTorch Lightning / Fabric ``CheckpointIO``
* :mod:`ckptstore.integrations.transformers` - the Hugging Face ``Trainer`` (and Accelerate)
* :mod:`ckptstore.integrations.deepspeed` - DeepSpeed's ``CheckpointEngine``
* :mod:`ckptstore.integrations.torchtitan` - a TorchTitan checkpoint manager

A framework is imported only by its own package, so ``import ckptstore`` never needs one;
each is an optional extra of the package (``pip install ckptstore[lightning]``, ...). The
versions tested are named in python/FRAMEWORKS.md.

Each integration is framework glue; what they share lives once, in private modules here:
``_tree`` (a nested object as one committed checkpoint, and its non-blocking saves),
``_common`` (errors naming the checkpoint, the optimizer class checked at resume, DCP's
gathered errors, staging directories and leftovers, test seams) and ``_stock`` (the
frameworks' own ``torch.save`` files read with ``torch.load(weights_only=True)``, pickle only
on opt-in). The helpers of :mod:`ckptstore.torch` they use come from
:mod:`ckptstore.torch.internal`.
"""

__all__: list[str] = []  # the frameworks are the subpackages
