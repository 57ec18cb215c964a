"""A Garage cluster whose nodes run on hosts of a network-namespace cluster (netns_cluster):
one node per host, replication factor 3 (quorum 2), a layout applied, a bucket and a key,
as scripts/garage-test.sh sets up on loopback. For the tiered manager's persistent tier on a
distributed object store whose nodes can be lost like any host.

The garage executable: ``$GARAGE``, else ``~/.cache/ckptstore-tools/bin/garage`` (where
.ci/run builds garage 2.5.0), else ``garage`` on PATH; :func:`find_garage` returns ``None``
when there is none.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

API_PORT, RPC_PORT = 3900, 3901


def find_garage() -> str | None:
    for exe in (os.environ.get("GARAGE"), str(Path.home() / ".cache/ckptstore-tools/bin/garage"),
                shutil.which("garage")):
        if exe and os.access(exe, os.X_OK):
            return exe
    return None


class Garage:
    """Garage nodes on hosts ``hosts`` of cluster ``c`` (their files under ``work``):
    :meth:`env` gives the AWS_* variables of a client of node ``i``'s S3 API. The nodes are
    processes of their hosts: ``c.lose_host`` takes one down, ``c.close`` kills them all."""

    def __init__(self, c, hosts: list[int], work: Path, exe: str, bucket: str = "ckpt") -> None:
        self.c, self.hosts, self.exe, self.bucket = c, list(hosts), exe, bucket
        self.work = Path(work)
        self.key_id = "GK" + secrets.token_hex(12)
        self.secret = secrets.token_hex(32)
        rpc_secret = secrets.token_hex(32)
        self.procs = {}
        for i in self.hosts:
            d = self.work / f"node{i}"
            (d / "meta").mkdir(parents=True)
            (d / "data").mkdir()
            a = c.addr(i)
            (d / "garage.toml").write_text(
                f'metadata_dir = "{d}/meta"\ndata_dir = "{d}/data"\ndb_engine = "sqlite"\n'
                f'replication_factor = 3\nrpc_bind_addr = "{a}:{RPC_PORT}"\n'
                f'rpc_public_addr = "{a}:{RPC_PORT}"\nrpc_secret = "{rpc_secret}"\n\n'
                f'[s3_api]\ns3_region = "us-east-1"\napi_bind_addr = "{a}:{API_PORT}"\n'
                f'root_domain = ".s3.garage.localhost"\n'
            )
            with open(d / "log", "wb") as log:
                self.procs[i] = c.popen(i, [exe, "-c", str(d / "garage.toml"), "server"], stdout=log,
                                        stderr=log)
        first = self.hosts[0]
        for i in self.hosts:
            self._until(lambda i=i: self.g(i, "status"), 60, f"garage node on host {i} up")
        ids = {i: self.g(i, "node", "id", "-q").stdout.strip().splitlines()[-1] for i in self.hosts}
        for i in self.hosts[1:]:
            self.g(first, "node", "connect", ids[i], check=True)
        for n, i in enumerate(self.hosts):
            self.g(first, "layout", "assign", "-z", f"dc{n}", "-c", "1G", ids[i].split("@")[0], check=True)
        self.g(first, "layout", "apply", "--version", "1", check=True)
        self.g(first, "bucket", "create", bucket, check=True)
        self.g(first, "key", "import", "--yes", "-n", "ckptkey", self.key_id, self.secret, check=True)
        self.g(first, "bucket", "allow", "--read", "--write", "--owner", bucket, "--key", "ckptkey", check=True)

    def g(self, i: int, *args, check: bool = False):
        r = self.c.run(i, [self.exe, "-c", str(self.work / f"node{i}" / "garage.toml"), *args], timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"garage {' '.join(args)} on host {i}: exit {r.returncode}: {r.stderr[-2000:]}")
        return r

    @staticmethod
    def _until(fn, limit_s: float, what: str) -> None:
        end = time.monotonic() + limit_s
        while fn().returncode != 0:
            if time.monotonic() > end:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def env(self, i: int) -> dict:
        """The client environment for node ``i``'s S3 API."""
        return {"AWS_ENDPOINT_URL": f"http://{self.c.addr(i)}:{API_PORT}", "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                "CKPT_S3_MAX_RETRIES": "3", "CKPT_S3_RETRY_TIMEOUT_S": "20"}
