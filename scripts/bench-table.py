#!/usr/bin/env python3
"""Read BENCHMARKS.md's table of current figures; with --check, enforce its shape.

    python3 scripts/bench-table.py            # print the table: path, ratio, goal
    python3 scripts/bench-table.py --check    # exit 1 naming every problem found
    python3 scripts/bench-table.py --check --file OTHER.md

The main table is the first Markdown table under the heading "## Current figures". Its
header must hold the columns path, figure, floor / peer, ratio, goal, command and machine
(matched by prefix, case-insensitive). --check fails when:

* a row lacks a figure, a floor / peer, a ratio, a command or a machine (an empty cell or
  one holding only a dash or "n/a"), or the command holds no `code`;
* a row has more or fewer cells than the header;
* the file is longer than MAX_LINES lines;
* a line matches a log-style pattern (LOG_PATTERNS): "session N", a heading naming an
  issue, "earlier we tried"... (the history belongs in git, not in the file).

Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILE = REPO / "BENCHMARKS.md"
MAX_LINES = 400
TABLE_HEADING = re.compile(r"^##\s+Current figures\s*$", re.IGNORECASE)
# Column name (prefix of the header cell, lower case) -> must the cell be filled?
COLUMNS = {
    "path": True,
    "figure": True,
    "floor": True,
    "ratio": True,
    "goal": False,
    "command": True,
    "machine": True,
}
EMPTY = {"", "-", "—", "–", "n/a", "na", "?", "tbd"}
LOG_PATTERNS = [
    (re.compile(r"\bsessions? \d+", re.IGNORECASE), "names a session"),
    (re.compile(r"^#+ .*\bissues? \d+", re.IGNORECASE), "heading names an issue"),
    (re.compile(r"^#+ .*\bsessions?\b", re.IGNORECASE), "heading names a session"),
    (re.compile(r"\bearlier we tried\b", re.IGNORECASE), "narrates history"),
    (re.compile(r"\b(?:this|that|the previous|the next) session\b", re.IGNORECASE), "narrates a session"),
]


def split_row(line: str) -> list[str]:
    """Cells of a Markdown table row; a `|` inside `code` or escaped as \\| does not split."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        s = s[:-1]
    cells, cur, in_code, i = [], [], False, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] == "|":
            cur.append("|")
            i += 2
            continue
        if c == "`":
            in_code = not in_code
        if c == "|" and not in_code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    cells.append("".join(cur).strip())
    return cells


def is_separator(cells: list[str]) -> bool:
    return all(re.fullmatch(r":?-{3,}:?", c) for c in cells)


def find_table(lines: list[str]) -> tuple[int, list[str], list[tuple[int, list[str]]]] | None:
    """(line number of the header, header cells, [(line number, cells)]) or None."""
    start = next((i for i, l in enumerate(lines) if TABLE_HEADING.match(l)), None)
    if start is None:
        return None
    i = start + 1
    while i < len(lines) and not lines[i].lstrip().startswith("|"):
        if lines[i].startswith("#"):
            return None  # the next section began before any table
        i += 1
    if i + 1 >= len(lines):
        return None
    header = split_row(lines[i])
    if not is_separator(split_row(lines[i + 1])):
        return None
    rows = []
    j = i + 2
    while j < len(lines) and lines[j].lstrip().startswith("|"):
        rows.append((j + 1, split_row(lines[j])))
        j += 1
    return i + 1, header, rows


def column_map(header: list[str]) -> tuple[dict[str, int], list[str]]:
    found, problems = {}, []
    for name in COLUMNS:
        idx = [k for k, h in enumerate(header) if h.lower().startswith(name)]
        if not idx:
            problems.append(f"the table has no '{name}' column (header: {header})")
        else:
            found[name] = idx[0]
    return found, problems


def check(text: str) -> list[str]:
    lines = text.splitlines()
    problems = []
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} lines, more than {MAX_LINES}")
    for n, line in enumerate(lines, 1):
        for pat, why in LOG_PATTERNS:
            if pat.search(line):
                problems.append(f"line {n}: log-style ({why}): {line.strip()[:100]}")
    table = find_table(lines)
    if table is None:
        problems.append("no table under a '## Current figures' heading")
        return problems
    _, header, rows = table
    cols, col_problems = column_map(header)
    problems += col_problems
    if col_problems:
        return problems
    if not rows:
        problems.append("the table of current figures has no rows")
    for n, cells in rows:
        name = cells[cols["path"]] if len(cells) > cols["path"] else "?"
        where = f"line {n}, row '{name}'"
        if len(cells) != len(header):
            problems.append(f"{where}: {len(cells)} cells, the header has {len(header)}")
            continue
        for col, required in COLUMNS.items():
            if required and cells[cols[col]].strip().lower() in EMPTY:
                problems.append(f"{where}: no {col}")
        if "`" not in cells[cols["command"]]:
            problems.append(f"{where}: the command is not given as `code`")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail (exit 1) on any problem")
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="default: BENCHMARKS.md")
    args = ap.parse_args(argv)
    try:
        text = args.file.read_text(encoding="utf-8")
    except OSError as e:
        print(f"bench-table: cannot read {args.file}: {e}", file=sys.stderr)
        return 1
    if args.check:
        problems = check(text)
        for p in problems:
            print(f"{args.file.name}: {p}", file=sys.stderr)
        if problems:
            return 1
        rows = find_table(text.splitlines())[2]
        print(f"{args.file.name}: OK ({len(rows)} rows, {len(text.splitlines())} lines)")
        return 0
    table = find_table(text.splitlines())
    if table is None:
        print("bench-table: no table under '## Current figures'", file=sys.stderr)
        return 1
    _, header, rows = table
    cols, problems = column_map(header)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    try:
        for _, cells in rows:
            get = lambda c: cells[cols[c]] if len(cells) > cols[c] else ""
            print(f"{get('path')}\t{get('ratio')}\t{get('goal')}")
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
