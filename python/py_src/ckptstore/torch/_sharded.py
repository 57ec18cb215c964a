"""The sharded save and load of :mod:`ckptstore.torch.distributed` (its implementation,
which the tiered manager builds on too): the DCP state dict and metadata of a model and
optimizer, the checks against a checkpoint's metadata, the planned read into fresh tensors,
the moments' layout by the engine, and the ranks' agreement at each step."""

from __future__ import annotations

import functools
import gc
import json
import os
import weakref
from typing import Any, Callable, Mapping, Optional, TypeVar, cast

from .. import _ckptstore
from .._types import F16Scaled
from ..errors import (
    CheckpointError,
    IncompatibleStateError,
    InvalidArgumentError,
    OptimizerStateError,
    UnsupportedFormatError,
)
from ._dtypes import _from_array, _to_numpy, _torch, _wire_of
from ._fanout import read_once
from ._state import (
    _changed_class,
    _check_fit,
    _encode_groups,
    _group_hyper,
    _optimizer_class,
    _param_names,
)
from ._values import _decode, _encode
from .dcp import META_KEY as _DCP_KEY
from .dcp import Reader, Writer

__all__ = ["save", "load", "META_KEY"]

#: Manifest metadata key under which :func:`save` records what it stored.
META_KEY = "ckptstore.torch.distributed"
#: 2: optimizer state stored as ``optim/<param>/<state>`` (format-spec/optimizer.md, one
#: stored name); 1 (still read): ``optim.<param>.<state>``, DCP's flattening of a nested dict.
_META_VERSION = 2


def _state_key(version: int, param: str, state: str) -> str:
    """The stored name of ``param``'s optimizer state ``state`` in a checkpoint of metadata
    ``version``: the package's one name from version 2 on."""
    return f"optim/{param}/{state}" if version >= 2 else f"optim.{param}.{state}"


def _dtensor_type() -> Any:
    """torch's DTensor class (its public module, or the private one of older torch)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    return DTensor


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor_type())


def save(
    path: "str | os.PathLike[str]",
    model: Any,
    optimizer: Any = None,
    extra: Optional[Mapping[str, Any]] = None,
    *,
    max_shard_size: Optional[int] = None,
    process_group: Any = None,
) -> Optional[dict]:
    """Save ``model`` (FSDP2, DTensor-sharded or plain), ``optimizer`` and ``extra`` as one
    ckptstore checkpoint in the directory ``path``; call it on every rank. Committed
    atomically and durably by the coordinator: until it returns, the previous checkpoint in
    ``path`` stays the committed one.

    ``extra``: tensors (stored as tensors, from one rank) and JSON values (numbers, strings,
    lists, dicts, tuples), returned by :func:`load`. Returns the commit info on the
    coordinator, ``None`` on the other ranks.
    """
    import torch.distributed.checkpoint as dcp

    sd, meta = state_and_meta(model, optimizer, extra)
    w = Writer(path, max_shard_size=max_shard_size, metadata={META_KEY: meta})
    dcp.save(sd, storage_writer=w, process_group=process_group)
    return w.commit_info


#: Models whose ``get_model_state_dict`` was found to be their ``state_dict()`` as it is:
#: model -> the keys it had then (see :func:`_model_state_dict`).
_PLAIN_STATE_DICT: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _model_state_dict(model: Any) -> dict:
    """``get_model_state_dict(model)``, at the cost of ``model.state_dict()`` where that is
    what it returns. torch's function also maps wrapper keys (DDP's ``module.``,
    ``torch.compile``'s ``_orig_mod.``) to parameter names and, for FSDP1 modules, picks the
    sharded state dict; for a model of neither (plain, FSDP2, tensor parallel) it returns
    ``state_dict()`` unchanged, after building name maps of every parameter: 30 us a
    parameter, two thirds of a save's blocking overhead at 500 parameters. So the first call
    takes both and compares them (the same keys in the same order, each value the same
    tensor: type, shape, dtype, storage); while they agree and the keys stay those, later
    calls take ``state_dict()`` alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keys = _PLAIN_STATE_DICT.get(model)
    if keys is not None:
        raw = model.state_dict()
        if tuple(raw) == keys:
            return raw
    msd = get_model_state_dict(model)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        plain = not FSDP1.fsdp_modules(model)
    except ImportError:  # pragma: no cover - torch without FSDP1
        plain = True
    if plain:
        raw = model.state_dict()
        plain = list(raw) == list(msd) and all(_same_tensor(raw[k], msd[k]) for k in raw)
    try:
        if plain:
            _PLAIN_STATE_DICT[model] = tuple(msd)
        else:
            _PLAIN_STATE_DICT.pop(model, None)
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        pass
    return msd


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are views of the same bytes alike (a DTensor: its local
    shard, with the same placements); values that are not tensors must be equal objects."""
    torch = _torch()
    if type(a) is not type(b):
        return False
    if _is_dtensor(a):
        return a.placements == b.placements and _same_tensor(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                and a.device == b.device and a.data_ptr() == b.data_ptr())
    return a is b


def state_and_meta(model: Any, optimizer: Any, extra: Optional[Mapping[str, Any]]) -> tuple[dict, dict]:
    """The DCP state dict of ``model``, ``optimizer`` and ``extra`` and the manifest metadata
    that :func:`load` reads back: what :func:`save` writes, and what the tiered manager
    (``ckptstore.torch.tiered``) writes into a host's tier."""
    torch = _torch()

    msd = _model_state_dict(model)
    meta: dict[str, Any] = {
        "version": _META_VERSION,
        "model": list(msd),
        "extra": {},
        "extra_tensors": [],
    }
    sd: dict[str, Any] = {"model": dict(msd)}
    if optimizer is not None:
        names = _param_names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        osd = optimizer.state_dict()
        groups = _encode_groups(osd["param_groups"], names)
        state: dict[str, dict[str, Any]] = {}
        keys: dict[str, list[str]] = {}
        values: dict[str, dict[str, Any]] = {}
        for i, st in osd["state"].items():
            n = names[i]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    state.setdefault(n, {})[k] = v
                    keys.setdefault(n, []).append(k)
                elif v is not None:
                    values.setdefault(n, {})[k] = _encode(v, f"parameter {n!r}, state {k!r}")
        for n, st in state.items():
            for k, v in st.items():
                sd[_state_key(_META_VERSION, n, k)] = v
        meta["optimizer"] = {
            "class": _optimizer_class(optimizer),
            "groups": groups,
            "param_shapes": {n: list(p.shape) for n, p in zip(names, params)},
            "state_keys": keys,
            "values": values,
        }
    xt = {}
    for k, v in (extra or {}).items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"extra keys must be strings, got {k!r}")
        if isinstance(v, torch.Tensor):
            xt[k] = v
            meta["extra_tensors"].append(k)
        else:
            meta["extra"][k] = _encode(v, f"extra {k!r}")
    if xt:
        sd["extra"] = xt
    return sd, meta


def _broadcast_meta(path: Any, process_group: Any) -> tuple[dict, str]:
    """The checkpoint's metadata and id, read by the first rank and sent to all (so every
    rank checks against, and loads, the same checkpoint)."""
    import torch.distributed as dist

    obj: list[Any] = [None]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(process_group) == 0:
        try:
            # The manifest only (a remote checkpoint is not downloaded here).
            rr = _ckptstore.Checkpoint(os.fspath(path), lazy=True)
            obj[0] = (json.loads(rr.metadata_json()), rr.checkpoint_id, None)
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
            obj[0] = (None, None, f"{type(e).__name__}: {e}")
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(obj, src=src, group=process_group)
    meta, cid, err = obj[0]
    if err is not None:
        raise IncompatibleStateError(f"cannot open the checkpoint {os.fspath(path)!r}: {err}")
    return meta, cid


def _target(template: Any, size: list[int], dtype: Any) -> Any:
    """A fresh tensor to load a stored tensor of ``size`` into: laid out like ``template``
    (same DTensor placements) when the global shapes agree, else a plain tensor."""
    torch = _torch()
    if template is not None and list(template.shape) == size:
        return torch.empty_like(template, dtype=dtype)
    return torch.empty(size, dtype=dtype)


_F = TypeVar("_F", bound=Callable[..., Any])


def _gc_paused(fn: _F) -> _F:
    """``fn`` with Python's cyclic garbage collector paused while it runs (restored after;
    objects are still freed when their last reference goes). A restore allocates tens of
    thousands of small objects (plans, read items) in a process whose heap holds torch's:
    they set off a full collection, 0.15 s on the heap of a bare torch import (measured on
    a one-rank restore of 256 MiB that took 0.31 s), more on a training process's."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return cast(_F, paused)


@_gc_paused
def load(
    path: "str | os.PathLike[str]",
    model: Any,
    optimizer: Any = None,
    *,
    strict: bool = True,
    layout: Any = None,
    process_group: Any = None,
    allow_optimizer_change: bool = False,
    check_extra: Optional[Callable[[dict], Any]] = None,
) -> dict:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint :func:`save` wrote
    at ``path``, on any world size; call it on every rank. Returns the ``extra`` dict.

    Checked before anything changes, identically on every rank: every model state-dict
    entry is in the checkpoint with the same global shape (with ``strict``, the checkpoint
    holds no model entry the model lacks); the optimizer fits the checkpoint's by the rule
    of :func:`ckptstore.check_optimizer_fit`, as in :func:`ckptstore.torch.load`: the same
    optimizer class as the one saved, as many parameter groups, each naming the same
    parameters (by model name, in any order) with the same global shapes
    (``allow_optimizer_change=True``: a deliberate change of optimizer class, as in
    :func:`ckptstore.torch.load`); every stored ``extra`` value decodes; then the checkpoint
    is read into fresh tensors, every stored chunk read CRC-checked and the ranks agreeing
    that all reads passed. Any failure raises on every rank (a
    :class:`ckptstore.CheckpointError` naming the ranks that failed) with the model and
    optimizer untouched.

    Applied: the optimizer's complete new state dict through ``load_state_dict``
    (hyperparameters from the checkpoint, state exactly for the parameters the checkpoint
    has state for), and the model through ``set_model_state_dict``. ``layout``: ``None``,
    ``"bf16"`` / ``"f16_scaled"`` for every floating state shaped like its parameter (never
    ``step``), or a dict by state name (``"*"``: the default; ``"as_stored"``/``"f32"``
    leave a state as stored).

    ``check_extra``: called on every rank with the ``extra`` dict once everything is read
    and checked, before the model and the optimizer change (its return value is ignored):
    what it raises on any rank fails the load on every rank with nothing changed, as
    :class:`CheckpointError` naming the ranks. The place to decode or check state of your
    own (a data loader's position, say) that must come back together with the model.
    """
    # 1-3. The checks, the fresh tensors to read into, the extra values decoded (a malformed
    # one fails the load here): identical on every rank, from the first rank's metadata.
    meta_all, cid = _broadcast_meta(path, process_group)
    prep = _prepare(path, meta_all, cid, model, optimizer, strict, allow_optimizer_change)
    # 4a. Each rank plans its reads alone; the ranks agree that every plan was made.
    try:
        _agreed(lambda: _plan(prep, process_group), path, process_group)
    except BaseException:
        if prep.reader is not None:
            prep.reader.reset()
        raise
    return _finish(prep, model, optimizer, strict=strict, layout=layout, process_group=process_group,
                   allow_optimizer_change=allow_optimizer_change, check_extra=check_extra)


class _Prepared:
    """A load up to its reads (:func:`_prepare`, :func:`_plan`): the checkpoint's metadata,
    the fresh tensors to read into, the decoded extra values and, once planned, this rank's
    DCP read plan. The tiered restore plans once, fetches what the plan reads, and loads."""

    def __init__(self, path: Any, cid: Optional[str], sd: dict, om: dict, names: list,
                 tgt_m: dict, tgt_o: dict, tgt_x: dict, extra: dict) -> None:
        self.path, self.cid, self.sd, self.om, self.names = path, cid, sd, om, names
        self.tgt_m, self.tgt_o, self.tgt_x, self.extra = tgt_m, tgt_o, tgt_x, extra
        self.planner: Any = None
        self.plan: Any = None
        self.reader: Any = None  # the Reader planned with, that reads (reset: reopened then)
        self.fan_out = True  # read once, fan out (the same on every rank: it is collective)
        # Set by the tiered restore: the part of the plan already being read (in a thread,
        # while the other bytes arrive); ``result()`` waits for it and raises its error. Its
        # items are no longer in ``plan``.
        self.pre_read: Any = None


def _prepare(path: Any, meta_all: dict, cid: Optional[str], model: Any, optimizer: Any, strict: bool,
             allow_optimizer_change: bool) -> _Prepared:
    """Steps 1-3 of :func:`load` on this rank alone (no collective): the checks against
    the checkpoint's metadata ``meta_all``, the fresh tensors, the extra values decoded."""
    sd, meta, om, names, tgt_m, tgt_o, tgt_x = _targets(
        path, meta_all, model, optimizer, strict, allow_optimizer_change
    )
    extra: dict[str, Any] = {
        k: _decode(v, f"{os.fspath(path)!r}, extra {k!r}") for k, v in (meta.get("extra") or {}).items()
    }
    return _Prepared(path, cid, sd, om, names, tgt_m, tgt_o, tgt_x, extra)


def _plan(prep: _Prepared, pg: Any) -> None:
    """This rank's read plan of ``prep`` (DCP's default load planner, run alone: "the
    default load behavior involved no global coordination", its global plan is the local
    plans unchanged and the reader's ``prepare_global_plan`` the identity too; gathering
    every rank's plan on one rank and scattering it back, as ``dcp.load`` does, only costs
    pickles of every read item of every rank, O(world x items) on the coordinator). No
    collective; no tensor data read. The reader planned with stays open for the read
    (:func:`_finish`): its destinations are the fresh tensors, each block checked as it is
    copied; the ranks agree after the read, not inside it (``all_or_nothing=False``)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    coordinator = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(pg) == 0
    reader = Reader(prep.path, process_group=pg, all_or_nothing=False, expect_checkpoint_id=prep.cid,
                    fresh_destinations=True)
    try:
        planner = DefaultLoadPlanner()
        planner.set_up_planner({k: prep.sd[k] for k in sorted(prep.sd)}, None, coordinator)  # dcp.load's key order
        # Only the grid cells this rank's tensors touch (the planner's flattened state dict).
        reader.wanted = _boxes(planner.state_dict)
        md = planner.metadata = reader.read_metadata()
        reader.set_up_storage_reader(md, coordinator)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        prep.plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
        prep.planner, prep.reader = planner, reader
    except BaseException:
        reader.reset()
        raise


def _boxes(sd: dict) -> dict[str, list[Any]]:
    """``{fqn: [(offsets, sizes)]}``: the box of the global tensor that each tensor of the
    flattened state dict ``sd`` holds (a DTensor its local chunks, DCP's own
    ``__create_chunk_list__``; a plain tensor the whole of it)."""
    torch = _torch()
    out: dict[str, list[Any]] = {}
    for fqn, obj in sd.items():
        if hasattr(obj, "__create_chunk_list__"):
            out[fqn] = [([int(o) for o in c.offsets], [int(n) for n in c.sizes]) for c in obj.__create_chunk_list__()]
        elif isinstance(obj, torch.Tensor):
            out[fqn] = [([0] * obj.dim(), [int(n) for n in obj.shape])]
    return out


def _finish(prep: _Prepared, model: Any, optimizer: Any, *, strict: bool, layout: Any, process_group: Any,
            allow_optimizer_change: bool, check_extra: Optional[Callable[[dict], Any]]) -> dict:
    """Steps 4-6 of :func:`load` (every rank, ``prep`` planned on every rank): read into
    the fresh tensors, every block CRC-checked as it is copied and the ranks agreeing that
    every read passed; the layout; ``check_extra``; then apply."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = prep.path
    # 4b. Read. The destinations are fresh tensors, which nothing uses if the load raises:
    # each block is checked as it is copied (one pass); the ranks agree once, below.
    def read() -> None:
        try:
            if prep.pre_read is not None:  # its error is this rank's error, agreed below
                prep.pre_read.result()
            if prep.fan_out:  # each chunk several ranks need read once, sent to the others
                read_once(prep, process_group)
            else:  # (a tiered restore whose bytes came from the hosts' tiers: on every rank)
                prep.reader.read_data(prep.plan, prep.planner).wait()
        finally:
            prep.reader.reset()

    _agreed(read, path, process_group)

    # 5. Moments in the layout asked for.
    if layout is not None and prep.tgt_o:
        _apply_layout(prep.tgt_o, prep.names, optimizer, layout, path, process_group)

    extra = dict(prep.extra)
    extra.update(prep.tgt_x)
    if check_extra is not None:
        _agreed(lambda: check_extra(extra), path, process_group, refused=_ExtraRefused)

    # 6. Apply: nothing above changed the model or the optimizer.
    if optimizer is not None:
        keep_live = _changed_class(optimizer, prep.om.get("class"), allow_optimizer_change)
        optimizer.load_state_dict(_new_optimizer_state(optimizer, prep.names, prep.om, prep.tgt_o, keep_live))
    set_model_state_dict(model, prep.tgt_m, options=StateDictOptions(strict=strict))
    return extra


def _gather_errors(err: Optional[BaseException], pg: Any) -> dict:
    """Every rank's error, ``{rank: (class name, message)}`` for the ranks that have one
    (one all-gather when torch.distributed is initialized)."""
    import torch.distributed as dist

    mine = None if err is None else (type(err).__name__, str(err))
    got: list = [mine]
    if dist.is_available() and dist.is_initialized():
        got = [None] * dist.get_world_size(pg)
        dist.all_gather_object(got, mine, group=pg)
    return {r: e for r, e in enumerate(got) if e is not None}


class _ExtraRefused(CheckpointError):
    """``check_extra`` raised on some rank (internal: the tiered manager passes such a step
    over without suspecting its copies)."""


def _agreed(fn: Callable[[], Any], path: Any, pg: Any, *,
            refused: Optional[type[CheckpointError]] = None) -> None:
    """``fn()`` on every rank, then the ranks agree (one all-gather of the error texts):
    if it raised on any rank, every rank raises the first failing rank's error class (one
    of :mod:`ckptstore.errors`, else :class:`CheckpointError`) naming the failing ranks,
    with the ``param`` and ``state`` of this rank's own error where it has them;
    ``refused``: a refusal of the caller's (``check_extra`` refusing the extra,
    :class:`_ExtraRefused`; the layout refused, :class:`_LayoutRefused`), raised as that
    class."""
    from .. import errors

    err: Optional[BaseException] = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on below
        err = e
    bad = _gather_errors(err, pg)
    if not bad:
        return
    name, text = next(iter(bad.values()))
    where = f"loading {os.fspath(path)!r}"
    if refused is _ExtraRefused:
        raise _ExtraRefused(f"{where}: check_extra refused its extra on rank(s) {sorted(bad)}: {name}: {text}") from err
    cls = getattr(errors, name, None)
    if refused is not None:
        cls = refused
    elif not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    out = cls(f"{where} failed on rank(s) {sorted(bad)}: {text}")
    for attr in ("param", "state"):
        if hasattr(err, attr):
            setattr(out, attr, getattr(err, attr))
    raise out from err


def _targets(
    path: Any, meta_all: dict, model: Any, optimizer: Any, strict: bool, allow_optimizer_change: bool
) -> tuple:
    """Steps 1-3 of :func:`load`, on this rank alone: the checks against the checkpoint's
    metadata ``meta_all`` and the fresh tensors to read into, as the state dict DCP's load
    planner plans over (``sd``: :func:`_plan`) and its pieces."""
    torch = _torch()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    meta = meta_all.get(META_KEY)
    dmeta = meta_all.get(_DCP_KEY)
    if not isinstance(meta, dict) or not isinstance(dmeta, dict):
        raise IncompatibleStateError(
            f"{os.fspath(path)!r} was not written by ckptstore.torch.distributed.save"
        )
    items = dmeta.get("items") or {}
    version = meta.get("version")
    if not isinstance(version, int) or not 1 <= version <= _META_VERSION:
        raise UnsupportedFormatError(
            f"{os.fspath(path)!r}: its {META_KEY!r} metadata has version {version!r}; this "
            f"ckptstore reads versions 1 to {_META_VERSION}: upgrade ckptstore"
        )

    def stored(fqn: str) -> tuple[list[int], Any]:
        it = items.get(fqn)
        if not isinstance(it, dict) or it.get("kind") != "tensor":
            raise IncompatibleStateError(f"the checkpoint has no tensor {fqn!r}")
        return [int(d) for d in it["size"]], getattr(torch, it["dtype"])

    # 1. The model: names and global shapes.
    msd: dict[str, Any] = get_model_state_dict(model)
    missing = [n for n in msd if f"model.{n}" not in items]
    if missing:
        raise IncompatibleStateError(
            f"cannot restore the model: the checkpoint has no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    if strict:
        unexpected = [n for n in meta.get("model") or [] if n not in msd]
        if unexpected:
            raise IncompatibleStateError(
                f"cannot restore the model: the checkpoint holds {unexpected[0]!r}, which the "
                "model does not have (strict=False to ignore)"
            )
    tgt_m = {}
    for n, t in msd.items():
        size, _ = stored(f"model.{n}")
        if size != list(t.shape):
            raise IncompatibleStateError(
                f"cannot restore the model: {n!r} has shape {tuple(size)} in the checkpoint, "
                f"{tuple(t.shape)} in the model"
            )
        tgt_m[n] = torch.empty_like(t)

    # 2. The optimizer: groups, parameters, shapes; fresh tensors for its state.
    tgt_o: dict[str, dict[str, Any]] = {}
    names: list[str] = []
    om: dict = {}
    if optimizer is not None:
        got = meta.get("optimizer")
        if not isinstance(got, dict):
            raise IncompatibleStateError(
                "cannot restore the optimizer: the checkpoint holds no optimizer state"
            )
        om = got
        names = _param_names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        by_name = dict(zip(names, params))
        _check_fit(
            optimizer,
            names,
            om.get("groups"),
            om.get("param_shapes"),
            om.get("class"),
            allow_optimizer_change,
        )
        for pname, keys in (om.get("state_keys") or {}).items():
            p = by_name.get(pname)
            if p is None:
                raise IncompatibleStateError(
                    f"cannot restore the optimizer: the checkpoint has state for {pname!r}, "
                    "which the optimizer does not optimize"
                )
            for k in keys:
                size, dtype = stored(_state_key(version, pname, k))
                tgt_o.setdefault(pname, {})[k] = _target(p, size, dtype)

    # 3. Extra tensors.
    tgt_x = {}
    for k in meta.get("extra_tensors") or []:
        size, dtype = stored(f"extra.{k}")
        tgt_x[k] = torch.empty(size, dtype=dtype)

    # The state dict read into (every stored chunk CRC-checked as copied; all ranks agree).
    sd: dict[str, Any] = {"model": tgt_m}
    if tgt_o and version >= 2:
        sd.update({_state_key(version, p, k): t for p, st in tgt_o.items() for k, t in st.items()})
    elif tgt_o:
        sd["optim"] = tgt_o
    if tgt_x:
        sd["extra"] = tgt_x
    return sd, meta, om, names, tgt_m, tgt_o, tgt_x


def _new_optimizer_state(
    optimizer: Any, names: list[str], om: dict, tgt_o: dict, keep_live_hyper: bool
) -> dict:
    """The state dict for ``load_state_dict`` (``om`` checked by :func:`_check_fit`):
    groups by position, parameters by name in the live order, hyperparameters from the
    checkpoint (``keep_live_hyper``: plus the live group's that the checkpoint's lacks)."""
    values = om.get("values") or {}
    groups = []
    state: dict[int, dict[str, Any]] = {}
    pos = 0
    for lg, cg in zip(optimizer.param_groups, om["groups"]):
        live = names[pos : pos + len(lg["params"])]
        g = _group_hyper(lg, cg, keep_live_hyper)
        g["params"] = list(range(pos, pos + len(live)))
        groups.append(g)
        for i, n in enumerate(live, start=pos):
            s: dict[str, Any] = dict(tgt_o.get(n) or {})
            for k, v in (values.get(n) or {}).items():
                s[k] = _decode(v)
            if s:
                state[i] = s
        pos += len(live)
    return {"state": state, "param_groups": groups}


class _LayoutRefused(OptimizerStateError):
    """The engine refused to convert a state to the layout asked for (an absmax too small
    to scale by, non-finite values), on every rank alike (internal: the tiered manager
    raises it rather than passing the step over, since every copy holds the same values)."""


def _apply_layout(tgt_o: dict, names: list[str], optimizer: Any, layout: Any, path: Any, pg: Any) -> None:
    """The moments in ``layout``, by the engine: which states a target applies to
    (``state_target``, the rule of :meth:`ckptstore.Checkpoint.load_optimizer`, on global
    shapes), each FP16-scaled state's scale from its global absmax (the engine's
    ``state_absbits`` of every rank's shard, folded by one integer all-reduce for all
    states), the conversion (``convert_state``) into fresh arrays, whose values, as torch
    gets them from :func:`ckptstore.torch.load`, replace the fresh tensors' (never a live
    one). A refusal is raised on every rank alike, as :class:`OptimizerStateError` naming
    the parameter and the state."""
    torch = _torch()
    import torch.distributed as dist

    params = dict(zip(names, [p for g in optimizer.param_groups for p in g["params"]]))
    todo: list[tuple[str, str, Any, str, Any, str]] = []
    bits: list[int] = []

    def plan() -> None:
        for pname in sorted(tgt_o):
            for k in sorted(tgt_o[pname]):
                t = tgt_o[pname][k]
                local = t.to_local() if _is_dtensor(t) else t
                wire = _wire_of.get(local.dtype)
                if wire is None:  # a dtype no checkpoint holds: refused there, naming the state
                    wire = _to_numpy(f"{pname}/{k}", local)[1]
                target = _ckptstore.state_target(
                    pname, k, wire, list(t.shape), list(params[pname].shape), layout
                )
                if target == "as_stored":
                    continue  # its bytes are not touched (a CUDA shard is not copied out)
                _, wire, arr = _to_numpy(f"{pname}/{k}", local.contiguous())
                todo.append((pname, k, local, wire, arr, target))
                if target.startswith("f16_scaled"):
                    bits.append(_ckptstore.state_absbits(pname, k, wire, arr))

    _agreed(plan, path, pg)
    folded = torch.tensor(bits, dtype=torch.int64)
    if bits and dist.is_available() and dist.is_initialized():
        dist.all_reduce(folded, op=dist.ReduceOp.MAX, group=pg)
    absmax = iter(folded.tolist())

    def convert() -> None:
        for pname, k, local, wire, arr, target in todo:
            bits = next(absmax) if target.startswith("f16_scaled") else None
            if wire == "F32":
                # One fused engine pass into a fresh buffer (the FP32 values the state holds
                # in ``target``): taken as the state when the target is a plain CPU tensor,
                # else copied into the target (a DTensor's shard, a CUDA tensor).
                out = torch.empty(local.shape, dtype=torch.float32)
                _ckptstore.round_state(pname, k, arr.reshape(-1), target, out.view(-1).numpy(), absmax_bits=bits)
                if local is tgt_o[pname][k] and local.device.type == "cpu":
                    tgt_o[pname][k] = out
                else:
                    local.copy_(out)
                continue
            got = _ckptstore.convert_state(pname, k, wire, arr, target, absmax_bits=bits)
            values = got.to_float32() if isinstance(got, F16Scaled) else got
            local.copy_(_from_array(values))

    _agreed(convert, path, pg, refused=_LayoutRefused)
