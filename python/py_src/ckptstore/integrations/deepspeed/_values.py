"""DeepSpeed's own values stored without pickle (rebuilt from a fixed table of classes), the
optimizer class recorded in every file of a tag, and files of DeepSpeed's default engine
(``torch.save``) read as plain data (the package docs)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import functools
import logging
import os
from typing import Any, Dict, Optional

from ...errors import InvalidArgumentError, PickleNotAllowedError
from .._stock import UNREADABLE, WeightsOnlyRefusal, torch_load

_log = logging.getLogger(__package__)  # the package's logger

_MARK = "$deepspeed"
#: Top-level key of a tag's files: the optimizer class of the save.
_CLASS_KEY = _MARK + ".optimizer_class"


# ---- DeepSpeed's values, stored without pickle ------------------------------------------


def _known_types() -> Dict[str, type]:
    """The classes rebuilt on load, by a fixed name (never imported from the checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "ZeroStageEnum": ZeroStageEnum,
        "LossScaler": LossScaler,
        "DynamicLossScaler": DynamicLossScaler,
        "fragment_address": fragment_address,
    }


@functools.lru_cache(maxsize=1)
def _types() -> Dict[str, type]:
    return _known_types()


def _name_of(v: Any) -> Optional[str]:
    for name, cls in _types().items():
        if type(v) is cls:
            return name
    return None


def _encode(v: Any) -> Any:
    """``v`` with DeepSpeed's own objects replaced by marked dicts (tensors kept as they are,
    so that ``save_tree`` stores an object met twice once)."""
    if isinstance(v, (str, bytes, bool, int, float)) or v is None:
        name = _name_of(v) if isinstance(v, int) else None
        if name is not None and isinstance(v, int):  # ZeroStageEnum is an int
            return {_MARK: "enum", "class": name, "value": int(v)}
        return v
    if isinstance(v, dict):
        items = {k: _encode(x) for k, x in v.items()}
        if any(isinstance(k, str) and k.startswith(_MARK) for k in v):  # our keys: escaped
            return {_MARK: "dict", "items": [[k, x] for k, x in items.items()],
                    "ordered": isinstance(v, collections.OrderedDict)}
        return collections.OrderedDict(items) if isinstance(v, collections.OrderedDict) else items
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if type(v) is tuple:
        return tuple(_encode(x) for x in v)
    if isinstance(v, argparse.Namespace):
        return {_MARK: "namespace", "vars": _encode(dict(vars(v)))}
    name = _name_of(v)
    if name is not None:
        if dataclasses.is_dataclass(v):
            fields = {f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(v)}
            return {_MARK: "dataclass", "class": name, "fields": fields}
        return {_MARK: "object", "class": name, "state": _encode(dict(vars(v)))}
    return v  # tensors, torch.Size, sets, numpy, ... and what only pickle can store


def _decode(v: Any, where: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, where) for x in v]
    if type(v) is tuple:
        return tuple(_decode(x, where) for x in v)
    if not isinstance(v, dict):
        return v
    if _MARK not in v:
        items = {k: _decode(x, where) for k, x in v.items()}
        return collections.OrderedDict(items) if isinstance(v, collections.OrderedDict) else items
    kind = v[_MARK]
    try:
        if kind == "dict":
            pairs = [(k, _decode(x, where)) for k, x in v["items"]]
            return collections.OrderedDict(pairs) if v.get("ordered") else dict(pairs)
        if kind == "namespace":
            return argparse.Namespace(**_decode(v["vars"], where))
        cls = _types()[v["class"]]
        if kind == "enum" and issubclass(cls, enum.Enum):
            return cls(v["value"])
        if kind == "dataclass" and dataclasses.is_dataclass(cls):
            return cls(**_decode(v["fields"], where))
        if kind == "object" and not issubclass(cls, enum.Enum) and not dataclasses.is_dataclass(cls):
            obj = cls.__new__(cls)
            obj.__dict__.update(_decode(v["state"], where))
            return obj
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{where!r}: a stored DeepSpeed value is malformed: {v!r:.200} ({e})") from e
    raise InvalidArgumentError(f"{where!r}: unknown stored DeepSpeed value kind {kind!r}")


# ---- the optimizer class, recorded with every file of a tag --------------------------------


def _with_class(obj: Any, optimizer_class: str) -> Any:
    """A file's (encoded) object with the optimizer class of the save under the top-level key
    ``_CLASS_KEY`` (its tensors keep their names). A caller's dict holding a key that starts
    with ``_MARK`` is escaped by :func:`_encode`, so that key at the top level is only this;
    an object that is not a plain top-level dict records nothing."""
    if not isinstance(obj, dict) or _MARK in obj:
        return obj
    out = type(obj)(obj)
    out[_CLASS_KEY] = optimizer_class
    return out


def _recorded_class(obj: Any, where: str) -> "tuple[Any, Optional[str]]":
    """``(object, recorded optimizer class or None)`` of a stored file's object."""
    if not isinstance(obj, dict) or _MARK in obj or _CLASS_KEY not in obj:
        return obj, None
    cls = obj[_CLASS_KEY]
    if not isinstance(cls, str):
        raise InvalidArgumentError(f"{where!r}: the stored optimizer class is malformed: {cls!r:.200}")
    out = type(obj)((k, v) for k, v in obj.items() if k != _CLASS_KEY)
    return out, cls


def _read_default_file(path: str, map_location: Any, allow_pickle: bool) -> Any:
    """A file of DeepSpeed's default engine (``torch.save``; a run begun without
    :func:`install`): read with ``torch.load(weights_only=True)`` allowing DeepSpeed's own
    classes of the fixed table (and ``argparse.Namespace``), as plain data; what needs more
    is refused (:class:`PickleNotAllowedError`) unless ``allow_pickle``, which reads it as
    DeepSpeed does (``weights_only=False``). The first file of a tag read is logged."""
    tag_dir = os.path.dirname(os.path.abspath(path))
    if tag_dir not in _logged_default:
        _logged_default.add(tag_dir)
        _log.warning(
            "ckptstore: %s holds files of DeepSpeed's default checkpoint engine (torch.save), "
            "not ckptstore checkpoints: loading them with torch.load(weights_only=%s), without "
            "CRC checks; the next tags saved are ckptstore checkpoints",
            tag_dir, "False" if allow_pickle else "True",
        )
    allowed = [*_types().values(), argparse.Namespace]
    try:
        return torch_load(path, map_location=map_location, allow_pickle=allow_pickle, safe_globals=allowed)
    except WeightsOnlyRefusal as e:
        raise PickleNotAllowedError(
            f"{path!r}: a file of DeepSpeed's default engine (torch.save) that "
            f"torch.load(weights_only=True) refuses ({e.reason}); make the engine with "
            "allow_pickle=True to load it with torch.load(weights_only=False), only if you "
            "trust it as much as code you run") from e
    except UNREADABLE as e:
        raise InvalidArgumentError(f"{path!r}: not a readable torch.save file: {e}") from e


#: Tag directories whose default-engine files were logged (once each per process).
_logged_default: "set[str]" = set()

