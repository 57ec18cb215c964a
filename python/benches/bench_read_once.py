"""Read once, fan out: a replicated (DDP-style) model restored from storage behind a slow
link by every host, each chunk read once and sent on over the process group, against every
rank reading its own copy (``CKPTSTORE_READ_ONCE`` off). Hosts are Linux network
namespaces (tests/python/netns_cluster.py, as ``bench_tiers.py``); needs root, ``ip``,
``tc``, ``ss`` and s3s-fs.

    .venv/bin/python python/benches/bench_read_once.py                    # 32 MiB per rank
    .venv/bin/python python/benches/bench_read_once.py --mib 256 --reps 3 --json /tmp/ro.json

The job: ``--hosts`` hosts (default 3) x 1 rank, each with the same model (a stack of
``nn.Linear(--width)``, Adam, one step: model + moments about ``--mib`` MiB), saved once by
``ckptstore.torch.distributed.save`` to ``s3://bkt/ro`` on an S3 server (s3s-fs) in a
storage host of its own whose link is capped with tbf at ``--storage-rate`` (200MiB/s).
Then ``--reps`` rounds, each loading the checkpoint twice with
``ckptstore.torch.distributed.load`` into fresh models, once each way, the order swapped
every round: ``once`` (each chunk read by one rank, sent to the others) and ``each`` (every
rank reads everything). Per load: the time (after a barrier, the slowest rank), and the
tensor bytes each rank read from storage (``ckptstore.torch._fanout.LAST``: the engine's
ranged GETs fetch exactly the CRC-checked chunks read, so this is the payload each host
pulled over the capped link; the HTTP connections close with each load, so socket
counters cannot be read after it). Each load is checked to give the saved state (an exact
fingerprint on every rank).

Goals (issue: recovery at the network's speed): bytes read from storage by the job with
``once`` = 1.0x the checkpoint (``each``: hosts x); ``once`` time <= 0.4x ``each``
(median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = os.path.abspath(__file__)
sys.path.insert(0, str(Path(HERE).resolve().parents[2] / "tests" / "python"))
sys.path.insert(0, str(Path(HERE).resolve().parent))

import bench_tiers as bt  # noqa: E402
import netns_cluster as nc  # noqa: E402

MIB = 1 << 20


def _model(width: int, layers: int, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    m = nn.Sequential(*[mod for _ in range(layers) for mod in (nn.Linear(width, width), nn.ReLU())])
    return m, torch.optim.Adam(m.parameters(), lr=1e-4)


def _fingerprint(m, o) -> str:
    import torch

    ts = [p.detach() for p in m.parameters()]
    ts += [v for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    return repr(math.fsum(t.double().sum().item() for t in ts))


def _job_main(shared: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ckptstore.torch.distributed as ctd
    from ckptstore.torch import _fanout

    torch.set_num_threads(1)
    cfg = json.loads(Path(shared, "ro-config.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]))
    m, o = _model(cfg["width"], cfg["layers"], seed=0)
    x = torch.randn(16, cfg["width"], generator=torch.Generator().manual_seed(7))  # the same on every rank
    (m(x) ** 2).mean().backward()
    o.step()
    want = _fingerprint(m, o)
    t0 = time.perf_counter()
    ctd.save(cfg["path"], m, o, extra={"step": 1})
    res = {"rank": rank, "save_s": time.perf_counter() - t0, "loads": []}
    del m, o
    for r in range(cfg["reps"]):
        for way in (("once", "each") if r % 2 == 0 else ("each", "once")):
            _fanout.ENABLED = way == "once"
            m2, o2 = _model(cfg["width"], cfg["layers"], seed=1)
            dist.barrier()
            t0 = time.perf_counter()
            ctd.load(cfg["path"], m2, o2)
            took = time.perf_counter() - t0
            got = _fanout.LAST.get("read_bytes", 0)
            res["loads"].append({"round": r, "way": way, "s": took, "storage_bytes": got,
                                 "exact": _fingerprint(m2, o2) == want, "last": dict(_fanout.LAST)})
            del m2, o2
    nc._result(res)


def run(args) -> dict:
    res: dict = {"args": vars(args)}
    H = args.hosts
    with nc.Cluster(H + 1, base_dir=args.dir) as c:
        s3p = bt._start_s3(c, H)
        try:
            env = {"AWS_ENDPOINT_URL": f"http://{c.addr(H)}:{bt.S3_PORT}", "AWS_ACCESS_KEY_ID": bt.KEY,
                   "AWS_SECRET_ACCESS_KEY": bt.SECRET, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
            res["storage_rate_Bps"] = c.cap(H, args.storage_rate)
            per_layer = (args.width * args.width + args.width) * 4 * 3  # weights + 2 moments, F32
            layers = max(1, round(args.mib * MIB / per_layer))
            cfg = {"width": args.width, "layers": layers, "reps": args.reps, "timeout_s": args.timeout,
                   "path": f"s3://{bt.BUCKET}/ro", "storage_addr": c.addr(H)}
            (c.shared / "ro-config.json").write_text(json.dumps(cfg))
            res["config"] = cfg
            print(f"{H} hosts x 1 rank, {layers} x Linear({args.width}) replicated, s3 behind "
                  f"{args.storage_rate}", flush=True)
            j = c.start([sys.executable, HERE, "job", str(c.shared)], hosts=list(range(H)), env=env)
            j.check(timeout=args.timeout * (2 + 2 * args.reps))
            res["ranks"] = [nc.job_result(j.output(r)) for r in range(j.world)]
        finally:
            s3p.kill()
    return res


def summarize(res) -> dict:
    ranks = res["ranks"]
    n = len(ranks[0]["loads"])
    rows = []
    for i in range(n):
        loads = [r["loads"][i] for r in ranks]
        rows.append({"round": loads[0]["round"], "way": loads[0]["way"], "s": max(x["s"] for x in loads),
                     "storage_bytes": sum(x["storage_bytes"] for x in loads),
                     "exact": all(x["exact"] for x in loads)})
    stored = sum(r["loads"][0]["last"].get("read_bytes", 0) for r in ranks if r["loads"][0]["way"] == "once")
    by = {w: [x for x in rows if x["way"] == w] for w in ("once", "each")}
    ratios = [a["s"] / b["s"] for a, b in zip(by["once"], by["each"])]
    out = {
        "rows": rows,
        "once_s": statistics.median(x["s"] for x in by["once"]),
        "each_s": statistics.median(x["s"] for x in by["each"]),
        "time_ratio": statistics.median(ratios),
        "ratios": [round(x, 3) for x in ratios],
        "once_storage_mib": statistics.median(x["storage_bytes"] for x in by["once"]) / MIB,
        "each_storage_mib": statistics.median(x["storage_bytes"] for x in by["each"]) / MIB,
        "chunk_bytes_read_once_mib": stored / MIB if stored else None,
        "exact": all(x["exact"] for x in rows),
    }
    per_rank = out["each_storage_mib"] / len(ranks)  # what one rank's own copy takes
    out["once_storage_x"] = out["once_storage_mib"] / per_rank if per_rank else float("nan")
    out["each_storage_x"] = out["each_storage_mib"] / per_rank if per_rank else float("nan")
    return out


def report(s) -> None:
    print(f"{'round':>5} {'way':5} {'load s':>8} {'from storage MiB':>17} exact")
    for x in s["rows"]:
        print(f"{x['round']:>5} {x['way']:5} {x['s']:8.2f} {x['storage_bytes'] / MIB:17.1f} {x['exact']}")
    print(f"medians: once {s['once_s']:.2f} s, each {s['each_s']:.2f} s; once / each {s['time_ratio']:.2f} "
          f"(rounds {s['ratios']})")
    print(f"from storage: once {s['once_storage_mib']:.1f} MiB ({s['once_storage_x']:.2f}x one copy), each "
          f"{s['each_storage_mib']:.1f} MiB ({s['each_storage_x']:.2f}x)")
    ok1 = s["once_storage_x"] <= 1.05
    ok2 = s["time_ratio"] <= 0.4
    print(f"  {'PASS' if ok1 else 'MISS'}  bytes read from storage with read-once = 1.0x the checkpoint: "
          f"{s['once_storage_x']:.2f}x")
    print(f"  {'PASS' if ok2 else 'MISS'}  read-once restore <= 0.4x every rank reading its own copy: "
          f"{s['time_ratio']:.2f}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "job":
        _job_main(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=32, help="model + Adam state per rank, MiB")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--storage-rate", default="200MiB/s")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    why = nc.skip_reason()
    if why:
        print(f"cannot make hosts from network namespaces here: {why}")
        return 2
    res = run(args)
    s = summarize(res)
    report(s)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": res, "summary": s}, indent=1))
    return 0 if s["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
