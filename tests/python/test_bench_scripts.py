"""The benchmark scripts that issue 24's and issue 26's figures come from, run end to end on
tiny states: each must finish and print the lines BENCHMARKS.md and python/README quote.
What the scripts check themselves is part of the test: bench_dcp, bench_gpu and bench_manager
compare restored bytes with the saved ones, the framework scripts that a resume happened. Timings are printed, never asserted (speed is measured by the scripts,
not by tests). The frameworks' scripts need the frameworks (a missing one fails, never
skips), as the integration tests do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "python" / "benches"


def run_script(name: str, *args: str, timeout: float = 600) -> tuple[str, int]:
    """Run ``python/<name> args``; its stdout and its pid (checked to have exited with 0)."""
    # The venv's bin/ on PATH: DeepSpeed builds its CPU comm op at run time with its ninja.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    with subprocess.Popen([sys.executable, str(SCRIPTS / name), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"{name} {' '.join(args)} ran past {timeout} s:\n{out}\n{err}")
    assert p.returncode == 0, f"{name} {' '.join(args)} failed:\n{out}\n{err}"
    return out, p.pid


def restore_args(tmp_path: Path, repeat: int, ways: str) -> list[str]:
    # Each way runs in a child process of its own (torch imported each time): few of them.
    return ["--restore", "--layers", "1", "--width", "256", "--repeat", str(repeat),
            "--ways", ways, "--dir", str(tmp_path)]


def test_bench_torch_restore_prints_the_floor_pairs(tmp_path):
    out, _ = run_script("bench_torch.py", *restore_args(tmp_path, 2, "raw,floor,ckptstore"))
    assert "hot restore / its floor (fresh optimizer state" in out, out
    m = re.search(r"each repetition's pair: ([0-9., ]+); median ([0-9.]+)x", out)
    assert m, out
    assert len(m.group(1).split(",")) == 2, out  # one ratio per repetition
    assert re.search(r"cold: raw read of the files / ckptstore's restore: [0-9.]+x", out), out


def test_bench_dcp_one_rank_cold(tmp_path):
    out, _ = run_script("bench_dcp.py", "--gib", "0.004", "--reps", "1", "--world", "1", "--cold",
                     "--dir", str(tmp_path))
    # Every load is compared with the saved bytes inside the script (AssertionError there).
    for line in ("load floor", "ckptstore        vs HuggingFace", "ckptstore-stream vs FileSystem"):
        assert line in out, out


def throttle_root() -> str | None:
    """The cgroup directory under which ReadThrottle makes its group, or None when this
    machine cannot throttle reads (not root, no cgroup file system, or one in which the io
    controller cannot be enabled, as in some containers): tried for real, then removed."""
    if os.geteuid() != 0:
        return None
    sys.path.insert(0, str(SCRIPTS))
    try:
        from bench_util import ReadThrottle
    finally:
        sys.path.pop(0)
    try:
        probe = ReadThrottle(str(REPO), 1 << 30)
    except SystemExit:
        return None
    probe.close()
    return os.path.dirname(probe.dir)


def test_read_throttle_is_applied_and_removed(tmp_path):
    root = throttle_root()
    if root is None:
        pytest.skip("no read throttle can be made here (it needs root, a cgroup file system and "
                    "an io controller that can be enabled)")
    out, pid = run_script("bench_torch.py", *restore_args(tmp_path, 1, "floor,ckptstore"),
                          "--throttle", "1GiB")
    assert re.search(r"every child's reads throttled: \S+ = \d+:\d+ (rbps=)?1073741824", out), out
    assert "each repetition's pair" in out, out
    # The group is named after the script's pid (a suite running beside this one makes its own).
    assert not os.path.exists(os.path.join(root, f"ckptstore-bench-{pid}")), "group left behind"
    out, pid = run_script("bench_dcp.py", "--gib", "0.004", "--reps", "1", "--world", "1",
                          "--cold", "--throttle", "1GiB", "--dir", str(tmp_path / "dcp"))
    assert "every rank's reads throttled" in out and "reads held to 1GiB/s" in out, out
    assert not os.path.exists(os.path.join(root, f"ckptstore-bench-{pid}")), "group left behind"


def test_bench_gpu_runs_on_cpu(tmp_path):
    # The GPU part of issue 24 waits for a CUDA machine; the script must be ready for it.
    out, _ = run_script("bench_gpu.py", "--device", "cpu", "--layers", "2", "--width", "256",
                     "--repeat", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json"))
    for mode in ("hot:", "cold:"):
        assert mode in out, out
    assert "ckptstore / read bandwidth" in out, out
    assert (tmp_path / "r.json").stat().st_size > 0


def test_bench_manager_prints_its_goals(tmp_path):
    out, _ = run_script("bench_manager.py", "--size", "8MiB", "--runs", "1", "--saves", "3",
                     "--width", "256", "--dir", str(tmp_path))
    assert "restore of a background save: bit-exact" in out, out
    assert re.search(r"copying the state once into reused buffers: [0-9.]+x", out), out
    assert re.search(r"peak RSS after save 3 / after save 2 [0-9.]+", out), out


@pytest.mark.parametrize("script,args,line", [
    ("bench_transformers.py", ["--small", "--saves", "2", "--repeat", "1"],
     "train() to on_train_begin (the restore)"),
    ("bench_lightning.py", ["--layers", "1", "--width", "256", "--saves", "3", "--repeat", "1"],
     "JSON {"),
    ("bench_deepspeed.py", ["--layers", "1", "--width", "256", "--saves", "3", "--repeat", "1"],
     "resume warm: load torch"),
    ("bench_torchtitan.py", ["--gib", "0.01", "--layers", "1", "--saves", "1"],
     "ckptstore async blocked / stock synchronous save"),
])
def test_framework_bench_runs(tmp_path, script, args, line):
    out, _ = run_script(script, *args, "--dir", str(tmp_path))
    assert line in out, out


def test_bench_tiers_runs_on_namespace_hosts():
    """python/benches/bench_tiers.py end to end on a tiny state (s3 persistent tier behind a capped
    link, the DCP leg skipped without s3fs): every restart restores the trained state
    exactly (the script's own check), and it prints its goals."""
    sys.path.insert(0, str(REPO / "tests" / "python"))
    import netns_cluster as nc

    why = nc.skip_reason()
    if why:
        pytest.skip(f"cannot make hosts from network namespaces here: {why}")
    out, _ = run_script("bench_tiers.py", "--mib-per-host", "4", "--width", "256", "--saves", "4",
                        "--repeats", "1", "--persist-every", "2", "--persistent", "s3")
    for leg in ("fast", "persistent"):
        assert re.search(rf"^  {leg} .* \d+ +{leg} +True", out, re.M), out  # restored exactly
    assert "\ngoals:\n" in out and "host memory flat" in out and "restore alone from peers <= 1.5x" in out, out


def test_bench_tier_meta_judges_its_goals(tmp_path):
    """python/benches/bench_tier_meta.py on a tiny state, one size measured by every child
    process (build, commit, record, scan, plan, a rank's save, the save's coordinator): every
    group of rows printed and judged, the figures written, the case removed; and its fit
    (what a run at several sizes extrapolates with) on exact lines and parabolas."""
    out, _ = run_script("bench_tier_meta.py", "--ranks", "16", "--tensors", "30", "--dir", str(tmp_path),
                        "--json", str(tmp_path / "r.json"))
    assert "the tiered manager's metadata at 16 ranks x 30 tensors" in out, out
    for row in ("holdings all-gather: buffer on every rank", "_plan: memory held after it",
                "direct items' wants", "host leader: read + commit", "tiered save, each rank alone",
                "save_part: peak RSS"):
        assert re.search(rf"^\| {re.escape(row)}.*\| (PASS|MISS) \| measured", out, re.MULTILINE), out
    for row in ("DCP Metadata, whole", "dcp.save (distributed.save", "coordinator: peak RSS"):  # context
        assert re.search(rf"^\| {re.escape(row)}", out, re.MULTILINE), out
    assert re.search(r"^goals: \d+ PASS, \d+ MISS", out, re.MULTILINE), out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["group"] for r in rows} == {"record", "holdings", "plan", "restore commit", "save, a rank",
                                          "dcp.save coordinator"}, rows
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench-tier-meta-")], "a case left behind"

    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_tier_meta as btm
    finally:
        sys.path.pop(0)
    v, coef, resid = btm.fit([32, 64, 128], [3 + 2 * x for x in (32, 64, 128)], "lin", 1024)
    assert abs(v - 2051) < 1e-6 and resid < 1e-9, (v, coef)
    v, _, _ = btm.fit([32, 64, 128], [x * x + 5 for x in (32, 64, 128)], "quad", 1024)
    assert abs(v - (1024 * 1024 + 5)) < 1e-3, v
    v, coef, _ = btm.fit([32, 64, 128], [0.3, 0.1, 0.2], "lin", 1024)  # no growth: stays flat, >= 0
    assert coef[1] == 0 and abs(v - 0.2) < 1e-9, (v, coef)
