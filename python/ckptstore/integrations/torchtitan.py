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

Test seam: ``CKPTSTORE_TORCHTITAN_KILL="<point>[:<step>]"`` SIGKILLs the process at
``point`` (``commit``: the coordinator, every rank's part written, before the commit;
``write``: a rank, before writing its part) of the save of ``step`` (any step if omitted).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
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

from .. import CheckpointManager as _EngineManager, _ckptstore, atomic
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumError,
    IncompatibleStateError,
    InvalidArgumentError,
    PickleNotAllowedError,
)
from ..torch._state import _check_class, _optimizer_class
from ..torch.dcp import META_KEY, Reader, Writer

__all__ = ["CheckpointManager", "PickleNotAllowedError", "STATE_KEY", "step_name"]

#: Manifest metadata key of the non-tensor state (JSON).
STATE_KEY = "ckptstore.torchtitan"
_VERSION = 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_KILL_ENV = "CKPTSTORE_TORCHTITAN_KILL"
#: A step directory of TorchTitan's own manager (``step-<N>``, no padding) or of ours.
_STEP_RE = re.compile(r"^step-(\d+)$")
#: What retention renames a stock step directory to before deleting it.

logger = logging.getLogger(__name__)


def step_name(step: int) -> str:
    """The directory name of ``step`` (the engine manager's ``step-<8+ digits>``)."""
    return f"step-{int(step):08d}"


def _join(base: str, name: str) -> str:
    if not base:
        return name
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def _seam(point: str, step: Optional[int]) -> None:
    """The test seam: SIGKILL this process at ``point`` when the environment asks."""
    spec = os.environ.get(_KILL_ENV)
    if not spec:
        return
    want, _, at = spec.partition(":")
    if want == point and (not at or step is None or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- non-tensor state as JSON ---------------------------------------------------------------


class _Encoder:
    """Walks a state dict: tensors out into ``tensors`` (flat DCP names), the rest into a
    JSON skeleton that names them."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if path in self.tensors:
                raise InvalidArgumentError(f"two state entries flatten to the same name {path!r}")
            self.tensors[path] = v
            return {"$t": path}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v if _I64_MIN <= v <= _I64_MAX else {"$int": str(v)}
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$tuple": [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            sub = (lambda k: f"{path}.{k}") if path else str
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self.encode(x, sub(k)) for k, x in v.items()}
            return {"$dict": [[self.encode(k, sub(k)), self.encode(x, sub(k))] for k, x in v.items()]}
        if isinstance(v, np.generic) and not isinstance(v, (np.void, np.object_)):
            return self.encode(v.item(), path)
        if self.allow_pickle:
            try:
                raw = pickle.dumps(v)
            except Exception as e:  # noqa: BLE001 - pickle raises many kinds
                raise InvalidArgumentError(f"state entry {path!r}: cannot pickle it: {e}") from e
            return {"$pickle": base64.b64encode(raw).decode("ascii")}
        raise PickleNotAllowedError(
            f"state entry {path!r}: a value of type {type(v).__name__} is not JSON, bytes or "
            "a tensor; storing it needs pickle (allow_pickle=True in the checkpoint config)"
        )


_DROP = object()


def _decode(v: Any, path: str, tensors: dict[str, Any], allow_pickle: bool, where: str) -> Any:
    """The value of skeleton ``v``; tensor references become ``tensors[name]`` (or
    ``_DROP`` when the load did not ask for that tensor)."""
    if isinstance(v, list):
        out = [_decode(x, path, tensors, allow_pickle, where) for x in v]
        return [x for x in out if x is not _DROP]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        tag, x = next(iter(v.items()))
        if tag == "$t":
            return tensors.get(x, _DROP)
        if tag == "$int":
            return int(x)
        if tag == "$float":
            return float(x)
        if tag == "$bytes":
            return base64.b64decode(x)
        if tag == "$tuple":
            return tuple(_decode(y, path, tensors, allow_pickle, where) for y in x)
        if tag == "$dict":
            out = {}
            for k, y in x:
                val = _decode(y, path, tensors, allow_pickle, where)
                if val is not _DROP:
                    out[_decode(k, path, tensors, allow_pickle, where)] = val
            return out
        if tag == "$pickle":
            if not allow_pickle:
                raise PickleNotAllowedError(
                    f"{where}: state entry {path!r} is pickled; loading it runs code chosen by "
                    "the checkpoint's writer: set allow_pickle=True only for checkpoints you trust"
                )
            return pickle.loads(base64.b64decode(x))
    out = {}
    for k, y in v.items():
        if k.startswith("$"):
            raise CheckpointError(f"{where}: unknown tag {k!r} in the stored state at {path!r}")
        val = _decode(y, f"{path}.{k}" if path else k, tensors, allow_pickle, where)
        if val is not _DROP:
            out[k] = val
    return out


def _merge(a: Any, b: Any) -> Any:
    """Rank skeletons merged key by key (plain objects only); ``a`` (lower rank) wins."""
    if (
        isinstance(a, dict)
        and isinstance(b, dict)
        and not any(k.startswith("$") for k in a)
        and not any(k.startswith("$") for k in b)
    ):
        out = dict(a)
        for k, y in b.items():
            out[k] = _merge(a[k], y) if k in a else y
        return out
    return a


def _unwrap(e: BaseException) -> BaseException:
    """The ckptstore error inside DCP's ``CheckpointException`` (a checksum error first:
    other ranks report only that a peer's checks failed)."""
    if not isinstance(e, CheckpointException):
        return e
    found = [exc for exc, _ in e.failures.values()]
    for cls in (ChecksumError, CheckpointError):
        for exc in found:
            if isinstance(exc, cls):
                return exc
    return found[0] if found else e


# ---- TorchTitan's own checkpoints (the migration path) -----------------------------------------

#: Globals a DCP ``.metadata`` file may name: the classes of DCP's metadata modules (defined
#: there), the torch dtypes, and these.
_META_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_META_GLOBALS = {
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
_MANIFEST = "ckpt-manifest.json"
_DCP_METADATA = ".metadata"
_HF_INDEX = "model.safetensors.index.json"


def _pickle_refused(where: str, what: str) -> PickleNotAllowedError:
    return PickleNotAllowedError(
        f"{where}: {what}; reading it needs pickle beyond torch.load(weights_only=True): set "
        "allow_pickle=True in the checkpoint config only for checkpoints you trust (unpickling "
        "runs code chosen by whoever wrote them)"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` (a pickle) read with only the globals DCP metadata is made of."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _META_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module in _META_CLASS_MODULES:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise _pickle_refused(self.where, f"the DCP metadata names {module}.{name}, which DCP metadata is not made of")


class _StockReader(FileSystemReader):
    """DCP's file reader for a step of TorchTitan's own manager; its ``.metadata`` is
    unpickled with :class:`_MetadataUnpickler` (plain pickle with ``allow_pickle``)."""

    def __init__(self, path: str, allow_pickle: bool) -> None:
        super().__init__(path)
        self._dir = str(path)
        self._allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = os.path.join(self._dir, _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}")
        try:
            with open(path, "rb") as f:
                md = pickle.load(f) if self._allow_pickle else _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises many kinds
            raise CheckpointError(f"{path}: cannot read the DCP metadata: {e!r}") from e
        if not hasattr(md, "state_dict_metadata") or not isinstance(md.state_dict_metadata, dict):
            raise CheckpointError(f"{path}: not DCP metadata ({type(md).__name__})")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _StockPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with
    ``torch.load(weights_only=True)`` (DCP's own uses ``weights_only=False``); a value that
    needs more is refused unless ``allow_pickle``."""

    def __init__(self, allow_pickle: bool, where: str) -> None:
        super().__init__()
        self._allow_pickle = allow_pickle
        self._where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._allow_pickle:
            return super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _pickle_refused(self._where, f"state entry {fqn!r} is not plain data ({e})") from e
        except Exception as e:  # noqa: BLE001 - damaged bytes raise many kinds
            raise CheckpointError(f"{self._where}: state entry {fqn!r} cannot be read: {e!r}") from e
        # The planner's own placement, fed the value just read (re-serialized: plain data).
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return super().load_bytes(read_item, buf)


def _is_stock_step(path: str) -> bool:
    """A step directory of TorchTitan's own manager: DCP's ``.metadata`` (or a Hugging Face
    export's index) and no ckptstore manifest."""
    if os.path.isfile(os.path.join(path, _MANIFEST)):
        return False
    return os.path.isfile(os.path.join(path, _DCP_METADATA)) or os.path.isfile(os.path.join(path, _HF_INDEX))


# ---- the optimizer class ----------------------------------------------------------------------


def _optimizers_class(optimizers: Any) -> Optional[str]:
    """The class recorded for TorchTitan's optimizers: the class name of each optimizer of an
    ``OptimizersContainer`` (or of one plain optimizer), several as their sorted names joined
    by ``+``; ``None`` when there is none."""
    if optimizers is None:
        return None
    inner = getattr(optimizers, "optimizers", None)
    opts = list(inner) if isinstance(inner, (list, tuple)) else [optimizers]
    names = sorted({_optimizer_class(o) for o in opts})
    return "+".join(names) if names else None


# ---- the writer with the test seam ----------------------------------------------------------


class _StepWriter(Writer):
    def __init__(self, path: str, step: int, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.step = step

    def write_data(self, plan: Any, planner: Any) -> Any:
        _seam("write", self.step)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        _seam("commit", self.step)
        super().finish(metadata, results)


# ---- step listing and retention -------------------------------------------------------------


class _Steps:
    """The committed steps under a folder and retention, by the engine's managers."""

    def __init__(self, folder: str, keep_latest_k: int) -> None:
        self.folder = folder
        self.keep = keep_latest_k if keep_latest_k > 0 else None
        self.remote = "://" in folder
        self._local: Optional[_EngineManager] = None

    def _mgr(self) -> _EngineManager:
        if self._local is None:
            self._local = _EngineManager(self.folder, keep_last=self.keep)
        return self._local

    def path(self, step: int) -> str:
        return _join(self.folder, step_name(step))

    def steps(self) -> list[int]:
        if not self.remote and not os.path.isdir(self.folder):
            return []
        return list(self._mgr().steps())

    def latest(self) -> Optional[int]:
        s = self.steps()
        return s[-1] if s else None

    def _gc_local(self) -> None:
        """Keep the newest ``keep`` steps of both kinds by step (a ckptstore step wins a tie,
        and the newest ckptstore step is always kept): stock steps beyond them are renamed
        out of the ``step-<N>`` names, then deleted; ckptstore steps go through the engine's
        manager (which never deletes a step a reader holds)."""
        assert self.keep is not None
        atomic.sweep_leftovers(self.folder)  # what a removal cut short left
        stock = self.stock_steps()
        if not stock:
            self._mgr().gc()
            return
        ours = self.steps()
        every = sorted([(s, 0) for s in stock] + [(s, 1) for s in ours])
        kept = every[-self.keep:]
        for s, kind in every[: -self.keep]:
            if kind == 0:
                atomic.remove_dir(stock[s])  # whole or not at all
        if ours:
            keep_ours = max(1, sum(1 for _, kind in kept if kind == 1))
            _EngineManager(self.folder, keep_last=keep_ours).gc()

    def stock_steps(self) -> dict[int, str]:
        """The steps TorchTitan's own manager wrote under a local folder (``step-<N>``
        holding DCP's ``.metadata`` or a Hugging Face export), by step."""
        if self.remote or not os.path.isdir(self.folder):
            return {}
        out: dict[int, str] = {}
        for name in sorted(os.listdir(self.folder)):
            m = _STEP_RE.match(name)
            path = os.path.join(self.folder, name)
            if m and os.path.isdir(path) and _is_stock_step(path):
                out.setdefault(int(m.group(1)), path)
        return out

    def gc(self) -> None:
        if self.keep is None:
            return
        if not self.remote:
            self._gc_local()
            return
        self._mgr().gc()


# ---- the manager ----------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


class CheckpointManager(BaseCheckpointManager):
    """TorchTitan's checkpoint manager on ckptstore (see the module's documentation).

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

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {mode}")
            self.async_mode = mode  # type: ignore[assignment]
            if self.max_shard_size is not None and self.max_shard_size <= 0:
                raise ValueError("max_shard_size must be positive")

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
        self._steps = _Steps(self.folder, config.keep_latest_k)
        self.pg: Any = None
        if self.async_mode != "disabled" and _dist():
            self.pg = dist.new_group(backend="gloo")
        self.stager: Optional[DefaultStager] = None
        self.staging_future: Optional[Future] = None
        self._pending_step: Optional[int] = None
        #: The step a completed ``load`` restored (``None``: none yet / a fresh start).
        self.loaded_step: Optional[int] = None

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
            self._save_model_only(curr_step)
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

    # -- load ----------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
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
        cfg = self.config
        if load_step != -1 and load_step not in steps:
            path = stock[load_step]
            self._load_stock(path, model_only=load_step == 0)
            self.loaded_step = load_step
            logger.warning(
                "ckptstore: resumed step %d from %s, a checkpoint of TorchTitan's own manager "
                "(DCP format, loaded as TorchTitan loads it: no CRC check); the next saves are "
                "ckptstore checkpoints (%s)",
                load_step, path, _join(self.folder, "step-<8 digits>"),
            )
            return True
        if load_step == -1:
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
        self._load_path(self.step_path(load_step), model_only=load_step == 0)
        self.loaded_step = load_step
        return True

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

            absent = [k for k in parts if not held(k)]
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
            try:
                changed = _check_class(
                    _optimizers_class(states[OPTIMIZER]), saved.get("optimizer_class"),
                    self.allow_optimizer_change,
                )
            except IncompatibleStateError as e:
                e.message = f"{path}: {e.message}"
                e.args = (e.message, *e.args[1:])
                raise
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
        absent = [k for k in keys if k not in skeleton and live[k] is not None]
        if absent:
            raise CheckpointError(f"{path}: the checkpoint holds no state {absent[0]!r}")
        # Decode before anything is read, so that a refused value changes nothing.
        placeholders: dict[str, Any] = {name: _Ref(name) for name in want}
        try:
            decoded = _decode(
                {k: skeleton[k] for k in keys if k in skeleton}, "", placeholders, self.allow_pickle, path
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
            else:
                states[k] = values[k]
        if MODEL in states:
            model_sd = {k: want[k] for k in live if k in enc.tensors and k in want}
            states[MODEL].load_state_dict(model_sd)


def _substitute(v: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Placeholders (``_Ref``) -> the loaded tensors."""
    if isinstance(v, _Ref):
        return tensors[v.name]
    if isinstance(v, dict):
        return {k: _substitute(x, tensors) for k, x in v.items()}
    if isinstance(v, list):
        return [_substitute(x, tensors) for x in v]
    if isinstance(v, tuple):
        return tuple(_substitute(x, tensors) for x in v)
    return v


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
