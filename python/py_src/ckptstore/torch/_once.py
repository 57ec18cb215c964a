"""Decisions made once: what every rank must act on alike (which step is the newest, which
tag ``latest`` names) read by one rank and handed to all.

On a shared file system each host sees the directory through its own client caches: a name
looked up and missed stays missing there for up to a minute (GlusterFS's negative-lookup
cache, NFS's ``lookupcache``), a replaced file keeps its old attributes for seconds. Ranks that
each list the directory can disagree on whether a checkpoint exists, and then one rank loads
while another does not, and the job deadlocks in the first collective. So the first rank of
the group decides, and the others take its answer (or raise its error) without looking
(format-spec/durability.md, "On a shared file system").
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, TypeVar

from ..errors import CheckpointError

_T = TypeVar("_T")


def _decided_once(decide: Callable[[], _T], *, what: str, process_group: Any = None) -> _T:
    """``decide()`` run by the first rank of ``process_group`` (the default group when
    ``None``) alone, and its result handed to every rank of the group; without an initialized
    process group (or in a group of one) simply ``decide()``. Every rank of the group must
    call this at the same point, as any collective.

    Raises what ``decide()`` raised on the first rank, on every rank: the same exception where
    it pickles, else (on the other ranks) :class:`ckptstore.CheckpointError` naming ``what``
    and it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return decide()
    box: list[Optional[tuple[Any, Optional[BaseException]]]] = [None]
    mine: Optional[BaseException] = None  # the first rank's own error, raised there as it is
    if dist.get_rank(process_group) == 0:
        try:
            box[0] = (decide(), None)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            mine = err = e
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an error that does not travel is sent as text
                err = CheckpointError(f"{what} (decided on the first rank): {type(e).__name__}: {e}")
            box[0] = (None, err)
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    got = box[0]
    assert got is not None  # the broadcast filled it on every rank
    value, error = got
    if mine is not None:
        raise mine
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]
