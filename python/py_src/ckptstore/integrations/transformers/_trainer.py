"""The Hugging Face ``Trainer`` whose ``checkpoint-N`` directories are committed ckptstore
checkpoints (the package docs)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy

from ... import atomic
from ... import open as _open
from ...errors import CorruptCheckpointError
from ...torch.internal import AsyncSaver, Handle, decided_once, to_numpy
from .._common import fsync_file, pause_point, remove_leftovers, staging_name
from .._tree import prepare_any
from ._checkpoint import (
    TRAINER_STATE_NAME,
    _items,
    _naming,
    _read_tree,
    _restore,
    _rng_state,
    _save_items,
    _set_rng_state,
    is_ckptstore_checkpoint,
)

logger = logging.getLogger(__package__)  # the package's logger

_CKPT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")


def _committed_checkpoints(run_dir: str) -> List[tuple]:
    """``(step, path)`` of the checkpoints in ``run_dir`` that rotation counts: the committed
    ones of this package, and the stock Trainer's (``checkpoint-N`` holding its
    ``trainer_state.json``: a run switched to ckptstore counts both kinds, as the stock
    Trainer counts every ``checkpoint-N``)."""
    out = []
    for n in os.listdir(run_dir):
        m = _CKPT_RE.match(n)
        p = os.path.join(run_dir, n)
        if m and os.path.isdir(p) and (
            is_ckptstore_checkpoint(p) or os.path.isfile(os.path.join(p, TRAINER_STATE_NAME))
        ):
            out.append((int(m.group(1)), p))
    return sorted(out)


# ---- the Trainer ---------------------------------------------------------------------------


class Trainer(transformers.Trainer):
    """:class:`transformers.Trainer` whose ``checkpoint-N`` directories are committed ckptstore
    checkpoints (package docs). Extra keyword arguments:

    * ``ckptstore_allow_pickle`` (default ``False``): store (and load) values that only
      pickle can store; see the package docs for what that trusts;
    * ``ckptstore_max_shard_size``: most tensor bytes per shard (default: the engine's);
    * ``ckptstore_async`` (default ``False``): non-blocking saves (package docs);
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
        #: The background saver of ``ckptstore_async`` (one save in flight), made at the
        #: first non-blocking save.
        self._ckptstore_saver: Optional[AsyncSaver] = None
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
            # A dict by class name at run time (transformers annotates it as a list).
            stateful: Any = self.state.stateful_callbacks
            for cb in [c for c in callbacks if isinstance(c, exportable)]:
                cb_name = cb.__class__.__name__
                cb_state = cb.state()
                if isinstance(stateful[cb_name], list):
                    stateful[cb_name].append(cb_state)
                else:
                    stateful[cb_name] = cb_state
            state_text = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
            self._ckptstore_write(run_dir, name, final, state_text, rng, full)

        if self.args.push_to_hub:
            self.ckptstore_wait()
            self._push_from_checkpoint(final)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The stock push copies model.safetensors (and config.json) from checkpoint-N into the
        # output directory and uploads that; a ckptstore checkpoint-N holds no such file, so
        # the model is written there first, as ``save_model`` writes it (the checkpoint was
        # saved from this model a moment ago: the same weights).
        args = self.args
        if (
            self._ckptstore_active()
            and self.is_world_process_zero()
            and args.hub_strategy != HubStrategy.END
            and (args.hub_always_push or self.push_in_progress is None or self.push_in_progress.is_done())
            and is_ckptstore_checkpoint(checkpoint_folder)
        ):
            if getattr(self, "is_distributed_loading_by_transformers", False):
                logger.warning("ckptstore: the model is sharded across ranks: this push carries no weights")
            else:
                self._save(args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)

    def _ckptstore_write(
        self, run_dir: str, name: str, final: str, state_text: str, rng: Any, full: bool
    ) -> None:
        atomic.make_dirs(run_dir)
        remove_leftovers(run_dir)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        config_text = to_json() if to_json is not None else None
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
            items = _items(model, optimizer, tree, kind, pickle_ok, to_numpy, prepare_any)
            self._ckptstore_publish(run_dir, name, final, state_text, model, items)
            self._ckptstore_after_publish(run_dir, final, best)
            return
        # Non-blocking: copy every tensor into the reused snapshot buffers, then write,
        # publish and rotate on the saver's thread while training goes on.
        self.ckptstore_wait()
        if self._ckptstore_saver is None:
            self._ckptstore_saver = AsyncSaver(1, name="ckptstore-hf-save", what="the Trainer's saver")

        def build(copy: Any) -> Any:
            return _items(model, optimizer, tree, kind, pickle_ok, copy, copy)

        def write(items: Any) -> None:
            self._ckptstore_publish(run_dir, name, final, state_text, model, items)
            self._ckptstore_after_publish(run_dir, final, best)

        self._ckptstore_saver.save(Handle(name), build, write)

    def ckptstore_wait(self) -> None:
        """Wait for the non-blocking save in flight (if any); raise its error."""
        if self._ckptstore_saver is not None:
            self._ckptstore_saver.wait()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if (args[0] if args else kwargs.get("resume_from_checkpoint")) is True:
            # The newest checkpoint is chosen by the first rank and handed to the others (as
            # a path: the Trainer then looks no further): on a shared file system another
            # host's caches may show an older listing, and ranks would resume apart.
            from transformers.trainer_utils import get_last_checkpoint

            out_dir = self.args.output_dir
            last = decided_once(lambda: get_last_checkpoint(out_dir), what=f"the last checkpoint in {out_dir}")
            if last is None:  # the Trainer's own error, on every rank
                raise ValueError(f"No valid checkpoint found in output directory ({out_dir})")
            if args:
                args = (last, *args[1:])
            else:
                kwargs["resume_from_checkpoint"] = last
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
        pause_point("hf-after-publish", logger)
        self._ckptstore_rotate(run_dir, final, best)

    def _ckptstore_publish(
        self, run_dir: str, name: str, final: str, state_text: str, model: Any, items: tuple
    ) -> None:
        config = getattr(model, "config", None)
        staging = os.path.join(run_dir, staging_name(name))
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
                    fsync_file(p)
            atomic.fsync_dir(staging)
            pause_point("hf-before-publish", logger)
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

