"""Helpers shared by the benchmark scripts python/benches/bench_*.py (not a test, not part of the
package): the files of a checkpoint, fsync, page-cache eviction and warming, process memory,
state sizes, best-of timings and the fresh-process children's JSON.

Only the standard library is imported here (torch inside the functions that take tensors),
so that a script that takes its own folder off ``sys.path`` (to import the installed
``ckptstore``, not the source beside it) can import this module first::

    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, _here)
    from bench_util import evict, files_of  # noqa: E402
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any, Iterable, Mapping, Optional, Sequence


def parse_size(s: str) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"2GB"``, ``"4096"``: bytes."""
    s = s.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


# ---- files -------------------------------------------------------------------------------


def files_of(path: str) -> list:
    """``[path]`` for a file, else every file under the directory ``path``, sorted."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, fs in os.walk(path):
        out += [os.path.join(root, f) for f in fs]
    return sorted(out)


def remove(path: str) -> None:
    """Remove the file or directory tree ``path``, if there is one."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def fsync_file(path: str) -> None:
    """fsync one file (or directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync every file under ``path`` (or the file) and its directory."""
    for p in files_of(path) + [path if os.path.isdir(path) else os.path.dirname(path)]:
        fsync_file(p)


def evict(path: str) -> None:
    """Drop every file under ``path`` (or the file) from the page cache, after an fsync."""
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict_checked(path: str, nbytes: int) -> None:
    """:func:`evict`, then, where ``fincore`` is installed, exit unless less than 1% of
    ``nbytes`` of the files is still cached."""
    evict(path)
    if shutil.which("fincore"):
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES"] + files_of(path),
                             capture_output=True, text=True).stdout.split()
        cached = sum(int(x) for x in out if x.isdigit())
        if cached > nbytes // 100:
            raise SystemExit(f"eviction did not take: {cached} bytes of {path} cached")


def raw_read(path: str) -> int:
    """Read every file under ``path`` (or the file) once, ``pread`` into one reused 8 MiB
    buffer (the page cache warmed, or the disk's speed measured); the bytes read."""
    n = 0
    buf = bytearray(8 << 20)
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while True:
                r = os.preadv(fd, [buf], off)
                if r <= 0:
                    break
                off += r
            n += off
        finally:
            os.close(fd)
    return n


class ReadThrottle:
    """A control group that holds reads from the disk behind ``path`` to ``bytes_per_s``
    (cgroup v2 ``io.max rbps``, or v1 ``blkio.throttle.read_bps_device``; root only), for
    cold figures that do not move with a shared disk's load: a process joins it with
    :meth:`enter` (``subprocess.run(..., preexec_fn=throttle.enter)``), and every read it
    makes from that disk, page faults on mapped files included, goes at most that fast.
    :meth:`close` removes the group once its processes have exited. Exits with a message
    where the system offers no such group (not root, no cgroup file system)."""

    def __init__(self, path: str, bytes_per_s: int) -> None:
        dev = os.stat(path).st_dev
        node = f"{os.major(dev)}:{os.minor(dev)}"
        sysdev = os.path.realpath(f"/sys/dev/block/{node}")
        # The rule names a whole disk: a partition's is its parent's.
        if os.path.exists(os.path.join(sysdev, "partition")):
            with open(os.path.join(os.path.dirname(sysdev), "dev")) as f:
                node = f.read().strip()
        name = f"ckptstore-bench-{os.getpid()}"
        try:
            if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                    f.write("+io")
                self.dir = os.path.join("/sys/fs/cgroup", name)
                rule, value = "io.max", f"{node} rbps={bytes_per_s}"
            else:
                self.dir = os.path.join("/sys/fs/cgroup/blkio", name)
                rule, value = "blkio.throttle.read_bps_device", f"{node} {bytes_per_s}"
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, rule), "w") as f:
                f.write(value)
        except OSError as e:
            raise SystemExit(f"cannot throttle reads from {node} ({path}): {e}; "
                             "a cgroup file system and root are needed") from e
        self.rule = f"{rule} = {value}"

    def enter(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``)."""
        with open(os.path.join(self.dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        """Remove the group (its processes must have exited)."""
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


# ---- memory and state --------------------------------------------------------------------


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``; 0 if absent). VmHWM,
    not getrusage's ru_maxrss, for a child's peak: Linux carries ru_maxrss over exec from
    the forking parent, VmHWM is this process's own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def state_bytes(model: Any, opt: Any) -> int:
    """Bytes of ``model.state_dict()`` plus the optimizer's state tensors."""
    import torch

    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
    return n


# ---- timing ------------------------------------------------------------------------------


def copy_seconds(tensors: Sequence[Any], repeat: int = 3) -> float:
    """Best seconds of one ``copy_`` of every tensor into preallocated buffers (faulted in
    by a first copy): memory speed, the floor of any snapshot."""
    import torch

    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors):
        b.copy_(t)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


def keep_best(
    best: dict, key: Any, run: Mapping[str, float], keys: Optional[Iterable[str]] = None
) -> dict:
    """Merge one run's figures into ``best[key]``: the smallest value of each of ``keys``
    (default: all of them) so far; the first run is kept whole. Returns ``best[key]``."""
    b = best.setdefault(key, dict(run))
    for k in run if keys is None else keys:
        b[k] = min(b[k], run[k])
    return b


def run_json(cmd: list, failed: str, env: Optional[dict] = None) -> dict:
    """Run a benchmark child and return the JSON object of its last line of output; exit
    with ``failed`` and the end of its stderr if it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{failed}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
