"""The one fault seam of the crash and chaos tests (internal: in no ``__all__``).

``CKPTSTORE_FAULT="<point>[:<step>][@<rank>][#<n>]"`` makes the process SIGKILL itself the
``n``-th time (from 1; default the first) it reaches ``point`` at ``step`` on ``rank``
(a part left out matches any step or rank). Unset, a point costs one environment lookup.
A spec that does not parse, or names a point that does not exist (a test whose fault could
never fire), raises :class:`~ckptstore.errors.InvalidArgumentError` naming the variable.
The count starts when the spec is first seen, and again at each :func:`arm`.

The points (:data:`POINTS`), by area:

- ``manager.snapshot`` (each tensor copied into the snapshot buffers), ``manager.write``
  (the background thread, before a save's write), ``manager.restore`` (inside the step's
  lease, before the load): :class:`ckptstore.torch.CheckpointManager`;
- ``tiers.snapshot`` (the save's copy made), ``tiers.local-write`` (the part written, before
  its CRCs are gathered), ``tiers.replicate`` (the host's files sent, before the received
  ones are published), ``tiers.record`` (``commit.json`` written, before the index names the
  step), ``tiers.persist-upload`` (a host's shards in the persistent tier, before its part
  descriptors), ``tiers.persist-commit`` (before the persistent commit), ``tiers.restore``
  (the step assembled, before the load): the tiered manager, with steps and ranks;
- ``torchtitan.write``, ``torchtitan.commit``: the TorchTitan manager, with steps;
- ``deepspeed.save`` (in ``save``), ``deepspeed.publish`` (before the tag is published),
  ``deepspeed.latest`` (published, before ``latest`` is written): the DeepSpeed engine.

The engine's own pause seam (``CKPTSTORE_TEST_PAUSE``, shared with the Rust writer) is a
different thing: it holds a process at a point for a test to kill from outside.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from typing import NamedTuple, Optional

from .errors import InvalidArgumentError

#: The variable.
ENV = "CKPTSTORE_FAULT"

POINTS = frozenset(
    {
        "manager.snapshot",
        "manager.write",
        "manager.restore",
        "tiers.snapshot",
        "tiers.local-write",
        "tiers.replicate",
        "tiers.record",
        "tiers.persist-upload",
        "tiers.persist-commit",
        "tiers.restore",
        "torchtitan.write",
        "torchtitan.commit",
        "deepspeed.save",
        "deepspeed.publish",
        "deepspeed.latest",
    }
)

_GRAMMAR = re.compile(r"(?P<point>[a-z]+\.[a-z-]+)(?::(?P<step>\d+))?(?:@(?P<rank>\d+))?(?:#(?P<nth>\d+))?")


class Fault(NamedTuple):
    """A parsed spec."""

    point: str
    step: Optional[int]
    rank: Optional[int]
    nth: int


def parse(spec: str) -> Fault:
    """The fault ``spec`` asks for; :class:`InvalidArgumentError` if it is malformed or
    names no point."""
    m = _GRAMMAR.fullmatch(spec)
    if m is None or m["point"] not in POINTS or (m["nth"] is not None and int(m["nth"]) < 1):
        raise InvalidArgumentError(
            f"{ENV}={spec!r}: expected <point>[:<step>][@<rank>][#<n>], n >= 1, with a point among "
            f"{', '.join(sorted(POINTS))}"
        )

    def num(g: str) -> Optional[int]:
        return None if m[g] is None else int(m[g])

    return Fault(m["point"], num("step"), num("rank"), num("nth") or 1)


_lock = threading.Lock()
_spec: Optional[str] = None
_fault: Optional[Fault] = None
_hits = 0


def arm() -> Optional[Fault]:
    """Read the variable now (raising for a malformed spec) and start its count again; the
    fault it asks for, or None."""
    global _spec, _fault, _hits
    spec = os.environ.get(ENV) or None
    fault = parse(spec) if spec else None
    with _lock:
        _spec, _fault, _hits = spec, fault, 0
    return fault


def armed(point: str) -> bool:
    """Whether the variable asks for a fault at ``point`` (for a caller that would wrap a
    hot loop only then)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    if spec != _spec:
        arm()
    return _fault is not None and _fault.point == point


def fault_point(point: str, step: Optional[int] = None, rank: Optional[int] = None) -> None:
    """A point a test may kill the process at (see the module's docstring)."""
    global _hits
    spec = os.environ.get(ENV)
    if not spec:
        return
    if spec != _spec:
        arm()
    f = _fault
    if f is None or f.point != point:
        return
    if (f.step is not None and f.step != step) or (f.rank is not None and f.rank != rank):
        return
    with _lock:
        _hits += 1
        hit = _hits >= f.nth
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
