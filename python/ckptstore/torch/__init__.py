"""PyTorch helpers: save and restore a model and its optimizer with ckptstore.

``torch`` is imported on first use, so ``import ckptstore`` never needs it.

::

    import ckptstore.torch as ct

    ct.save("run/ckpt", model, optimizer, extra={"epoch": 3, "rng": torch.get_rng_state()})
    ...
    extra = ct.load("run/ckpt", model, optimizer)   # in place; returns the extra dict

What is stored (one atomic, durable checkpoint):

* every entry of ``model.state_dict()`` (parameters and persistent buffers) under its
  state-dict name, read straight from the tensors' memory (no copy for CPU tensors);
* the optimizer's ``state_dict()``: parameter groups with their hyperparameters, and every
  per-parameter state tensor (0-dim ``step`` included) as ``optim/<param>/<state>``, with
  parameters **named by their model names** (``model.named_parameters()``), so that a
  checkpoint does not depend on parameter order. Without a model, parameters are named
  by position (``param.<i>``);
* ``extra``: tensors and arrays as ``extra/<key>`` tensors, everything else as JSON in the
  manifest metadata.

Restoring is all or nothing: :func:`load` checks that the checkpoint fits (every model
entry present with its shape; for the optimizer the rule of
:func:`ckptstore.check_optimizer_fit`: the same optimizer class, the same number of
parameter groups, each naming the same parameters, in any order, with the same shapes) and
reads and CRC-checks every tensor it will use before it changes anything (the optimizer
state straight into fresh ``torch.empty`` tensors, CRC checked on the way). It then replaces the optimizer state whole through
``optimizer.load_state_dict`` (no copy; state the checkpoint does not name is gone) and
copies the model tensors in place under ``torch.no_grad()``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np

from .. import _ckptstore, _optimizer_parts, check_optimizer_fit, open as _open
from .._types import F16Scaled
from ..errors import IncompatibleStateError, InvalidArgumentError, InvalidTensorError
from .manager import CheckpointManager, SaveHandle

__all__ = ["save", "load", "META_KEY", "EXTRA_PREFIX", "CheckpointManager", "SaveHandle"]

#: Metadata key under which the torch helpers record what they stored.
META_KEY = "ckptstore.torch"
#: Prefix of the tensors that hold ``extra`` tensors.
EXTRA_PREFIX = "extra/"
_META_VERSION = 1

_wire_of: Dict[Any, str] = {}
_torch_of: Dict[str, Any] = {}


def _torch():
    import torch  # lazy: ckptstore does not depend on torch

    if not _wire_of:
        pairs = [
            (torch.bool, "BOOL"),
            (torch.uint8, "U8"),
            (torch.int8, "I8"),
            (torch.int16, "I16"),
            (torch.float16, "F16"),
            (torch.bfloat16, "BF16"),
            (torch.int32, "I32"),
            (torch.float32, "F32"),
            (torch.int64, "I64"),
            (torch.float64, "F64"),
        ]
        for name, wire in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
            if hasattr(torch, name):
                pairs.append((getattr(torch, name), wire))
        for dt, wire in pairs:
            _wire_of[dt] = wire
            _torch_of[wire] = dt
    return torch


# Same-size integer dtypes through which tensors without a numpy dtype are viewed.
_CARRIER = {"BF16": "int16", "U16": "int16", "U32": "int32", "U64": "int64"}


def _to_numpy(name: str, t: Any) -> tuple[str, str, np.ndarray]:
    """``(name, wire dtype, array)`` over the tensor's own memory (CPU tensors are not
    copied; others are copied to the CPU first)."""
    torch = _torch()
    if isinstance(t, np.ndarray):
        from .. import _prepare

        return _prepare(name, t)
    if not isinstance(t, torch.Tensor):
        from .. import _prepare

        return _prepare(name, np.asarray(t))
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.layout != torch.strided:
        raise InvalidTensorError(f"tensor {name!r}: only dense (strided) tensors can be stored")
    wire = _wire_of.get(t.dtype)
    if wire is None:
        raise InvalidTensorError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
    if wire in _CARRIER:
        t = t.view(getattr(torch, _CARRIER[wire]))
    return name, wire, t.numpy()


def _from_array(a: np.ndarray) -> Any:
    """A torch tensor over a numpy array's memory (writable arrays only, no copy)."""
    torch = _torch()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_raw(raw: np.ndarray, wire: str, shape: tuple[int, ...]) -> Any:
    """A torch tensor of ``wire`` dtype and ``shape`` over a read-only uint8 array of its
    bytes (no copy; only ever read, as the source of ``copy_`` or ``clone``)."""
    torch = _torch()
    with warnings.catch_warnings():
        # torch warns that the array is not writable: it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(raw)
    return t.view(_torch_of[wire]).reshape(shape)


# ---- JSON for hyperparameters and non-tensor values ------------------------------------


def _encode(v: Any, where: str) -> Any:
    torch = _torch()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, tuple):
        return {"$tuple": [_encode(x, where) for x in v]}
    if isinstance(v, list):
        return [_encode(x, where) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _encode(x, where) for k, x in v.items()}
    if isinstance(v, torch.Tensor) and v.numel() <= 64:
        return {"$tensor": v.detach().cpu().tolist(), "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, (np.generic,)):
        return _encode(v.item(), where)
    raise InvalidArgumentError(
        f"{where}: cannot store a value of type {type(v).__name__} (JSON types, tuples and "
        "small tensors only)"
    )


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1 and "$tuple" in v:
            return tuple(_decode(x) for x in v["$tuple"])
        if len(v) == 1 and "$float" in v:
            return float(v["$float"])
        if len(v) == 2 and "$tensor" in v and "dtype" in v:
            torch = _torch()
            return torch.tensor(v["$tensor"], dtype=getattr(torch, v["dtype"]))
        return {k: _decode(x) for k, x in v.items()}
    return v


# ---- save --------------------------------------------------------------------------------


def _param_names(model: Any, optimizer: Any) -> list[str]:
    """The name of every optimizer parameter, in ``state_dict()`` index order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is None:
        return [f"param.{i}" for i in range(len(params))]
    by_id = {}
    for n, p in model.named_parameters(remove_duplicate=True):
        by_id.setdefault(id(p), n)
    names = []
    for i, p in enumerate(params):
        n = by_id.get(id(p))
        if n is None:
            raise InvalidArgumentError(
                f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                "model: pass the model that owns every optimized parameter"
            )
        names.append(n)
    return names


#: Pass-through optimizer wrappers of the frameworks (class name -> attribute holding the
#: optimizer that runs): Accelerate's ``AcceleratedOptimizer`` (the Hugging Face Trainer)
#: and Lightning's ``LightningOptimizer``.
_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "LightningOptimizer": "_optimizer"}


def _optimizer_class(optimizer: Any) -> str:
    """The class name recorded for ``optimizer`` and compared at load (rule F1): the class
    of the optimizer that runs, seen through the frameworks' pass-through wrappers, so that
    an AdamW checkpoint is AdamW whether a Trainer wrapped it or not."""
    seen = 0
    while seen < 8:
        attr = _WRAPPERS.get(type(optimizer).__name__)
        inner = getattr(optimizer, attr, None) if attr else None
        if inner is None:
            break
        optimizer = inner
        seen += 1
    return type(optimizer).__name__


def _encode_groups(param_groups: list, names: list) -> list:
    """The optimizer state dict's parameter groups as stored: hyperparameters as JSON
    values, parameters by their names (``names[i]`` for index ``i``)."""
    groups = []
    for gi, g in enumerate(param_groups):
        hyper = {
            k: _encode(v, f"param group {gi}, {k!r}")
            for k, v in g.items()
            if k not in ("params", "param_names")
        }
        hyper["params"] = [names[i] for i in g["params"]]
        groups.append(hyper)
    return groups


def _build_items(
    model: Any,
    optimizer: Any,
    extra: Optional[Mapping[str, Any]],
    prepare: Callable[[str, Any], tuple[str, str, np.ndarray]],
) -> tuple[list[tuple[str, str, np.ndarray]], str, Any]:
    """What :func:`save` stores for ``model``, ``optimizer`` and ``extra``: the native
    save's items, its metadata JSON and its optimizer parts. ``prepare(name, tensor)``
    turns each tensor into ``(name, wire dtype, array)``: over the live tensor for
    :func:`save`, over a snapshot buffer for the manager's background saves."""
    torch = _torch()
    entries: list[tuple[str, str, np.ndarray]] = []
    meta: dict[str, Any] = {"version": _META_VERSION, "model": [], "extra": {}, "extra_tensors": []}
    if model is not None:
        for name, t in model.state_dict().items():
            if not isinstance(t, torch.Tensor):
                raise InvalidTensorError(
                    f"model state {name!r} is a {type(t).__name__}, not a tensor: "
                    "ckptstore.torch stores tensors (put other values in extra=)"
                )
            entries.append(prepare(name, t))
            meta["model"].append(name)
    optim = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        names = _param_names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = _encode_groups(sd["param_groups"], names)
        state: dict[str, dict[str, Any]] = {}
        values: dict[str, dict[str, Any]] = {}
        for i, st in sd["state"].items():
            n = names[i]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    state.setdefault(n, {})[k] = v
                elif v is not None:
                    values.setdefault(n, {})[k] = _encode(v, f"parameter {n!r}, state {k!r}")
        opt = {
            "param_groups": groups,
            "param_shapes": {n: tuple(p.shape) for n, p in zip(names, params)},
            "state": state,
        }
        optim = _optimizer_parts(opt, prepare=prepare)
        meta["optimizer"] = {"class": _optimizer_class(optimizer), "values": values}
    for k, v in (extra or {}).items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"extra keys must be strings, got {k!r}")
        if isinstance(v, (torch.Tensor, np.ndarray)):
            entries.append(prepare(EXTRA_PREFIX + k, v))
            meta["extra_tensors"].append(k)
        else:
            meta["extra"][k] = _encode(v, f"extra {k!r}")
    metadata = json.dumps({META_KEY: meta}, allow_nan=False)
    return entries, metadata, optim


def save(
    path: "str | os.PathLike[str]",
    model: Any = None,
    optimizer: Any = None,
    *,
    extra: Optional[Mapping[str, Any]] = None,
    max_shard_size: Optional[int] = None,
    cleanup: str = "background",
) -> dict:
    """Save ``model`` (its ``state_dict()``), ``optimizer`` (its ``state_dict()``, with
    parameters named by their model names) and ``extra`` as one checkpoint in the directory
    ``path``, atomically and durably replacing any checkpoint there.

    ``extra`` maps string keys to tensors or arrays (stored as tensors) or JSON values
    (numbers, strings, lists, dicts; tuples and non-finite floats are kept); :func:`load`
    returns it. Returns the commit info of :func:`ckptstore.save`.

    CPU tensors are written from their own memory, without a copy; keep them unchanged
    until ``save`` returns (it releases the GIL while writing).

    ``cleanup`` (default ``"background"``, for training loops): ``save`` returns once the
    new checkpoint is committed and durable, and the previous checkpoint's files are
    removed on a background thread (the next save into ``path`` waits for it;
    :func:`ckptstore.wait_for_cleanup` waits for all and runs at exit). ``"inline"``
    removes them before returning. See :func:`ckptstore.save`.
    """
    entries, metadata, optim = _build_items(model, optimizer, extra, _to_numpy)
    return _ckptstore.save(os.fspath(path), entries, metadata, max_shard_size, optim, cleanup)


# ---- load --------------------------------------------------------------------------------


def load(
    path: "str | os.PathLike[str]",
    model: Any = None,
    optimizer: Any = None,
    *,
    strict: bool = True,
    layout: Any = None,
    allow_optimizer_change: bool = False,
) -> dict:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint at ``path``;
    return the ``extra`` dict saved with it (tensors as fresh torch tensors).

    Everything is checked before anything changes: the model's every state-dict entry must
    be in the checkpoint with the same shape (with ``strict``, the checkpoint must not hold
    model entries the model lacks); the optimizer must fit the checkpoint's by the rule of
    :func:`ckptstore.check_optimizer_fit` (format-spec/optimizer.md §Compatibility): the
    same optimizer class as the one saved (``type(optimizer).__name__`` of the optimizer
    that runs, seen through Accelerate's and Lightning's wrappers; recorded by
    :func:`save`), as many parameter groups, matched by position, each naming the same
    parameters (by model name, in any order) with the same shapes; every tensor used is
    read and its CRC32 checked. Any failure raises a :class:`ckptstore.CheckpointError`
    (``IncompatibleStateError``, ``ChecksumError``, ...) with the model and optimizer
    untouched.

    ``allow_optimizer_change=True`` is the opt-in for a deliberate change of optimizer
    (say, state saved from TransformerEngine's ``FusedAdam`` restored into
    ``torch.optim.Adam``): the class is then not compared (the rest of the rule still
    applies), the checkpoint's state is installed as stored, and each group's
    hyperparameters are the checkpoint's plus the live group's own for the settings the
    checkpoint's group lacks (so an ``SGD`` restored from ``AdamW`` keeps its
    ``momentum``).

    The optimizer then gets a complete fresh state dict through ``load_state_dict``:
    hyperparameters from the checkpoint, and state exactly for the parameters the
    checkpoint has state for (others end with none). By default (``layout=None``) and for
    CPU or CUDA parameters whose state is stored plain in the dtype ``load_state_dict``
    gives it, each state tensor is a fresh ``torch.empty`` tensor on its parameter's device
    that the engine fills in one pass (read once from the mapped shard, CRC-checked on the
    way, written once; for CUDA, written once into a reused pinned buffer, then copied to
    the device), in the same parallel pass that checks the model's CRCs;
    ``load_state_dict`` keeps those tensors (no copy). Otherwise ``layout`` is passed to :meth:`Checkpoint.load_optimizer`
    (default: as stored); FP16-scaled states are handed to torch as float32. Model tensors
    are then written in place: contiguous CPU tensors of the stored dtype straight from the
    mapped file into their memory (the second read of their bytes: checking them first is
    what keeps the model unchanged on a damaged checkpoint), others with ``copy_`` under
    ``no_grad`` (dtype casts as ``copy_`` does them). CUDA tensors (model
    entries of the stored dtype, and the optimizer state of CUDA parameters except
    ``step``) are filled through two reused 64 MiB pinned buffers, tensors larger than a
    buffer in pieces, the host-to-device copy of one buffer overlapped with the filling of
    the other. ``load`` returns when every copy has finished.
    """
    torch = _torch()
    ck = _open(path)
    meta = ck.metadata.get(META_KEY) or {}

    # 1. The model: names and shapes (its bytes are CRC-checked in step 4, copied in step 5).
    copies = []
    if model is not None:
        live = model.state_dict(keep_vars=True)
        missing = [n for n in live if n not in ck]
        if missing:
            raise IncompatibleStateError(
                f"cannot restore the model: the checkpoint has no tensor {missing[0]!r}"
                + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
            )
        saved = meta.get("model")
        if strict and saved is not None:
            unexpected = [n for n in saved if n not in live]
            if unexpected:
                raise IncompatibleStateError(
                    f"cannot restore the model: the checkpoint holds {unexpected[0]!r}, which "
                    "the model does not have (strict=False to ignore)"
                )
        for n, t in live.items():
            info = ck.info(n)
            if tuple(info["shape"]) != tuple(t.shape):
                raise IncompatibleStateError(
                    f"cannot restore the model: {n!r} has shape {tuple(info['shape'])} in the "
                    f"checkpoint, {tuple(t.shape)} in the model"
                )
            copies.append((n, t, info))

    # 2. The optimizer: a complete new state dict, checked against the live optimizer. On
    # the direct path its tensors are fresh torch.empty tensors of their final dtype, filled
    # in step 4; otherwise (a layout, CUDA parameters, scaled or chunked state, a dtype that
    # load_state_dict would cast) the engine loads and converts them here.
    new_sd = None
    fills: list[tuple[str, np.ndarray]] = []
    # Fresh CUDA state tensors of the direct path: (nbytes, flat uint8 view, stored name).
    cuda_fills: list[tuple[int, Any, str]] = []
    if optimizer is not None:
        if not ck.has_optimizer:
            raise IncompatibleStateError(
                "cannot restore the optimizer: the checkpoint holds no optimizer state"
            )
        # The section only (no state read yet): the rule first.
        plan = ck.optimizer_plan()
        ometa = meta.get("optimizer") or {}
        saved_class = ometa.get("class") if isinstance(ometa, dict) else None
        names = _param_names(model, optimizer)
        _check_fit(
            optimizer,
            names,
            plan["param_groups"],
            plan["param_shapes"],
            saved_class,
            allow_optimizer_change,
        )
        keep_live = _changed_class(optimizer, saved_class, allow_optimizer_change)
        if layout is None and _direct_ok(model, optimizer, plan):
            new_sd = _build_state_dict(
                model,
                optimizer,
                plan,
                ometa,
                fresh=fills,
                cuda_fresh=cuda_fills,
                keep_live_hyper=keep_live,
            )
        else:
            st = ck.load_optimizer(layout, release=True)
            new_sd = _build_state_dict(model, optimizer, st, ometa, keep_live_hyper=keep_live)

    # 3. Extra values: tensors into fresh torch.empty tensors, filled in step 4.
    extra: dict[str, Any] = {k: _decode(v) for k, v in (meta.get("extra") or {}).items()}
    for k in meta.get("extra_tensors") or []:
        n = EXTRA_PREFIX + k
        info = ck.info(n)
        extra[k] = _empty_for(info)
        fills.append((n, _bytes_of(extra[k])))

    # 4. One pass over the bytes (parallel, interpreter released): the fresh tensors of
    # steps 2 and 3 filled with their CRC computed on the way, and the CRC of every model
    # tensor checked; mapped pages leave the process as it goes (they stay in the page
    # cache, hot for the copy of step 5). Nothing live is written before all have passed.
    # Fresh CUDA state tensors larger than a staging buffer are staged in pieces (4b):
    # their CRCs are checked in this pass.
    big = [n for nb, _, n in cuda_fills if nb > _STAGE_BYTES]
    ck.fill_and_verify(fills, [n for n, _, _ in copies] + big, release=True)
    # 4b. Fresh CUDA state tensors (not live yet): filled through two reused pinned buffers
    # by the same engine pass (read once from the map, CRC-checked on the way into the
    # pinned buffer; larger ones, checked above, in pieces), each buffer's host-to-device
    # copy overlapped with the next fill. A damaged tensor raises here, before anything
    # live changes.
    if cuda_fills:
        _stage_to_cuda(
            cuda_fills,
            lambda pairs: ck.fill_and_verify(pairs, release=True),
            ck.copy_ranges_into_unchecked,
        )

    # 5. Apply: nothing above changed the model or the optimizer.
    if new_sd is not None:
        # The state tensors already have their parameter's dtype and device:
        # load_state_dict keeps them as they are (no copy) and replaces the state whole.
        optimizer.load_state_dict(new_sd)
    if copies:
        direct = []
        staged = []
        slow = []
        for n, t, info in copies:
            d = t.detach()
            plain = (
                d.is_contiguous()
                and d.layout == torch.strided
                and not (d.is_conj() or d.is_neg())
                and _wire_of.get(d.dtype) == info["dtype"]
            )
            if plain and d.device.type == "cpu":
                # Straight into the tensor's memory: the stored bytes are its bytes.
                direct.append((n, d.reshape(-1).view(torch.uint8).numpy()))
            elif plain and d.device.type == "cuda" and info["nbytes"] > 0 and _STAGE_BYTES > 0:
                # Through reused pinned buffers, copies overlapped with the next reads
                # (tensors larger than a buffer in pieces).
                staged.append((info["nbytes"], d.reshape(-1).view(torch.uint8), n))
            else:
                slow.append((n, t, info))
        with torch.no_grad():
            if direct:
                ck.copy_into_unchecked(direct, release=True)
            if staged:
                _stage_to_cuda(
                    staged, lambda pairs: ck.copy_into_unchecked(pairs, release=True), ck.copy_ranges_into_unchecked
                )
            if slow:
                raw = ck.read([n for n, _, _ in slow], verify=False, raw=True)
                for n, t, info in slow:
                    t.copy_(_from_raw(raw[n], info["dtype"], tuple(info["shape"])))
    return extra


def _empty_for(info: dict, device: Any = None) -> Any:
    """A fresh tensor for the stored tensor ``info`` (its dtype and shape), on ``device``
    (default: the CPU)."""
    torch = _torch()
    dt = _torch_of.get(info["dtype"])
    if dt is None:
        raise InvalidTensorError(f"dtype {info['dtype']} has no torch dtype here")
    return torch.empty(tuple(info["shape"]), dtype=dt, device=device)


def _bytes_of(t: Any) -> np.ndarray:
    """A writable 1-D ``uint8`` numpy view of a contiguous CPU tensor's memory."""
    torch = _torch()
    return t.reshape(-1).view(torch.uint8).numpy()


def _direct_ok(model: Any, optimizer: Any, plan: dict) -> bool:
    """Whether every state of ``plan`` (:meth:`Checkpoint.optimizer_plan`) can be filled
    straight into a fresh tensor on its parameter's device (CPU or CUDA; CUDA ones through
    pinned staging) that ``load_state_dict`` keeps as it is: CPU or CUDA parameters, plain
    (not FP16-scaled, not chunked) state of a torch dtype, and floating states of floating
    parameters stored in the parameter's dtype (``load_state_dict`` casts those to it
    otherwise)."""
    _torch()
    try:
        names = _param_names(model, optimizer)
    except InvalidArgumentError:
        return False  # the general path raises it with its context
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_name = dict(zip(names, params))
    for n, states in plan["state"].items():
        p = by_name.get(n)
        if p is None:
            continue  # not in the live optimizer: the checks of _build_state_dict refuse it
        if p.device.type not in ("cpu", "cuda"):
            return False
        for k, e in states.items():
            dt = _torch_of.get(e["dtype"]) if e["dtype"] is not None else None
            if e["encoding"] != "plain" or dt is None:
                return False
            if k != "step" and p.is_floating_point() and dt != p.dtype:
                return False
    return True


# ---- CUDA destinations: pinned staging ----------------------------------------------------

#: Size of each of the two pinned staging buffers; larger tensors are staged in pieces of
#: this size. 0 turns staging off (CUDA tensors are then written with ``copy_`` from
#: pageable memory, and fresh CUDA state is moved by ``load_state_dict``).
_STAGE_BYTES = 64 << 20
_ALIGN = 256


def _batches(sizes: "list[int]", cap: int) -> "list[list[tuple[int, int]]]":
    """Greedy, order-keeping batches of ``(index, offset)``: each batch's items, at
    ``_ALIGN``-aligned offsets, fit in ``cap`` bytes. Every size must be <= ``cap``."""
    out: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    off = 0
    for i, nb in enumerate(sizes):
        if nb > cap:
            raise InvalidArgumentError(f"internal: staged item of {nb} bytes > buffer {cap}")
        if cur and off + nb > cap:
            out.append(cur)
            cur, off = [], 0
        cur.append((i, off))
        off += -(-nb // _ALIGN) * _ALIGN
    if cur:
        out.append(cur)
    return out


def _stage_to_cuda(
    items: list,
    fill: Callable[[list], None],
    fill_range: Optional[Callable[[list], None]] = None,
) -> None:
    """Copy host bytes into CUDA tensors through two reused pinned buffers.

    ``items``: ``(nbytes, flat uint8 CUDA tensor, key)``. ``fill(pairs)`` writes, for each
    ``(key, uint8 numpy view of pinned memory)``, the key's bytes into the view (checked
    bytes: the caller checks them, before or on the way). An item larger than
    ``_STAGE_BYTES`` goes in pieces of at most that size, written by
    ``fill_range(triples)``, for each ``(key, byte offset, view)`` (required then). While
    the device copies one buffer (``non_blocking`` on a side stream), the other is filled;
    a buffer is refilled only after the event recorded behind its last copies has
    completed. Returns when every copy has finished."""
    torch = _torch()
    devs = {it[1].device for it in items}
    if len(devs) > 1:
        for d in devs:
            _stage_to_cuda([it for it in items if it[1].device == d], fill, fill_range)
        return
    # (nbytes, destination, key, byte offset or None for a whole item)
    pieces: list[tuple[int, Any, Any, Optional[int]]] = []
    for nb, dst, key in items:
        if nb <= _STAGE_BYTES:
            pieces.append((nb, dst, key, None))
            continue
        if fill_range is None:
            raise InvalidArgumentError(f"{key!r}: {nb} bytes is over the staging buffer")
        for off in range(0, nb, _STAGE_BYTES):
            n = min(_STAGE_BYTES, nb - off)
            pieces.append((n, dst[off : off + n], key, off))
    if not pieces:
        return
    dev = pieces[0][1].device
    batches = _batches([nb for nb, _, _, _ in pieces], _STAGE_BYTES)
    need = max(sum(-(-pieces[i][0] // _ALIGN) * _ALIGN for i, _ in b) for b in batches)
    cap = min(_STAGE_BYTES, need)
    bufs = [
        torch.empty(cap, dtype=torch.uint8, pin_memory=True)
        for _ in range(min(2, len(batches)))
    ]
    done: list[Any] = [None] * len(bufs)
    stream = torch.cuda.Stream(device=dev)
    # The destinations may still be in use on the caller's stream.
    stream.wait_stream(torch.cuda.current_stream(dev))
    for bi, batch in enumerate(batches):
        k = bi % len(bufs)
        if done[k] is not None:
            done[k].synchronize()
        buf = bufs[k]
        views = [(i, buf[off : off + pieces[i][0]]) for i, off in batch]
        whole = [(pieces[i][2], v.numpy()) for i, v in views if pieces[i][3] is None]
        ranged = [(pieces[i][2], pieces[i][3], v.numpy()) for i, v in views if pieces[i][3] is not None]
        if whole:
            fill(whole)
        if ranged:
            fill_range(ranged)
        with torch.cuda.stream(stream):
            for i, v in views:
                pieces[i][1].copy_(v, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        done[k] = ev
    stream.synchronize()


# ---- the optimizer compatibility rule -----------------------------------------------------


def _check_fit(
    optimizer: Any,
    names: list,
    saved_groups: Any,
    saved_shapes: Any,
    saved_class: Any,
    allow_optimizer_change: bool,
) -> None:
    """Raise ``IncompatibleStateError`` unless the checkpoint's optimizer (its groups,
    each ``{"params": [names], ...}``, its ``{name: shape}`` and its class, ``None`` if
    not recorded) fits the live ``optimizer``, whose parameters are called ``names`` (in
    ``state_dict()`` index order): the one rule, :func:`ckptstore.check_optimizer_fit`
    (the Rust engine's). Also for :mod:`ckptstore.torch.distributed`. A recorded class
    that is a framework's wrapper (checkpoints written before the class was seen through
    them) says nothing about the optimizer, and is not compared."""
    if saved_class in _WRAPPERS:
        saved_class = None
    live = []
    pos = 0
    for g in optimizer.param_groups:
        ps = g["params"]
        live.append([(names[i], tuple(p.shape)) for i, p in enumerate(ps, start=pos)])
        pos += len(ps)
    shapes = saved_shapes if isinstance(saved_shapes, Mapping) else {}
    saved = None
    if isinstance(saved_groups, (list, tuple)):
        saved = [
            [(n, shapes.get(n) if isinstance(n, str) else None) for n in g.get("params") or []]
            if isinstance(g, Mapping)
            else None
            for g in saved_groups
        ]
    check_optimizer_fit(
        live,
        saved,
        live_class=_optimizer_class(optimizer),
        saved_class=saved_class,
        allow_optimizer_change=allow_optimizer_change,
    )


def _changed_class(optimizer: Any, saved_class: Any, allow_optimizer_change: bool) -> bool:
    """Whether this restore is an allowed change of optimizer class."""
    return (
        allow_optimizer_change
        and isinstance(saved_class, str)
        and saved_class != _optimizer_class(optimizer)
    )


def _group_hyper(live_group: Mapping, saved_group: Mapping, keep_live: bool) -> dict:
    """A group's hyperparameters for ``load_state_dict``: the checkpoint's (decoded);
    with ``keep_live`` (a change of optimizer) also the live group's for the settings the
    checkpoint's lacks."""
    g = {k: _decode(v) for k, v in saved_group.items() if k != "params"}
    if keep_live:
        for k, v in live_group.items():
            if k not in ("params", "param_names"):
                g.setdefault(k, v)
    return g


def _build_state_dict(
    model: Any,
    optimizer: Any,
    st: dict,
    ometa: dict,
    fresh: Optional[list] = None,
    cuda_fresh: Optional[list] = None,
    keep_live_hyper: bool = False,
) -> dict:
    """The state dict for ``optimizer.load_state_dict`` from ``st``, checked against the
    live optimizer. ``st`` is :meth:`Checkpoint.load_optimizer`'s result (state as arrays),
    or, with ``fresh`` given, :meth:`Checkpoint.optimizer_plan`'s (state as descriptions):
    then each state is a fresh ``torch.empty`` tensor and ``(tensor name, its bytes)`` is
    appended to ``fresh`` for the caller to fill; states of CUDA parameters (but ``step``,
    which ``load_state_dict`` keeps where it is) are created on the parameter's device
    instead and appended to ``cuda_fresh`` as ``(nbytes, flat uint8 view, tensor name)``
    for :func:`_stage_to_cuda`.

    The caller has checked that ``st`` fits the optimizer (:func:`_check_fit`): here the
    checkpoint's groups are matched by position and their parameters by name, in the live
    optimizer's order. ``keep_live_hyper`` (a deliberate change of optimizer class): each
    group keeps the live group's hyperparameters that the checkpoint's group lacks."""
    names = _param_names(model, optimizer)
    live_groups = optimizer.param_groups
    ck_groups = st["param_groups"]
    values = ometa.get("values") or {}
    groups = []
    state: dict[int, dict[str, Any]] = {}
    live_params = [p for g in live_groups for p in g["params"]]
    dev_of = [p.device if p.device.type == "cuda" else None for p in live_params]
    staged: list[tuple[Any, int, str]] = []
    pos = 0
    for lg, cg in zip(live_groups, ck_groups):
        live_names = names[pos : pos + len(lg["params"])]
        g = _group_hyper(lg, cg, keep_live_hyper)
        g["params"] = list(range(pos, pos + len(live_names)))
        groups.append(g)
        for i, n in enumerate(live_names, start=pos):
            s: dict[str, Any] = {}
            for k, v in (st["state"].get(n) or {}).items():
                if fresh is not None:
                    dev = dev_of[i]
                    if (
                        cuda_fresh is not None
                        and dev is not None
                        and k != "step"
                        and math.prod(v["shape"]) > 0
                        and _STAGE_BYTES > 0
                    ):
                        s[k] = _empty_for(v, dev)
                        flat = s[k].reshape(-1).view(_torch().uint8)
                        cuda_fresh.append((flat.numel(), flat, v["tensor"]))
                    else:
                        s[k] = _empty_for(v)
                        fresh.append((v["tensor"], _bytes_of(s[k])))
                    continue
                s[k] = _from_array(v.to_float32() if isinstance(v, F16Scaled) else v)
                if dev_of[i] is not None and k != "step" and 0 < s[k].nbytes <= _STAGE_BYTES:
                    # load_state_dict moves every state but "step" to its parameter's
                    # device: do it here through pinned staging (no live state changes).
                    staged.append((s[k], i, k))
            for k, v in (values.get(n) or {}).items():
                s[k] = _decode(v)
            if s:
                state[i] = s
        pos += len(live_names)
    if staged:
        torch = _torch()
        items = []
        for host, i, k in staged:
            dst = torch.empty(host.shape, dtype=host.dtype, device=dev_of[i])
            items.append((host.nbytes, dst.reshape(-1).view(torch.uint8), (host, i, k, dst)))

        def fill(pairs: list) -> None:
            for (host, _, _, _), view in pairs:
                np.copyto(view, host.reshape(-1).view(torch.uint8).numpy())

        _stage_to_cuda(items, fill)
        for _, _, (_, i, k, dst) in items:
            state[i][k] = dst
    return {"state": state, "param_groups": groups}
