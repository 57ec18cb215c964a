"""ckptstore inside the training frameworks: one module per framework, each a one-line switch.

* :mod:`ckptstore.integrations.lightning` - PyTorch Lightning / Fabric ``CheckpointIO``
* :mod:`ckptstore.integrations.transformers` - the Hugging Face ``Trainer`` (and Accelerate)
* :mod:`ckptstore.integrations.deepspeed` - DeepSpeed's ``CheckpointEngine``
* :mod:`ckptstore.integrations.torchtitan` - a TorchTitan checkpoint manager

A framework is imported only by its own module, so ``import ckptstore`` never needs one;
each is an optional extra of the package (``pip install ckptstore[lightning]``, ...). The
versions tested are named in python/README.md (Frameworks).
"""
