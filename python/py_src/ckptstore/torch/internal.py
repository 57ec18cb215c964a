"""The helpers of :mod:`ckptstore.torch` that other ckptstore modules (the framework
integrations in :mod:`ckptstore.integrations`) build on, under public names, so that no
module outside ``ckptstore.torch`` reaches into its private ones.

Not the user API (that is ``ckptstore.torch.__all__``): these change with ckptstore. Importing
this module does not import torch (:func:`torch_module` does, on first use).
"""

from __future__ import annotations

from ._dtypes import _bytes_of as bytes_of
from ._dtypes import _empty_for as empty_for
from ._dtypes import _to_numpy as to_numpy
from ._dtypes import _torch as torch_module
from ._items import _build_items as build_items
from ._once import _decided_once as decided_once
from ._saver import AsyncSaver, Handle, Snapshot, check_max_in_flight
from ._state import _check_class as check_class
from ._state import _group_hyper as group_hyper
from ._state import _optimizer_class as optimizer_class

__all__ = [
    "bytes_of",
    "empty_for",
    "to_numpy",
    "torch_module",
    "build_items",
    "decided_once",
    "check_class",
    "group_hyper",
    "optimizer_class",
    "AsyncSaver",
    "Handle",
    "Snapshot",
    "check_max_in_flight",
]

# What each is (the docstrings are the private originals'):
#
# * ``torch_module()``: ``torch``, imported on first use, with the dtype tables filled;
# * ``to_numpy(name, tensor)``: ``(name, wire dtype, array)`` over the tensor's memory;
# * ``empty_for(info, device=None)``: a fresh tensor for a stored tensor's ``info``;
# * ``bytes_of(tensor)``: the tensor's bytes as a flat ``uint8`` array (no copy);
# * ``build_items(model, optimizer, extra, prepare)``: what :func:`ckptstore.torch.save`
#   stores (entries, metadata JSON, optimizer parts), tensors through ``prepare``;
# * ``decided_once(decide, what=, process_group=None)``: ``decide()`` on the group's first rank
#   alone, its result (or its error) on every rank (what the ranks must act on alike, read
#   once where client caches could show each host another directory);
# * ``optimizer_class(optimizer)``: the class name recorded and compared (rule F1), seen
#   through the frameworks' pass-through wrappers;
# * ``check_class(live, saved, allow_optimizer_change)``: rule F1 alone; whether this is an
#   allowed change of class;
# * ``group_hyper(live_group, saved_group, keep_live)``: a group's hyperparameters for
#   ``load_state_dict`` (with ``keep_live``, the live group's for the settings missing);
# * ``Snapshot``: one set of reused snapshot buffers (``begin``, ``copy``, ``end``);
# * ``Handle``: a background save's outcome (``done``, ``wait``), set once by its writer;
# * ``AsyncSaver``: THE background saver (snapshot, ordered writer thread, max in flight,
#   ``wait``/``close`` raising the first unseen error); ``check_max_in_flight`` its argument
#   check, for a caller that makes its saver later.
