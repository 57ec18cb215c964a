"""The Python examples of README.md, python/README.md and python/FRAMEWORKS.md run.

Every ```python block of both files is one test, run in a fresh temporary working directory
with a namespace of its own. A block that cannot run here (it needs a GPU, an S3 server, a
multi-process launcher, or a framework run too slow for the suite) carries a marker on the
line right above its fence, and is skipped with that reason:

    <!-- not run: needs an S3 server -->
    ```python

A block without a marker must run; a marker with no reason, or one that is not right above a
``python`` fence, fails the check below, and so does an unclosed fence. Test ids name the
file and the fence's line (``python/README.md:123``); a failing block's traceback shows the
Markdown file's own lines.

Blocks that import a training framework (Lightning, transformers, Accelerate, DeepSpeed,
TorchTitan) or ``ckptstore.integrations`` run in a fresh interpreter with a single-process
launcher's environment, since the frameworks keep process-wide state (Accelerate's
singletons, seeds, patched loaders); the others run in this process, and a process group a
block leaves initialized is destroyed after it. The frameworks the examples use must be
installed (``scripts/test.sh`` installs them); about 20-45 s on the 2-core VM.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
FILES = ["README.md", "python/README.md", "python/FRAMEWORKS.md"]

FENCE_OPEN = re.compile(r"^(\s*)```\s*python\s*$")
FENCE_ANY = re.compile(r"^\s*```")  # an opening fence, of any language
FENCE_CLOSE = re.compile(r"^\s*```\s*$")  # a closing fence has no info string
MARKER = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")
FRAMEWORKS = {"lightning", "pytorch_lightning", "transformers", "accelerate", "deepspeed",
              "torchtitan"}
SUBPROCESS_TIMEOUT_S = 240


@dataclass
class Block:
    file: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str  # the block's lines, dedented, padded so that line numbers match the file
    skip: Optional[str]  # the marker's reason, or None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def parse(rel: str) -> tuple[List[Block], List[str]]:
    """The python blocks of one Markdown file, and the problems found in its markers."""
    lines = (REPO / rel).read_text(encoding="utf-8").splitlines()
    blocks: List[Block] = []
    problems: List[str] = []
    i = 0
    in_other = False  # inside a fence of another language
    while i < len(lines):
        line = lines[i]
        if in_other:
            if FENCE_CLOSE.match(line):
                in_other = False
            i += 1
            continue
        m = MARKER.match(line)
        if m:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not FENCE_OPEN.match(nxt):
                problems.append(f"{rel}:{i + 1}: a not-run marker that is not right above a ```python fence")
            elif not m.group(1).strip():
                problems.append(f"{rel}:{i + 1}: a not-run marker without a reason")
            i += 1
            continue
        m = FENCE_OPEN.match(line)
        if m:
            indent = m.group(1)
            start = i
            body: List[str] = []
            i += 1
            while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                problems.append(f"{rel}:{start + 1}: a ```python fence that is never closed")
                break
            prev = lines[start - 1] if start > 0 else ""
            marker = MARKER.match(prev)
            code = "\n" * (start + 1) + textwrap.dedent("\n".join(body)) + "\n"
            blocks.append(Block(rel, start + 1, code, marker.group(1).strip() if marker else None))
            i += 1
            continue
        if FENCE_ANY.match(line):
            in_other = True
        i += 1
    return blocks, problems


def all_blocks() -> List[Block]:
    out: List[Block] = []
    for rel in FILES:
        out += parse(rel)[0]
    return out


BLOCKS = all_blocks()


def _params() -> list:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.skip(reason=f"not run: {b.skip}")] if b.skip else [])
        for b in BLOCKS
    ]


def _imports_a_framework(code: str) -> bool:
    """Whether the block imports one of FRAMEWORKS (any ``import`` or ``from`` statement)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        if any(n.split(".")[0] in FRAMEWORKS or n.startswith("ckptstore.integrations") for n in names):
            return True
    return False


def test_every_block_runs_or_says_why_not():
    """Markers are well formed and fences closed; the examples are there at all."""
    problems: List[str] = []
    for rel in FILES:
        problems += parse(rel)[1]
    assert not problems, "\n".join(problems)
    per_file = {rel: sum(b.file == rel for b in BLOCKS) for rel in FILES}
    assert per_file["python/README.md"] >= 10, per_file
    not_run = [b for b in BLOCKS if b.skip]
    assert len(not_run) <= 3, "keep the not-run blocks few: " + ", ".join(b.id for b in not_run)


def _run_in_subprocess(block: Block, cwd: Path) -> None:
    script = cwd / "_readme_block.py"
    script.write_text(block.code, encoding="utf-8")
    runner = (
        "import sys; src = open(sys.argv[1], encoding='utf-8').read(); "
        "exec(compile(src, sys.argv[2], 'exec'), {'__name__': '__main__'})"
    )
    env = dict(os.environ)
    # A single-process launcher's environment, and the venv's tools (DeepSpeed's ninja) first.
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", DS_ACCELERATOR="cpu")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [sys.executable, "-c", runner, str(script), str(REPO / block.file)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-60:])
        pytest.fail(f"{block.id}: the example exited with {r.returncode}\n{tail}", pytrace=False)


def _run_in_process(block: Block) -> None:
    code = compile(block.code, str(REPO / block.file), "exec")
    namespace = {"__name__": "__readme_example__"}
    try:
        exec(code, namespace)
    finally:
        import ckptstore

        ckptstore.wait_for_cleanup()
        if "torch" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.parametrize("block", _params())
def test_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if _imports_a_framework(block.code):
        _run_in_subprocess(block, tmp_path)
    else:
        _run_in_process(block)
