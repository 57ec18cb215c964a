"""The one codec of the non-tensor Python values a checkpoint's JSON metadata holds
(format-spec/values.md): used by :mod:`ckptstore.torch` (optimizer values, ``extra``, DCP
planner data), the tree of :mod:`ckptstore.integrations._tree` and TorchTitan's state.

A value encodes to JSON: JSON's own values as they are, and a tagged object (one key
starting with ``$``) for what JSON lacks. Tensors are either *stored* (the caller's
``tensor`` callback stores them and names them: ``{"$tensor": name}``) or, without a
callback, small torch tensors are *inlined* (``$inline_tensor``). Anything else is pickled
only with the caller's ``allow_pickle=True``; without it the value is refused with
:class:`~ckptstore.errors.PickleNotAllowedError`, and so is a stored pickle at decode.

Importing this module does not import torch: torch values are recognised only once torch
is imported by someone else, and decoding a torch tag imports it.
"""

from __future__ import annotations

import base64
import binascii
import collections
import math
import pickle
import re
import sys
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from .errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    PickleNotAllowedError,
    UnsupportedFormatError,
)

__all__ = ["Encoder", "Decoder", "DROP", "INLINE_MAX", "is_tagged", "slash_join"]

#: Integers in this range are plain JSON numbers (exact as i64 / u64); others are ``$int``.
I64_MIN, U64_MAX = -(1 << 63), (1 << 64) - 1
#: Most elements of a torch tensor stored inline (no ``tensor`` callback).
INLINE_MAX = 64
#: Returned by a decoder's ``tensor`` callback for a tensor the caller does not want: the
#: entry holding it is left out of its list, tuple, set or dict.
DROP = object()

#: numpy scalar kinds stored as ``$np`` (their ``item()`` round-trips exactly).
_NP_KINDS = "biufUS"
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)\Z")
_TAGS = {
    "$tensor", "$ndarray", "$inline_tensor", "$int", "$float", "$bytes", "$tuple", "$set",
    "$frozenset", "$dict", "$odict", "$np", "$size", "$torch_dtype", "$torch_device",
    "$pickle",
    "$t",  # read-only alias of "$tensor" (TorchTitan's state before values.md)
}
#: The keys beside the tag each form may have (besides the tag itself).
_FIELDS = {"$tensor": {"device", "parameter"}, "$inline_tensor": {"dtype", "shape"},
           "$np": {"value"}}
_REQUIRED = {"$inline_tensor": {"dtype", "shape"}, "$np": {"value"}}


def is_tagged(o: Any) -> bool:
    """Whether JSON object ``o`` is a tagged value (has a key starting with ``$``) rather
    than a plain dict."""
    return isinstance(o, dict) and any(isinstance(k, str) and k.startswith("$") for k in o)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def slash_join(path: str, key: Any) -> str:
    """The default path of a child: ``parent/key`` (``key`` alone at the root), a string key
    escaped as in JSON Pointer (``~`` -> ``~0``, ``/`` -> ``~1``), another key by its
    ``repr``. Paths name stored tensors and appear in error messages."""
    if isinstance(key, str):
        text = _escape(key)
    elif isinstance(key, (bool, int, float)) or key is None:
        text = repr(key)
    else:
        text = _escape(repr(key))
    return f"{path}/{text}" if path else text


def _torch() -> Any:
    """torch if something imported it already (an encoder never imports it)."""
    return sys.modules.get("torch")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class Encoder:
    """Encodes values (:meth:`encode`) per format-spec/values.md.

    ``tensor(value, path) -> name``: stores a torch tensor (and a numpy array when
    ``arrays``) and names it; ``None``: torch tensors of at most :data:`INLINE_MAX`
    elements are inlined, larger ones refused, numpy arrays treated as any other value.
    ``join(path, key)``: a child's path (:func:`slash_join`). ``allow_pickle``: pickle what
    nothing else stores; ``hint``: the end of the refusal's message (how to opt in).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        tensor: Optional[Callable[[Any, str], str]] = None,
        arrays: bool = False,
        join: Callable[[str, Any], str] = slash_join,
        hint: str = "pass allow_pickle=True to store it (and to load it: unpickling runs "
        "code chosen by whoever wrote the checkpoint)",
    ) -> None:
        self.allow_pickle = allow_pickle
        self.tensor = tensor
        self.arrays = arrays and tensor is not None
        self.join = join
        self.hint = hint
        self.torch = _torch()

    def encode(self, v: Any, path: str = "") -> Any:
        """``v`` as a JSON value (``json.dumps(..., allow_nan=False)`` accepts it).

        Raises:
            PickleNotAllowedError: a value only pickle stores, without ``allow_pickle``.
            InvalidArgumentError: a value pickle cannot store either; a tensor too large
                (or not dense) to inline.
        """
        torch = self.torch
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, str):
            return str(v)
        if isinstance(v, int):
            v = int(v)
            return v if I64_MIN <= v <= U64_MAX else {"$int": str(v)}
        if isinstance(v, float):
            v = float(v)
            return v if math.isfinite(v) else {"$float": repr(v)}
        if torch is not None:
            if isinstance(v, torch.Tensor):
                return self._torch_tensor(v, path)
            if isinstance(v, torch.Size):
                return {"$size": [int(x) for x in v]}
            if isinstance(v, torch.dtype):
                return {"$torch_dtype": str(v).replace("torch.", "")}
            if isinstance(v, torch.device):
                return {"$torch_device": str(v)}
        if isinstance(v, np.ndarray) and self.arrays:
            return {"$ndarray": self.tensor(v, path)}  # type: ignore[misc]
        if isinstance(v, np.generic) and v.dtype.kind in _NP_KINDS and (
            v.dtype.kind in "US" or v.dtype.itemsize <= 8
        ):
            return {"$np": v.dtype.str, "value": self.encode(v.item(), path)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": _b64(bytes(v))}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$tuple": [self.encode(x, self.join(path, i)) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, self.join(path, i)) for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            tag = "$frozenset" if isinstance(v, frozenset) else "$set"
            return {tag: [self.encode(x, self.join(path, i)) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            plain = all(isinstance(k, str) and not k.startswith("$") for k in v)
            if plain and not isinstance(v, collections.OrderedDict):
                return {str(k): self.encode(x, self.join(path, k)) for k, x in v.items()}
            tag = "$odict" if isinstance(v, collections.OrderedDict) else "$dict"
            pairs = []
            for k, x in v.items():
                p = self.join(path, k)
                pairs.append([self.encode(k, p + "#key"), self.encode(x, p)])
            return {tag: pairs}
        return self._pickled(v, path)

    def _torch_tensor(self, v: Any, path: str) -> dict:
        torch = self.torch
        if self.tensor is not None:
            out: dict = {"$tensor": self.tensor(v, path)}
            dev = v.device.type if v.device.index is None else f"{v.device.type}:{v.device.index}"
            if dev != "cpu":
                out["device"] = dev
            if isinstance(v, torch.nn.Parameter):
                out["parameter"] = bool(v.requires_grad)
            return out
        where = path or "the value"
        if v.layout != torch.strided or v.numel() > INLINE_MAX:
            raise InvalidArgumentError(
                f"{where}: a tensor stored in JSON has at most {INLINE_MAX} elements and is "
                f"dense (got {v.numel()} elements, layout {v.layout})"
            )
        t = v.detach().to("cpu").contiguous().reshape(-1)
        try:
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(f"{where}: a {v.dtype} tensor cannot be stored in JSON: {e}") from e
        return {"$inline_tensor": _b64(raw), "dtype": str(v.dtype).replace("torch.", ""),
                "shape": [int(x) for x in v.shape]}

    def _pickled(self, v: Any, path: str) -> dict:
        where = path or "the value"
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"{where}: a value of type {type(v).__module__}.{type(v).__qualname__} "
                f"can only be stored pickled; {self.hint}"
            )
        try:
            blob = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's value
            raise InvalidArgumentError(f"{where}: cannot pickle it: {e}") from e
        return {"$pickle": _b64(blob)}


def _torch_import() -> Any:
    import torch

    return torch


class Decoder:
    """Decodes what :class:`Encoder` wrote (and the older tags of values.md §Older writers).

    ``tensor(tag, name, fields)``: the value of a stored tensor (``tag`` ``"$tensor"`` or
    ``"$ndarray"``, ``fields`` the tagged object's other keys), or :data:`DROP`; without it
    a stored tensor is malformed. ``where``: names the checkpoint in error messages.

    Errors (each naming ``where`` and the place in the value): :class:`PickleNotAllowedError`
    (a pickle without ``allow_pickle``), :class:`UnsupportedFormatError` (an unknown tag),
    :class:`CorruptCheckpointError` (a known tag whose content is malformed).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        tensor: Optional[Callable[[str, str, dict], Any]] = None,
        where: str = "the checkpoint",
    ) -> None:
        self.allow_pickle = allow_pickle
        self.tensor = tensor
        self.where = where

    # ---- errors --------------------------------------------------------------------------

    def _bad(self, path: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: the stored value at {path or '/'!r} is malformed ({what})"
        )

    def _refuse_pickle(self, path: str) -> PickleNotAllowedError:
        return PickleNotAllowedError(
            f"{self.where} holds a pickled value at {path or '/'!r}; loading it runs code "
            "chosen by whoever wrote the checkpoint: pass allow_pickle=True only if you trust "
            "the checkpoint as much as code you run"
        )

    def _tag(self, o: dict, path: str) -> str:
        """The tag of tagged object ``o``, its keys checked."""
        tags = [k for k in o if isinstance(k, str) and k.startswith("$")]
        unknown = [k for k in tags if k not in _TAGS]
        if unknown:
            raise UnsupportedFormatError(
                f"{self.where}: unknown tag {unknown[0]!r} in the stored value at {path or '/'!r} "
                "(written by a newer ckptstore?)"
            )
        if len(tags) != 1:
            raise self._bad(path, f"an object with several tags {tags}")
        tag = tags[0]
        rest = set(o) - {tag}
        allowed = _FIELDS.get(tag, set())
        if tag == "$tensor" and isinstance(o[tag], list):
            allowed = {"dtype"}  # ckptstore.torch's inline list (read-only alias)
        if rest - allowed or not _REQUIRED.get(tag, set()) <= rest:
            raise self._bad(path, f"{tag} with the keys {sorted(o)}")
        return tag

    # ---- pass 1: the stored tensors, pickles refused ---------------------------------------

    def scan(self, v: Any, path: str = "") -> Iterator[Tuple[str, str, dict]]:
        """``(tag, name, fields)`` of every stored tensor in ``v``, in order; refuses a
        pickle without ``allow_pickle`` and unknown tags, before anything is built (so a
        caller reads no tensor for a value it would refuse)."""
        if isinstance(v, list):
            for i, x in enumerate(v):
                yield from self.scan(x, f"{path}/{i}")
            return
        if not isinstance(v, dict):
            return
        if not is_tagged(v):
            for k, x in v.items():
                yield from self.scan(x, f"{path}/{_escape(str(k))}")
            return
        tag = self._tag(v, path)
        x = v[tag]
        if tag in ("$tensor", "$t", "$ndarray") and not isinstance(x, list):
            if not isinstance(x, str):
                raise self._bad(path, f"{tag} names no tensor")
            yield ("$ndarray" if tag == "$ndarray" else "$tensor", x,
                   {k: y for k, y in v.items() if k != tag})
        elif tag == "$pickle" and not self.allow_pickle:
            raise self._refuse_pickle(path)
        elif tag == "$np":
            yield from self.scan(v["value"], path)
        elif tag in ("$tuple", "$set", "$frozenset", "$dict", "$odict") and isinstance(x, list):
            for i, y in enumerate(x):
                yield from self.scan(y, f"{path}/{i}")

    # ---- pass 2: the value -----------------------------------------------------------------

    def decode(self, v: Any, path: str = "") -> Any:
        """The value of JSON value ``v`` (:data:`DROP` if it is a dropped tensor)."""
        if isinstance(v, list):
            return self._items(v, path)
        if not isinstance(v, dict):
            return v  # JSON's own leaves (and a value decoded already, e.g. a live group's tuple)
        if not is_tagged(v):
            out = {}
            for k, x in v.items():
                y = self.decode(x, f"{path}/{_escape(str(k))}")
                if y is not DROP:
                    out[k] = y
            return out
        tag = self._tag(v, path)
        x = v[tag]
        try:
            return self._tagged(tag, x, v, path)
        except (CorruptCheckpointError, UnsupportedFormatError, PickleNotAllowedError):
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RuntimeError,
                binascii.Error) as e:
            raise self._bad(path, f"{tag}: {e}") from e

    def _items(self, x: Any, path: str, tag: str = "a list") -> List[Any]:
        if not isinstance(x, list):
            raise self._bad(path, f"{tag} holds no list")
        out = [self.decode(y, f"{path}/{i}") for i, y in enumerate(x)]
        return [y for y in out if y is not DROP]

    def _pairs(self, x: Any, path: str, tag: str) -> List[Tuple[Any, Any]]:
        if not isinstance(x, list) or not all(isinstance(p, list) and len(p) == 2 for p in x):
            raise self._bad(path, f"{tag} holds no list of pairs")
        out = []
        for i, (k, y) in enumerate(x):
            val = self.decode(y, f"{path}/{i}")
            if val is not DROP:
                out.append((self.decode(k, f"{path}/{i}#key"), val))
        return out

    def _tagged(self, tag: str, x: Any, o: dict, path: str) -> Any:
        if tag in ("$tensor", "$t", "$ndarray") and not isinstance(x, list):
            if not isinstance(x, str):
                raise self._bad(path, f"{tag} names no tensor")
            if self.tensor is None:
                raise self._bad(path, f"a stored tensor {x!r} where none is expected")
            kind = "$ndarray" if tag == "$ndarray" else "$tensor"
            return self.tensor(kind, x, {k: y for k, y in o.items() if k != tag})
        if tag == "$tensor":  # ckptstore.torch's inline list (read-only alias)
            torch = _torch_import()
            return torch.tensor(x, dtype=self._torch_dtype(o.get("dtype"), path))
        if tag == "$inline_tensor":
            return self._inline(x, o, path)
        if tag == "$int":
            if not isinstance(x, str) or not _INT_RE.match(x):
                raise self._bad(path, f"$int holds {x!r}, not a decimal integer")
            return int(x)
        if tag == "$float":
            if x not in _FLOATS:
                raise self._bad(path, f"$float holds {x!r}, not nan, inf or -inf")
            return _FLOATS[x]
        if tag in ("$bytes", "$pickle"):
            if not isinstance(x, str):
                raise self._bad(path, f"{tag} holds no base64 text")
            raw = base64.b64decode(x, validate=True)
            if tag == "$bytes":
                return raw
            if not self.allow_pickle:
                raise self._refuse_pickle(path)
            return pickle.loads(raw)  # noqa: S301 - the caller opted in
        if tag == "$tuple":
            return tuple(self._items(x, path, tag))
        if tag in ("$set", "$frozenset"):
            items = self._items(x, path, tag)
            return frozenset(items) if tag == "$frozenset" else set(items)
        if tag in ("$dict", "$odict"):
            pairs = self._pairs(x, path, tag)
            return collections.OrderedDict(pairs) if tag == "$odict" else dict(pairs)
        if tag == "$np":
            if not isinstance(x, str):
                raise self._bad(path, "$np holds no dtype")
            dt = np.dtype(x)
            if dt.kind not in _NP_KINDS or (dt.kind not in "US" and dt.itemsize > 8):
                raise self._bad(path, f"$np of dtype {x!r}")
            return dt.type(self.decode(o["value"], path))
        if tag == "$size":
            if not isinstance(x, list) or not all(type(d) is int and d >= 0 for d in x):
                raise self._bad(path, "$size holds no list of sizes")
            return _torch_import().Size(x)
        if tag == "$torch_dtype":
            return self._torch_dtype(x, path)
        if tag == "$torch_device":
            if not isinstance(x, str):
                raise self._bad(path, "$torch_device holds no device")
            return _torch_import().device(x)
        raise self._bad(path, f"{tag} holds {x!r:.80}")  # pragma: no cover - _tag lists them

    def _torch_dtype(self, name: Any, path: str) -> Any:
        torch = _torch_import()
        dt = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dt, torch.dtype):
            raise self._bad(path, f"{name!r} is not a torch dtype")
        return dt

    def _inline(self, x: Any, o: dict, path: str) -> Any:
        torch = _torch_import()
        dtype = self._torch_dtype(o["dtype"], path)
        shape = o["shape"]
        if not isinstance(x, str) or not isinstance(shape, list) or not all(
            type(d) is int and d >= 0 for d in shape
        ):
            raise self._bad(path, "$inline_tensor holds no base64 text and shape")
        raw = base64.b64decode(x, validate=True)
        numel = math.prod(shape)
        if len(raw) != numel * dtype.itemsize:
            raise self._bad(path, f"$inline_tensor of {len(raw)} bytes for {shape} {dtype}")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)


def has_pickle(v: Any) -> bool:
    """Whether a stored JSON value holds a pickled value (loading it needs ``allow_pickle``)."""
    if isinstance(v, list):
        return any(has_pickle(x) for x in v)
    if isinstance(v, dict):
        if is_tagged(v) and "$pickle" in v:
            return True
        return any(has_pickle(x) for x in v.values())
    return False
