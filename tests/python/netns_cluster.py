"""A cluster on one machine: hosts made of Linux network namespaces (issue 39).

Each host is a network namespace with one interface, ``eth0``, on a bridge in the root
namespace, an address of its own and its own local directory seen at the same path by every
process started in it. torch.distributed (gloo) jobs run across the hosts as they would across
machines; a host can be lost (its link cut, then every process in it killed: its peers get no
FIN and block until their timeout), partitioned from others, capped in bandwidth and replaced.
Needs root, ``ip`` (iproute2), ``tc`` and ``unshare``; :func:`skip_reason` says why not where
it cannot work. Standard library only (the jobs import torch, this module never does).

    from netns_cluster import Cluster
    with Cluster(3) as c:                               # hosts 0..2 at c.addr(0..2)
        job = c.start([sys.executable, "train.py"], ranks_per_host=1, hosts=[0, 1])
        ...
        c.lose_host(1, wipe_local=True)                 # link down, then kill all in it
        c.partition([0], [2]); c.heal()
        c.cap(2, "200MiB/s")                            # tbf on host 2's link, both ways
        c.replace_host(1)                               # fresh host, same address, empty disk
        job.wait(timeout=60)
    # every namespace, link, bridge and temp dir is gone here, also when the body raised

Names and addresses. A cluster's names start with ``ck<pid>-<n>`` (n: the lowest number free
on this machine for this pid): namespaces and root-side veths ``ck<pid>-<n>h<i>``, the bridge
``ck<pid>-<n>b``, the partition bridge ``ck<pid>-<n>p``. Its subnet is a 10.79.x.0/24 that no
route or address of the root namespace overlaps (chosen under a lock file, so two runs on one
machine never take the same); the bridge has .1 (``gateway``: a server in the root namespace
is reachable from the hosts there), host i has .(10+i).

Directories. ``<base>`` is a new ``ckptstore-netns-<tag>-XXXX`` in ``base_dir`` (default: the
temp dir), removed by close. Host i's local directory is ``<base>/hosts/h<i>.<generation>``; every process
started through this module in host i sees it at ``local_path`` (``<base>/local`` unless
given), by a bind mount in a private mount namespace of its own (``unshare --mount
--propagation private``, under ``ip netns exec``), so nothing is mounted in the root
namespace and the mounts end with the processes. ``shared`` (``<base>/shared``) is an
ordinary directory, the same for every host: the shared file system.

Environment of every process started in host i: ``CLUSTER_HOST=i``, ``CLUSTER_ADDR``,
``CLUSTER_LOCAL`` (= local_path), ``CLUSTER_SHARED``, ``GLOO_SOCKET_IFNAME=eth0``; a job's
ranks also get ``MASTER_ADDR`` (the address of the job's first host), ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and
``NODE_RANK``. Ranks are numbered host by host: ranks 0..r-1 on the job's first host.

Verbs (see each method):
- ``start(argv, ranks_per_host, hosts, env)``: a job of len(hosts) * ranks_per_host ranks.
- ``lose_host(i, wipe_local)``: ``eth0`` down first, then SIGKILL to every process of the
  namespace (``ip netns pids``) until none is left; the local directory emptied or kept.
- ``partition(a, b)`` / ``heal()``: the root-side ports of group b's hosts move to a second
  bridge that is connected to nothing; frames between the groups are dropped silently (no
  RST, no ICMP), as when a switch splits. Hosts named in neither group stay with group a and
  the root namespace. ``heal()`` moves every port back; the TCP connections that had not
  timed out meanwhile carry on.
- ``cap(i, rate)`` / ``uncap(i)``: a tbf qdisc at that rate on host i's eth0 (what it sends)
  and on its root-side veth (what it receives).
- ``replace_host(i)``: the old namespace destroyed, a new one at the same address with an
  empty local directory (a new machine put in the lost one's place).
- ``close()``: kill every process of every host, delete the links, bridges, namespaces and
  the temp dir. Idempotent; also run at exit and on SIGTERM/SIGHUP (turned into SystemExit
  when no other handler was set). ``sweep_stale()`` removes what a SIGKILLed run left
  (``scripts/netns-cluster.py down``). The only thing kept on the machine is the empty lock
  file /run/lock/ckptstore-netns-cluster.lock; /run/netns, which `ip netns add` makes a
  mount, is unmounted again by the last cluster to close if a cluster made it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dist_helpers import exit_together  # every job's end (stdlib only at import)

RUN_NETNS = "/run/netns"
LOCK_FILE = "/run/lock/ckptstore-netns-cluster.lock"
# Written when a cluster's first `ip netns add` made /run/netns (a mount, made by ip): the
# last cluster to close unmounts it again if it is empty, so nothing stays mounted.
RUN_NETNS_MARKER = "/run/lock/ckptstore-netns-cluster.made-run-netns"
NAME_RE = re.compile(r"^ck(\d+)-(\d+)([hbp])(\d*)$")
IFNAMSIZ = 15
BASE_PORT = 29500
KILL_DEADLINE_S = 30.0

_LIVE: set = set()
_LIVE_LOCK = threading.RLock()
_SIGNALS_INSTALLED = False


class ClusterError(RuntimeError):
    """A command of the harness failed (the message holds the command and its stderr)."""


def _cmd(*argv, check=True, timeout=60) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, argv))}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


@contextlib.contextmanager
def _machine_lock():
    """The lock every cluster on this machine takes to pick names and subnets."""
    os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _netns_names() -> list[str]:
    r = _cmd("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    r = _cmd("ip", "-o", "link", "show", check=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def _ns_pids(ns: str) -> list[int]:
    r = _cmd("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_ns(ns: str, deadline_s: float = KILL_DEADLINE_S) -> None:
    """SIGKILL every process of namespace ``ns`` until none is left (new ones forked
    meanwhile included). Raises ClusterError if some survive ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        if time.monotonic() > end:
            raise ClusterError(f"processes {pids} of namespace {ns} survive SIGKILL")
        time.sleep(0.02)  # let the kernel finish the kills before listing again


def _is_mount(path: str) -> bool:
    """Whether ``path`` is a mount point in this mount namespace (os.path.ismount misses
    a directory bind-mounted onto itself, which is what `ip netns add` makes of /run/netns)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == path for line in f)
    except OSError:
        return os.path.ismount(path)


def _mark_run_netns() -> None:
    """Call under the machine lock before an `ip netns add`."""
    if not _is_mount(RUN_NETNS) and not os.path.exists(RUN_NETNS_MARKER):
        existed = os.path.isdir(RUN_NETNS)
        with open(RUN_NETNS_MARKER, "w") as f:
            f.write("dir-existed\n" if existed else "dir-made\n")


def _restore_run_netns() -> None:
    """Call under the machine lock after deleting namespaces: undo /run/netns if a cluster
    made it and nothing is left in it."""
    if not os.path.exists(RUN_NETNS_MARKER):
        return
    try:
        if os.path.isdir(RUN_NETNS) and os.listdir(RUN_NETNS):
            return  # someone's namespaces are still there
        with open(RUN_NETNS_MARKER) as f:
            how = f.read().strip()
        while _is_mount(RUN_NETNS):
            if _cmd("umount", RUN_NETNS, check=False).returncode != 0:
                return
        if how == "dir-made":
            with contextlib.suppress(OSError):
                os.rmdir(RUN_NETNS)
        os.unlink(RUN_NETNS_MARKER)
    except OSError:
        pass


def _mac(addr: str) -> str:
    """A locally administered MAC made of an IPv4 address: 02:00:a:b:c:d."""
    return "02:00:" + ":".join(f"{b:02x}" for b in ipaddress.ip_address(addr).packed)


def parse_rate(rate) -> int:
    """Bytes per second from an int (bytes/s) or a string: ``200MiB/s``, ``25MB/s``,
    ``200mbit``, ``1gbit``, ``100kibps`` (bit: bits; bps or B/s: bytes; k/m/g/t powers of
    1000, ki/mi/gi/ti powers of 1024)."""
    if isinstance(rate, int):
        if rate <= 0:
            raise ValueError(f"rate must be positive, not {rate}")
        return rate
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?(bit|bps|b/s)\s*", str(rate), re.I)
    if not m:
        raise ValueError(f"unreadable rate {rate!r} (e.g. 200MiB/s, 200mbit, 25000000 as bytes/s)")
    num, prefix, unit = float(m.group(1)), (m.group(2) or "").lower(), m.group(3).lower()
    mult = 1
    if prefix:
        mult = (1024 if prefix.endswith("i") else 1000) ** ("kmgt".index(prefix[0]) + 1)
    v = num * mult / (8 if unit == "bit" else 1)
    if v < 1:
        raise ValueError(f"rate {rate!r} is under 1 byte/s")
    return int(v)


# ---- probing -------------------------------------------------------------------------------

_SKIP: list = []


def skip_reason() -> str | None:
    """Why hosts cannot be made here (None when they can). Checked once per process by
    making a probe namespace with a veth pair, a bridge, a tbf qdisc and a private bind
    mount inside it, then removing it."""
    if _SKIP:
        return _SKIP[0]
    _SKIP.append(_probe())
    return _SKIP[0]


def _probe() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network namespaces, veths and mounts need root"
    for tool in ("ip", "tc", "unshare", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    ns = f"ck{os.getpid()}-0p"  # matches NAME_RE: sweep_stale removes it after a SIGKILL
    tmp = tempfile.mkdtemp(prefix="ckptstore-netns-probe-")
    steps = [
        ("ip netns add", ["ip", "netns", "add", ns]),
        ("veth pair in a namespace", ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"]),
        ("bridge in a namespace", ["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"]),
        ("bridge port", ["ip", "-n", ns, "link", "set", "pb", "master", "pbr"]),
        ("link up", ["ip", "-n", ns, "link", "set", "pa", "up"]),
        ("tc tbf", ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
                    "rate", "8mbit", "burst", "64kb", "latency", "50ms"]),
        ("unshare --mount with a bind mount", [
            "ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mount --bind "$1" "$2" && test -e "$2/probe"', "sh", tmp, tmp + "/m"]),
    ]
    os.mkdir(tmp + "/m")
    Path(tmp, "probe").touch()
    try:
        with _machine_lock():
            _mark_run_netns()
            for what, argv in steps:
                r = _cmd(*argv, check=False)
                if r.returncode != 0:
                    return f"{what} failed here: `{' '.join(argv)}`: {r.stderr.strip() or 'exit %d' % r.returncode}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"probe failed: {e}"
    finally:
        with _machine_lock():
            if ns in _netns_names():
                _kill_ns(ns)
                _cmd("ip", "netns", "del", ns, check=False)
            _restore_run_netns()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- jobs ----------------------------------------------------------------------------------


class Job:
    """The ranks of one ``Cluster.start``. ``procs[r]`` is rank r's Popen (its pid is the
    rank's process: `ip netns exec`, unshare and sh all exec into it); its stdout and stderr
    go to ``logs[r]``."""

    def __init__(self, cluster, procs, logs, rank_hosts, port):
        self.cluster = cluster
        self.procs = procs
        self.logs = logs
        self.rank_hosts = rank_hosts  # rank -> host index
        self.port = port

    @property
    def world(self) -> int:
        return len(self.procs)

    def output(self, rank: int) -> str:
        return Path(self.logs[rank]).read_text(errors="replace")

    def poll(self) -> list:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float = 120, ranks=None) -> list:
        """Exit codes of ``ranks`` (all by default) once they have exited. If some still run
        after ``timeout`` s (an upper bound for a failure, never an ordering), kill the whole
        job and raise TimeoutError with every rank's log tail."""
        ranks = range(self.world) if ranks is None else ranks
        end = time.monotonic() + timeout
        for r in ranks:
            try:
                self.procs[r].wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(f"rank {r} still running after {timeout} s\n{self.tails()}") from None
        return [self.procs[r].returncode for r in ranks]

    def check(self, timeout: float = 120) -> None:
        """wait(), then raise AssertionError naming every rank that did not exit 0."""
        codes = self.wait(timeout)
        bad = [r for r, c in enumerate(codes) if c != 0]
        if bad:
            raise AssertionError(f"ranks {bad} exited {[codes[r] for r in bad]}\n{self.tails()}")

    def tails(self, lines: int = 30) -> str:
        out = []
        for r in range(self.world):
            text = self.output(r).splitlines()[-lines:]
            out.append(f"--- rank {r} on host {self.rank_hosts[r]} (exit {self.procs[r].poll()}):\n" + "\n".join(text))
        return "\n".join(out)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=KILL_DEADLINE_S)


# ---- the cluster ---------------------------------------------------------------------------


class Host:
    def __init__(self, index: int, ns: str, link: str, addr: str, local_dir: Path):
        self.index = index
        self.ns = ns          # network namespace name
        self.link = link      # root-side veth (its peer is eth0 in ns)
        self.addr = addr
        self.local_dir = local_dir
        self.generation = 0
        self.lost = False
        self.holder = None  # a process holding mounts of this host's own (hold_mounts)

    def __repr__(self):
        return f"Host({self.index}, {self.ns}, {self.addr}{', lost' if self.lost else ''})"


class Cluster:
    """``hosts`` hosts (see the module docstring). ``base_dir``: where its temp directory
    goes (a new one inside it, removed by close); ``local_path``: where each host sees its
    local directory (default ``<temp>/local``; an absolute path of your own must exist or be
    creatable, and is removed by close only if close's cluster made it and it is empty)."""

    def __init__(self, hosts: int, *, base_dir=None, local_path=None):
        if not 1 <= hosts <= 99:
            raise ValueError(f"1..99 hosts, not {hosts}")
        self._closed = self._closing = False
        self._close_lock = threading.RLock()
        self._procs: list = []
        self._jobs = 0
        self._partitioned: set = set()
        self._made_local_path = None
        self.hosts: list[Host] = []
        self.tag = None
        self.bridge = self.pbridge = None
        self._bridge_made = self._pbridge_made = False
        self.base = None
        with _LIVE_LOCK:
            _LIVE.add(self)
        _install_exit_handlers()
        try:
            with _machine_lock():
                self.tag = self._free_tag(hosts)
                # The tag in the name lets sweep_stale find it after a SIGKILLed run.
                self.base = Path(tempfile.mkdtemp(prefix=f"ckptstore-netns-{self.tag}-", dir=base_dir))
                self.shared = self.base / "shared"
                self.logs = self.base / "logs"
                for d in (self.shared, self.logs, self.base / "hosts"):
                    d.mkdir()
                if local_path is None:
                    self.local_path = str(self.base / "local")
                    os.mkdir(self.local_path)
                else:
                    self.local_path = os.path.abspath(local_path)
                    if not os.path.isdir(self.local_path):
                        os.makedirs(self.local_path)
                        self._made_local_path = self.local_path
                self.bridge = f"{self.tag}b"
                self.pbridge = f"{self.tag}p"
                self.net = self._free_subnet()
                self.gateway = str(self.net.network_address + 1)
                _cmd("ip", "link", "add", self.bridge, "type", "bridge")
                self._bridge_made = True
                # A fixed MAC: a bridge takes its ports' lowest otherwise, which partition
                # and replace_host would change under the hosts' ARP caches.
                _cmd("ip", "link", "set", self.bridge, "address", _mac(self.gateway))
                _cmd("ip", "addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
                _cmd("ip", "link", "set", self.bridge, "up")
                _mark_run_netns()
                for i in range(hosts):
                    self._make_host(i, generation=0)
        except BaseException:
            self.close()
            raise

    # -- names ---------------------------------------------------------------------------

    def _free_tag(self, hosts: int) -> str:
        ns, links = set(_netns_names()), set(_link_names())
        with _LIVE_LOCK:
            taken = {c.tag for c in _LIVE if c is not self and c.tag}
        pid = os.getpid()
        for n in range(1000):
            tag = f"ck{pid}-{n}"
            if tag in taken:
                continue
            if len(f"{tag}h{hosts - 1}") > IFNAMSIZ:
                break
            if any((m := NAME_RE.match(x)) and f"ck{m.group(1)}-{m.group(2)}" == tag for x in ns | links):
                continue  # left by an earlier process with our pid (sweep_stale removes it)
            return tag
        raise ClusterError(f"no free name ck{pid}-<n> for {hosts} hosts (interface names are limited to {IFNAMSIZ} chars)")

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = []
        for argv in (("ip", "-j", "-4", "route", "show", "table", "all"), ("ip", "-j", "-4", "addr", "show")):
            r = _cmd(*argv, check=False)
            try:
                data = json.loads(r.stdout or "[]")
            except ValueError:
                data = []
            for item in data:
                dst = item.get("dst")
                if dst and dst != "default":
                    with contextlib.suppress(ValueError):
                        used.append(ipaddress.ip_network(dst, strict=False))
                for a in item.get("addr_info", []):
                    with contextlib.suppress(ValueError, KeyError):
                        used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
        start = (os.getpid() * 7 + int(self.tag.split("-")[1])) % 256
        for k in range(256):
            net = ipaddress.ip_network(f"10.79.{(start + k) % 256}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise ClusterError("no 10.79.x.0/24 is free of the root namespace's routes and addresses")

    def names(self) -> dict:
        """Everything this cluster made, by kind (for cleanup checks)."""
        return {
            "netns": [h.ns for h in self.hosts],
            "links": [h.link for h in self.hosts] + [self.bridge, self.pbridge],
            "base": str(self.base),
            "tag": self.tag,
        }

    # -- hosts ---------------------------------------------------------------------------

    def _make_host(self, i: int, generation: int) -> Host:
        ns = link = f"{self.tag}h{i}"
        addr = str(self.net.network_address + 10 + i)
        local = self.base / "hosts" / f"h{i}.{generation}"
        local.mkdir()
        h = Host(i, ns, link, addr, local)
        h.generation = generation
        if i < len(self.hosts):
            self.hosts[i] = h  # so close() finds it if what follows fails
        else:
            self.hosts.append(h)
        _cmd("ip", "netns", "add", ns)
        # The MAC follows from the address, so a replacement answers to the MAC its peers
        # have cached for that address (a new one would be unreachable until ARP expires).
        _cmd("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "address", _mac(addr), "netns", ns)
        _cmd("ip", "link", "set", link, "master", self.bridge)
        _cmd("ip", "link", "set", link, "up")
        _cmd("ip", "-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
        _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")
        return h

    def _destroy_host(self, h: Host) -> None:
        if h.ns in _netns_names():
            _kill_ns(h.ns)
        self._reap()
        if h.link in _link_names():
            _cmd("ip", "link", "del", h.link, check=False)  # its peer eth0 goes with it
        if h.ns in _netns_names():
            _cmd("ip", "netns", "del", h.ns, check=False)

    def addr(self, i: int) -> str:
        return self.hosts[i].addr

    def local_dir(self, i: int) -> Path:
        """Host i's local directory as the root namespace sees it (not at local_path)."""
        return self.hosts[i].local_dir

    def hold_mounts(self, i: int, setup: str, *args: str, ready: str, timeout: float = 30) -> None:
        """Give host i a mount namespace of its own that outlives its processes (a machine's
        mounts: a FUSE file system, say): a holder process in the host runs the shell
        ``setup`` (with ``args`` as $1...), then sleeps; from then on every process started
        in host i starts inside a copy of that namespace (its mounts made there later, by
        :meth:`run` with ``in_holder=True``, included). ``ready``: a path whose mount shows
        in the holder's mountinfo once ``setup`` is done. The holder dies with the host
        (lose_host, replace_host, close)."""
        self._check_open()
        h = self.hosts[i]
        if h.holder is not None:
            raise ClusterError(f"host {i} already holds mounts")
        p = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, "unshare", "--mount", "--propagation", "private",
             "sh", "-c", setup + "\nexec sleep infinity", "sh", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        self._procs.append(p)
        end = time.monotonic() + timeout
        while True:
            try:
                mounts = Path(f"/proc/{p.pid}/mountinfo").read_text()
            except OSError:
                mounts = ""
            # The holder's own namespace (not the one `ip netns exec` made) shows `ready`.
            if f" {ready} " in mounts and os.readlink(f"/proc/{p.pid}/exe").endswith("sleep"):
                break
            if p.poll() is not None or time.monotonic() > end:
                err = p.stderr.read().decode(errors="replace") if p.poll() is not None and p.stderr else ""
                raise ClusterError(f"host {i}: the mount holder did not come up: {err.strip()}")
            time.sleep(0.05)
        h.holder = p

    def host_argv(self, i: int, argv, in_holder: bool = False) -> list:
        """``argv`` wrapped to run in host i with its local directory at local_path (inside
        a copy of its held mounts, if any; ``in_holder``: in the holder's namespace itself,
        for mounts every later process of the host should see)."""
        h = self.hosts[i]
        if h.holder is not None:
            enter = ["nsenter", "-t", str(h.holder.pid), "-m", "-n", "--"]
            if in_holder:
                return [*enter, *[str(a) for a in argv]]
            head = [*enter, "unshare", "--mount", "--propagation", "private"]
        elif in_holder:
            raise ClusterError(f"host {i} holds no mounts (hold_mounts first)")
        else:
            head = ["ip", "netns", "exec", h.ns, "unshare", "--mount", "--propagation", "private"]
        return [
            *head,
            "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
            str(h.local_dir), self.local_path, *[str(a) for a in argv],
        ]

    def host_env(self, i: int, env=None) -> dict:
        e = dict(os.environ)
        e.update(
            CLUSTER_HOST=str(i), CLUSTER_ADDR=self.hosts[i].addr, CLUSTER_LOCAL=self.local_path,
            CLUSTER_SHARED=str(self.shared), GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1",
        )
        if env:
            e.update({k: str(v) for k, v in env.items()})
        return e

    def popen(self, i: int, argv, env=None, **kw) -> subprocess.Popen:
        """Start ``argv`` in host i (subprocess.Popen keywords pass through). It runs in a
        session of its own (a Ctrl-C reaches the harness only, which then cleans up)."""
        self._check_open()
        if self.hosts[i].lost:
            raise ClusterError(f"host {i} is lost (replace_host({i}) first)")
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(self.host_argv(i, argv), env=self.host_env(i, env), start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv, env=None, timeout: float = 60, in_holder: bool = False,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in host i to completion (output captured as text unless overridden;
        ``in_holder``: see :meth:`host_argv`)."""
        self._check_open()
        if self.hosts[i].lost:
            raise ClusterError(f"host {i} is lost (replace_host({i}) first)")
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.host_argv(i, argv, in_holder), env=self.host_env(i, env), timeout=timeout,
                              **kw)

    def start(self, argv, ranks_per_host: int = 1, hosts=None, env=None, port: int | None = None) -> Job:
        """A job of ``len(hosts) * ranks_per_host`` ranks, each running ``argv`` (a full
        command: ``[sys.executable, "train.py", ...]``), hosts all of them by default.
        MASTER_ADDR is the first host's address, MASTER_PORT a port new to this cluster
        (every host is a fresh namespace, so no other run can hold it)."""
        self._check_open()
        hosts = list(range(len(self.hosts))) if hosts is None else list(hosts)
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts must be distinct and not empty: {hosts}")
        for i in hosts:
            if self.hosts[i].lost:
                raise ClusterError(f"host {i} is lost (replace_host({i}) first)")
        world = len(hosts) * ranks_per_host
        if port is None:
            port = BASE_PORT + self._jobs
        jid = self._jobs
        self._jobs += 1
        procs, logs, rank_hosts = [], [], []
        try:
            for node, i in enumerate(hosts):
                for lr in range(ranks_per_host):
                    rank = node * ranks_per_host + lr
                    e = dict(env or {})
                    e.update(
                        MASTER_ADDR=self.hosts[hosts[0]].addr, MASTER_PORT=port, RANK=rank,
                        WORLD_SIZE=world, LOCAL_RANK=lr, LOCAL_WORLD_SIZE=ranks_per_host,
                        GROUP_RANK=node, NODE_RANK=node,
                    )
                    log = self.logs / f"job{jid}.rank{rank}.log"
                    with open(log, "wb") as f:
                        procs.append(self.popen(i, argv, env=e, stdout=f, stderr=subprocess.STDOUT))
                    logs.append(log)
                    rank_hosts.append(i)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        return Job(self, procs, logs, rank_hosts, port)

    def pids(self, i: int) -> list[int]:
        return _ns_pids(self.hosts[i].ns)

    # -- faults --------------------------------------------------------------------------

    def lose_host(self, i: int, wipe_local: bool = False) -> None:
        """Host i fails as a machine does: its eth0 goes down first (so nothing it sends,
        FIN or RST included, reaches anyone), then every process in it is SIGKILLed until
        none is left; its local directory is emptied if ``wipe_local``, else kept for a
        replacement to find (or not: replace_host gives an empty one)."""
        self._check_open()
        h = self.hosts[i]
        _cmd("ip", "-n", h.ns, "link", "set", "eth0", "down")
        _kill_ns(h.ns)
        self._reap()
        h.lost = True
        h.holder = None
        if wipe_local:
            for p in h.local_dir.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()

    def replace_host(self, i: int) -> None:
        """Host i's namespace destroyed (its processes killed first), a new one made at the
        same address with an empty local directory; it joins the main bridge (a partition
        in force does not cover it) without a cap."""
        self._check_open()
        old = self.hosts[i]
        with _machine_lock():
            self._destroy_host(old)
            self._partitioned.discard(i)
            _mark_run_netns()
            self._make_host(i, generation=old.generation + 1)

    def partition(self, group_a, group_b=None) -> None:
        """Cut every host of ``group_b`` (default: all not in group_a) off from ``group_a``:
        their root-side ports move to a second bridge connected to nothing. Frames between
        the groups vanish silently; inside each group nothing changes. Hosts in neither
        group stay with group_a and the root namespace (the gateway address)."""
        self._check_open()
        a = set(group_a)
        b = set(range(len(self.hosts))) - a if group_b is None else set(group_b)
        if a & b or not a or not b:
            raise ValueError(f"partition needs two disjoint non-empty groups, not {sorted(a)} and {sorted(b)}")
        self.heal()
        if self.pbridge not in _link_names():
            _cmd("ip", "link", "add", self.pbridge, "type", "bridge")
            self._pbridge_made = True
            _cmd("ip", "link", "set", self.pbridge, "up")
        for i in sorted(b):
            _cmd("ip", "link", "set", self.hosts[i].link, "master", self.pbridge)
            self._partitioned.add(i)

    def heal(self) -> None:
        """Undo partition(): every port back on the main bridge."""
        self._check_open()
        for i in sorted(self._partitioned):
            _cmd("ip", "link", "set", self.hosts[i].link, "master", self.bridge)
        self._partitioned.clear()

    def cap(self, i: int, rate, direction: str = "both", burst: int | None = None) -> int:
        """Cap host i's link with tbf at ``rate`` (see parse_rate): ``egress`` shapes what it
        sends (on its eth0), ``ingress`` what it receives (on its root-side veth), ``both``
        (default) both. ``burst`` in bytes, default max(64 KiB, rate / 250). Replaces an
        earlier cap. Returns the rate in bytes/s (what `tc -j qdisc show` prints as rate)."""
        self._check_open()
        bps = parse_rate(rate)
        if direction not in ("both", "egress", "ingress"):
            raise ValueError(f"direction is both, egress or ingress, not {direction!r}")
        burst = burst or max(64 * 1024, bps // 250)
        args = ["tc", "qdisc", "replace", "dev", None, "root", "tbf", "rate", f"{bps * 8}bit",
                "burst", str(burst), "latency", "50ms"]
        h = self.hosts[i]
        if direction in ("both", "egress"):
            _cmd("ip", "netns", "exec", h.ns, *[a if a else "eth0" for a in args])
        if direction in ("both", "ingress"):
            _cmd(*[a if a else h.link for a in args])
        return bps

    def uncap(self, i: int) -> None:
        """Remove host i's caps (both directions)."""
        self._check_open()
        h = self.hosts[i]
        _cmd("ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _cmd("tc", "qdisc", "del", "dev", h.link, "root", check=False)

    def qdiscs(self, i: int, side: str = "egress") -> list:
        """`tc -j qdisc show` of host i's eth0 (egress) or root-side veth (ingress)."""
        h = self.hosts[i]
        if side == "egress":
            r = _cmd("ip", "netns", "exec", h.ns, "tc", "-j", "qdisc", "show", "dev", "eth0")
        else:
            r = _cmd("tc", "-j", "qdisc", "show", "dev", h.link)
        return json.loads(r.stdout or "[]")

    # -- cleanup -------------------------------------------------------------------------

    def _reap(self) -> None:
        keep = []
        for p in self._procs:
            if p.poll() is None:
                keep.append(p)
        self._procs = keep

    def _check_open(self):
        if self._closed or self._closing:
            raise ClusterError("this cluster is closed")

    def close(self) -> None:
        """Kill every process in every host, delete links, bridges and namespaces, remove the
        temp directory. Every step is tried even when an earlier one failed; the first
        failure is raised at the end. Safe to call again."""
        with self._close_lock:
            if self._closed:
                return
            # Refuse new work from here on, but count as closed only at the end: a close
            # cut short (a SIGTERM's SystemExit inside it) is done again by the atexit hook.
            self._closing = True
            errors = []

            def attempt(fn, *a):
                try:
                    fn(*a)
                except Exception as e:  # noqa: BLE001 - collected, raised at the end
                    errors.append(e)

            with _machine_lock():
                for h in self.hosts:
                    attempt(self._destroy_host, h)
                for p in self._procs:
                    with contextlib.suppress(Exception):
                        p.kill()
                        p.wait(timeout=KILL_DEADLINE_S)
                self._procs = []
                links = set(_link_names())
                for br, made in ((self.pbridge, self._pbridge_made), (self.bridge, self._bridge_made)):
                    if made and br in links:
                        attempt(_cmd, "ip", "link", "del", br)
                _restore_run_netns()
            if self.base is not None and self.base.exists():
                attempt(shutil.rmtree, self.base)
            if self._made_local_path:
                with contextlib.suppress(OSError):
                    os.rmdir(self._made_local_path)
            self._closed = True
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if errors:
                raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"Cluster({self.tag}, {self.hosts})"


def sweep_stale(all_pids: bool = False) -> list[str]:
    """Remove namespaces, links, bridges and temp dirs (those in the default temp dir) that
    clusters of dead processes left (a SIGKILLed harness runs no cleanup); with
    ``all_pids``, those of live processes too.
    Never those of this process's open clusters. Returns what it removed."""
    removed = []
    with _LIVE_LOCK:
        mine = {c.tag for c in _LIVE if c.tag}

    def stale(name):
        m = NAME_RE.match(name)
        if not m or f"ck{m.group(1)}-{m.group(2)}" in mine:
            return False
        pid = int(m.group(1))
        if all_pids or pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is gone
        except (OSError, IndexError):
            return True

    with _machine_lock():
        for ns in _netns_names():
            if stale(ns):
                _kill_ns(ns)
                _cmd("ip", "netns", "del", ns, check=False)
                removed.append(f"netns {ns}")
        for link in _link_names():
            if stale(link):
                _cmd("ip", "link", "del", link, check=False)
                removed.append(f"link {link}")
        _restore_run_netns()
        tmp = Path(tempfile.gettempdir())
        for d in tmp.glob("ckptstore-netns-ck*-*-*"):
            tag = d.name[len("ckptstore-netns-"):].rsplit("-", 1)[0]
            if d.is_dir() and stale(f"{tag}b"):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"dir {d}")
    return removed


def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        with contextlib.suppress(Exception):
            c.close()


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _install_exit_handlers() -> None:
    """atexit closes every open cluster; SIGTERM and SIGHUP become SystemExit (which unwinds
    the with-blocks and then runs atexit) where no handler of someone else's is set."""
    global _SIGNALS_INSTALLED
    if _SIGNALS_INSTALLED:
        return
    _SIGNALS_INSTALLED = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) == signal.SIG_DFL:
                signal.signal(s, _on_signal)


# ---- jobs that the tests and scripts/netns-cluster.py run in the hosts ----------------------
# `python netns_cluster.py job NAME DIR` as a rank of Cluster.start (torch imported here only).
#   fsdp-save DIR   FSDP2 (CPU, gloo) model + Adam, 2 steps, ckptstore.torch.distributed.save
#                   to DIR/ckpt; rank 0 also writes the gathered state to DIR/expect.pt.
#   fsdp-load DIR   a model of another seed, its own state, then load DIR/ckpt on this world
#                   size; prints {"differ": [names not bit-identical to expect.pt], ...}.
#   lose-wait DIR   an all_reduce, then DIR/ready.<rank>; rank 0 waits for DIR/lost (the
#                   harness writes it after lose_host), sets the group timeout to
#                   $LOSE_TIMEOUT_S and runs an all_reduce: prints what it raised.
# Each prints one line `RESULT <json>`; see job_result().


def _fsdp_model(world: int, seed: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 5))  # rows 10, 5: uneven on 3
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _fsdp_train(m, o, start: int, steps: int, rank: int):
    import torch

    for s in range(start, start + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * s + rank))
        (m(x) ** 2).mean().backward()
        o.step()
        o.zero_grad()


def _fsdp_gather(m, o) -> dict:
    """Full parameters and optimizer states (collective)."""
    out = {}
    names = {id(p): n for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        out[n] = p.detach().full_tensor().clone()
    for p, st in o.state.items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def _bits(t):
    import torch

    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def _result(obj) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def job_result(text: str):
    """The object a job printed with its RESULT line (None if it printed none)."""
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def wait_file(path: Path, limit_s: float) -> bool:
    """Wait for ``path`` to exist (a handshake); False after ``limit_s`` (a failure bound)."""
    end = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _job_main(name: str, d: str) -> int:
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    d = Path(d)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    where = {"rank": rank, "world": world, "host": int(os.environ["CLUSTER_HOST"]), "addr": os.environ["CLUSTER_ADDR"]}
    if name == "fsdp-save":
        import ckptstore.torch.distributed as ctd

        m, o = _fsdp_model(world, seed=0)
        _fsdp_train(m, o, 0, 2, rank)
        ctd.save(d / "ckpt", m, o, extra={"step": 2})
        full = _fsdp_gather(m, o)
        if rank == 0:
            torch.save(full, d / "expect.pt.tmp")
            os.replace(d / "expect.pt.tmp", d / "expect.pt")
        _result({**where, "saved": sorted(full)})
    elif name == "fsdp-load":
        import ckptstore.torch.distributed as ctd

        m, o = _fsdp_model(world, seed=1)
        _fsdp_train(m, o, 7, 1, rank)  # a state of its own, to be replaced whole
        extra = ctd.load(d / "ckpt", m, o)
        got, want = _fsdp_gather(m, o), torch.load(d / "expect.pt")
        differ = sorted(set(got) ^ set(want))
        differ += sorted(
            k for k in set(got) & set(want)
            if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
            or not torch.equal(_bits(got[k]), _bits(want[k]))
        )
        _result({**where, "compared": len(want), "differ": differ, "extra": {k: str(v) for k, v in extra.items()}})
    elif name == "lose-wait":
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [float(world)] * 4, t
        (d / f"ready.{rank}.tmp").write_text("ready")
        os.replace(d / f"ready.{rank}.tmp", d / f"ready.{rank}")
        if rank != 0:
            threading.Event().wait()  # until the harness kills this host
        if not wait_file(d / "lost", 300):
            _result({**where, "raised": None, "error": "the harness never wrote lost"})
            os._exit(3)
        dist.set_timeout(timedelta(seconds=float(os.environ.get("LOSE_TIMEOUT_S", "3"))))
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001 - what it raised is the result
            _result({**where, "raised": type(e).__name__, "runtime_error": isinstance(e, RuntimeError),
                     "msg": str(e)[:2000], "after_s": round(time.monotonic() - t0, 2)})
            os._exit(0)  # the group is broken: no destroy_process_group
        _result({**where, "raised": None})
        os._exit(1)
    else:
        raise SystemExit(f"unknown job {name}")
    exit_together(rank, world)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "job":
        sys.exit(_job_main(sys.argv[2], sys.argv[3]))
    print(__doc__)
    sys.exit(2)
