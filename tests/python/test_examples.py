"""The examples of python/examples/ run as a user runs them (a new interpreter each, the
installed package), and each says it ended where it should: the job it shows works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ckpt_helpers as h

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "python" / "examples"


def run(name: str, *args: str, env: "dict | None" = None) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, f"{name} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_every_example_is_run_here():
    tested = {"save_resume.py", "manager_loop.py", "fsdp2_ranks.py", "tiered.py", "s3.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_save_and_resume(tmp_path):
    assert "bit-identical to the uninterrupted run: True" in run("save_resume.py", str(tmp_path / "ck"))


def test_manager_in_a_loop(tmp_path):
    out = run("manager_loop.py", str(tmp_path))
    assert "resumed from step 8" in out and "committed steps kept: [8, 12]" in out
    assert "restarted run bit-identical to the uninterrupted one: True" in out


def test_fsdp2_saved_on_2_ranks_loaded_on_3(tmp_path):
    assert "saved on 2 ranks, loaded on 3: bit-identical: True" in run("fsdp2_ranks.py", str(tmp_path))


def test_tiered_host_replaced(tmp_path):
    out = run("tiered.py", str(tmp_path))
    for r in (0, 1):
        assert f"rank {r}: restored step 3 from the fast tier, bit-identical: True" in out, out


def test_s3(tmp_path):
    data = tempfile.mkdtemp()
    os.mkdir(os.path.join(data, "bkt"))
    try:
        proc, port = h.start_s3s_fs(data, "examplekey", "examplesecret0123456789")
    except h.S3sFsError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "examplekey",
               "AWS_SECRET_ACCESS_KEY": "examplesecret0123456789", "AWS_REGION": "us-east-1",
               "AWS_ALLOW_HTTP": "true"}
        out = run("s3.py", "s3://bkt/run", env=env)
        assert "steps on s3://bkt/run: [2, 3]" in out and "restored step 3, bit-identical: True" in out
        assert "read 2 rows of 'weight' lazily: equal: True" in out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
