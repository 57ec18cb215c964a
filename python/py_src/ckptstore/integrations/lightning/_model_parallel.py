"""``ModelParallelStrategy`` (FSDP2 / DTensor): Lightning's strategy with its distributed
checkpoints stored through ckptstore's DCP ``Writer`` / ``Reader`` (the package docs)."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException

from ... import open as _open
from ...errors import CheckpointError, InvalidArgumentError, PickleNotAllowedError
from ...torch.internal import optimizer_class
from .._common import check_optimizer_class, dcp_error, name_error, with_live_hyper
from .._tree import has_pickle
from ._base import _is_remote, _local, _location
from ._io import CheckpointIO
from ._rest import _DCP_EXTRA, _DCP_TREE_VERSION, DCP_TREE_KEY, build_rest, split_rest
from ._tiered import TIERED_KEY, Tiered


def _split_tensors(d: Any) -> tuple:
    """A (nested) state dict as ``(tensors, rest)``: the same nesting of dicts, tensor leaves
    in the first, every other leaf (and empty dicts) in the second."""
    tensors: Dict[Any, Any] = {}
    rest: Dict[Any, Any] = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif isinstance(v, dict):
            t, r = _split_tensors(v)
            if t:
                tensors[k] = t
            if r or not t:
                rest[k] = r
        else:
            rest[k] = v
    return tensors, rest


def _merge_tensors(tensors: Dict[Any, Any], rest: Dict[Any, Any]) -> Dict[Any, Any]:
    """The inverse of :func:`_split_tensors`."""
    out: Dict[Any, Any] = dict(rest)
    for k, v in tensors.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_tensors(v, out[k])
        else:
            out[k] = v
    return out


def _dcp_items(meta: Dict[str, Any]) -> set:
    """The DCP names (``optimizer_0.state.net.0.weight.exp_avg``) a checkpoint holds."""
    from ...torch.dcp import META_KEY

    m = meta.get(META_KEY)
    items = m.get("items") if isinstance(m, dict) else None
    return set(items) if isinstance(items, dict) else set()


def _only_stored(tensors: Dict[Any, Any], prefix: str, stored: set) -> Dict[Any, Any]:
    """The nested tensors whose DCP names (``prefix.key.key...``) are in ``stored``."""
    out: Dict[Any, Any] = {}
    for k, v in tensors.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict):
            out[k] = _only_stored(v, name, stored)
        elif name in stored:
            out[k] = v
    return out


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel over DTensor) with its
    distributed checkpoints stored by ckptstore through DCP (see the package docs).

    Takes the arguments of ``lightning.pytorch.strategies.ModelParallelStrategy`` plus
    ``allow_pickle`` and ``max_shard_size`` (per rank). ``save_distributed_checkpoint``
    must stay ``True`` (for a full checkpoint on rank 0 use the stock strategy with
    :class:`CheckpointIO`). Unless a ``CheckpointIO`` plugin is given, this strategy's
    checkpoint IO is a :class:`CheckpointIO` (``ModelCheckpoint`` removes superseded
    checkpoints through it).

    ``save_checkpoint``: every rank writes its shards with :class:`ckptstore.torch.dcp.Writer`
    and rank 0 commits them with the rest of the dict (loops, callbacks, schedulers,
    hyperparameters: JSON in the manifest, its tensors as replicated DCP tensors) in one
    commit. ``load_checkpoint``: one ``dcp.load`` with :class:`ckptstore.torch.dcp.Reader`
    for the model, every optimizer and those tensors, so that the CRC of every piece read is
    checked on every rank, and the ranks agree, before any destination is written; then the
    optimizer state is applied with ``set_optimizer_state_dict`` (``load_state_dict``:
    replaced whole). Resharding to another world size is DCP's.

    DCP is given tensors only: every other leaf (the optimizer's ``param_groups``,
    non-tensor model state), which DCP would ``torch.save`` into bytes items and unpickle on
    load, is stored as JSON with the rest of the dict, so the checkpoint holds no pickle
    unless ``allow_pickle`` let a value through. As with the stock strategy, the load first
    builds the live optimizer's state dict with ``get_optimizer_state_dict``, which gives an
    optimizer that has no state yet zero-filled state (a step with ``lr=0``): a failed
    resume leaves the model as it was and such an optimizer with that initial state.

    The class of each optimizer is recorded at save; ``load_checkpoint`` refuses a checkpoint
    saved by another class (:class:`ckptstore.IncompatibleStateError` naming both) before it
    builds any state dict or reads anything, so the model and the optimizers are left exactly
    as they were, unless ``allow_optimizer_change=True`` (package docs: what a change loads).

    ``tiered``: the tiered mode, a dict of the arguments of
    :class:`ckptstore.torch.distributed.CheckpointManager` (``local``, ``persistent``,
    ``persist_every``, ``replicas``, ``keep_last``): each save goes through that manager, keyed
    by the global step, and the path Lightning names gets a pointer; resuming from a pointer
    restores the newest step the tiers hold (the package docs).
    """

    def __init__(
        self,
        *args: Any,
        allow_pickle: bool = False,
        max_shard_size: Optional[int] = None,
        allow_optimizer_change: bool = False,
        tiered: Optional[Mapping[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise InvalidArgumentError(
                "ckptstore's ModelParallelStrategy saves distributed checkpoints only: for a "
                "full checkpoint use lightning's ModelParallelStrategy(save_distributed_checkpoint="
                "False) with plugins=[ckptstore.integrations.lightning.CheckpointIO()]"
            )
        if tiered is not None and (allow_optimizer_change or max_shard_size is not None):
            raise InvalidArgumentError(
                "allow_optimizer_change and max_shard_size are not supported in the tiered mode (tiered=)"
            )
        super().__init__(*args, **kwargs)
        self._tiered = None if tiered is None else Tiered(tiered)
        self.allow_pickle = bool(allow_pickle)
        self.max_shard_size = max_shard_size
        self.allow_optimizer_change = bool(allow_optimizer_change)
        if self._checkpoint_io is None:
            self._checkpoint_io = CheckpointIO(allow_pickle=allow_pickle)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self._tiered is not None:
            self._tiered.in_fit = True

    def teardown(self) -> None:
        try:
            if self._tiered is not None:
                self._tiered.close()  # waits for the tiered saves in flight
        finally:
            super().teardown()

    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        from ...torch.dcp import Writer

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported"
            )
        location = _location(self.broadcast(_location(filepath)))
        if not _is_remote(location) and os.path.isfile(_local(location)):
            raise InvalidArgumentError(
                f"{location!r} is a file: a checkpoint of another format is in the way"
            )
        if self._tiered is not None:
            self._tiered.save(self, checkpoint, location)
            return
        rest = dict(checkpoint)
        # DCP gets the tensors only: it would pickle every other leaf (torch.save into a
        # bytes item, loaded with torch.load(weights_only=False)). The rest (optimizer
        # param_groups, non-tensor model state) goes into the JSON tree with the remainder
        # of Lightning's dict.
        state: Dict[str, Any] = {}
        state["state_dict"], model_rest = _split_tensors(rest.pop("state_dict"))
        optim_rests = []
        for i, osd in enumerate(rest.pop("optimizer_states", [])):
            state[f"optimizer_{i}"], r = _split_tensors(osd)
            optim_rests.append(r)
        whole = {"rest": rest, "state_dict": model_rest, "optimizer_states": optim_rests}
        tree, tensors = split_rest(whole, self.allow_pickle)
        tree["optimizer_classes"] = [optimizer_class(o) for o in self.optimizers]
        if tensors:
            state[_DCP_EXTRA] = tensors
        writer = Writer(location, max_shard_size=self.max_shard_size, metadata={DCP_TREE_KEY: tree})
        dcp.save(state, storage_writer=writer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from ...torch.dcp import Reader

        location = _location(self.broadcast(_location(checkpoint_path)))
        with _open(location) as ck:
            meta = ck.metadata
            cid = ck.checkpoint_id
        if TIERED_KEY in meta:
            if self._tiered is None:
                raise InvalidArgumentError(
                    f"{location!r} points to a step of tiered checkpoints: resume it with the "
                    "strategy's tiered= arguments of the run that saved it"
                )
            allow = self.allow_pickle and weights_only is not True
            return self._tiered.load(self, location, meta[TIERED_KEY], allow)
        tree = meta.get(DCP_TREE_KEY)
        if not isinstance(tree, dict) or tree.get("version") != _DCP_TREE_VERSION:
            raise InvalidArgumentError(
                f"{location!r} is not a checkpoint of ckptstore's ModelParallelStrategy (no "
                f"{DCP_TREE_KEY!r} metadata of version {_DCP_TREE_VERSION})"
            )
        allow = self.allow_pickle and weights_only is not True
        if not allow and has_pickle(tree["tree"]):
            raise PickleNotAllowedError(
                f"{location!r} holds a pickled value; pass allow_pickle=True to the strategy to "
                "load it, only if you trust the checkpoint as much as code you run"
            )
        assert self.model is not None and self.lightning_module is not None
        # The optimizer classes first: before any state dict is built or anything is read.
        saved_classes = tree.get("optimizer_classes")
        if not isinstance(saved_classes, list):
            saved_classes = []
        changed = []
        for i, optim in enumerate(self.optimizers):
            saved = saved_classes[i] if i < len(saved_classes) else None
            where = f"{location} (optimizer {i})"
            changed.append(check_optimizer_class(optimizer_class(optim), saved, self.allow_optimizer_change, where))
        module = self.model
        state: Dict[str, Any] = {"state_dict": _split_tensors(get_model_state_dict(module))[0]}
        live_groups: Dict[int, Any] = {}
        for i, optim in enumerate(self.optimizers):
            osd = get_optimizer_state_dict(module, optim)
            tensors, rest = _split_tensors(osd)
            if changed[i]:
                # Another class: read the live optimizer's state names the checkpoint has.
                stored = _dcp_items(meta)
                tensors = _only_stored(tensors, f"optimizer_{i}", stored)
                live_groups[i] = rest.get("param_groups") or []
            state[f"optimizer_{i}"] = tensors
        fresh: Dict[str, Any] = {}
        for name, d in (tree.get("tensors") or {}).items():
            fresh[name] = torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
        if fresh:
            state[_DCP_EXTRA] = fresh
        # One load: every CRC checked on every rank, and agreed, before anything is written.
        try:
            dcp.load(state, storage_reader=Reader(location, expect_checkpoint_id=cid))
        except CheckpointError as e:
            name_error(e, location)
            raise
        except CheckpointException as e:
            # DCP gathers the ranks' errors: raise ckptstore's own (this rank's first).
            err = dcp_error(e, self.global_rank)
            if err is None:
                raise
            raise name_error(err, location) from e
        whole = build_rest(tree, fresh, location, allow)
        module.load_state_dict(
            _merge_tensors(state["state_dict"], whole["state_dict"]),
            strict=self.lightning_module.strict_loading,
        )
        for i, optim in enumerate(self.optimizers):
            if i >= len(whole["optimizer_states"]):
                raise InvalidArgumentError(
                    f"{location!r} holds {len(whole['optimizer_states'])} optimizer state(s), "
                    f"the strategy has {len(self.optimizers)} optimizers"
                )
            saved_rest = whole["optimizer_states"][i]
            if i in live_groups and isinstance(saved_rest, dict):
                saved_rest = dict(saved_rest)
                saved_rest["param_groups"] = with_live_hyper(
                    live_groups[i], saved_rest.get("param_groups") or []
                )
            set_optimizer_state_dict(
                module,
                optim,
                optim_state_dict=_merge_tensors(state[f"optimizer_{i}"], saved_rest),
                options=StateDictOptions(cpu_offload=True),
            )
        return whole["rest"]

