"""Sharded save and restore of FSDP2 / DTensor models and their optimizers with ckptstore.

::

    import ckptstore.torch.distributed as ctd

    ctd.save("run/ckpt", model, optimizer, extra={"epoch": 3})   # every rank
    extra = ctd.load("run/ckpt", model, optimizer)                # every rank, any world size

Built on ``torch.distributed.checkpoint`` (DCP) with ckptstore's storage layer
(:mod:`ckptstore.torch.dcp`): every rank writes its own shards of the DTensor parameters
and optimizer states, the coordinator commits them as one ckptstore checkpoint, and a load
on any world size (or mesh) reads the boxes each rank needs. The model is taken with
``get_model_state_dict``; the optimizer's state tensors are stored by parameter name
(``optim/<param>/<state>``, the package's one name: format-spec/optimizer.md; checkpoints
of metadata version 1, ``optim.<param>.<state>``, are still read), its parameter groups and
non-tensor values as JSON in the manifest: the DCP state dict holds tensors only, so a load
unpickles nothing.

:func:`load` has the guarantees of :func:`ckptstore.torch.load`: everything is checked
before anything changes (names, global shapes, parameter groups, and the CRC32 of every
stored byte read, the ranks agreeing that every rank's reads passed); the data is read into
fresh tensors laid out like the live ones, and only then applied. The optimizer gets a
complete new state through ``load_state_dict`` on every rank: state the checkpoint does not
name is gone. ``layout`` converts the moments with the engine as TransformerEngine-style
FP16-scaled or BF16 storage would (``"bf16"``, ``"f16_scaled"``, or a dict by state name
with ``"*"`` as the default; an FP16 scale from the global absmax), and hands them to torch
as float32, like :func:`ckptstore.torch.load`.

The implementation is :mod:`ckptstore.torch._sharded`; the tiered manager
(:mod:`ckptstore.torch.tiered`) builds on it, and is exported here too.
"""

from __future__ import annotations

from ._sharded import META_KEY, load, save
from .tiered import CheckpointManager

__all__ = ["save", "load", "META_KEY", "CheckpointManager"]
