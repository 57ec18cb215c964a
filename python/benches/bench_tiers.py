"""Tiered checkpoints across hosts (issue 39): recovery from peers against the persistent
tier and against DCP, the save's blocking time, host memory over many saves. Hosts are Linux
network namespaces (tests/python/netns_cluster.py); needs root, ``ip``, ``tc``, ``ss``.

    .venv/bin/python python/benches/bench_tiers.py                       # smoke: 32 MiB per host
    .venv/bin/python python/benches/bench_tiers.py --mib-per-host 256 --json /tmp/tiers.json

The job: ``--hosts`` hosts (default 3) x 1 rank, FSDP2 (``fully_shard``, CPU, gloo) over a
stack of ``nn.Linear`` (width ``--width``) with Adam, sized so that model + Adam state is
about ``--mib-per-host`` MiB per host (the issue: 256 MiB - 1 GiB). The persistent tier
(``--persistent``):

* ``s3``: ``s3://bkt/persistent`` on an S3 server (``s3s-fs``) in a storage host of its own
  (one more namespace) whose link is capped with tbf at ``--storage-rate`` (200MiB/s) both
  ways; the peers' links are not capped. If the manager refuses an ``s3://`` tier (or
  s3s-fs is missing), the run falls back to ``dir`` and says so.
* ``dir``: ``<shared>/persistent``, a directory every host sees (the same machine's disk:
  NOT behind a capped link, so the persistent tier is as fast as the local one here).

What one run measures, in order (all in the same run, so the ratios compare like with like):

1. ``train``: one step (Adam state materialised), then ``--saves`` (50) steps each followed
   by ``mgr.save`` + ``mgr.wait`` (``CheckpointManager(local=$CLUSTER_LOCAL, persistent,
   persist_every, replicas=1, keep_last=2)``); per save: the time ``save()`` blocks, the time
   until ``wait()`` returns, and VmRSS after it. Before each save, after a barrier as the
   save is, every rank times one ``copy_`` of every local parameter shard and optimizer
   state tensor into buffers kept across the saves (their bytes are taken off VmRSS): the
   baseline of the blocking goal, timed alike (the ranks share the cores and the memory
   bus). The same copy alone (best of 3, before and after the saves) is reported too. Last, the final state is also saved with DCP
   (``FileSystemWriter`` on ``<shared>/dcp``, or ``FsspecWriter`` on the S3 server if s3fs is
   installed) for leg 3c.
2. Host 1 lost (``lose_host(1, wipe_local=True)``) and replaced by an empty one.
3. Three restarts, each a fresh job on the same hosts, timed from the driver's launch of the
   job to two moments: the state restored, the first resumed step about to start (python
   start, torch import, process group, model build, restore: "to resumed"), and the end of
   that first step ("to 1st step"; the step is the same work in every leg: 13-20 s of FSDP2
   over gloo on this 2-core machine at 1 GiB per host); and the restore alone inside the job:
   a) ``fast``: ``mgr.restore_latest`` from the local tiers and the peers (timed alone: the
      copies a replaced host gets back afterwards run in the background, timed as
      ``close_s``, the first resumed step running beside them);
   b) ``persistent``: every local tier wiped first, ``mgr.restore_latest`` from the
      persistent tier;
   c) ``dcp``: ``dcp.load`` through DCP's reader on the same storage, then
      ``set_state_dict`` (s3 mode: ``FsspecReader`` over s3fs, which the venv lacks: put it
      elsewhere, ``pip install --target /tmp/s3fs-pkgs s3fs==<fsspec's version>``, and run
      with ``PYTHONPATH=/tmp/s3fs-pkgs``; without it the leg is skipped and says why).
   ``--repeats N`` runs each restart N times (host 1 lost again before each fast one, the
   local tiers wiped again before the others); medians are reported.
   Every restore is checked to give the trained state (an exact fingerprint of every
   parameter and optimizer state shard).
4. In job 3a, the bytes the peer restore moved between each pair of hosts (``ss -ti``
   ``bytes_received`` of every TCP socket, by peer address, before and after
   ``restore_latest``), then the same bytes sent between the same hosts with
   ``torch.distributed`` isend/irecv of uint8 tensors over gloo, all pairs at once (best of
   2): the raw transfer; and once more with the receive buffers allocated inside the timed
   region, first touched by the receive as a restore's fresh tensors are (the baseline of
   the peer restore's goal). The restore's own fetch rounds (the byte ranges moving between
   hosts) are timed from the manager's phase trace (``CKPTSTORE_TIERS_TRACE``) too. Around
   every restore, the MiB the machine read from and wrote to disk (``/proc/vmstat``): the
   local tiers are directories on disk here, served from the page cache unless evicted.

Goals (issue 39) printed with PASS/MISS: restart from peers >= 3x faster than from the
persistent tier (both to resumed and to the first step's end), and the restore alone >= 5x faster
(issue 51); the restore alone from peers <= 1.5x the raw transfer into fresh buffers (issue 51);
median save blocking <= 1.2x the median copy timed alike; memory flat over the saves (here: every rank's VmRSS after the last save <= 1.1x
its VmRSS after the first). ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.abspath(__file__)
_here = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(_here))  # python/benches -> the repository
sys.path.insert(0, _here)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
from bench_util import copy_seconds, status_kib  # noqa: E402  (stdlib only)
import netns_cluster as nc  # noqa: E402  (stdlib only)
# Import the installed ckptstore, not the source tree next to this script.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

MIB = 1 << 20
BUCKET, KEY, SECRET, S3_PORT = "bkt", "benchtierskey", "benchtierssecret0123456789", 9000
BATCH = 8


# ---- in the hosts ------------------------------------------------------------------------


def _model(cfg, world, seed):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Built on the meta device, sharded, then each rank fills its own shards (as large jobs
    # start): the restart times hold no full-model initialisation on every rank.
    w = cfg["width"]
    with torch.device("meta"):
        m = nn.Sequential(*[mod for _ in range(cfg["layers"]) for mod in (nn.Linear(w, w), nn.ReLU())])
    mesh = init_device_mesh("cpu", (world,))
    for mod in m:
        if isinstance(mod, nn.Linear):
            fully_shard(mod, mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.to_empty(device="cpu")
    g = torch.Generator().manual_seed(1000 * seed + dist_rank())
    with torch.no_grad():
        for p in m.parameters():
            p.to_local().normal_(0, 0.02, generator=g)
    return m, torch.optim.Adam(m.parameters(), lr=1e-4)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _train_step(m, o, step, rank, width):
    import torch

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1000 * step + rank))
    (m(x) ** 2).mean().backward()
    o.step()
    o.zero_grad()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state_tensors(m, o):
    """This rank's parameter shards and optimizer state tensors, by name."""
    import torch

    names = {id(p): n for n, p in m.named_parameters()}
    out = {n: _local(p.detach()) for n, p in m.named_parameters()}
    for p, st in o.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim/{names[id(p)]}/{k}"] = _local(v.detach())
    return out


def _fingerprint(m, o) -> str:
    """Order-independent exact fingerprint of this rank's state (sum of per-tensor sums)."""
    sums = [t.double().sum().item() for _, t in sorted(_state_tensors(m, o).items())]
    return repr(math.fsum(sums))


def _ss_bytes(addrs: dict) -> dict:
    """TCP payload bytes received so far by this namespace, by the host they came from
    (``ss -tinH``: every socket's bytes_received, keyed by its peer address)."""
    out = subprocess.run(["ss", "-tinHn"], capture_output=True, text=True, check=True).stdout
    got: dict = {}
    peer = None
    for line in out.splitlines():
        if line and not line[0].isspace():
            cols = line.split()
            peer = cols[-1].rsplit(":", 1)[0].strip("[]") if len(cols) >= 5 else None
        m = re.search(r"bytes_received:(\d+)", line)
        if m and peer in addrs:
            h = addrs[peer]
            got[h] = got.get(h, 0) + int(m.group(1))
    return got


def _disk_kib() -> tuple[int, int]:
    """KiB the machine has read from and written to disk so far (``/proc/vmstat``
    ``pgpgin``, ``pgpgout``: every host, one kernel): the local tiers are on disk here, and
    what a restore reads of them comes from the page cache or, where evicted, the disk."""
    got = dict(line.split(" ", 1) for line in Path("/proc/vmstat").read_text().splitlines() if " " in line)
    return int(got.get("pgpgin", 0)), int(got.get("pgpgout", 0))


def _dcp_storage(cfg, write: bool):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if cfg["dcp"]["kind"] == "dir":
        return (FileSystemWriter if write else FileSystemReader)(cfg["dcp"]["path"])
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = cfg["dcp"]["storage_options"]
    return (FsspecWriter if write else FsspecReader)(cfg["dcp"]["path"], **opts)


def _raw_transfer(matrix, leaders, host, is_leader, reps=2, fresh=False) -> list:
    """Send matrix[src][dst] bytes from each host's first rank to each other one's, all
    pairs at once (isend/irecv of uint8 tensors); seconds of each repetition. ``fresh``:
    the receive buffers are allocated inside the timed region and first touched by the
    receive, as a restore's fresh tensors are; else allocated and zeroed before it."""
    import torch
    import torch.distributed as dist

    sends, recvs = [], []
    if is_leader:
        for h, n in enumerate(matrix[host]):
            if n and h != host:
                sends.append((leaders[h], torch.ones(n, dtype=torch.uint8)))
        for h, row in enumerate(matrix):
            if row[host] and h != host:
                recvs.append((leaders[h], row[host]))
    times = []
    for _ in range(reps):
        bufs = [] if fresh else [(src, torch.zeros(n, dtype=torch.uint8)) for src, n in recvs]
        dist.barrier()
        t0 = time.perf_counter()
        if fresh:
            bufs = [(src, torch.empty(n, dtype=torch.uint8)) for src, n in recvs]
        reqs = [dist.isend(b, dst) for dst, b in sends] + [dist.irecv(b, src) for src, b in bufs]
        for r in reqs:
            r.wait()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        del bufs
    return times


def _job_main(name: str, shared: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = json.loads(Path(shared, "bench-config.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rph = int(os.environ["LOCAL_WORLD_SIZE"])
    host, is_leader = rank // rph, int(os.environ["LOCAL_RANK"]) == 0
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))
    res = {"rank": rank, "host": host, "t_init": time.time()}
    m, o = _model(cfg, world, seed=0 if name == "train" else 1)
    res["t_built"] = time.time()
    w = cfg["width"]

    def manager():
        from ckptstore.torch.distributed import CheckpointManager

        return CheckpointManager(local=os.environ["CLUSTER_LOCAL"], persistent=cfg["persistent"],
                                 persist_every=cfg["persist_every"], replicas=1, keep_last=2)

    if name == "train":
        _train_step(m, o, 0, rank, w)  # Adam state materialised
        tensors = list(_state_tensors(m, o).values())
        res["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        copy = [copy_seconds(tensors)]
        block, done, rss, sync_copy = [], [], [], []
        # One copy of the state timed as each save is: every rank at once after a barrier
        # (the ranks share the 2 cores and the memory bus), into buffers kept across the
        # saves (their bytes are taken off the RSS figures below).
        bufs = [torch.empty_like(t) for t in tensors]
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        bufs_bytes = sum(b.numel() * b.element_size() for b in bufs)
        mgr = manager()
        for s in range(1, cfg["saves"] + 1):
            _train_step(m, o, s, rank, w)
            dist.barrier()
            t0 = time.perf_counter()
            for b, t in zip(bufs, tensors):
                b.copy_(t)
            sync_copy.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(s, m, o, extra={"step": s})
            t1 = time.perf_counter()
            mgr.wait()
            t2 = time.perf_counter()
            block.append(t1 - t0)
            done.append(t2 - t0)
            rss.append(status_kib("VmRSS") * 1024 - bufs_bytes)
        mgr.close()
        del bufs
        copy.append(copy_seconds(tensors))
        res.update(copy_s=min(copy), copy_runs=copy, sync_copy_s=sync_copy, block_s=block, done_s=done, rss=rss,
                   fingerprint=_fingerprint(m, o), step=cfg["saves"])
        if cfg["dcp"]["kind"] != "skip":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(m, o)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save({"model": msd, "optim": osd, "step": torch.tensor(cfg["saves"])},
                     storage_writer=_dcp_storage(cfg, write=True))
            res["dcp_save_s"] = time.perf_counter() - t0
    else:
        mode = name.split("-", 1)[1]
        addrs = {a: int(h) for a, h in cfg["addrs"].items()}
        before = _ss_bytes(addrs) if is_leader else {}
        disk0 = _disk_kib()
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(m, o)
            sd = {"model": msd, "optim": osd, "step": torch.tensor(-1)}
            dcp.load(sd, storage_reader=_dcp_storage(cfg, write=False))
            set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            step, tier = int(sd["step"]), "dcp"
        else:
            mgr = manager()  # its gloo group, the hosts found, the tiers opened
            t_open = time.perf_counter()
            res["open_s"] = t_open - t0
            cpu0 = time.process_time()  # every thread of this rank, user + system
            step = mgr.restore_latest(m, o)
            tier = mgr.last_tier
            res["restore_s"] = time.perf_counter() - t_open  # restore_latest alone
            res["restore_cpu_s"] = time.process_time() - cpu0
            res["t_resumed"] = time.time()  # restored: the first resumed step can start
            after = _ss_bytes(addrs) if is_leader else {}  # what the restore moved
            t1 = time.perf_counter()
            mgr.close()  # waits for the copies a replaced host gets back (the background)
            res["close_s"] = time.perf_counter() - t1
        if mode == "dcp":
            res["restore_s"] = time.perf_counter() - t0
            res["t_resumed"] = time.time()
            after = _ss_bytes(addrs) if is_leader else {}
        res["disk_mib"] = [(a - b) / 1024 for a, b in zip(_disk_kib(), disk0)]  # read, written: every host's
        res.update(step=step, tier=tier, fingerprint=_fingerprint(m, o))
        _train_step(m, o, (step or 0) + 1, rank, w)
        res["t_first_step"] = time.time()
        if mode == "fast":
            got = {h: after.get(h, 0) - before.get(h, 0) for h in after}
            rows = [None] * world
            dist.all_gather_object(rows, (host, is_leader, got))
            n_hosts = world // rph
            matrix = [[0] * n_hosts for _ in range(n_hosts)]  # matrix[src][dst]
            for dst, lead, g in rows:
                if lead:
                    for src, n in g.items():
                        if src != dst and src < n_hosts:
                            matrix[src][dst] = n
            res["matrix"] = matrix
            res["raw_s"] = _raw_transfer(matrix, [h * rph for h in range(n_hosts)], host, is_leader)
            res["raw_fresh_s"] = _raw_transfer(matrix, [h * rph for h in range(n_hosts)], host, is_leader,
                                               fresh=True)
    nc._result(res)
    nc.exit_together(rank, world)


# ---- the driver --------------------------------------------------------------------------


def _s3s_exe():
    exe = os.environ.get("CKPT_S3S_FS") or shutil.which("s3s-fs") or str(Path.home() / ".cargo/bin/s3s-fs")
    return exe if os.access(exe, os.X_OK) else None


def _start_s3(c, i):
    """s3s-fs serving host i's local directory on port 9000 of host i; its process."""
    exe = _s3s_exe()
    if exe is None:
        raise RuntimeError("s3s-fs not found (cargo install s3s-fs@0.14.1 --locked --features binary)")
    (c.local_dir(i) / BUCKET).mkdir()
    p = c.popen(i, [exe, "--host", "0.0.0.0", "--port", str(S3_PORT), "--access-key", KEY,
                    "--secret-key", SECRET, c.local_path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((c.addr(i), S3_PORT), timeout=1).close()
            return p
        except OSError:
            if p.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"s3s-fs did not listen on {c.addr(i)}:{S3_PORT}") from None
            time.sleep(0.05)


def _probe_s3_manager(env: dict) -> str | None:
    """Why the installed manager cannot take an s3:// persistent tier (None: it can)."""
    code = ("import tempfile\nfrom ckptstore.torch.distributed import CheckpointManager\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    CheckpointManager(local=d, persistent='s3://%s/probe', persist_every=1).close()\n" % BUCKET)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                       env={**os.environ, **env}, timeout=300)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]


def _run_job(c, name, hosts, env, timeout):
    t0 = time.time()
    j = c.start([sys.executable, HERE, "job", name, str(c.shared)], hosts=hosts, env=env)
    try:
        j.check(timeout=timeout)
    except (AssertionError, TimeoutError) as e:
        raise RuntimeError(f"job {name} failed:\n{e}") from None
    out = [nc.job_result(j.output(r)) for r in range(j.world)]
    if any(o is None for o in out):
        raise RuntimeError(f"job {name} printed no result:\n{j.tails()}")
    return t0, out


def _fetch_s(trace: Path) -> float | None:
    """From the manager's phase trace (``CKPTSTORE_TIERS_TRACE``): the longest time any
    rank spent in the restore's fetch rounds (the byte ranges moving between hosts)."""
    if not trace.exists():
        return None
    spent: dict = {}
    prev: dict = {}
    for line in trace.read_text().splitlines():
        m = re.match(r"ckptstore tiers: rank (\d+) \+([0-9.]+)s -> (.*)$", line)
        if not m:
            continue
        r, dt, label = int(m[1]), float(m[2]), m[3]
        if "fetch round" in prev.get(r, ""):
            spent[r] = spent.get(r, 0.0) + dt
        prev[r] = label
    return max(spent.values()) if spent else None


def _wipe(d: Path):
    for p in d.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _layers(args) -> int:
    # model + Adam (exp_avg, exp_avg_sq): 3x the parameter bytes, spread over the hosts.
    per_layer = (args.width * args.width + args.width) * 4
    return max(2, round(args.mib_per_host * MIB * args.hosts / 3 / per_layer))


def run(args) -> dict:
    notes: list = []
    res = {"args": vars(args), "notes": notes}
    H = args.hosts
    want_s3 = args.persistent == "s3"
    with nc.Cluster(H + (1 if want_s3 else 0), base_dir=args.dir) as c:
        env, mode = {}, "dir"
        if want_s3:
            try:
                s3p = _start_s3(c, H)
                env = {"AWS_ENDPOINT_URL": f"http://{c.addr(H)}:{S3_PORT}", "AWS_ACCESS_KEY_ID": KEY,
                       "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
                why = _probe_s3_manager(env)
            except RuntimeError as e:
                why, s3p = str(e), None
            if why is None:
                mode = "s3"
                res["storage_rate_Bps"] = c.cap(H, args.storage_rate)
            else:
                notes.append(f"--persistent s3 unavailable ({why}); fell back to dir")
                if s3p is not None:
                    s3p.kill()
                env = {}
        if mode == "dir":
            notes.append("persistent tier = a directory of the shared file system on this machine's disk: "
                         "NOT behind a capped link (no 200 MiB/s storage host in this mode)")
            persistent = str(c.shared / "persistent")
            dcp = {"kind": "dir", "path": str(c.shared / "dcp")}
        else:
            persistent = f"s3://{BUCKET}/persistent"
            try:
                import importlib.util
                has_s3fs = importlib.util.find_spec("s3fs") is not None
            except ImportError:
                has_s3fs = False
            if has_s3fs:
                dcp = {"kind": "fsspec", "path": f"s3://{BUCKET}/dcp", "storage_options": {
                    "key": KEY, "secret": SECRET, "endpoint_url": env["AWS_ENDPOINT_URL"],
                    "client_kwargs": {"region_name": "us-east-1"}}}
            else:
                dcp = {"kind": "skip"}
                notes.append("DCP leg skipped: s3fs (fsspec's S3 file system) is not importable "
                             "(install it outside the venv, e.g. pip install --target DIR s3fs, and set PYTHONPATH=DIR)")
        res["mode"] = mode
        cfg = {"width": args.width, "layers": _layers(args), "saves": args.saves,
               "persist_every": args.persist_every, "persistent": persistent, "dcp": dcp,
               "timeout_s": args.timeout, "addrs": {c.addr(i): i for i in range(len(c.hosts))}}
        res["config"] = cfg
        (c.shared / "bench-config.json").write_text(json.dumps(cfg))
        hosts = list(range(H))
        print(f"{H} hosts x 1 rank, {cfg['layers']} x Linear({args.width}, {args.width}), persistent: "
              f"{persistent} ({mode}), {args.saves} saves, persist_every={args.persist_every}", flush=True)

        _, train = _run_job(c, "train", hosts, env, args.timeout * 4)
        res["train"] = train
        print(f"train + {args.saves} saves done", flush=True)
        legs: dict = {}
        for leg in ("fast", "persistent", "dcp"):
            if leg == "dcp" and dcp["kind"] == "skip":
                continue
            for _ in range(args.repeats):
                if leg == "fast":  # host 1 lost (again: a restore may have left files there)
                    c.lose_host(1, wipe_local=True)
                    c.replace_host(1)
                else:
                    for i in hosts:
                        _wipe(c.local_dir(i))
                trace = Path(args.trace_dir or c.shared) / f"trace-{leg}-{len(legs.get(leg, []))}.log"
                t0, out = _run_job(c, f"resume-{leg}", hosts, {**env, "CKPTSTORE_TIERS_TRACE": str(trace)},
                                   args.timeout)
                legs.setdefault(leg, []).append({"launch": t0, "ranks": out, "fetch_s": _fetch_s(trace)})
                print(f"restart from {leg}: {max(o['t_first_step'] for o in out) - t0:.2f} s", flush=True)
        res["legs"] = legs
    return res


def summarize(res) -> dict:
    train, legs = res["train"], res["legs"]
    fp = {o["rank"]: o["fingerprint"] for o in train}
    s = {"state_mib_per_rank": [round(o["state_bytes"] / MIB, 1) for o in train]}
    med = statistics.median
    for leg, reps in legs.items():  # medians over the repetitions of each leg
        s[leg] = {
            "resumed_s": med([max(_t_resumed(o) for o in d["ranks"]) - d["launch"] for d in reps]),
            "restart_s": med([max(o["t_first_step"] for o in d["ranks"]) - d["launch"] for d in reps]),
            "startup_s": med([max(o["t_built"] for o in d["ranks"]) - d["launch"] for d in reps]),
            "restore_s": med([max(o["restore_s"] for o in d["ranks"]) for d in reps]),
            "restore_runs_s": [round(max(o["restore_s"] for o in d["ranks"]), 3) for d in reps],
            # the manager's opening before it (runs before it was timed apart: 0), and the CPU
            # seconds of the restore summed over the ranks (they share the machine's cores)
            "open_s": med([max(o.get("open_s", 0) for o in d["ranks"]) for d in reps]),
            "restore_cpu_s": med([sum(o.get("restore_cpu_s", 0) for o in d["ranks"]) for d in reps]),
            "disk_mib": [[round(max((o.get("disk_mib") or [0, 0])[k] for o in d["ranks"]), 1) for k in (0, 1)]
                         for d in reps],
            "step": [o["step"] for d in reps for o in d["ranks"]],
            "tier": sorted({str(o["tier"]) for d in reps for o in d["ranks"]}),
            "bit_identical": all(o["fingerprint"] == fp[o["rank"]] for d in reps for o in d["ranks"]),
        }
    if "fast" in legs:
        r0 = legs["fast"][0]["ranks"][0]
        s["peer_bytes_matrix"] = r0["matrix"]
        s["peer_bytes"] = sum(map(sum, r0["matrix"]))
        def raw(key):  # per repetition: the raw transfer's best of 2 (each timed by its slowest rank)
            return med([min(max(o[key][k] for o in d["ranks"]) for k in range(len(r0[key]))) for d in legs["fast"]])

        s["raw_s"] = raw("raw_s")
        if "raw_fresh_s" in r0:
            s["raw_fresh_s"] = raw("raw_fresh_s")
        fetch = [d["fetch_s"] for d in legs["fast"] if d.get("fetch_s")]
        s["fetch_s"] = med(fetch) if fetch else None
    n = len(train[0]["block_s"])
    blk = [max(o["block_s"][k] for o in train) for k in range(n)]
    dn = [max(o["done_s"][k] for o in train) for k in range(n)]
    pe = res["config"]["persist_every"]
    persisted = [k for k in range(n) if pe and (k + 1) % pe == 0]
    sync = [max(o["sync_copy_s"][k] for o in train) for k in range(n)]
    s["save"] = {
        "copy_s": max(o["copy_s"] for o in train),
        "copy_sync_median_s": statistics.median(sync),
        "block_median_s": statistics.median(blk), "block_max_s": max(blk),
        "block_median_not_persisted_s": statistics.median([blk[k] for k in range(n) if k not in persisted] or [0]),
        "block_median_persisted_s": statistics.median([blk[k] for k in persisted]) if persisted else None,
        "wait_done_median_s": statistics.median(dn),
        "dcp_save_s": max((o.get("dcp_save_s") or 0) for o in train) or None,
    }
    s["rss_mib"] = [{"rank": o["rank"], "first": o["rss"][0] / MIB, "max": max(o["rss"]) / MIB,
                     "last": o["rss"][-1] / MIB, "at10": o["rss"][min(9, n - 1)] / MIB} for o in train]
    goals = []
    if "fast" in s and "persistent" in s:
        x = s["persistent"]["resumed_s"] / s["fast"]["resumed_s"]
        goals.append(("restart from peers >= 3x faster than from the persistent tier, to the state restored "
                      "(the first resumed step starting)", x, x >= 3.0))
        x = s["persistent"]["restart_s"] / s["fast"]["restart_s"]
        goals.append(("the same, to the first resumed step done (its own time in both)", x, x >= 3.0))
        x = s["persistent"]["restore_s"] / s["fast"]["restore_s"]
        goals.append(("restore alone from peers >= 5x faster than from the persistent tier", x, x >= 5.0))
    if s.get("raw_fresh_s"):
        x = s["fast"]["restore_s"] / s["raw_fresh_s"]
        goals.append(("restore alone from peers <= 1.5x a raw transfer of the same bytes into fresh buffers "
                      "(restore s / raw fresh s)", x, x <= 1.5))
    x = s["save"]["block_median_s"] / s["save"]["copy_sync_median_s"]
    goals.append(("save blocking (median) <= 1.2x one copy of the state timed alike", x, x <= 1.2))
    x = max(r["last"] / r["first"] for r in s["rss_mib"])
    goals.append(("host memory flat over the saves (max over ranks of RSS last / first <= 1.1)", x, x <= 1.1))
    s["goals"] = [{"goal": g, "value": round(v, 3), "pass": ok} for g, v, ok in goals]
    return s


def _t_resumed(o: dict) -> float:
    """When a rank's restore returned (runs before ``t_resumed`` was recorded: its build
    time plus its restore, which started after a barrier)."""
    return o.get("t_resumed") or o["t_built"] + o["restore_s"]


def report(res, s) -> None:
    print(f"\nmode: {res['mode']}; state per rank (MiB): {s['state_mib_per_rank']}")
    for n in res["notes"]:
        print(f"note: {n}")
    print(f"\n{'restart after a lost host':28} {'to resumed s':>12} {'to 1st step s':>13} {'startup s':>10} {'restore s':>10}"
          "  step  tier        exact"
          + (f"   (medians of {res['args']['repeats']})" if res["args"]["repeats"] > 1 else ""))
    for leg in ("fast", "persistent", "dcp"):
        if leg in s:
            d = s[leg]
            print(f"  {leg:26} {d['resumed_s']:12.2f} {d['restart_s']:13.2f} {d['startup_s']:10.2f} {d['restore_s']:10.2f}  "
                  f"{d['step'][0]!s:4}  {','.join(d['tier']):10}  {d['bit_identical']}")
    print("  disk read, written during each restore (the machine's pgpgin, pgpgout; MiB): "
          + "; ".join(f"{leg} {s[leg]['disk_mib']}" for leg in ("fast", "persistent", "dcp") if leg in s))
    for a, b in (("persistent", "fast"), ("dcp", "fast"), ("dcp", "persistent")):
        if a in s and b in s:
            print(f"  {a} / {b}: to resumed {s[a]['resumed_s'] / s[b]['resumed_s']:.2f}x, "
                  f"to 1st step {s[a]['restart_s'] / s[b]['restart_s']:.2f}x, "
                  f"restore alone {s[a]['restore_s'] / s[b]['restore_s']:.2f}x")
    if "raw_s" in s:
        print(f"\npeer restore moved {s['peer_bytes'] / MIB:.1f} MiB (matrix src->dst, MiB: "
              f"{[[round(v / MIB, 1) for v in row] for row in s['peer_bytes_matrix']]}); raw transfer of "
              f"the same: {s['raw_s']:.2f} s ({s['peer_bytes'] / MIB / s['raw_s']:.0f} MiB/s); restore "
              f"{s['fast']['restore_s']:.2f} s" + (f", of which its fetch rounds {s['fetch_s']:.2f} s (raw s / "
                                                    f"fetch s: {s['raw_s'] / s['fetch_s']:.2f})" if s.get("fetch_s") else ""))
        if s.get("raw_fresh_s"):
            print(f"  the same into receive buffers allocated in the timed region (first touched by the receive, "
                  f"as a restore's fresh tensors are): {s['raw_fresh_s']:.2f} s "
                  f"({s['peer_bytes'] / MIB / s['raw_fresh_s']:.0f} MiB/s; raw fresh s / restore s: "
                  f"{s['raw_fresh_s'] / s['fast']['restore_s']:.2f})")
        f, cores = s["fast"], os.cpu_count() or 1
        if f.get("restore_cpu_s"):
            print(f"  restore_latest alone (the manager's opening before it, {f['open_s']:.2f} s, is not in it): "
                  f"its CPU seconds summed over the ranks {f['restore_cpu_s']:.2f} s; over this machine's "
                  f"{cores} cores, the least wall time that CPU work allows here is "
                  f"{f['restore_cpu_s'] / cores:.2f} s ({f['restore_s'] / (f['restore_cpu_s'] / cores):.2f}x "
                  "of it); hosts of their own would run each rank's share beside the others'")
    v = s["save"]
    print(f"\nsave: one copy {v['copy_sync_median_s'] * 1e3:.1f} ms timed as the saves (every rank at once after "
          f"a barrier, median of the slowest rank), {v['copy_s'] * 1e3:.1f} ms alone (best of 3); save() blocks median {v['block_median_s'] * 1e3:.0f} ms "
          f"(not persisted {v['block_median_not_persisted_s'] * 1e3:.0f} ms, persisted "
          f"{(v['block_median_persisted_s'] or 0) * 1e3:.0f} ms, max {v['block_max_s'] * 1e3:.0f} ms); "
          f"save+wait median {v['wait_done_median_s'] * 1e3:.0f} ms"
          + (f"; DCP save (blocking) {v['dcp_save_s']:.2f} s" if v["dcp_save_s"] else ""))
    print("RSS over the saves (MiB): " + "; ".join(
        f"rank {r['rank']} first {r['first']:.0f} 10th {r['at10']:.0f} max {r['max']:.0f} last {r['last']:.0f}"
        for r in s["rss_mib"]))
    print("\ngoals:")
    for g in s["goals"]:
        print(f"  {'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-host", type=float, default=32, help="model + Adam state per host, MiB (issue: 256-1024)")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1, help="restarts per leg (medians reported)")
    ap.add_argument("--persist-every", type=int, default=10)
    ap.add_argument("--persistent", choices=("s3", "dir"), default="s3")
    ap.add_argument("--storage-rate", default="200MiB/s", help="tbf cap of the storage host's link (s3 mode)")
    ap.add_argument("--timeout", type=float, default=600, help="process group timeout and per-job bound, s")
    ap.add_argument("--dir", default=None, help="where the cluster's temp dir goes (default: the temp dir)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--trace-dir", default=None,
                    help="keep the restarts' phase traces (CKPTSTORE_TIERS_TRACE) here (default: in the cluster, removed)")
    args = ap.parse_args()
    if args.hosts < 3:
        ap.error("--hosts must be >= 3 (host 1 is lost, a peer holds its replica)")
    why = nc.skip_reason()
    if why:
        print(f"cannot make hosts here: {why}", file=sys.stderr)
        return 2
    try:
        res = run(args)
    except Exception as e:  # noqa: BLE001 - reported, the cluster is already cleaned up
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "error": f"{type(e).__name__}: {e}"}, indent=1))
        return 1
    s = summarize(res)
    res["summary"] = s
    report(res, s)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "job":
        _job_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
