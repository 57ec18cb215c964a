"""A GlusterFS volume across hosts of a network-namespace cluster (netns_cluster): one
``glusterd`` and one brick per host, replica = the number of hosts, mounted through FUSE in
every host at the same path with the client caches an NFS client keeps (md-cache, the
negative-lookup cache, stat-prefetch, readdir-ahead; 10 s). Debian's ``glusterfs-server`` and
``glusterfs-client`` (10.3 on Debian 12); :func:`skip_reason` says why not where they are
missing. The shared file system of format-spec/tiers.md's persistent tier and of every
multi-host commit, as users run them (issue 52).

Each host gets a mount namespace of its own (``Cluster.hold_mounts``): a tmpfs on ``/run``
(glusterd's socket and pid files) and bind mounts of a directory of its own on
``/var/lib/glusterd`` and ``/var/log/glusterfs``, so the hosts' daemons share nothing but
the network. glusterd listens on the host's address only (``transport.socket.bind-address``).
Every process of the host (``c.start``, ``c.popen``, ``c.run``) sees the volume at
:attr:`Volume.mount`; the root namespace sees an empty directory there. The daemons and the
FUSE client are processes of their hosts: ``c.lose_host`` takes a host's brick down with it,
``c.close`` kills them all and removes the bricks with the cluster's directory.

``cache_invalidation``: the server's upcalls that tell clients a cached entry changed
(``features.cache-invalidation``, ``performance.cache-invalidation``). Off (the default, as an
NFS client has none), a host that looked a name up and missed keeps missing it after another
host created it: 10 s for the first name made in a directory, longer for later ones (listing
the directory clears it), and ``os.makedirs(p, exist_ok=True)`` from several hosts at once
fails on some (measured: /tmp/gluster-probe, 2026-12-06).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

VOLUME = "ckvol"

#: The client caches, at an NFS client's attribute-cache timeouts.
NFS_LIKE = {
    "performance.stat-prefetch": "on",
    "performance.md-cache-timeout": "10",
    "performance.nl-cache": "on",
    "performance.nl-cache-timeout": "10",
    "performance.readdir-ahead": "on",
}

_SETUP = """set -e
mount -t tmpfs -o mode=755 ckrun /run
mkdir -p /run/gluster /run/lock
mount --bind "$1/lib" /var/lib/glusterd
mount --bind "$1/log" /var/log/glusterfs
"""


def skip_reason() -> str | None:
    """Why a volume cannot be made here (None: it can)."""
    for exe in ("glusterd", "gluster", "mount.glusterfs", "nsenter"):
        if shutil.which(exe) is None:
            return f"{exe} not found (apt-get install glusterfs-server glusterfs-client)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (FUSE is not available)"
    if not os.path.isdir("/var/lib/glusterd") or not os.path.isdir("/var/log/glusterfs"):
        return "/var/lib/glusterd or /var/log/glusterfs is missing (glusterfs-server not installed)"
    return None


class Volume:
    """A replicated volume on hosts ``hosts`` of cluster ``c`` (bricks and daemon state
    under ``work``), mounted at ``mount`` in each of them. ``options``: volume options set
    before it starts (default :data:`NFS_LIKE` with ``cache_invalidation`` as given)."""

    def __init__(self, c, hosts: list[int], work: Path, mount: str, *, cache_invalidation: bool = False,
                 options: dict | None = None, timeout: float = 90) -> None:
        self.c, self.hosts, self.work, self.mount = c, list(hosts), Path(work), mount
        self.timeout = timeout
        os.makedirs(mount, exist_ok=True)
        for i in self.hosts:
            d = self.work / f"h{i}"
            for sub in ("lib", "log", "etc", "brick"):
                (d / sub).mkdir(parents=True)
            for sub in ("groups", "hooks"):  # what the package put in /var/lib/glusterd
                if os.path.isdir(f"/var/lib/glusterd/{sub}"):
                    shutil.copytree(f"/var/lib/glusterd/{sub}", d / "lib" / sub, symlinks=True)
            vol = Path("/etc/glusterfs/glusterd.vol").read_text()
            vol = vol.replace("end-volume", f"    option transport.socket.bind-address {c.addr(i)}\nend-volume", 1)
            (d / "etc" / "glusterd.vol").write_text(vol)
            c.hold_mounts(i, _SETUP, str(d), ready="/var/log/glusterfs")
            self.g(i, "glusterd", "-f", str(d / "etc" / "glusterd.vol"), "-p", "/run/glusterd.pid",
                   "-l", "/var/log/glusterfs/glusterd.log", cli=False)
        for i in self.hosts:
            self._until(lambda i=i: self.g(i, "peer", "status", check=False).returncode == 0, f"glusterd on host {i}")
        first = self.hosts[0]
        for i in self.hosts[1:]:
            self.g(first, "peer", "probe", c.addr(i))
        if len(self.hosts) > 1:  # so that the first host is known by its address, not "localhost"
            self.g(self.hosts[1], "peer", "probe", c.addr(first))
        n = len(self.hosts)
        self._until(lambda: all(self.g(i, "pool", "list").stdout.count("Connected") == n for i in self.hosts),
                    "the peers connected")
        bricks = [f"{c.addr(i)}:{self.work / f'h{i}' / 'brick' / 'b'}" for i in self.hosts]
        rep = ["replica", str(n)] if n > 1 else []
        self.g(first, "volume", "create", VOLUME, *rep, "transport", "tcp", *bricks, "force")
        inval = "on" if cache_invalidation else "off"
        opts = dict(NFS_LIKE if options is None else options)
        opts.setdefault("features.cache-invalidation", inval)
        opts.setdefault("performance.cache-invalidation", inval)
        for k, v in opts.items():
            self.g(first, "volume", "set", VOLUME, k, v)
        self.g(first, "volume", "start", VOLUME)
        self._until(lambda: len(re.findall(r"^Online\s*:\s*Y", self.g(first, "volume", "status", VOLUME,
                                                                       "detail").stdout, re.MULTILINE)) == n,
                    "every brick online")
        for i in self.hosts:
            self.g(i, "mount", "-t", "glusterfs", "-o", "log-file=/var/log/glusterfs/mnt.log",
                   f"{c.addr(i)}:/{VOLUME}", mount, cli=False)

    def mount_client(self, i: int, server: int) -> None:
        """Mount the volume in host i, a host without a brick or a daemon (one made by
        ``c.replace_host`` after a loss, say), from host ``server``'s daemon (the others
        listed as backups): a fresh client, with cold caches."""
        c = self.c
        backups = ":".join(c.addr(h) for h in self.hosts if h not in (i, server))
        log = self.work / f"client-h{i}.log"
        c.hold_mounts(i, 'set -e\nmount -t glusterfs -o "log-file=$1,backup-volfile-servers=$2" "$3:/' + VOLUME
                      + '" "$4"', str(log), backups, c.addr(server), self.mount, ready=self.mount,
                      timeout=self.timeout)

    def g(self, i: int, *args: str, cli: bool = True, check: bool = True):
        """Run ``gluster --mode=script args`` (``cli``) or ``args`` in host i's holder."""
        argv = ["gluster", "--mode=script", *args] if cli else list(args)
        r = self.c.run(i, argv, timeout=self.timeout, in_holder=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"host {i}: {' '.join(argv)} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r

    def _until(self, ok, what: str) -> None:
        end = time.monotonic() + self.timeout
        while True:
            try:
                if ok():
                    return
            except RuntimeError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"GlusterFS: {what}: not within {self.timeout:.0f} s")
            time.sleep(0.1)
