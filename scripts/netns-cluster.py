#!/usr/bin/env python3
"""Hosts made of network namespaces on this machine, for people (issue 39). The library is
tests/python/netns_cluster.py (its docstring has the verbs); the tests use it through the
make_cluster fixture of tests/python/netns_fixtures.py. Needs root and iproute2.

  scripts/netns-cluster.py up 3            # 3 hosts; prints how to enter each; Ctrl-C removes them
  scripts/netns-cluster.py demo            # FSDP2 saved by 2 ranks on 2 hosts, loaded on a 3rd
  scripts/netns-cluster.py down            # remove what killed runs left (--all: every run's)

Options: --base-dir DIR (up, demo: where the run's directory goes), --timeout S (demo: upper
bound per job), --all (down). PYTHON=... selects the interpreter the ranks run (default:
.venv/bin/python if it exists, else this one). Exit status 0 when everything asked for
worked, 1 when a check failed, 2 when hosts cannot be made here (the reason is printed),
130 after Ctrl-C or SIGTERM (the cluster removed first).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
import netns_cluster as nc  # noqa: E402


def python() -> str:
    if os.environ.get("PYTHON"):
        return os.environ["PYTHON"]
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def enter_command(c: nc.Cluster, i: int) -> str:
    argv = c.host_argv(i, ["env", f"CLUSTER_HOST={i}", f"CLUSTER_ADDR={c.addr(i)}",
                           f"CLUSTER_LOCAL={c.local_path}", f"CLUSTER_SHARED={c.shared}",
                           "GLOO_SOCKET_IFNAME=eth0", "bash"])
    return " ".join(shlex.quote(a) for a in argv)


def describe(c: nc.Cluster) -> None:
    print(f"cluster {c.tag}: subnet {c.net}, gateway (root namespace) {c.gateway}")
    print(f"  shared dir (same on every host): {c.shared}")
    print(f"  local dir path (each host its own): {c.local_path}")
    for h in c.hosts:
        print(f"  host {h.index}: netns {h.ns}, eth0 {h.addr}, local dir {h.local_dir}")


def cmd_up(args) -> int:
    with nc.Cluster(args.hosts, base_dir=args.base_dir) as c:
        describe(c)
        print("\nenter a host (a shell with its own local dir at the local dir path):")
        for h in c.hosts:
            print(f"  {enter_command(c, h.index)}")
        print("\ntorch.distributed across hosts: MASTER_ADDR=" + c.addr(0) + " GLOO_SOCKET_IFNAME=eth0")
        print("up; Ctrl-C (or SIGTERM) removes every namespace, link and directory", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("\ntaking the cluster down")
    print("down")
    return 0


def cmd_demo(args) -> int:
    py = python()
    lib = str(Path(nc.__file__).resolve())
    with nc.Cluster(3, base_dir=args.base_dir) as c:
        describe(c)
        t = time.monotonic()
        print(f"\n1. FSDP2 (CPU, gloo) + Adam on 2 ranks, hosts 0 and 1; 2 steps; "
              f"ckptstore.torch.distributed.save to {c.shared}/ckpt")
        save = c.start([py, lib, "job", "fsdp-save", c.shared], hosts=[0, 1])
        save.check(timeout=args.timeout)
        for r in range(2):
            res = nc.job_result(save.output(r))
            print(f"   rank {r} ran on host {res['host']} ({res['addr']}), world {res['world']}")
        print(f"   saved in {time.monotonic() - t:.1f} s: {sorted(p.name for p in (c.shared / 'ckpt').iterdir())}")
        t = time.monotonic()
        print("2. a fresh model of another seed on 1 rank, host 2; ckptstore.torch.distributed.load")
        load = c.start([py, lib, "job", "fsdp-load", c.shared], hosts=[2])
        load.check(timeout=args.timeout)
        res = nc.job_result(load.output(0))
        print(f"   loaded on host {res['host']} ({res['addr']}), world {res['world']}, "
              f"in {time.monotonic() - t:.1f} s; extra {res['extra']}")
        ok = res["differ"] == [] and res["compared"] > 0
        print(f"3. {res['compared']} tensors compared with the saving job's gathered state: "
              + ("all bit-identical" if ok else f"DIFFERENT: {res['differ']}"))
    print("cluster removed")
    return 0 if ok else 1


def cmd_down(args) -> int:
    removed = nc.sweep_stale(all_pids=args.all)
    for r in removed:
        print(f"removed {r}")
    print(f"{len(removed)} removed" + ("" if args.all else " (only runs whose process is gone; --all for every run)"))
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make H hosts and keep them until Ctrl-C")
    up.add_argument("hosts", type=int)
    up.add_argument("--base-dir", help="where the run's directory goes (default: the temp dir)")
    demo = sub.add_parser("demo", help="FSDP2 saved on 2 hosts, loaded bit-identical on a third")
    demo.add_argument("--base-dir")
    demo.add_argument("--timeout", type=float, default=300, help="upper bound per job, s")
    down = sub.add_parser("down", help="remove leftovers of killed runs")
    down.add_argument("--all", action="store_true", help="also those of runs still alive")
    args = ap.parse_args()
    if args.cmd != "down":
        why = nc.skip_reason()
        if why:
            print(f"netns-cluster: cannot make hosts here: {why}", file=sys.stderr)
            return 2
    # SIGTERM/SIGHUP unwind like Ctrl-C (netns_cluster installs that with the first cluster;
    # `up` waits in the main thread, so the with-block's cleanup runs).
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored (`cmd &`)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        return {"up": cmd_up, "demo": cmd_demo, "down": cmd_down}[args.cmd](args)
    except KeyboardInterrupt:
        print("interrupted; cluster removed", file=sys.stderr)
        return 130
    except AssertionError as e:
        print(f"netns-cluster: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
