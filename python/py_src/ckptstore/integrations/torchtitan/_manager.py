"""TorchTitan's checkpoint manager on ckptstore (the package docs)."""

from __future__ import annotations

import binascii
import json
import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Optional, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from ... import _ckptstore
from ..._faults import fault_point
from ...errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError
from ...torch.dcp import META_KEY, Reader, Writer
from ...torch.internal import decided_once, optimizer_class
from .._common import check_optimizer_class, dcp_error
from . import _tiered
from ._codec import _VERSION, STATE_KEY, _decode, _Encoder, _merge, _Ref, _substitute
from ._steps import _join, _Steps
from ._stock_steps import _DCP_METADATA, _is_stock_step, _StockPlanner, _StockReader

logger = logging.getLogger(__package__)  # the package's logger


def _unwrap(e: BaseException) -> BaseException:
    """The ckptstore error inside DCP's ``CheckpointException`` (:func:`dcp_error`: a
    checksum error first, as the other ranks report only that a peer's checks failed),
    else the first error it gathered."""
    if not isinstance(e, CheckpointException):
        return e
    err = dcp_error(e, _rank())
    if err is not None:
        return err
    found = [exc for exc, _ in e.failures.values()]
    return found[0] if found else e


# ---- the optimizer class ----------------------------------------------------------------------


def _optimizers_class(optimizers: Any) -> Optional[str]:
    """The class recorded for TorchTitan's optimizers: the class name of each optimizer of an
    ``OptimizersContainer`` (or of one plain optimizer), several as their sorted names joined
    by ``+``; ``None`` when there is none."""
    if optimizers is None:
        return None
    inner = getattr(optimizers, "optimizers", None)
    opts = list(inner) if isinstance(inner, (list, tuple)) else [optimizers]
    names = sorted({optimizer_class(o) for o in opts})
    return "+".join(names) if names else None


# ---- the writer with the test seam ----------------------------------------------------------


class _StepWriter(Writer):
    def __init__(self, path: str, step: int, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.step = step

    def write_data(self, plan: Any, planner: Any) -> Any:
        fault_point("torchtitan.write", self.step)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        fault_point("torchtitan.commit", self.step)
        super().finish(metadata, results)


def _holds_nothing(component: Any) -> bool:
    """Whether ``component``'s state (its ``state_dict()``, else itself) flattens to no entry:
    dicts all the way down, none holding a value."""

    def empty(x: Any) -> bool:
        return isinstance(x, dict) and all(empty(v) for v in x.values())

    sd = component.state_dict() if callable(getattr(component, "state_dict", None)) else component
    return empty(sd)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


class CheckpointManager(BaseCheckpointManager):
    """TorchTitan's checkpoint manager on ckptstore (see the package's documentation).

    Built by the trainer from :class:`CheckpointManager.Config` (``config.checkpoint.build(
    dataloader=, model_parts=, optimizers=, lr_schedulers=, states=, sd_adapter=,
    base_folder=)``). Checkpoints of step ``N`` are ``FOLDER/step-<N, 8 digits>/``:
    :meth:`step_path`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Save mode: synchronous; snapshot then write on a thread; or the snapshot too on
        a thread (``maybe_wait_for_staging`` waits for it)."""

        max_shard_size: Optional[int] = None
        """Most tensor bytes per shard file of each rank (default: the engine's, 4 GiB)."""

        allow_pickle: bool = False
        """Store (and load) non-tensor values that are not JSON or bytes with pickle.
        Loading such a value runs code chosen by whoever wrote the checkpoint."""

        allow_optimizer_change: bool = False
        """Resume a step saved by another optimizer class (refused by default with
        ``IncompatibleStateError`` naming both): the live optimizer gets the checkpoint's
        state for the state names it has and the checkpoint's hyperparameters plus its own
        for the settings the checkpoint lacks."""

        local_folder: str = ""
        """The tiered mode: this host's tier (RAM such as ``/dev/shm/ckpt``, or node-local
        disk; joined to ``base_folder`` like ``folder`` when relative), the same path on every
        host. Every save lands there; ``folder`` is the persistent tier. Empty: off."""

        persist_every: int = 0
        """Tiered mode: a saved step whose number is a multiple of this (a multiple of
        ``interval``) is also persisted to ``folder``; 0: never."""

        replicas: int = 1
        """Tiered mode: copies of each host's part kept in the tiers of other hosts."""

        local_keep_latest_k: int = 2
        """Tiered mode: the steps kept in each host's tier (``keep_latest_k`` is the
        persistent tier's retention)."""

        tiered_timeout_seconds: Optional[float] = None
        """Tiered mode: seconds any one operation between ranks may wait, a lost host being
        reported after it (``None``: the tiered manager's default)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {mode}")
            self.async_mode = mode  # type: ignore[assignment]
            if self.max_shard_size is not None and self.max_shard_size <= 0:
                raise ValueError("max_shard_size must be positive")
            _tiered.check_config(self)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Optional[Future] = None
        if not self.enable:
            return
        self.config = config
        self.folder = _join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.async_mode = config.async_mode
        self.allow_pickle = config.allow_pickle
        self.allow_optimizer_change = config.allow_optimizer_change
        self.max_shard_size = config.max_shard_size
        self.keep_latest_k = config.keep_latest_k
        # The tiered mode's persistent tier is `folder`, laid out by the tiered manager: its
        # model-only export of the last step goes beside, into `folder/export`.
        exports = _join(self.folder, "export") if config.local_folder else self.folder
        self._steps = _Steps(exports, config.keep_latest_k)
        self.pg: Any = None
        if self.async_mode != "disabled" and _dist():
            self.pg = dist.new_group(backend="gloo")
        self.stager: Optional[DefaultStager] = None
        self.staging_future: Optional[Future] = None
        self._pending_step: Optional[int] = None
        #: The step a completed ``load`` restored (``None``: none yet / a fresh start).
        self.loaded_step: Optional[int] = None
        #: The tiered manager (``config.local_folder``; ``None``: the untiered mode).
        self.tiered: Any = None
        if config.local_folder:
            _tiered.model_and_optimizer(self)  # refused before anything is built
            self.tiered = _tiered.build(config, _join(base_folder, config.local_folder), self.folder)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- paths and steps -----------------------------------------------------------------

    def step_path(self, step: int) -> str:
        """The checkpoint directory (or URL) of ``step``."""
        return self._steps.path(step)

    def committed_steps(self) -> list[int]:
        """The committed steps under the folder, ascending."""
        return self._steps.steps()

    # -- save ----------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _flat_states(self, states: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """TorchTitan's layout: model entries at the top level, the other components under
        their keys; every ``Stateful`` asked for its ``state_dict``."""
        states = self.states if states is None else states
        out: dict[str, Any] = {}
        for k, v in states.items():
            if k == MODEL:
                continue
            out[k] = v.state_dict() if isinstance(v, Stateful) else v
        if MODEL in states:
            for k, v in states[MODEL].state_dict().items():
                if k in out:
                    raise InvalidArgumentError(f"model entry {k!r} collides with a state key")
                out[k] = v
        return out

    def _split(self, flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
        enc = _Encoder(self.allow_pickle)
        skeleton = enc.encode(flat, "")
        return enc.tensors, skeleton

    def _gathered(self, skeleton: Any) -> Any:
        if not _dist() or dist.get_world_size() == 1:
            return skeleton
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, skeleton)
        merged = every[0]
        for s in every[1:]:
            merged = _merge(merged, s)
        return merged

    def _writer(self, step: int, skeleton: Any, model_only: bool) -> Writer:
        meta = {
            STATE_KEY: {
                "version": _VERSION,
                "step": int(step),
                "model_only": bool(model_only),
                "states": skeleton,
            }
        }
        optimizer_class = None if model_only else _optimizers_class(self.states.get(OPTIMIZER))
        if optimizer_class is not None:
            meta[STATE_KEY]["optimizer_class"] = optimizer_class
        return _StepWriter(
            self.step_path(step), step, max_shard_size=self.max_shard_size, metadata=meta
        )

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.last_save_model_only:
            if self.tiered is not None:
                self.tiered.wait()  # no upload into the folder in flight while its gc runs
            self._save_model_only(curr_step)
            return True
        if self.tiered is not None:
            _tiered.save(self, curr_step, last_step)
            return True
        tensors, skeleton = self._split(self._flat_states())
        skeleton = self._gathered(skeleton)
        writer = self._writer(curr_step, skeleton, model_only=False)
        mode = "disabled" if last_step else self.async_mode
        if mode == "disabled":
            self._dcp_save(tensors, writer)
            self._after_commit()
            return True
        if self.stager is None:
            accel = torch.cuda.is_available()
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=accel,
                    use_shared_memory=False,
                    use_async_staging=mode == "async_with_pinned_mem",
                    use_non_blocking_copy=accel and mode == "async_with_pinned_mem",
                )
            )
        kw: dict[str, Any] = {"storage_writer": writer, "async_stager": self.stager}
        if self.pg is not None:
            kw["process_group"] = self.pg
        else:
            kw["no_dist"] = not _dist()
        result = dcp.async_save(tensors, **kw)
        if isinstance(result, AsyncSaveResponse):
            self.staging_future = result.staging_completion
            self.save_future = result.upload_completion
        else:
            self.save_future = cast(Future, result)
        self._pending_step = curr_step
        return True

    def _dcp_save(self, tensors: dict[str, torch.Tensor], writer: Writer) -> None:
        try:
            dcp.save(tensors, storage_writer=writer, no_dist=not _dist())
        except CheckpointException as e:
            raise _unwrap(e) from e

    def _after_commit(self) -> None:
        if _rank() == 0:
            self._steps.gc()

    def _save_model_only(self, curr_step: int) -> None:
        """The model alone, in ``export_dtype`` (names converted to Hugging Face's by the
        adapter with ``last_save_in_hf``): the export ``ckpt consolidate`` turns into a
        Hugging Face directory."""
        states = self.states[MODEL].state_dict()
        states = {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
            else v
            for k, v in states.items()
        }
        if self.last_save_in_hf:
            states = self.sd_adapter.to_hf(states)
        tensors, skeleton = self._split(states)
        writer = self._writer(curr_step, self._gathered(skeleton), model_only=True)
        self._dcp_save(tensors, writer)
        self._after_commit()

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is None:
            return
        fut, self.staging_future = self.staging_future, None
        fut.result()

    def _wait_for_saving(self) -> None:
        fut = self.save_future
        assert fut is not None
        self.save_future = None
        self._pending_step = None
        try:
            fut.result()
        except CheckpointException as e:
            raise _unwrap(e) from e
        self._after_commit()

    def _close(self) -> None:
        try:
            self.maybe_wait_for_staging()
            self.maybe_wait_for_saving()
        finally:
            if self.stager is not None:
                self.stager.close()
                self.stager = None
            tiered, self.tiered = self.tiered, None
            if tiered is not None:
                tiered.close()  # waits for its saves in flight; raises a failed one's error

    # -- load ----------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if self.tiered is not None:
            if step != -1:
                raise ValueError(
                    f"the tiered mode resumes the newest step its tiers hold, not step {step} "
                    "(checkpoint.load_step -1)"
                )
            restored = _tiered.load(self)
            if restored is None:
                return self._load_initial()
            self.loaded_step = restored
            return True
        # Which step to resume is read by the first rank alone and handed to the others: on a
        # shared file system another host's caches may still show an older listing (or none),
        # and ranks that each chose would load different steps, or one none, and deadlock.
        load_step, stock_path = decided_once(
            lambda: self._choose_step(step), what=f"choosing the step to resume under {self.folder}"
        )
        if stock_path is not None:
            self._load_stock(stock_path, model_only=load_step == 0)
            self.loaded_step = load_step
            logger.warning(
                "ckptstore: resumed step %d from %s, a checkpoint of TorchTitan's own manager "
                "(DCP format, loaded as TorchTitan loads it: no CRC check); the next saves are "
                "ckptstore checkpoints (%s)",
                load_step, stock_path, _join(self.folder, "step-<8 digits>"),
            )
            return True
        if load_step == -1:
            return self._load_initial()
        self._load_path(self.step_path(load_step), model_only=load_step == 0)
        self.loaded_step = load_step
        return True

    def _choose_step(self, step: int) -> tuple[int, Optional[str]]:
        """The step to resume (``-1``: none) and, for a step of TorchTitan's own manager,
        its directory (``None`` for a ckptstore step), from this rank's listing."""
        steps = self._steps.steps()
        # Steps of TorchTitan's own manager (a job switched to ckptstore): the newest step of
        # either kind is the latest (a ckptstore step wins a tie).
        stock = self._steps.stock_steps()
        if step != -1:
            if step not in steps and step not in stock:
                raise CheckpointNotFoundError(
                    f"{self.step_path(step)}: step {step} is not a committed checkpoint under "
                    f"{self.folder} (committed: {steps}"
                    + (f"; TorchTitan's own: {sorted(stock)})" if stock else ")")
                )
            load_step = step
        else:
            load_step = max(steps[-1] if steps else -1, max(stock) if stock else -1)
        if load_step != -1 and load_step not in steps:
            return load_step, stock[load_step]
        return load_step, None

    def _load_initial(self) -> bool:
        """No step to resume: ``initial_load_path`` (a ckptstore or stock checkpoint, or a
        Hugging Face directory) or the adapter's Hugging Face assets, if configured."""
        cfg = self.config
        if cfg.initial_load_path:
            if cfg.initial_load_in_hf:
                self._load_hf(cfg.initial_load_path, cfg.initial_load_in_hf_quantized)
            elif "://" not in cfg.initial_load_path and _is_stock_step(cfg.initial_load_path):
                self._load_stock(cfg.initial_load_path, model_only=cfg.initial_load_model_only)
                logger.warning(
                    "ckptstore: initial_load_path %s is a checkpoint of TorchTitan's own "
                    "manager (DCP format), loaded as TorchTitan loads it (no CRC check)",
                    cfg.initial_load_path,
                )
            else:
                self._load_path(cfg.initial_load_path, model_only=cfg.initial_load_model_only)
            return True
        if cfg.initial_load_in_hf:
            path = getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ValueError("from_hf=True requires sd_adapter and hf_assets_path.")
            self._load_hf(path, cfg.initial_load_in_hf_quantized)
            return True
        return False

    def _load_stock(self, path: str, *, model_only: bool) -> None:
        """A step of TorchTitan's own manager, loaded as TorchTitan loads it (``dcp.load`` of
        its flattened state, then the model's ``load_state_dict``), with its non-tensor
        values and DCP metadata read as plain data (pickle beyond that needs
        ``allow_pickle``). Checked before anything is read: an export (model only, or in
        Hugging Face format) is refused when resuming, and every component loaded must be in
        it. No CRC: DCP's files have none, and DCP writes the live tensors as it reads."""
        if not os.path.isfile(os.path.join(path, _DCP_METADATA)):
            raise CheckpointError(
                f"{path}: a Hugging Face export of TorchTitan's own manager (model only); load "
                "an earlier step (checkpoint.load_step) to resume training"
            )
        reader = _StockReader(path, self.allow_pickle)
        stored = set(reader.read_metadata().state_dict_metadata)
        if model_only:
            states: dict[str, Any] = {MODEL: self.states[MODEL]}
        else:
            for k in self.exclude_from_loading:
                if k not in self.states:
                    raise ValueError(f"{k} not found in state_dict.")
            states = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
            parts = [k for k, v in states.items() if k != MODEL and v is not None]

            def held(k: str) -> bool:
                return any(n == k or n.startswith(k + ".") for n in stored)

            # A component whose state holds nothing (a data loader whose state_dict() is {},
            # as in TorchTitan's own tests) left nothing in the step: DCP loads it as it is,
            # and so does this (TorchTitan's manager resumes such a step).
            absent = [k for k in parts if not held(k) and not _holds_nothing(states[k])]
            if absent and not any(held(k) for k in parts):
                raise CheckpointError(
                    f"{path}: a model-only export of TorchTitan's own manager; load an earlier "
                    "step (checkpoint.load_step) to resume training"
                )
            if absent:
                raise CheckpointError(f"{path}: the checkpoint holds no state {absent[0]!r}")
        # TorchTitan's own layout (its manager's _states_to_load): the model's entries at the
        # top level, the other components as themselves (DCP calls their state_dict and
        # load_state_dict).
        sd: dict[str, Any] = {k: v for k, v in states.items() if k != MODEL}
        sd.update(states[MODEL].state_dict())
        try:
            dcp.load(sd, storage_reader=reader, planner=_StockPlanner(self.allow_pickle, path), no_dist=not _dist())
        except CheckpointException as e:
            raise _unwrap(e) from e
        states[MODEL].load_state_dict(sd)

    def _load_hf(self, path: str, quantized: bool) -> None:
        """A Hugging Face directory through the adapter's reader (TorchTitan's own path)."""
        assert self.sd_adapter is not None, "loading a Hugging Face checkpoint needs sd_adapter"
        hf = self.sd_adapter.to_hf(self.states[MODEL].state_dict())
        dcp.load(hf, storage_reader=self.sd_adapter.get_hf_storage_reader(path, quantized))
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf))

    def _load_path(self, path: str, *, model_only: bool) -> None:
        """Check names, read every tensor through the Reader (CRC-checked, ranks agreeing,
        before any destination is written), then apply each component's state."""
        try:
            meta = json.loads(_ckptstore.Checkpoint(path, lazy=True).metadata_json())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: the manifest's metadata is not JSON: {e}") from e
        dcp_items = (meta.get(META_KEY) or {}).get("items") if isinstance(meta, dict) else None
        saved = meta.get(STATE_KEY) if isinstance(meta, dict) else None
        if not isinstance(dcp_items, dict):
            raise CheckpointError(f"{path}: not a DCP checkpoint written by ckptstore")
        if model_only and not isinstance(saved, dict):
            saved = {"states": {}}  # any ckptstore DCP checkpoint gives its model tensors
        if not isinstance(saved, dict) or "states" not in saved:
            raise CheckpointError(f"{path}: not a checkpoint of ckptstore's TorchTitan manager")
        stored = set(dcp_items)
        skeleton = saved["states"]
        if saved.get("model_only") and not model_only:
            raise CheckpointError(
                f"{path}: step {saved.get('step')} is a model-only export; load an earlier step "
                "(checkpoint.load_step) to resume training"
            )
        if model_only:
            states: dict[str, Any] = {MODEL: self.states[MODEL]}
        else:
            for k in self.exclude_from_loading:
                if k not in self.states:
                    raise ValueError(f"{k} not found in state_dict.")
            states = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        # The optimizer class first: before any state dict is built (an optimizer without
        # state would get some) or anything is read.
        changed = False
        if OPTIMIZER in states:
            changed = check_optimizer_class(
                _optimizers_class(states[OPTIMIZER]), saved.get("optimizer_class"),
                self.allow_optimizer_change, path,
            )
        live = self._flat_states(states)
        enc = _Encoder(allow_pickle=True)  # only the tensors of the live structure are used
        enc.encode(live, "")
        want: dict[str, torch.Tensor] = {}
        missing = []
        for name, t in enc.tensors.items():
            if name in stored:
                want[name] = t
            elif name.startswith(OPTIMIZER + ".state."):
                continue  # state the checkpoint does not name: dropped below
            else:
                missing.append(name)
        if missing:
            raise CheckpointError(
                f"{path}: the checkpoint has no tensor {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        keys = [k for k in live if k not in enc.tensors] if isinstance(live, dict) else []
        if not isinstance(skeleton, dict):
            raise CheckpointError(f"{path}: the stored state is not an object")
        absent = [k for k in keys if k not in skeleton and live[k] is not None and not _holds_nothing(live[k])]
        if absent:
            raise CheckpointError(f"{path}: the checkpoint holds no state {absent[0]!r}")
        # Decode before anything is read, so that a refused value changes nothing.
        placeholders: dict[str, Any] = {name: _Ref(name) for name in want}
        try:
            decoded = _decode(
                {k: skeleton[k] for k in keys if k in skeleton}, placeholders, self.allow_pickle, path
            )
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, binascii.Error) as e:
            raise CheckpointError(f"{path}: the stored non-tensor state is malformed: {e!r}") from e
        if changed and isinstance(decoded.get(OPTIMIZER), dict) and isinstance(live.get(OPTIMIZER), dict):
            # An allowed change of class: the live groups' settings the checkpoint lacks.
            ours = decoded[OPTIMIZER]
            for k, v in live[OPTIMIZER].items():
                if k.startswith("param_groups.") and k not in ours and not isinstance(v, torch.Tensor):
                    ours[k] = v
        reader = Reader(path)
        try:
            dcp.load(want, storage_reader=reader, no_dist=not _dist())
        except CheckpointException as e:
            raise _unwrap(e) from e
        values = _substitute(decoded, want)
        for k in keys:
            if k not in values:
                continue
            comp = states[k]
            if isinstance(comp, Stateful):
                comp.load_state_dict(values[k])
            else:  # a plain value: replaced in the manager's states (`states` is a filtered copy)
                self.states[k] = values[k]
        if MODEL in states:
            model_sd = {k: want[k] for k in live if k in enc.tensors and k in want}
            states[MODEL].load_state_dict(model_sd)

