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

Rotation (``save_total_limit``): after a checkpoint is published, the oldest committed
ckptstore ``checkpoint-N`` directories (by step) beyond the limit are removed; the one just
written and ``state.best_model_checkpoint`` are never removed. A removed checkpoint is first
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

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from .. import _ckptstore, atomic, open as _open
from .. import torch as _ct
from ..errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError, InvalidArgumentError
from ._tree import TREE_KEY, PickleNotAllowedError, _flatten, _prepare_any, load_tree

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

logger = logging.getLogger(__name__)

#: Metadata key marking a checkpoint written by this module: ``{"version", "kind", ...}``.
MARKER_KEY = "ckptstore.transformers"
#: Root key of the tree (scheduler, scaler, RNG, trainer state) in the checkpoint.
TREE_ROOT = "hf.trainer"
_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.json"
_STAGING = ".ckptstore-staging-"
_CKPT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")
_LEFTOVER_RE = re.compile(r"^\.ckptstore-staging-.*-(\d+)-[0-9a-f]{12}$")

# ---- test seam -----------------------------------------------------------------------------

_PAUSE_ENV = "CKPTSTORE_TEST_PAUSE"
_PAUSE_DIR_ENV = "CKPTSTORE_TEST_PAUSE_DIR"


def _pause(point: str) -> None:
    """Stop here for a test (module docs); inert unless both variables are set."""
    points = os.environ.get(_PAUSE_ENV)
    pdir = os.environ.get(_PAUSE_DIR_ENV)
    if not points or not pdir or point not in [p.strip() for p in points.split(",")]:
        return
    try:
        with open(os.path.join(pdir, point), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        logger.error("%s: cannot announce %s in %s: %s; not pausing", _PAUSE_ENV, point, pdir, e)
        return
    while True:
        time.sleep(3600)


# ---- one checkpoint: model + optimizer (ckptstore.torch) + a tree ---------------------------


def save_checkpoint(
    path: "str | os.PathLike[str]",
    model: Any,
    optimizer: Any,
    tree: Dict[str, Any],
    *,
    kind: str,
    allow_pickle: bool = False,
    max_shard_size: Optional[int] = None,
) -> dict:
    """Save ``model`` and ``optimizer`` as :func:`ckptstore.torch.save` stores them, plus
    ``tree`` (JSON values and tensors, :mod:`ckptstore.integrations._tree`) under
    :data:`TREE_ROOT`, as one committed checkpoint in the directory ``path`` (atomically
    replacing one there). Returns the commit info."""
    items = _items(model, optimizer, tree, kind, allow_pickle, _ct._to_numpy, _prepare_any)
    return _save_items(path, items, max_shard_size)


def _items(
    model: Any,
    optimizer: Any,
    tree: Dict[str, Any],
    kind: str,
    allow_pickle: bool,
    prepare: Any,
    prepare_tree: Any,
) -> tuple:
    """``(entries, metadata JSON, optimizer parts)`` of :func:`save_checkpoint`, every
    tensor turned into ``(name, wire dtype, array)`` by ``prepare`` (the live tensor, or a
    snapshot buffer's copy)."""
    entries, meta_json, optim = _ct._build_items(model, optimizer, None, prepare)
    t_entries, t_meta = _flatten({TREE_ROOT: tree}, prepare_tree, allow_pickle)
    taken = {e[0] for e in entries}
    for name, _, _ in t_entries:
        if name in taken:
            raise InvalidArgumentError(f"model tensor {name!r} has the name of a trainer state tensor")
    meta = json.loads(meta_json)
    meta.update(json.loads(t_meta))
    meta[MARKER_KEY] = {"version": _VERSION, "kind": kind}
    return entries + t_entries, json.dumps(meta, allow_nan=False), optim


def _save_items(path: "str | os.PathLike[str]", items: tuple, max_shard_size: Optional[int]) -> dict:
    entries, metadata, optim = items
    return _ckptstore.save(os.fspath(path), entries, metadata, max_shard_size, optim, "inline")


def is_ckptstore_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` holds a committed checkpoint written by this module."""
    if not os.path.isdir(path):
        return False
    try:
        with _open(path) as ck:
            return ck.kind == "ckptstore" and isinstance(ck.metadata.get(MARKER_KEY), dict)
    except CheckpointError:
        return False


def _read_tree(path: "str | os.PathLike[str]", allow_pickle: bool) -> Dict[str, Any]:
    """The tree of a checkpoint of this module: every tensor fresh and CRC-checked."""
    with _open(path) as ck:
        marker = ck.metadata.get(MARKER_KEY)
        if not isinstance(marker, dict) or marker.get("version") != _VERSION:
            raise InvalidArgumentError(
                f"{os.fspath(path)!r}: not a checkpoint of ckptstore.integrations.transformers "
                f"version {_VERSION} (metadata {MARKER_KEY!r}: {marker!r})"
            )
        if TREE_KEY not in ck.metadata:
            raise CorruptCheckpointError(f"{os.fspath(path)!r}: the trainer state tree is missing")
    tree = load_tree(path, allow_pickle=allow_pickle, map_location="cpu")
    if not isinstance(tree, dict) or not isinstance(tree.get(TREE_ROOT), dict):
        raise CorruptCheckpointError(f"{os.fspath(path)!r}: the trainer state tree has no {TREE_ROOT!r}")
    return tree[TREE_ROOT]


@contextlib.contextmanager
def _naming(path: "str | os.PathLike[str]", what: str) -> Iterator[None]:
    """Prefix the message of a ckptstore error raised inside with ``what`` and ``path``
    (the engine's messages name the tensor and shard file, not the checkpoint)."""
    try:
        yield
    except CheckpointError as e:
        e.message = f"{what} {os.fspath(path)!r}: {e.message}"
        e.args = (e.message,)
        raise


# ---- restoring the model through its own load_state_dict -------------------------------------


class _Staged:
    """What :func:`ckptstore.torch.load` uses of a model, over fresh tensors: its
    ``state_dict`` is ``tensors`` (filled from the checkpoint, every CRC checked), its
    parameters are the live model's (they name the optimizer's parameters)."""

    def __init__(self, model: Any, tensors: Dict[str, Any]) -> None:
        self._model = model
        self._tensors = tensors

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return dict(self._tensors)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self._model.named_parameters(*args, **kwargs)


def _custom_loading(model: Any) -> bool:
    """Whether ``model`` loads state its own way: an overridden ``load_state_dict`` (on its
    class or the object) or a ``load_state_dict`` pre-hook on any of its modules. Then its
    ``load_state_dict`` decides which names and shapes it takes."""
    fn = getattr(getattr(model, "load_state_dict", None), "__func__", None)
    if fn is not torch.nn.Module.load_state_dict:
        return True
    return any(getattr(m, "_load_state_dict_pre_hooks", None) for m in model.modules())


def _restore(path: str, model: Any, optimizer: Any = None, allow_optimizer_change: bool = False) -> None:
    """Restore ``model`` (and ``optimizer``) from a checkpoint of this module, the model
    through its own ``load_state_dict`` (its overrides and pre-hooks run, as in the stock
    Trainer).

    Before anything changes: the model's names and shapes against the checkpoint (unless
    the model loads its own way, :func:`_custom_loading`: its ``load_state_dict`` judges),
    the optimizer by :func:`ckptstore.torch.load`'s rule, and every CRC32 (the model's
    tensors are read into fresh tensors). Then the optimizer's state is replaced whole and
    ``model.load_state_dict(tensors, True)`` runs; if it raises, the optimizer gets its
    previous state back."""
    with _open(path) as ck:
        meta = ck.metadata.get(_ct.META_KEY)
        names = meta.get("model") if isinstance(meta, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorruptCheckpointError("the checkpoint lists no model tensors")
        infos = {n: ck.info(n) for n in names}
    if not _custom_loading(model):
        live = model.state_dict()
        missing = [n for n in live if n not in infos]
        unexpected = [n for n in infos if n not in live]
        bad = [n for n in live if n in infos and tuple(infos[n]["shape"]) != tuple(live[n].shape)]
        if missing or unexpected or bad:
            if missing:
                why = f"the checkpoint has no tensor {missing[0]!r}"
            elif unexpected:
                why = f"the checkpoint holds {unexpected[0]!r}, which the model does not have"
            else:
                n = bad[0]
                why = f"{n!r} has shape {tuple(infos[n]['shape'])} in the checkpoint, {tuple(live[n].shape)} in the model"
            raise IncompatibleStateError(f"cannot restore the model: {why}")
    tensors = {n: _ct._empty_for(info) for n, info in infos.items()}
    before = optimizer.state_dict() if optimizer is not None else None
    # Every CRC checked, the optimizer checked, then its state replaced; the model's bytes
    # land in `tensors`, nothing of the live model changes here.
    _ct.load(path, _Staged(model, tensors), optimizer, allow_optimizer_change=allow_optimizer_change)
    try:
        model.load_state_dict(tensors, True)
    except BaseException:
        if before is not None:
            optimizer.load_state_dict(before)
        raise


# ---- RNG states ----------------------------------------------------------------------------


def _rng_state() -> Dict[str, Any]:
    st: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.random.get_rng_state_all()
    return st


def _set_rng_state(st: Dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.random.set_rng_state(st["cpu"])
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            logger.warning(
                "the checkpoint holds CUDA RNG states of %d devices, this process sees %d: "
                "CUDA RNG states not restored",
                len(cuda),
                torch.cuda.device_count(),
            )


# ---- filesystem helpers ----------------------------------------------------------------------


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(run_dir: str) -> None:
    """Remove the staging directories of processes that are gone, and what an interrupted
    publish or removal left (:func:`ckptstore.atomic.sweep_leftovers`)."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return
    for n in names:
        m = _LEFTOVER_RE.match(n)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(run_dir, n), ignore_errors=True)
    atomic.sweep_leftovers(run_dir)


def _side_name(name: str) -> str:
    return f"{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _committed_checkpoints(run_dir: str) -> List[tuple]:
    """``(step, path)`` of the committed checkpoints of this module in ``run_dir``."""
    out = []
    for n in os.listdir(run_dir):
        m = _CKPT_RE.match(n)
        p = os.path.join(run_dir, n)
        if m and os.path.isdir(p) and is_ckptstore_checkpoint(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


# ---- the Trainer ---------------------------------------------------------------------------


class Trainer(transformers.Trainer):
    """:class:`transformers.Trainer` whose ``checkpoint-N`` directories are committed ckptstore
    checkpoints (module docs). Extra keyword arguments:

    * ``ckptstore_allow_pickle`` (default ``False``): store (and load) values that only
      pickle can store; see the module docs for what that trusts;
    * ``ckptstore_max_shard_size``: most tensor bytes per shard (default: the engine's);
    * ``ckptstore_async`` (default ``False``): non-blocking saves (module docs);
    * ``ckptstore_allow_optimizer_change`` (default ``False``): resume a checkpoint saved by
      another optimizer class (``ckptstore.torch.load``'s ``allow_optimizer_change``); without
      it such a resume raises ``IncompatibleStateError`` naming both classes.
    """

    def __init__(
        self,
        *args: Any,
        ckptstore_allow_pickle: bool = False,
        ckptstore_max_shard_size: Optional[int] = None,
        ckptstore_async: bool = False,
        ckptstore_allow_optimizer_change: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ckptstore_allow_optimizer_change = bool(ckptstore_allow_optimizer_change)
        self.ckptstore_allow_pickle = bool(ckptstore_allow_pickle)
        self.ckptstore_max_shard_size = ckptstore_max_shard_size
        self.ckptstore_async = bool(ckptstore_async)
        self._ckptstore_snapshot: Any = None
        self._ckptstore_thread: Optional[threading.Thread] = None
        self._ckptstore_error: Optional[BaseException] = None
        self._ckptstore_trees: Dict[str, Dict[str, Any]] = {}
        self._ckptstore_pending_model: Optional[tuple] = None
        self._ckptstore_warned = False

    # -- which setups go through ckptstore

    def _ckptstore_active(self) -> bool:
        reason = None
        if self.is_deepspeed_enabled:
            reason = "DeepSpeed"
        elif self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            reason = "FSDP"
        elif transformers.utils.is_torch_xla_available():
            reason = "XLA"
        elif transformers.utils.is_sagemaker_mp_enabled():
            reason = "SageMaker model parallelism"
        if reason is None:
            return True
        if not self._ckptstore_warned:
            logger.warning("ckptstore: %s checkpoints keep the stock Trainer checkpointing", reason)
            self._ckptstore_warned = True
        return False

    def _ckptstore_tree(self, path: str) -> Dict[str, Any]:
        key = os.path.abspath(path)
        tree = self._ckptstore_trees.get(key)
        if tree is None:
            with _naming(path, "resuming from"):
                tree = _read_tree(path, self.ckptstore_allow_pickle)
            self._ckptstore_trees[key] = tree
        return tree

    # -- saving

    def _ckptstore_rng(self) -> List[Dict[str, Any]]:
        """The RNG states of every process, in process order (gathered under DDP)."""
        mine = _rng_state()
        if self.args.world_size <= 1 or not torch.distributed.is_initialized():
            return [mine]
        gathered: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if not self._ckptstore_active():
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, name)

        if (
            self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST]
            and self.state.best_global_step
        ):
            if self.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED:
                torch.distributed.barrier()
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            # The checkpoint being written is the best one: it exists once published below.
            if self.state.best_global_step == step or os.path.exists(best):
                self.state.best_model_checkpoint = best

        full = not self.args.save_only_model
        rng = self._ckptstore_rng() if full else None
        if self.args.should_save:
            exportable = transformers.trainer_callback.ExportableState
            callbacks = self.callback_handler.callbacks + [self.control]
            for cb in [c for c in callbacks if isinstance(c, exportable)]:
                cb_name = cb.__class__.__name__
                cb_state = cb.state()
                if isinstance(self.state.stateful_callbacks[cb_name], list):
                    self.state.stateful_callbacks[cb_name].append(cb_state)
                else:
                    self.state.stateful_callbacks[cb_name] = cb_state
            state_text = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
            self._ckptstore_write(run_dir, name, final, state_text, rng, full)

        if self.args.push_to_hub:
            self.ckptstore_wait()
            self._push_from_checkpoint(final)

    def _ckptstore_write(
        self, run_dir: str, name: str, final: str, state_text: str, rng: Any, full: bool
    ) -> None:
        os.makedirs(run_dir, exist_ok=True)
        _remove_leftovers(run_dir)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        config = getattr(model, "config", None)
        config_text = config.to_json_string() if hasattr(config, "to_json_string") else None
        tree: Dict[str, Any] = {
            "trainer_state": state_text,
            "global_step": self.state.global_step,
            "config": config_text,
            "args": self.args.to_json_string(),
            "world_size": self.args.world_size,
        }
        optimizer = None
        if full:
            optimizer = self.optimizer
            sched = self.lr_scheduler
            tree["scheduler"] = sched.state_dict() if sched is not None else None
            scaler = getattr(self.accelerator, "scaler", None)
            tree["scaler"] = scaler.state_dict() if scaler is not None else None
            tree["rng"] = rng
        kind = "trainer-checkpoint"
        pickle_ok = self.ckptstore_allow_pickle
        best = self.state.best_model_checkpoint
        if not self.ckptstore_async:
            items = _items(model, optimizer, tree, kind, pickle_ok, _ct._to_numpy, _prepare_any)
            self._ckptstore_publish(run_dir, name, final, state_text, model, items)
            self._ckptstore_after_publish(run_dir, final, best)
            return
        # Non-blocking: copy every tensor into the reused snapshot buffers, then write,
        # publish and rotate on a thread while training goes on.
        self.ckptstore_wait()
        from ..torch.manager import _Snapshot

        if self._ckptstore_snapshot is None:
            self._ckptstore_snapshot = _Snapshot()
        snap = self._ckptstore_snapshot
        snap.begin()
        items = _items(model, optimizer, tree, kind, pickle_ok, snap.copy, snap.copy)
        snap.end()

        def work() -> None:
            try:
                self._ckptstore_publish(run_dir, name, final, state_text, model, items)
                self._ckptstore_after_publish(run_dir, final, best)
            except BaseException as e:  # noqa: BLE001 - raised by ckptstore_wait
                self._ckptstore_error = e

        self._ckptstore_thread = threading.Thread(target=work, name="ckptstore-hf-save")
        self._ckptstore_thread.start()

    def ckptstore_wait(self) -> None:
        """Wait for the non-blocking save in flight (if any); raise its error."""
        t = self._ckptstore_thread
        if t is not None:
            t.join()
            self._ckptstore_thread = None
        err, self._ckptstore_error = self._ckptstore_error, None
        if err is not None:
            raise err

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = super().train(*args, **kwargs)
        except BaseException:
            try:
                self.ckptstore_wait()
            except BaseException as e:  # noqa: BLE001 - the training error wins
                logger.error("ckptstore: a background save failed too: %s", e)
            raise
        self.ckptstore_wait()
        self._ckptstore_end_of_train_cleanup()  # a no-op once _finalize_training ran it
        return out

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # The Trainer's end of training (best model, then the save_total_limit=1 cleanup)
        # must see the checkpoints a blocking save would have left: the save still in flight
        # is published and rotated first, then the cleanup's rule is applied here, removing
        # ckptstore checkpoints the way rotation does (out of the names first).
        if self._ckptstore_active():
            self.ckptstore_wait()
            self._ckptstore_end_of_train_cleanup()
        return super()._finalize_training(*args, **kwargs)

    def _ckptstore_end_of_train_cleanup(self) -> None:
        """The stock Trainer's end-of-train rule (``save_total_limit == 1`` and a best
        checkpoint: every other checkpoint is deleted) on the committed ckptstore
        checkpoints of the best checkpoint's run directory."""
        best = self.state.best_model_checkpoint
        if not (self.args.should_save and best is not None and self.args.save_total_limit == 1):
            return
        if not self._ckptstore_active():
            return
        run_dir = os.path.dirname(os.path.abspath(best))
        if not os.path.isdir(run_dir):
            return
        for _, p in _committed_checkpoints(run_dir):
            if os.path.abspath(p) != os.path.abspath(best):
                logger.info("ckptstore: removing %s (save_total_limit=1, best is %s)", p, best)
                atomic.remove_dir(p)

    def _ckptstore_after_publish(self, run_dir: str, final: str, best: Optional[str]) -> None:
        _pause("hf-after-publish")
        self._ckptstore_rotate(run_dir, final, best)

    def _ckptstore_publish(
        self, run_dir: str, name: str, final: str, state_text: str, model: Any, items: tuple
    ) -> None:
        config = getattr(model, "config", None)
        staging = os.path.join(run_dir, _STAGING + _side_name(name))
        os.mkdir(staging)
        try:
            _save_items(staging, items, self.ckptstore_max_shard_size)
            atomic.write_file(staging, TRAINER_STATE_NAME, state_text)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(staging)
                gen = getattr(model, "generation_config", None)
                if gen is not None and getattr(model, "can_generate", lambda: False)():
                    gen.save_pretrained(staging)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(staging)
            for n in os.listdir(staging):
                p = os.path.join(staging, n)
                if os.path.isfile(p):
                    _fsync_file(p)
            atomic.fsync_dir(staging)
            _pause("hf-before-publish")
            # One rename, or one exchange with the checkpoint it replaces: checkpoint-N
            # names the old directory or the new one, never neither.
            atomic.publish_dir(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("ckptstore: committed %s", final)

    def _ckptstore_rotate(self, run_dir: str, current: str, best: Optional[str]) -> None:
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        cks = _committed_checkpoints(run_dir)
        if len(cks) <= limit:
            return
        protected = {os.path.abspath(current)}
        if best is not None:
            protected.add(os.path.abspath(best))
        keep = max(limit, len(protected))
        remaining = len(cks)
        for _, p in cks:
            if remaining <= keep:
                break
            if os.path.abspath(p) in protected:
                continue
            logger.info("ckptstore: removing %s (save_total_limit=%d)", p, limit)
            atomic.remove_dir(p)
            remaining -= 1

    # -- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ckptstore_active():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not is_ckptstore_checkpoint(resume_from_checkpoint):
            # A run begun with the stock checkpointing: its checkpoint is loaded by the stock
            # code (safetensors, torch.load(weights_only=True)); the next saves are ours.
            logger.warning(
                "ckptstore: %s is a checkpoint of the stock Trainer, not a ckptstore checkpoint: "
                "resuming from it with the stock code (no CRC check, not all or nothing); the "
                "next checkpoints are ckptstore checkpoints",
                resume_from_checkpoint,
            )
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        tree = self._ckptstore_tree(resume_from_checkpoint)
        state_file = os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)
        try:
            with open(state_file, "rb") as f:
                on_disk = f.read()
        except OSError as e:
            raise CorruptCheckpointError(f"{state_file!r}: cannot read it: {e}") from e
        if on_disk != str(tree.get("trainer_state", "")).encode("utf-8"):
            raise CorruptCheckpointError(
                f"{state_file!r} differs from the trainer state committed in the checkpoint "
                f"{resume_from_checkpoint!r}"
            )
        if not self.is_in_train:
            # Called outside train(): restore the model now (checked before it changes).
            target = self.accelerator.unwrap_model(
                model if model is not None else self.model, keep_torch_compile=False
            )
            with _naming(resume_from_checkpoint, "loading the model from"):
                _restore(resume_from_checkpoint, target)
            return
        # In train(): the model is restored with the optimizer
        # (_load_optimizer_and_scheduler), all checked before either changes.
        self._ckptstore_pending_model = (os.path.abspath(resume_from_checkpoint), model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if not self._ckptstore_active() or not is_ckptstore_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        tree = self._ckptstore_tree(checkpoint)
        pending = self._ckptstore_pending_model
        model = pending[1] if pending is not None and pending[0] == os.path.abspath(checkpoint) else None
        if model is None:
            model = self.model
        model = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        with _naming(checkpoint, "resuming from"):
            with _open(checkpoint) as ck:
                has_opt = ck.has_optimizer
            _restore(
                checkpoint,
                model,
                self.optimizer if has_opt else None,
                allow_optimizer_change=self.ckptstore_allow_optimizer_change,
            )
        self._ckptstore_pending_model = None
        if has_opt and tree.get("scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(tree["scheduler"])

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if not self._ckptstore_active() or not is_ckptstore_checkpoint(checkpoint):
            return super()._load_scaler(checkpoint)
        st = self._ckptstore_tree(checkpoint).get("scaler")
        scaler = getattr(self.accelerator, "scaler", None)
        if st is not None and scaler is not None:
            scaler.load_state_dict(st)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if not self._ckptstore_active() or not is_ckptstore_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)
        rng = self._ckptstore_tree(checkpoint).get("rng")
        if not rng:
            logger.info("ckptstore: %s holds no RNG states; reproducibility is not guaranteed", checkpoint)
            return
        i = self.args.process_index
        if len(rng) != self.args.world_size or i >= len(rng):
            logger.info(
                "ckptstore: %s holds the RNG states of %d process(es), this run has %d: not restored",
                checkpoint,
                len(rng),
                self.args.world_size,
            )
            return
        _set_rng_state(rng[i])
        # The RNG is the last thing resumed: drop the cached tree.
        self._ckptstore_trees.pop(os.path.abspath(checkpoint), None)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not self._ckptstore_active() or not is_ckptstore_checkpoint(best):
            return super()._load_best_model()
        logger.info("ckptstore: loading the best model from %s (score %s)", best, self.state.best_metric)
        with _naming(best, "loading the best model from"):
            _restore(best, self.accelerator.unwrap_model(self.model, keep_torch_compile=False))


# ---- Accelerate ------------------------------------------------------------------------------


def _accelerate_parts(accelerator: Any) -> tuple:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
        DistributedType.XLA,
    ):
        raise InvalidArgumentError(
            f"ckptstore save_state/load_state: {accelerator.distributed_type} is not supported "
            "(use Accelerator.save_state)"
        )
    if accelerator.num_processes != 1:
        raise InvalidArgumentError(
            "ckptstore save_state/load_state: one process only (got "
            f"{accelerator.num_processes}); use Accelerator.save_state"
        )
    if len(accelerator._models) != 1 or len(accelerator._optimizers) > 1:
        raise InvalidArgumentError(
            "ckptstore save_state/load_state: exactly one prepared model and at most one "
            f"optimizer (got {len(accelerator._models)} and {len(accelerator._optimizers)})"
        )
    model = accelerator.unwrap_model(accelerator._models[0], keep_torch_compile=False)
    opt = accelerator._optimizers[0] if accelerator._optimizers else None
    return model, opt


def save_state(
    accelerator: Any,
    output_dir: "str | os.PathLike[str]",
    *,
    allow_pickle: bool = False,
    max_shard_size: Optional[int] = None,
) -> str:
    """What ``accelerator.save_state(output_dir)`` saves (one process: model, optimizer,
    schedulers, stateful dataloaders, grad scaler, RNG states, ``accelerator.step``, objects
    registered for checkpointing) as one committed ckptstore checkpoint in ``output_dir``,
    atomically replacing one there. Returns ``output_dir``."""
    model, opt = _accelerate_parts(accelerator)
    tree: Dict[str, Any] = {
        "step": accelerator.step,
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [
            dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
            for dl in accelerator._dataloaders
        ],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "rng": [_rng_state()],
    }
    os.makedirs(output_dir, exist_ok=True)
    save_checkpoint(
        output_dir,
        model,
        opt,
        tree,
        kind="accelerate-state",
        allow_pickle=allow_pickle,
        max_shard_size=max_shard_size,
    )
    accelerator.project_configuration.iteration += 1
    return os.fspath(output_dir)


def load_state(
    accelerator: Any,
    input_dir: "str | os.PathLike[str]",
    *,
    allow_pickle: bool = False,
    allow_optimizer_change: bool = False,
) -> None:
    """Restore what :func:`save_state` saved into the prepared objects of ``accelerator``.
    Everything is read and checked (names, shapes, counts, the optimizer class unless
    ``allow_optimizer_change``, every CRC32) before the model or the optimizer changes; the
    optimizer state is replaced whole."""
    model, opt = _accelerate_parts(accelerator)
    where = os.fspath(input_dir)
    with _naming(where, "loading the state from"):
        tree = _read_tree(input_dir, allow_pickle)
    for what, live in (
        ("schedulers", accelerator._schedulers),
        ("dataloaders", accelerator._dataloaders),
        ("custom", accelerator._custom_objects),
    ):
        if len(tree.get(what) or []) != len(live):
            raise InvalidArgumentError(
                f"{where!r} holds {len(tree.get(what) or [])} {what}, the accelerator has {len(live)}"
            )
    with _naming(where, "loading the state from"):
        with _open(input_dir) as ck:
            if opt is not None and not ck.has_optimizer:
                raise InvalidArgumentError("it holds no optimizer state")
        _restore(os.fspath(input_dir), model, opt, allow_optimizer_change=allow_optimizer_change)
    for s, st in zip(accelerator._schedulers, tree["schedulers"]):
        s.load_state_dict(st)
    for dl, st in zip(accelerator._dataloaders, tree["dataloaders"]):
        if st is not None:
            dl.load_state_dict(st)
    if accelerator.scaler is not None and tree.get("scaler") is not None:
        accelerator.scaler.load_state_dict(tree["scaler"])
    for o, st in zip(accelerator._custom_objects, tree["custom"]):
        o.load_state_dict(st)
    accelerator.step = tree["step"]
    _set_rng_state(tree["rng"][0])


def _accelerator_class() -> Any:
    import accelerate

    class Accelerator(accelerate.Accelerator):
        """:class:`accelerate.Accelerator` whose ``save_state`` / ``load_state`` are
        :func:`save_state` / :func:`load_state` (an explicit directory is required; hooks
        registered with ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
        are not called)."""

        def save_state(
            self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kw: Any
        ) -> str:
            if output_dir is None:
                raise InvalidArgumentError("ckptstore Accelerator.save_state needs output_dir")
            return save_state(self, output_dir, **kw)

        def load_state(self, input_dir: Optional[str] = None, load_kwargs: Any = None, **kw: Any) -> None:
            if input_dir is None:
                raise InvalidArgumentError("ckptstore Accelerator.load_state needs input_dir")
            load_state(self, input_dir, **kw)

    return Accelerator


def __getattr__(name: str) -> Any:
    if name == "Accelerator":
        cls = _accelerator_class()
        globals()["Accelerator"] = cls
        return cls
    raise AttributeError(name)
