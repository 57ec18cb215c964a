"""The cluster-on-one-machine harness (netns_cluster.py, issue 39): hosts made of network
namespaces, each with its own address and local directory.

- FSDP2 on CPU saved through ckptstore.torch.distributed by 2 ranks on 2 hosts into the
  shared directory, loaded by 1 rank on a third host: bit-identical.
- Local directories are private to their host; lose_host keeps or wipes one; replace_host
  gives the same address and an empty one.
- A lost host (link down, then killed): the survivor's collective raises a timeout error
  instead of hanging. Ordered by file handshakes: the survivor starts its collective only
  after the harness has lost the host.
- partition/heal cut TCP between groups only and restore it (a connection held across the
  partition carries on); cap puts tbf with that rate on the link.
- close() leaves no namespace, link, bridge, mount or temp dir, also when the body raised;
  sweep_stale() removes what a SIGKILLed harness left.

No assertion depends on timing: timeouts only bound a failure.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import netns_cluster as nc
from netns_fixtures import make_cluster  # noqa: F401 - the fixture

LIB = Path(nc.__file__).resolve()
JOB_S = 240  # upper bound for one torch job on a loaded 2-core machine

SERVE = textwrap.dedent("""
    import socket, threading
    def serve(c):  # "ok", then echo until the client closes
        c.sendall(b"ok")
        while data := c.recv(4096):
            c.sendall(data)
        c.close()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7000))
    s.listen()
    print("listening", flush=True)
    while True:
        threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
""")
# Connects, then on each line from stdin sends "ping" and prints what comes back.
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], 7000), timeout=120)
        assert c.recv(2) == b"ok"
        print("connected", flush=True)
        sys.stdin.readline()
        c.sendall(b"ping")
        print("sent", flush=True)
        data = b""
        while len(data) < 4:
            data += c.recv(4 - len(data))
        print(data.decode(), flush=True)
    except OSError as e:
        print("failed:", e, flush=True)
""")
CONNECT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
        print(c.recv(2).decode())
    except OSError as e:
        print("failed:", e)
""")


def needs_torch():
    for mod in ("torch", "ckptstore"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")


def job(c, name, hosts, ranks_per_host=1, env=None):
    return c.start([sys.executable, LIB, "job", name, c.shared], ranks_per_host=ranks_per_host, hosts=hosts, env=env)


def serve(c, i):
    p = c.popen(i, [sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "listening"  # EOF (a failed server) reads ""
    return p


def connect(c, src, dst, limit_s):
    """`ok` or `failed: ...` (limit_s bounds a connection that cannot be made)."""
    return c.run(src, [sys.executable, "-c", CONNECT, c.addr(dst), str(limit_s)], timeout=limit_s + 60).stdout.strip()


def system_state():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    out += Path("/proc/self/mountinfo").read_text()
    return out


# ---- (a) FSDP2 across hosts ----------------------------------------------------------------


def test_fsdp2_saved_on_two_hosts_loads_on_a_third_bit_identical(make_cluster):
    needs_torch()
    c = make_cluster(3)
    save = job(c, "fsdp-save", hosts=[0, 1])
    save.check(timeout=JOB_S)
    saved = [nc.job_result(save.output(r)) for r in range(2)]
    assert [(s["rank"], s["world"], s["host"], s["addr"]) for s in saved] == [
        (0, 2, 0, c.addr(0)), (1, 2, 1, c.addr(1))
    ]
    assert (c.shared / "ckpt").is_dir()
    assert [list(c.local_dir(i).iterdir()) for i in range(3)] == [[], [], []]  # no local disk used

    load = job(c, "fsdp-load", hosts=[2])
    load.check(timeout=JOB_S)
    got = nc.job_result(load.output(0))
    assert (got["host"], got["world"], got["addr"]) == (2, 1, c.addr(2))
    assert got["compared"] == len(saved[0]["saved"]) >= 6  # 4 parameters + Adam moments
    assert got["differ"] == [], got
    assert got["extra"] == {"step": "2"}


# ---- (b) local directories -----------------------------------------------------------------


def test_local_dirs_are_private_lose_keeps_or_wipes_replace_is_empty(make_cluster):
    c = make_cluster(2)
    r = c.run(0, ["sh", "-c", 'echo h0 > "$CLUSTER_LOCAL/f" && cat "$CLUSTER_LOCAL/f"'])
    assert (r.returncode, r.stdout) == (0, "h0\n"), r.stderr
    r = c.run(1, ["sh", "-c", 'test ! -e "$CLUSTER_LOCAL/f" && echo h1 > "$CLUSTER_LOCAL/g" && ls -A "$CLUSTER_LOCAL"'])
    assert (r.returncode, r.stdout) == (0, "g\n"), r.stderr
    assert [p.name for p in c.local_dir(0).iterdir()] == ["f"]
    assert [p.name for p in c.local_dir(1).iterdir()] == ["g"]
    assert list(Path(c.local_path).iterdir()) == []  # the root namespace sees no host's files

    # The bind mount exists in the host's processes only, never in the root namespace.
    p = c.popen(0, ["sh", "-c", "echo ready && exec sleep 600"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"  # the wrapper mounts before it runs the command
    mine = Path(f"/proc/{p.pid}/mountinfo").read_text()
    assert any(line.split()[4] == c.local_path for line in mine.splitlines()), mine
    assert c.local_path not in [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]

    c.lose_host(0, wipe_local=False)
    assert p.wait(timeout=60) == -9 and c.pids(0) == []
    assert [q.name for q in c.local_dir(0).iterdir()] == ["f"]  # kept
    c.lose_host(1, wipe_local=True)
    assert list(c.local_dir(1).iterdir()) == []  # wiped
    with pytest.raises(nc.ClusterError, match="lost"):
        c.run(0, ["true"])

    addr, old = c.addr(0), c.local_dir(0)
    c.replace_host(0)
    assert c.addr(0) == addr and c.local_dir(0) != old and list(c.local_dir(0).iterdir()) == []
    r = c.run(0, ["ls", "-A", c.local_path])
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    # The replacement answers at the old address (same MAC, so no stale ARP entry anywhere).
    c.replace_host(1)
    srv = serve(c, 1)
    assert connect(c, 0, 1, 60) == "ok"
    srv.kill()


# ---- (c) a lost host -----------------------------------------------------------------------


def test_lost_host_survivor_collective_raises_timeout(make_cluster):
    needs_torch()
    c = make_cluster(2)
    j = job(c, "lose-wait", hosts=[0, 1], env={"LOSE_TIMEOUT_S": 3})
    for r in range(2):
        # Both ranks are past their first all_reduce: the group is up before the loss.
        if not nc.wait_file(c.shared / f"ready.{r}", JOB_S):
            j.kill()
            pytest.fail(f"rank {r} never got ready\n{j.tails()}")
    c.lose_host(1)
    assert j.wait(timeout=60, ranks=[1]) == [-9]
    (c.shared / "lost").write_text("")  # only now the survivor starts its collective
    assert j.wait(timeout=120, ranks=[0]) == [0], j.tails()
    got = nc.job_result(j.output(0))
    assert got["raised"] and got["runtime_error"], got
    assert "timed out" in got["msg"].lower() or "timeout" in got["msg"].lower(), got


# ---- partition, cap ------------------------------------------------------------------------


def test_partition_cuts_between_groups_only_and_heal_restores(make_cluster):
    c = make_cluster(3)
    srv1, srv2 = serve(c, 1), serve(c, 2)
    assert connect(c, 0, 2, 60) == "ok"
    held = c.popen(0, [sys.executable, "-c", CLIENT, c.addr(2)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert held.stdout.readline() == "connected\n"
    c.partition([0, 1], [2])
    assert connect(c, 0, 1, 60) == "ok"  # inside group a
    assert connect(c, 0, 2, 1).startswith("failed")  # across: dropped, so the limit ends it
    assert connect(c, 2, 1, 1).startswith("failed")
    held.stdin.write("go\n")
    held.stdin.flush()
    assert held.stdout.readline() == "sent\n"  # sent into the partition
    c.heal()
    assert held.stdout.readline() == "ping\n"  # the held connection carries on (retransmitted)
    assert connect(c, 0, 2, 60) == "ok"
    assert connect(c, 2, 1, 60) == "ok"
    with pytest.raises(ValueError):
        c.partition([0, 1], [1])
    srv1.kill()
    srv2.kill()


def test_cap_puts_tbf_with_that_rate_on_the_link(make_cluster):
    c = make_cluster(2)
    assert c.cap(1, "200MiB/s") == 200 * 2**20
    for side in ("egress", "ingress"):
        (q,) = [q for q in c.qdiscs(1, side) if q.get("root")]
        assert (q["kind"], q["options"]["rate"]) == ("tbf", 200 * 2**20), (side, q)
    r = c.run(1, ["tc", "qdisc", "show", "dev", "eth0"])  # what a person would type in the host
    assert "tbf" in r.stdout and "rate" in r.stdout, r
    assert not any(q["kind"] == "tbf" for q in c.qdiscs(0))  # host 0 untouched

    assert c.cap(1, "100mbit", direction="egress") == 12_500_000
    (q,) = [q for q in c.qdiscs(1) if q.get("root")]
    assert (q["kind"], q["options"]["rate"]) == ("tbf", 12_500_000)
    c.uncap(1)
    assert not any(q["kind"] == "tbf" for side in ("egress", "ingress") for q in c.qdiscs(1, side))
    assert nc.parse_rate("25MB/s") == nc.parse_rate("200mbit") == 25_000_000
    with pytest.raises(ValueError):
        nc.parse_rate("fast")


# ---- (e) cleanup ---------------------------------------------------------------------------


def test_close_removes_everything_also_when_the_body_raised(make_cluster, tmp_path):
    make_cluster(1)  # only for the fixture's skip; this test makes its own cluster
    with pytest.raises(RuntimeError, match="the body failed"):
        with nc.Cluster(2, base_dir=tmp_path) as c:
            names = c.names()
            c.partition([0], [1])
            c.cap(0, "10mbit")
            stubborn = c.popen(1, ["sh", "-c", 'trap "" TERM INT HUP; echo x > "$CLUSTER_LOCAL/x"; exec sleep 600'])
            keeper = c.popen(0, ["sleep", "600"])
            raise RuntimeError("the body failed")
    assert stubborn.poll() is not None and keeper.poll() is not None
    state = system_state()
    for name in names["netns"] + names["links"]:
        assert name not in state
    assert names["base"] not in state and not Path(names["base"]).exists()
    c.close()  # again: harmless
    with pytest.raises(nc.ClusterError, match="closed"):
        c.start(["true"])


def test_sweep_stale_removes_what_a_killed_harness_left(make_cluster):
    make_cluster(1)  # for the skip
    code = (
        f"import os, signal, sys; sys.path.insert(0, {str(LIB.parent)!r}); import netns_cluster as nc\n"
        "c = nc.Cluster(2); print(c.tag, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    tag = r.stdout.strip()
    assert r.returncode == -9 and tag.startswith("ck"), r
    assert f"{tag}h0" in system_state()  # left behind: no cleanup ran
    (left,) = Path(tempfile.gettempdir()).glob(f"ckptstore-netns-{tag}-*")
    removed = nc.sweep_stale()
    assert {f"netns {tag}h0", f"netns {tag}h1", f"link {tag}b", f"dir {left}"} <= set(removed), removed
    assert tag not in system_state() and not left.exists()
