"""The steps under a checkpoint folder (ckptstore's and TorchTitan's own) and retention."""

from __future__ import annotations

import os
import re
from typing import Optional

from ... import CheckpointManager as _EngineManager
from ... import atomic
from ._stock_steps import _is_stock_step

#: A step directory of TorchTitan's own manager (``step-<N>``, no padding) or of ours.
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The directory name of ``step`` (the engine manager's ``step-<8+ digits>``)."""
    return f"step-{int(step):08d}"


def _join(base: str, name: str) -> str:
    if not base:
        return name
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


class _Steps:
    """The committed steps under a folder and retention, by the engine's managers."""

    def __init__(self, folder: str, keep_latest_k: int) -> None:
        self.folder = folder
        self.keep = keep_latest_k if keep_latest_k > 0 else None
        self.remote = "://" in folder
        self._local: Optional[_EngineManager] = None

    def _mgr(self) -> _EngineManager:
        if self._local is None:
            self._local = _EngineManager(self.folder, keep_last=self.keep)
        return self._local

    def path(self, step: int) -> str:
        return _join(self.folder, step_name(step))

    def steps(self) -> list[int]:
        if not self.remote and not os.path.isdir(self.folder):
            return []
        return list(self._mgr().steps())

    def latest(self) -> Optional[int]:
        s = self.steps()
        return s[-1] if s else None

    def _gc_local(self) -> None:
        """Keep the newest ``keep`` steps of both kinds by step (a ckptstore step wins a tie,
        and the newest ckptstore step is always kept): stock steps beyond them are renamed
        out of the ``step-<N>`` names, then deleted; ckptstore steps go through the engine's
        manager (which never deletes a step a reader holds)."""
        assert self.keep is not None
        atomic.sweep_leftovers(self.folder)  # what a removal cut short left
        stock = self.stock_steps()
        if not stock:
            self._mgr().gc()
            return
        ours = self.steps()
        every = sorted([(s, 0) for s in stock] + [(s, 1) for s in ours])
        kept = every[-self.keep:]
        for s, kind in every[: -self.keep]:
            if kind == 0:
                atomic.remove_dir(stock[s])  # whole or not at all
        if ours:
            keep_ours = max(1, sum(1 for _, kind in kept if kind == 1))
            _EngineManager(self.folder, keep_last=keep_ours).gc()

    def stock_steps(self) -> dict[int, str]:
        """The steps TorchTitan's own manager wrote under a local folder (``step-<N>``
        holding DCP's ``.metadata`` or a Hugging Face export), by step."""
        if self.remote or not os.path.isdir(self.folder):
            return {}
        out: dict[int, str] = {}
        for name in sorted(os.listdir(self.folder)):
            m = _STEP_RE.match(name)
            path = os.path.join(self.folder, name)
            if m and os.path.isdir(path) and _is_stock_step(path):
                out.setdefault(int(m.group(1)), path)
        return out

    def gc(self) -> None:
        if self.keep is None:
            return
        if not self.remote:
            self._gc_local()
            return
        self._mgr().gc()

