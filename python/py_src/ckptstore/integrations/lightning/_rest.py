"""The rest of a Lightning checkpoint dict (loops, callbacks, schedulers, hyperparameters:
everything beside the model and the optimizers) as :class:`ModelParallelStrategy` stores it
in both its modes: a JSON tree in the value codec plus its tensors, and back."""

from __future__ import annotations

from typing import Any, Dict

import torch

#: Manifest metadata key under which :class:`ModelParallelStrategy` keeps the rest of
#: Lightning's checkpoint dict (beside DCP's own metadata); in the tiered mode, the key of
#: the ``extra`` entry that holds it.
DCP_TREE_KEY = "ckptstore.lightning"
_DCP_TREE_VERSION = 1
#: DCP state-dict key of the tensors of the rest of the dict (tiered mode: their ``extra``
#: keys are ``"<this>/<name>"``).
_DCP_EXTRA = "ckptstore.extra"


def split_rest(rest: Dict[str, Any], allow_pickle: bool) -> tuple:
    """The non-model, non-optimizer part of a Lightning checkpoint as a JSON skeleton and
    its tensors ``{name: tensor}`` (numpy arrays as CPU tensors), described in the
    skeleton."""
    from .._tree import Flattener

    tensors: Dict[str, Any] = {}
    described: Dict[str, Any] = {}

    def prepare(name: str, v: Any) -> tuple:
        import numpy as np

        if isinstance(v, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(v))
            kind = "ndarray"
        else:
            t = v.detach()
            kind = "tensor"
        tensors[name] = t
        described[name] = {"kind": kind, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
        return (name,)

    f = Flattener(prepare, allow_pickle)
    skeleton = f.walk(rest, "")
    return {"version": _DCP_TREE_VERSION, "tree": skeleton, "tensors": described}, tensors



def build_rest(tree: Dict[str, Any], fresh: Dict[str, Any], location: str, allow_pickle: bool) -> Any:
    """The object :func:`split_rest` stored as ``tree``, its tensors ``fresh`` (by name, as
    read back: CPU tensors), with pickled values refused unless ``allow_pickle``."""
    from .._tree import Loader

    loader = Loader(None, location, allow_pickle, None)
    for name, d in (tree.get("tensors") or {}).items():
        t = fresh[name]
        if d.get("kind") == "ndarray":
            loader.fresh[("$ndarray", name)] = t.numpy()
        else:
            loader.fresh[("$tensor", name)] = t
    return loader.build(tree["tree"])
