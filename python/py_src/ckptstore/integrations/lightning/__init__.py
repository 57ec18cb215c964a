"""ckptstore for PyTorch Lightning 2.6 and Fabric: every checkpoint one committed ckptstore
checkpoint.

::

    from ckptstore.integrations.lightning import CheckpointIO

    trainer = lightning.Trainer(plugins=[CheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")                       # resumes as with torch.save
    fabric = lightning.Fabric(plugins=[CheckpointIO(async_save=True)])

:class:`CheckpointIO` is a ``lightning.fabric.plugins.io.CheckpointIO``. Each
``save_checkpoint(checkpoint, path)`` writes Lightning's checkpoint dict as ONE ckptstore
checkpoint, a directory at ``path`` (``epoch=3-step=40.ckpt/``, ``last.ckpt/``) or an
``s3://`` URL, committed atomically: a save that dies half way leaves the checkpoint that
was there before (``last.ckpt`` included), never a torn one. What is stored
(:mod:`ckptstore.integrations._tree`): every tensor (model ``state_dict``, optimizer
states, tensors in callback state) as a ckptstore tensor named by its path in the dict
(``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``), CRC-checked and
visible to ``ckpt inspect`` / ``ckpt verify``; the rest as JSON in the manifest metadata.

``load_checkpoint`` returns the dict as saved, bit for bit: tensors with their dtype,
shape and device (``map_location`` as ``torch.load`` takes it: a device, a dict of device
strings, or ``f(tensor, saved_device)``); ``None``, bools, ints (any size), floats (NaN and
infinities kept), strings and bytes as they were. Round trips where JSON has no form:

* **tuples come back as tuples** and lists as lists (Adam's ``betas`` stays a tuple);
* **dicts with non-string keys keep their keys** (the optimizer ``state`` dict keyed by
  parameter index ``0, 1, ...`` comes back with ``int`` keys, in the same order), and
  ``OrderedDict`` (a model ``state_dict``) comes back as ``OrderedDict``;
* ``torch.Size``, ``torch.dtype``, ``torch.device``, sets and numpy scalars are kept; other
  dict subclasses (Lightning's ``AttributeDict`` of ``hyper_parameters``) come back as plain
  dicts, list and tuple subclasses as lists and tuples;
* a tensor object held twice (tied weights) is stored once and comes back as one object.

Every tensor is read into fresh memory and its CRC32 checked before ``load_checkpoint``
returns: a damaged checkpoint raises :class:`ckptstore.errors.ChecksumError` naming the
tensor (and the checkpoint), and Lightning, which loads the dict first and applies it
after, leaves the live model and optimizer untouched. Lightning applies optimizer state with
``optimizer.load_state_dict``, which replaces the state whole: state the live optimizer
holds for parameters the checkpoint does not name is gone after a resume (no merge).

**Pickle.** Anything else (an arbitrary Python object a callback or ``save_hyperparameters``
put in the checkpoint) is refused at save with
:class:`ckptstore.integrations._tree.PickleNotAllowedError` naming its path in the dict,
unless ``CheckpointIO(allow_pickle=True)``: then it is pickled into the metadata. Loading
such a checkpoint needs ``allow_pickle=True`` as well (and is refused whenever Lightning
asks for ``weights_only=True``): unpickling runs code chosen by whoever wrote the
checkpoint, so opt in only for checkpoints you trust as much as the code you run. The CRCs
detect damage, not malice. Without the opt-in nothing is ever unpickled.

**torch.save files** (Lightning's default format) load: a regular file at the path is read
with ``torch.load(weights_only=True)`` as ``TorchCheckpointIO`` reads it (every tensor on the
CPU unless ``map_location`` says otherwise), so that ``fabric.load_raw("pretrained.pt",
model)`` works and a run begun with the default IO resumes after the switch (the load is
logged; later saves are ckptstore checkpoints), in the same ``dirpath``: a save whose path
holds a file ``torch.save`` wrote (``last.ckpt``) writes beside it and replaces it in one step
(:func:`ckptstore.atomic.publish_dir`; blocking, also with ``async_save``). A file that needs pickle is refused with
:class:`PickleNotAllowedError` unless ``allow_pickle=True`` (then ``weights_only=False``,
unless Lightning asks for ``weights_only=True``).

**LightningModule.load_from_checkpoint** reads the path with ``torch.load`` itself, which
fails on a directory. Constructing a :class:`CheckpointIO` installs
:func:`patch_load_from_checkpoint`, which routes a committed ckptstore checkpoint (and only
that: files, open files and URLs go to Lightning's loader unchanged) through the load
above; pickled values only with ``load_from_checkpoint(..., weights_only=False)``. Scripts
that never build a ``CheckpointIO`` call :func:`load_from_checkpoint` (``load_from_checkpoint(
MyModule, path, **kwargs)``) or :func:`patch_load_from_checkpoint` first.

``map_location``: a callable returning ``None`` means ``torch.load``'s default placement,
the device the tensor was saved from (Lightning's ``_default_map_location`` returns ``None``
for every tensor it leaves where it is).

**Pickling** (``torch.save(trainer)``, ``strategy="ddp_spawn"`` and other spawn launches
pickle the Trainer with its plug-ins): a :class:`CheckpointIO` pickles its settings only;
saves in flight are waited for first (a background save's error is raised there), and the
copy starts a thread and buffers of its own at its first non-blocking save.

**Non-blocking saves.** ``CheckpointIO(async_save=True)``: ``save_checkpoint`` copies every
tensor into snapshot buffers and returns; a background thread writes and commits, saves in
the order they were made (:class:`ckptstore.integrations._tree.TreeSaver`). Unlike
Lightning's ``AsyncCheckpointIO``, which clones every tensor on every save, the buffers are
reused by the next save of the same structure, so host memory stays flat over any number
of saves (``max_in_flight`` buffer sets at most, each as large as the tensors saved).
``teardown()`` (Lightning calls it at the end of ``fit``) waits for the saves in flight,
frees the buffers and raises the first error of a background save; a later save raises an
earlier save's error too. ``load_checkpoint`` and ``remove_checkpoint`` of a path with a
save in flight wait for that save first.

**remove_checkpoint** (``ModelCheckpoint``'s top-k and ``last``) removes a committed
ckptstore checkpoint (a directory holding ``ckpt-manifest.json``, whose manifest is removed
first, so an interruption leaves no half checkpoint that still opens; or an ``s3://``
checkpoint that opens, removed with fsspec, which needs ``s3fs`` for that: without it the
checkpoint is kept and a warning says so), or a file ``torch.save`` wrote (Lightning's own
checkpoints from before the switch, which top-k counts as the stock IO would). A missing
path is a no-op, as with ``TorchCheckpointIO``; anything else (another file, a directory
that is not a checkpoint) raises :class:`ckptstore.errors.InvalidArgumentError` and is left
alone.

**FSDP2 / ModelParallel.** Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor) and
``FSDPStrategy`` save sharded checkpoints with ``torch.distributed.checkpoint.save`` directly
and never call ``CheckpointIO``. :class:`ModelParallelStrategy` is a drop-in subclass whose
``save_checkpoint`` / ``load_checkpoint`` route DCP through :class:`ckptstore.torch.dcp.Writer`
and :class:`~ckptstore.torch.dcp.Reader`: one committed checkpoint for all ranks (model and
optimizer shards plus the rest of Lightning's dict, which the stock strategy pickles into
``meta.pt``, stored here as in :class:`CheckpointIO`), resumable on another world size, and
a damaged checkpoint leaves every rank's model and optimizer unchanged. The FSDP1
``FSDPStrategy`` is not routed (lightning 2.6 runs it on GPUs only, so it is untested here):
use :class:`ModelParallelStrategy` (FSDP2) instead (see python/README.md).

**Tiered mode.** ``ModelParallelStrategy(..., tiered={"local": "/dev/shm/ckpt",
"persistent": "s3://bucket/run", "persist_every": 1000, "replicas": 1, "keep_last": 2})``: the
dict holds the arguments of :class:`ckptstore.torch.distributed.CheckpointManager` (the
tiered manager; also ``persist_keep_last``, ``timeout``). Each ``save_checkpoint`` saves the step
``checkpoint["global_step"]`` through it (the model and its optimizer as
:func:`ckptstore.torch.distributed.save` stores them, the rest of the dict in its ``extra``
as above; once per step: ``last.ckpt`` of a step already saved gets its pointer only) and
writes, at the path Lightning names, a pointer: a checkpoint without tensors whose metadata
``ckptstore.lightning.tiered`` names the step. ``ModelCheckpoint`` (top-k, ``save_last``) and
``fit(ckpt_path="last")`` work unchanged: loading a pointer is ``restore_latest``, the
newest step the tiers hold whole, on any world size (a warning says so when that is not the
step the pointer names); a path holding an ordinary checkpoint of this strategy loads as
before. Saves do not block inside ``fit`` (an error raises at the next save, or at
``teardown``, which waits); a save outside ``fit`` waits. One optimizer at most;
``allow_optimizer_change`` and ``max_shard_size`` are refused with ``tiered``. The rest of
the dict is rebuilt before the model and optimizer change (``restore_latest``'s
``check_extra``): a step whose rest cannot be (a pickled value without ``allow_pickle``, a
missing tensor) is passed over like an unreadable one, and when no step is left the resume
raises with the model and optimizer as they were.

**A change of optimizer class** (state saved by AdamW, resumed into ``SGD``): refused with
:class:`ckptstore.IncompatibleStateError` naming both classes, by rule F1 of
:func:`ckptstore.check_optimizer_fit` (the one rule of :func:`ckptstore.torch.load`), unless
the option ``allow_optimizer_change=True`` is given. A Lightning optimizer state dict does
not name its class, so the class (``type(optimizer).__name__`` of the optimizer that runs,
as :func:`ckptstore.torch.save` records it) is recorded at save, and checked at resume,
by whichever component sees the live optimizers:

* :class:`ModelParallelStrategy` records each optimizer's class with the rest of the dict and
  checks it in ``load_checkpoint`` before anything is read into the live model or optimizer
  (``ModelParallelStrategy(allow_optimizer_change=True)`` lets a change through): a refused
  resume leaves both exactly as they were.
* With :class:`CheckpointIO` (stock strategies), ``CheckpointIO`` only stores and returns a
  dict and never sees an optimizer, so the callback :class:`OptimizerCheck`
  (``Trainer(plugins=[CheckpointIO()], callbacks=[OptimizerCheck()])``; its
  ``allow_optimizer_change``) records the classes (its callback state) and checks them once
  the Trainer has built the optimizers, before Lightning loads any optimizer state, the
  learning rate schedulers or the loops' progress, and before any training step. What is not
  possible there: Lightning's stock strategies load the model's weights (``restore_model``)
  *before* they create the optimizers (``configure_optimizers`` runs in ``strategy.setup``),
  so when a class change is refused the model already holds the checkpoint's weights (the
  optimizer, schedulers and loops are untouched). Without the callback nothing is recorded or
  checked (a checkpoint that records no class is resumed as before, as is one saved without
  the callback). Strategies that restore the optimizer themselves (Lightning's
  ``DeepSpeedStrategy``) are left to their own load: the callback does not check them.
* Fabric (``fabric.save`` / ``fabric.load`` through :class:`CheckpointIO`): not checked;
  Fabric converts the optimizer to its state dict before ``CheckpointIO`` sees it, and no
  hook runs with both. Use :func:`ckptstore.torch.save` / :func:`ckptstore.torch.load` for
  the check there.

With the opt-in the checkpoint's optimizer state is installed as stored and each parameter
group gets the checkpoint's hyperparameters plus the live group's own for the settings the
checkpoint's group lacks (an ``SGD`` resumed from AdamW keeps its ``momentum``), as
:func:`ckptstore.torch.load` does. Under :class:`ModelParallelStrategy` (DCP loads into the
live optimizer's own state tensors) the live optimizer gets the checkpoint's state for the
state names it has itself; its others, and the checkpoint's names it does not use, start
fresh (``SGD`` from AdamW: a new momentum buffer at the next step).

Tested with lightning 2.6.6 and torch 2.15 (CPU, gloo).
"""

from __future__ import annotations

from ...errors import PickleNotAllowedError
from .._common import MANIFEST
from ._io import CheckpointIO
from ._load_from_checkpoint import load_from_checkpoint, patch_load_from_checkpoint
from ._model_parallel import DCP_TREE_KEY, ModelParallelStrategy
from ._optimizer_check import OptimizerCheck

__all__ = [
    "CheckpointIO",
    "ModelParallelStrategy",
    "OptimizerCheck",
    "PickleNotAllowedError",
    "load_from_checkpoint",
    "patch_load_from_checkpoint",
    "MANIFEST",
    "DCP_TREE_KEY",
]
