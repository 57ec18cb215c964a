"""The non-tensor state of a step as JSON (the manifest's ``ckptstore.torchtitan`` entry), in
the package's one value codec (:mod:`ckptstore._codec`, format-spec/values.md): tensors out
under their flat DCP names (``{"$tensor": name}``), the rest a skeleton naming them; decoded
back with pickled values refused unless the caller opts in."""

from __future__ import annotations

from typing import Any

import torch

from ..._codec import DROP, Decoder, Encoder, is_tagged
from ...errors import InvalidArgumentError

#: Manifest metadata key of the non-tensor state (JSON); in the tiered mode, the key of the
#: ``extra`` entry that holds it.
STATE_KEY = "ckptstore.torchtitan"
_VERSION = 1


def _dot_join(path: str, key: Any) -> str:
    """A child's flat DCP name: ``parent.key`` (``key`` alone at the root)."""
    return f"{path}.{key}" if path else str(key)


class _Encoder:
    """Walks a state dict: tensors out into ``tensors`` (flat DCP names), the rest into a
    JSON skeleton that names them."""

    def __init__(self, allow_pickle: bool) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._codec = Encoder(
            allow_pickle=allow_pickle, tensor=self._tensor, join=_dot_join,
            hint="storing it needs pickle (allow_pickle=True in the checkpoint config)",
        )

    def _tensor(self, v: Any, path: str) -> str:
        if path in self.tensors:
            raise InvalidArgumentError(f"two state entries flatten to the same name {path!r}")
        self.tensors[path] = v
        return path

    def encode(self, v: Any, path: str) -> Any:
        return self._codec.encode(v, path)


def _decode(v: Any, tensors: dict[str, Any], allow_pickle: bool, where: str) -> Any:
    """The value of skeleton ``v``; tensor references become ``tensors[name]``, and an
    entry holding a tensor the load did not ask for is left out."""
    dec = Decoder(allow_pickle=allow_pickle, where=where,
                  tensor=lambda _kind, name, _fields: tensors.get(name, DROP))
    return dec.decode(v)


def _merge(a: Any, b: Any) -> Any:
    """Rank skeletons merged key by key (plain objects only); ``a`` (lower rank) wins."""
    if (
        isinstance(a, dict)
        and isinstance(b, dict)
        and not is_tagged(a)
        and not is_tagged(b)
    ):
        out = dict(a)
        for k, y in b.items():
            out[k] = _merge(a[k], y) if k in a else y
        return out
    return a


def _substitute(v: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Placeholders (``_Ref``) -> the loaded tensors."""
    if isinstance(v, _Ref):
        return tensors[v.name]
    if isinstance(v, dict):  # OrderedDict stays one
        return type(v)((k, _substitute(x, tensors)) for k, x in v.items())
    if isinstance(v, list):
        return [_substitute(x, tensors) for x in v]
    if isinstance(v, tuple):
        return tuple(_substitute(x, tensors) for x in v)
    return v


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
