"""ckptstore under the Hugging Face ``Trainer`` (transformers 5) and Accelerate.

:class:`Trainer` is a drop-in subclass of :class:`transformers.Trainer`::

    from ckptstore.integrations.transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds)   # as before
    trainer.train()                                               # checkpoint-N: ckptstore
    trainer.train(resume_from_checkpoint=True)                    # or a checkpoint-N path

Every ``checkpoint-N`` it writes during training is **one committed ckptstore checkpoint**
holding the model (``model.state_dict()`` under its names), the optimizer (parameters named
by their model names, as :func:`ckptstore.torch.save` stores them), and, as a tree of JSON
values and tensors (:mod:`ckptstore.integrations._tree`, key ``hf.trainer``): the learning
rate scheduler's and the grad scaler's state dicts, the RNG states of every process
(python ``random``, numpy, torch CPU and CUDA: tuples and arrays round-trip exactly), the
text of ``trainer_state.json``, the model's config and the training arguments as JSON.
``ckpt verify``, ``ckpt inspect`` and ``ckpt consolidate`` open it; nothing in it is
pickled unless ``ckptstore_allow_pickle=True`` (below).

Visibility: a checkpoint is written into a staging directory
``<output_dir>/.ckptstore-staging-checkpoint-N-<pid>-<hex>`` (committed there by the
engine), with ``trainer_state.json`` (the same bytes as the committed copy), ``config.json``
and the processing class's files beside it; only then is the staging directory published as
``checkpoint-N`` (:func:`ckptstore.atomic.publish_dir`: a rename, then the output directory
fsynced). So nothing named ``checkpoint-N`` exists
before its checkpoint is committed and durable, and the Trainer's own "latest" logic
(``transformers.trainer_utils.get_last_checkpoint``, used by ``resume_from_checkpoint=True``
and by the example scripts) can only pick committed checkpoints. A save killed half-way
leaves a staging directory, which the next save into the output directory removes (if the
process that made it is gone). Re-saving an existing ``checkpoint-N`` swaps the new one in
with one ``renameat2(RENAME_EXCHANGE)`` where the kernel has it (else two renames, and a crash
between them is repaired by the next save's sweep: the old checkpoint is put back, never a
torn one). Rotation removes a checkpoint whole (:func:`ckptstore.atomic.remove_dir`).

Resuming: ``_load_from_checkpoint`` checks that ``trainer_state.json`` holds exactly the
committed text (else :class:`~ckptstore.errors.CorruptCheckpointError`) and defers the model:
it is restored together with the optimizer in ``_load_optimizer_and_scheduler``. Names,
shapes, the optimizer (:func:`ckptstore.torch.load`'s rule) and every CRC32 are checked, and
the model's tensors read into fresh tensors, before the model or the optimizer changes; then
the optimizer state is replaced whole (state the live optimizer holds for a parameter the
checkpoint does not name is gone) and the model is loaded through its own
``model.load_state_dict(tensors, True)``, as the stock Trainer does: an override of it and
``register_load_state_dict_pre_hook`` hooks run. A model that loads its own way (such an
override or a pre-hook) decides names and shapes itself (they are not checked first); if its
``load_state_dict`` raises, the optimizer gets its previous state back. Checkpoint directories that are
not ckptstore checkpoints (the stock Trainer's) are loaded by the stock code.

Hub pushes during training (``push_to_hub``, every ``hub_strategy`` but ``end``): the stock
push copies ``model.safetensors`` and ``config.json`` from ``checkpoint-N`` into the output
directory and uploads that; a ckptstore ``checkpoint-N`` holds no such files, so the model
is first written there as ``save_model`` writes it (the same weights the checkpoint holds).

Rotation (``save_total_limit``): after a checkpoint is published, the oldest
``checkpoint-N`` directories (by step) beyond the limit are removed, counting the committed
ckptstore ones and the stock Trainer's (those holding ``trainer_state.json``: a run switched
to ckptstore ends with the checkpoints a stock run would keep); the one just written and
``state.best_model_checkpoint`` are never removed. A removed checkpoint is first
renamed out of the ``checkpoint-N`` namespace and then deleted, so a crash during removal
leaves no half-deleted ``checkpoint-N`` behind.

Non-blocking saves (``ckptstore_async=True``): ``_save_checkpoint`` copies every tensor
(model, optimizer state, RNG) into snapshot buffers that the next save reuses (no
allocation after the first), captures the JSON values, and returns; a thread writes,
commits, publishes and rotates while training goes on. One save is in flight at a time (the
next save waits for it first), its error is raised by the next save, by the end of
``train`` (which waits for it) or by :meth:`Trainer.ckptstore_wait`. ``on_save`` callbacks
then run before ``checkpoint-N`` is published; ``push_to_hub`` waits for it. The end of
training waits for it before the Trainer's end-of-training cleanup (``save_total_limit=1``
keeps only the best checkpoint), so the checkpoints left are those of a blocking save.

``save_model`` (the final model) is the stock ``save_pretrained``: ``from_pretrained`` loads
it. ``load_best_model_at_end`` reads the best checkpoint with :func:`ckptstore.torch.load`.

Pickle: values that are neither JSON-like nor tensors (a custom scheduler holding an object,
say) are refused at save with :class:`~ckptstore.integrations._tree.PickleNotAllowedError`
naming their path, unless the Trainer is built with ``ckptstore_allow_pickle=True``; loading
such a checkpoint needs that too. Unpickling runs code chosen by whoever wrote the
checkpoint: opt in only for checkpoints you trust as much as the code you run.

Not covered (these keep the stock checkpointing, with a warning): DeepSpeed, FSDP, XLA/TPU
and SageMaker model parallelism. Under DDP the RNG states of every process are gathered to
the saving process (``all_gather_object``) and stored in the one checkpoint; each process
restores its own.

Accelerate: :func:`save_state` / :func:`load_state` (and :class:`Accelerator`, whose
``save_state`` / ``load_state`` call them) store what ``Accelerator.save_state`` stores for
one process (the model, at most one optimizer, the schedulers, stateful dataloaders, the
grad scaler, the RNG states, ``accelerator.step`` and the objects registered with
``register_for_checkpointing``) as one committed ckptstore checkpoint. Accelerate's own
hooks do not allow that: ``register_save_state_pre_hook(hook(models, weights, output_dir))``
can take over the model weights only (it may empty ``weights``); the optimizer, scheduler,
sampler, scaler and RNG states are then still written by ``save_accelerator_state`` with
``torch.save`` (pickle, one file each, no commit point), custom objects with
``save_custom_state`` (pickle), ``load_state`` reads them back with ``torch.load``, and under
FSDP / DeepSpeed the weights list is empty (their state goes through
``dist_cp.save(..., FileSystemWriter(...))`` and ``engine.save_checkpoint``, which no hook
reaches). ``automatic_checkpoint_naming`` with ``total_limit`` deletes folders with
``shutil.rmtree`` before the new save and ``load_state()`` picks the last folder by name
without any commit check; :func:`save_state` here takes an explicit directory.

Test seam: with ``CKPTSTORE_TEST_PAUSE`` (comma-separated point names) and
``CKPTSTORE_TEST_PAUSE_DIR`` set, the Trainer stops at ``hf-before-publish`` (the checkpoint
committed in its staging directory, the rename into ``checkpoint-N`` next) and
``hf-after-publish`` (published, rotation next): it writes ``<dir>/<point>`` holding its
process id and blocks, for a test to kill it. The engine's own points
(``before-manifest-rename``, ...) use the same variables.
"""

from __future__ import annotations

from typing import Any

from ...errors import PickleNotAllowedError
from ._accelerate import load_state, save_state
from ._checkpoint import MARKER_KEY, TREE_ROOT, is_ckptstore_checkpoint, save_checkpoint  # noqa: F401 - public
from ._trainer import Trainer

__all__ = [
    "Trainer",
    "Accelerator",
    "save_state",
    "load_state",
    "is_ckptstore_checkpoint",
    "MARKER_KEY",
    "TREE_ROOT",
    "PickleNotAllowedError",
]


def __getattr__(name: str) -> Any:
    if name == "Accelerator":
        from ._accelerate import _accelerator_class

        cls = _accelerator_class()
        globals()["Accelerator"] = cls
        return cls
    raise AttributeError(name)
