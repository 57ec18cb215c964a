"""Checkpoints of a framework's own engine (``torch.save`` pickles: a run begun without
ckptstore) read as plain data: ``torch.load(weights_only=True)``, allowing only the classes the
caller names; full unpickling (``weights_only=False``) only with the caller's ``allow_pickle``
opt-in. One copy for every integration that loads such files (Lightning's ``torch.save``
checkpoints, DeepSpeed's default engine, TorchTitan's DCP steps); each words its own errors."""

from __future__ import annotations

import pickle
from typing import Any, Iterable

#: What ``torch.load`` raises for bytes that are no ``torch.save`` data it can read (an I/O
#: error stays an ``OSError``).
UNREADABLE = (
    pickle.UnpicklingError,
    RuntimeError,
    EOFError,
    ValueError,
    KeyError,
    AttributeError,
    ImportError,
)


class WeightsOnlyRefusal(Exception):
    """``torch.load(weights_only=True)`` refused the data: ``reason`` says what it met (a
    global it does not allow, say), without torch's advice."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def weights_only_reason(message: str) -> str:
    """The reason in ``torch.load``'s weights-only refusal, without its advice, on one line."""
    i = message.find("WeightsUnpickler error:")
    r = message[i + len("WeightsUnpickler error:") :] if i >= 0 else message
    r = r.split("Check the documentation of torch.load")[0]
    return " ".join(r.replace("\033[1m", "").replace("\033[0m", "").split())[:500]


def torch_load(
    source: Any, *, map_location: Any = None, allow_pickle: bool = False, safe_globals: Iterable[Any] = ()
) -> Any:
    """``torch.load(source)`` (a path or a file object): with ``weights_only=True`` allowing
    ``safe_globals`` besides torch's own, or ``weights_only=False`` when ``allow_pickle``.

    Raises :class:`WeightsOnlyRefusal` when ``weights_only=True`` refuses the data; what
    ``torch.load`` raises otherwise (:data:`UNREADABLE` for data it cannot read)."""
    import torch

    if allow_pickle:
        return torch.load(source, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise WeightsOnlyRefusal(weights_only_reason(str(e))) from e
