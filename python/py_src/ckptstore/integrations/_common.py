"""What the framework integrations share that is about no framework: error messages that
name the checkpoint, the optimizer class checked at resume, DCP's gathered errors, staging
directories and what killed saves leave, and the test seams. One copy, used by every
integration that needs it; no framework is imported here."""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from typing import Any, Dict, List, Optional

from .. import atomic
from ..errors import CheckpointError, ChecksumError, IncompatibleStateError
from ..torch.internal import check_class, group_hyper

# ---- errors naming the checkpoint -------------------------------------------------------------


def prefix_message(e: CheckpointError, prefix: str) -> CheckpointError:
    """``e`` itself (same class and attributes), its message now ``"<prefix>: <message>"``."""
    e.message = f"{prefix}: {e.message}"
    e.args = (e.message, *e.args[1:])
    return e


def name_error(e: CheckpointError, where: str) -> CheckpointError:
    """``e`` itself with ``where`` (the checkpoint or file) leading its message, unless the
    message names it already (the engine's messages name the shard file and the tensor, not
    always the checkpoint)."""
    msg = getattr(e, "message", None)
    if isinstance(msg, str) and where not in msg:
        prefix_message(e, where)
    return e


def dcp_error(e: BaseException, rank: int) -> Optional[CheckpointError]:
    """The ckptstore error inside DCP's ``CheckpointException`` (its ``failures``, every
    rank's error by rank), or ``None``: a :class:`ChecksumError` first (the rank that found
    the damage names it; the others report only that another rank's checks failed), then
    any :class:`CheckpointError`; ``rank``'s own before the other ranks', in rank order."""
    failures = getattr(e, "failures", None) or {}
    order = sorted(failures, key=lambda r: (r != rank, r))
    found = [f[0] if isinstance(f, tuple) else f for f in (failures[r] for r in order)]
    for cls in (ChecksumError, CheckpointError):
        for exc in found:
            if isinstance(exc, cls):
                return exc
    return None


# ---- the optimizer class: recorded at save, checked at resume -----------------------------------


def check_optimizer_class(
    live_class: Optional[str], saved_class: Any, allow_optimizer_change: bool, where: Optional[str] = None
) -> bool:
    """Rule F1 of the one rule (:func:`ckptstore.check_optimizer_fit`), for frameworks that
    check the parameter groups themselves: :class:`ckptstore.IncompatibleStateError` naming
    both classes (and ``where``) when the recorded class (``None``: not recorded) is not the
    live one (``None``: unknown), unless ``allow_optimizer_change``. Returns whether this is
    an allowed change of class."""
    try:
        return check_class(live_class, saved_class, allow_optimizer_change)
    except IncompatibleStateError as e:
        if where:
            name_error(e, where)
        raise


def with_live_hyper(live_groups: Any, saved_groups: Any) -> List[Any]:
    """The checkpoint's parameter groups (matched to the live ones by position), each with
    the live group's hyperparameters for the settings it lacks (``ckptstore.torch.load``'s
    rule for a deliberate change of optimizer class)."""
    out = []
    for i, sg in enumerate(saved_groups):
        if i < len(live_groups) and isinstance(sg, dict):
            g = group_hyper(live_groups[i], sg, True)
            g["params"] = sg.get("params")
            out.append(g)
        else:
            out.append(sg)
    return out


def keep_live_hyper_hook(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """An ``Optimizer.register_load_state_dict_pre_hook`` hook for an allowed change of
    class: the state dict's groups get the live groups' settings they lack
    (:func:`with_live_hyper`)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        return state_dict
    return dict(state_dict, param_groups=with_live_hyper(optimizer.param_groups, groups))


# ---- checkpoint directories, staging directories and what killed saves left ----------------------

#: The manifest of a committed ckptstore checkpoint directory (its commit point).
MANIFEST = "ckpt-manifest.json"

#: Name prefix of a staging directory (:func:`staging_name`).
STAGING_PREFIX = ".ckptstore-staging-"
_LEFTOVER_RE = re.compile(r"^\.ckptstore-staging-.*-(\d+)-[0-9a-f]{12}$")


def staging_name(name: str) -> str:
    """A hidden staging directory's name for ``name``, unique and naming this process:
    ``.ckptstore-staging-<name>-<pid>-<12 hex>`` (:func:`remove_leftovers` removes it once
    the process is gone)."""
    return f"{STAGING_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def alive(pid: int) -> bool:
    """Whether the process ``pid`` exists (this one does; one we may not signal does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(parent: str) -> None:
    """Remove the staging directories (:func:`staging_name`) in ``parent`` of processes that
    are gone, and what an interrupted publish or removal left there
    (:func:`ckptstore.atomic.sweep_leftovers`). A missing ``parent`` holds none."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for n in names:
        m = _LEFTOVER_RE.match(n)
        if m and not alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
    atomic.sweep_leftovers(parent)


def fsync_file(path: str) -> None:
    """Flush the file ``path`` to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- test seams ----------------------------------------------------------------------------------


#: The pause seam's variables, shared with the engine's own points (``before-manifest-rename``).
PAUSE_ENV = "CKPTSTORE_TEST_PAUSE"
PAUSE_DIR_ENV = "CKPTSTORE_TEST_PAUSE_DIR"


def pause_point(point: str, logger: logging.Logger) -> None:
    """A test seam: with ``CKPTSTORE_TEST_PAUSE`` (comma-separated point names) naming
    ``point`` and ``CKPTSTORE_TEST_PAUSE_DIR`` set, write ``<dir>/<point>`` holding this
    process's id and block, for a test to kill the process; inert otherwise."""
    points = os.environ.get(PAUSE_ENV)
    pdir = os.environ.get(PAUSE_DIR_ENV)
    if not points or not pdir or point not in [p.strip() for p in points.split(",")]:
        return
    try:
        with open(os.path.join(pdir, point), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        logger.error("%s: cannot announce %s in %s: %s; not pausing", PAUSE_ENV, point, pdir, e)
        return
    while True:
        time.sleep(3600)
