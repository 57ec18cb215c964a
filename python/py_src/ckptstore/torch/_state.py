"""The optimizer state: parameter names, the class recorded and compared, the stored
parameter groups, the compatibility check at load, and the state dict handed to
``optimizer.load_state_dict`` (with the test for the direct, single-pass fill)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from .. import check_optimizer_fit
from .._types import F16Scaled
from ..errors import InvalidArgumentError
from . import _staging
from ._dtypes import _bytes_of, _empty_for, _from_array, _torch, _torch_of
from ._staging import _stage_to_cuda
from ._values import _decode, _encode


def _param_names(model: Any, optimizer: Any) -> list[str]:
    """The name of every optimizer parameter, in ``state_dict()`` index order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is None:
        return [f"param.{i}" for i in range(len(params))]
    by_id: dict[int, str] = {}
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
    saved: Any = None  # malformed groups are the engine's to refuse
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


def _check_class(live_class: Optional[str], saved_class: Any, allow_optimizer_change: bool) -> bool:
    """Rule F1 of the one rule (:func:`ckptstore.check_optimizer_fit`) alone, for the
    framework integrations, whose frameworks check the groups themselves: raise
    :class:`IncompatibleStateError` naming both classes when the recorded class (``None``:
    not recorded) is not the live one (``None``: unknown), unless ``allow_optimizer_change``.
    Returns whether this is an allowed change of class."""
    check_optimizer_fit(
        [], [], live_class=live_class, saved_class=saved_class,
        allow_optimizer_change=allow_optimizer_change,
    )
    return isinstance(saved_class, str) and live_class is not None and saved_class != live_class


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
                        and _staging._STAGE_BYTES > 0
                    ):
                        s[k] = _empty_for(v, dev)
                        flat = s[k].reshape(-1).view(_torch().uint8)
                        cuda_fresh.append((flat.numel(), flat, v["tensor"]))
                    else:
                        s[k] = _empty_for(v)
                        fresh.append((v["tensor"], _bytes_of(s[k])))
                    continue
                s[k] = _from_array(v.to_float32() if isinstance(v, F16Scaled) else v)
                if (
                    dev_of[i] is not None
                    and k != "step"
                    and 0 < s[k].nbytes <= _staging._STAGE_BYTES
                ):
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
