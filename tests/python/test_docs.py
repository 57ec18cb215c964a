"""BENCHMARKS.md keeps its shape: one table of current figures, each row complete, no log.

Runs `scripts/bench-table.py --check` on the real file, and checks on small made-up files
that the checker does catch what it is there to catch. Standard library only, well under 2 s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench-table.py"

HEADER = (
    "| path | figure | floor / peer (same run) | ratio | goal | command | machine |\n"
    "| --- | --- | --- | --- | --- | --- | --- |\n"
)
GOOD_ROW = "| cold restore | 1.647 s | raw read 1.726 s | 1.05x | >= 0.9x: met | `bench --cold` | 2-core VM |\n"


def _load_checker():
    spec = importlib.util.spec_from_file_location("bench_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench_table = _load_checker()


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_benchmarks_md_passes_the_check():
    r = run_check()
    assert r.returncode == 0, f"scripts/bench-table.py --check failed:\n{r.stderr}{r.stdout}"


def problems(body: str) -> str:
    """The checker's findings on a made-up file, one per line."""
    return "\n".join(bench_table.check("# Benchmarks\n\n## Current figures\n\n" + body))


def test_a_complete_table_passes():
    assert problems(HEADER + GOOD_ROW) == ""


def test_a_row_without_a_ratio_fails_naming_the_row():
    row = "| hot restore | 0.248 s | floor 0.161 s |  | <= 1.25x | `bench` | 2-core VM |\n"
    found = problems(HEADER + GOOD_ROW + row)
    assert "row 'hot restore': no ratio" in found
    assert "cold restore" not in found


def test_a_row_without_a_command_or_machine_fails():
    found = problems(HEADER + "| S3 save | 0.9 GiB/s | raw PUT | 0.95x | — | — |  |\n")
    assert "no command" in found and "no machine" in found


def test_log_style_lines_and_length_fail():
    found = problems(HEADER + GOOD_ROW + "\n## Issue 24: cold figures\n\nMeasured in session 20.\n")
    assert "heading names an issue" in found and "names a session" in found
    assert "more than 400" in problems(HEADER + GOOD_ROW + "\n" * 400)


def test_the_check_exits_1_on_a_broken_file(tmp_path):
    p = tmp_path / "B.md"
    p.write_text("# Benchmarks\n\nno table here\n", encoding="utf-8")
    r = run_check("--file", str(p))
    assert r.returncode == 1 and "Current figures" in r.stderr
