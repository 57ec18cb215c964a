"""ckptstore as TorchTitan's checkpoint manager (TorchTitan 0.3).

Select it in the trainer's config; everything else of the job stays as it is::

    from ckptstore.integrations.torchtitan import CheckpointManager

    config = Trainer.Config(..., checkpoint=CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
        async_mode="async",            # "disabled" | "async" | "async_with_pinned_mem"
    ))

The trainer builds it with ``config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
base_folder=...)`` and calls ``load(step)``, ``save(step, last_step)``,
``maybe_wait_for_staging()`` and ``close()``, as with TorchTitan's own manager.

What it stores, per step, in ``FOLDER/step-<step, 8 digits>/`` (the layout of ckptstore's
checkpoint manager, so ``ckpt ls FOLDER`` and ``ckpt gc`` see the same steps): one
committed ckptstore checkpoint written through DCP with :class:`ckptstore.torch.dcp.Writer`
(every rank writes its part, the coordinator commits; the manifest is the commit point).

* Tensors (model parameters and buffers, optimizer state, DTensor shards of FSDP2/TP) are
  DCP tensors under TorchTitan's flattened names: ``layers.0.weight``,
  ``optimizer.state.layers.0.weight.exp_avg``.
* Everything else (optimizer hyperparameters, the scheduler's ``last_epoch``, the train
  state, the dataloader's state) is JSON in the manifest (metadata key
  ``ckptstore.torchtitan``): JSON values as they are, tuples, bytes (base64), non-finite
  floats and big integers tagged. Values of other types are refused at save
  (:class:`PickleNotAllowedError`) unless the config sets ``allow_pickle=True``; loading a
  pickled value needs ``allow_pickle=True`` again. Nothing is unpickled by ckptstore
  otherwise. TorchTitan's own ``ParallelAwareDataloader`` stores its state as bytes it
  pickled itself and unpickles them in its ``load_state_dict``: those bytes are stored as
  bytes, and loading the dataloader state (the default; ``exclude_from_loading=
  ["dataloader"]`` skips it) trusts the checkpoint as much as TorchTitan's stock manager
  does. Non-tensor values that differ between ranks are merged key by key (the
  dataloader's ``dp_rank_<r>`` entries); where two ranks disagree on one key the lowest
  rank's value is kept, as DCP's deduplication does.

Load: names are checked first (a model tensor or a state entry the checkpoint lacks fails
naming it, before anything changes), then DCP reads through
:class:`ckptstore.torch.dcp.Reader`, which checks the CRC32 of everything read on every rank
before writing any destination, so a damaged checkpoint raises
:class:`ckptstore.ChecksumError` naming the tensor and leaves the live model, optimizer and
other state unchanged. Then each component's ``load_state_dict`` runs with the checkpoint's
values. Optimizer state the live optimizer holds for parameters the checkpoint does not name
is dropped (the optimizers' ``load_state_dict`` replaces their state whole): a resume never
merges stale state into the restored one. Any world size and mesh loads (DCP reshards).

A change of optimizer class (a step saved by AdamW, resumed by a job whose optimizer is
``SGD``): each step records the class of its optimizers (``type(optimizer).__name__`` of
every optimizer in TorchTitan's ``OptimizersContainer``; several classes as their sorted names
joined by ``+``) in the manifest (``optimizer_class`` beside ``states``). ``load`` compares
it with the live container's, by rule F1 of the one rule, :func:`ckptstore.check_optimizer_fit`,
before it reads or builds any state (TorchTitan's optimizer ``state_dict`` creates state
for an optimizer that has none): another class raises :class:`ckptstore.IncompatibleStateError`
naming both classes and the step, and nothing changes. ``allow_optimizer_change=True`` in the
config (or on the manager) lets a deliberate change through: TorchTitan's optimizer load
(its flat, FQN-keyed state dict) takes the state names the live optimizer has itself, so
those the checkpoint also holds are loaded and the others start fresh (``SGD`` from AdamW: a
new momentum buffer at the next step; AdamW's moments are not used), and each group gets
the checkpoint's hyperparameters plus the live group's own for the settings the checkpoint
lacks (``SGD`` keeps its ``momentum``), as :func:`ckptstore.torch.load` does. Not checked:
model-only loads (``initial_load_path``, exports), a load that excludes the optimizer
(``exclude_from_loading``), and steps saved before the class was recorded.

Retention (``keep_latest_k``) runs on the coordinator after each commit, and never while a
save is in flight; on a local folder it is the engine's manager, which also never deletes a
step a reader holds (``ckptstore.CheckpointManager.lease``). A save killed before its commit
leaves an uncommitted step directory that :meth:`CheckpointManager.load` ignores (the
previous committed step is the latest) and a later commit removes.

Switching a running job from TorchTitan's own manager: its ``step-<N>`` directories (DCP's
``.metadata`` and ``.distcp`` files) count as steps. ``load(step=-1)`` takes the newest step
of either kind (a ckptstore step wins a tie) and ``load(step=N)`` either kind; a stock step
is loaded as TorchTitan loads it (``dcp.load`` of its flattened state, then the model's
``load_state_dict``), with a warning in the log saying so. Its DCP ``.metadata`` (a pickle)
is read allowing only the classes DCP metadata is made of, and its non-tensor values with
``torch.load(weights_only=True)`` (DCP's own reader uses ``weights_only=False``): anything
else raises :class:`PickleNotAllowedError` unless ``allow_pickle=True``. DCP's files carry no
checksums and DCP writes the live tensors as it reads them, so a stock step does not get the
all-or-nothing load above (an export, model-only or Hugging Face, and a missing component are
refused before anything is read). ``keep_latest_k`` counts the steps of both kinds by step
and removes stock steps beyond it too (renamed out of the ``step-<N>`` names, then deleted);
the newest ckptstore step is always kept. Local folders only.

Async modes: ``"async"`` copies the state into reused CPU buffers on the calling thread
(``DefaultStager``; pinned when CUDA is available) and writes and commits on a background
thread (DCP's thread executor; the engine writes with the interpreter released).
``"async_with_pinned_mem"`` also runs the copy on a background thread: ``save`` returns at
once and ``maybe_wait_for_staging()`` (which the trainer calls before ``optimizer.step()``)
waits for the copy. TorchTitan's stock manager runs that mode's write in a separate process
(``AsyncCheckpointerType.PROCESS``); here the write stays on a thread of the trainer's
process. Saves are made one at a time: the next ``save`` first waits for the previous one.

Object storage: ``folder="s3://bucket/prefix"`` (and ``base_folder``) writes and reads
through the engine's S3 store (the ``AWS_*`` environment configures it, format-spec/s3.md).
Listing the committed steps and retention use the engine's manager
(:class:`ckptstore.CheckpointManager`) on a directory and on an ``s3://`` prefix alike.

Model-only export: the last step with ``last_save_model_only=True`` (TorchTitan's default)
writes only the model, in ``export_dtype``; with ``last_save_in_hf=True`` its names are
converted by the model's state-dict adapter (``sd_adapter.to_hf``) first. ``ckpt
consolidate FOLDER/step-<N> --out hf_dir`` assembles it into a Hugging Face directory
(``model.safetensors.index.json`` + shards). ``initial_load_path`` takes a ckptstore
checkpoint directory; ``initial_load_in_hf`` reads a Hugging Face directory through the
adapter's reader, as TorchTitan does.

Tiered mode: ``local_folder`` set selects ckptstore's tiered manager
(:class:`ckptstore.torch.distributed.CheckpointManager`)::

    CheckpointManager.Config(enable=True, folder="s3://bucket/run", interval=100,
        local_folder="/dev/shm/ckpt",   # this host's tier (the same path on every host)
        persist_every=1000,             # multiples of it (and of interval) also go to folder
        replicas=1,                     # copies of each host's part on other hosts
        local_keep_latest_k=2)          # steps kept in each host's tier

Every save goes through the tiered manager: each host's tier is ``local_folder`` (joined to
``base_folder`` when relative), the persistent tier is ``folder`` (``keep_latest_k``: its
retention, 0 keeping every step), ``tiered_timeout_seconds`` its ``timeout``. The model and
its optimizer are stored as :func:`ckptstore.torch.distributed.save` stores them; the other
states (train state, dataloader, schedulers, ``states``) in its ``extra``, under
``STATE_KEY``, in the codec above (merged across ranks as above; their tensors as extra
tensors ``STATE_KEY/<name>``). Saves do not block (the manager snapshots and writes in the
background; a failed save raises at the next save or at ``close()``). ``load(step=-1)`` is
``restore_latest``: the newest step some tier holds whole, on any world size, whose other
states decode and include every state of the job (checked before the model and optimizer
change: a step that fails this is passed over, with the warning that names it; none left
raises with the job untouched), then each component's ``load_state_dict`` (a value refused
there is refused after the model and optimizer were restored); when the tiers hold
nothing, ``initial_load_path`` as usual. The
last step with ``last_save_model_only`` stays the model-only export in ``folder``, written
once the tiers' saves in flight are done. Refused in this mode (by the config):
``async_mode`` other than ``"disabled"``, ``max_shard_size``, ``allow_optimizer_change``,
``load_step`` other than -1, ``persist_every`` not a multiple of ``interval``, and the tiered
keys without ``local_folder``; by the manager: several model parts (pipeline parallelism) or
several optimizers. The persistent tier's steps are not steps of the untiered mode, nor the
other way round: a folder serves one mode.

Test seam (``ckptstore._faults``): ``CKPTSTORE_FAULT="torchtitan.<point>[:<step>]"``
SIGKILLs the process at ``point`` (``commit``: the coordinator, every rank's part written,
before the commit; ``write``: a rank, before writing its part) of the save of ``step`` (any
step if omitted).
"""

from __future__ import annotations

from ...errors import PickleNotAllowedError
from ._manager import STATE_KEY, CheckpointManager
from ._steps import step_name

__all__ = ["CheckpointManager", "PickleNotAllowedError", "STATE_KEY", "step_name"]
