"""The Python package holds no second copy of the engine, counted from its source (as
tests/layers.rs and tests/surface.rs read the crate's):

- no conversion constant or kernel of the engine's (the FP16 range, FP16/BF16 casts of
  state values, unscaling arithmetic): every layout goes through ``_ckptstore``;
- one dtype table, the engine's (``_ckptstore.dtype_table``): no module lists wire dtype
  names or pairs numpy / torch dtypes with them.

Each check also runs on a planted copy, so that a scan which finds nothing cannot pass by
finding nothing anywhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore import _ckptstore
from ckptstore._dtypes import TABLE, numpy_dtype, type_name, wire_dtype

PKG = Path(__file__).resolve().parents[2] / "python" / "py_src" / "ckptstore"
SOURCES = sorted(PKG.rglob("*.py"))

# The engine's conversion arithmetic, as a copy of it would be written in Python.
KERNEL = re.compile(
    r"32752|65504|F16_MAX|max_range"  # the FP16-scaled range
    r"|\.half\(\)|\.to\(\s*(torch\.)?(float16|bfloat16|half)\b"  # FP16 / BF16 casts
    r"|astype\(\s*(np\.)?float16|float16\)\s*\*|\.float\(\)\s*\*\s*\w*scale"  # codes times scale
)


def code_strings(tree: ast.AST) -> list[str]:
    """String constants of the code, docstrings left out."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            docs.add(id(body[0].value))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def kernel_lines(text: str) -> list[str]:
    """Lines of code (comments and docstrings included: a copy described is still a copy
    in waiting, so none are allowed) that look like the engine's arithmetic."""
    return [line.strip() for line in text.splitlines() if KERNEL.search(line)]


def dtype_tables(text: str) -> int:
    """1 if the module lists three or more wire dtype names as code strings (a table),
    else 0."""
    wires = {w for w, _, _, _ in TABLE}
    return int(len(wires & set(code_strings(ast.parse(text)))) >= 3)


def test_the_scan_sees_every_module():
    assert len(SOURCES) > 40 and PKG / "torch" / "distributed.py" in SOURCES


def test_no_python_copy_of_the_engine_conversion_arithmetic():
    found = {str(p.relative_to(PKG)): kernel_lines(p.read_text()) for p in SOURCES}
    assert {k: v for k, v in found.items() if v} == {}
    # The scan finds the copy distributed.py had (removed: it turned tiny moments into inf).
    planted = """
_F16_RANGE = 32752.0
s = amax / _F16_RANGE
q = (local.float() * r).to(torch.float16)
local.copy_(local.to(torch.bfloat16).to(local.dtype))
"""
    assert len(kernel_lines(planted)) == 3


def test_one_dtype_table_the_engines():
    counts = {str(p.relative_to(PKG)): dtype_tables(p.read_text()) for p in SOURCES}
    assert sum(counts.values()) == 0, {k: v for k, v in counts.items() if v}
    # The scan finds a table like the four the package had.
    assert dtype_tables('_WIRE = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}') == 1
    # Docstrings naming dtypes are not tables.
    assert dtype_tables('def f():\n    """"F32", "BF16", "BOOL"."""\n') == 0


def test_the_engine_table_covers_numpy_and_torch():
    torch = pytest.importorskip("torch")
    from ckptstore.torch._dtypes import _torch, _torch_of, _wire_of

    wires = [w for w, _, _, _ in TABLE]
    assert len(wires) == len(set(wires)) and {"BOOL", "U8", "I64", "F16", "BF16", "F32", "F64"} <= set(wires)
    for w, ts, size, is_float in TABLE:
        dt = numpy_dtype(w)
        assert dt.itemsize == size and wire_dtype(dt) == w and type_name(w) == dt.name
        assert is_float == (w in ("F16", "BF16", "F32", "F64"))
    assert ckptstore.wire_dtype(np.float32) == "F32" and ckptstore.wire_dtype(">f4") == "F32"
    with pytest.raises(ckptstore.InvalidTensorError):
        ckptstore.wire_dtype(np.complex64)
    _torch()
    assert _wire_of[torch.bfloat16] == "BF16" and _torch_of["F32"] is torch.float32
    assert set(_torch_of) <= set(wires) and {_wire_of[d] for d in _torch_of.values()} == set(_torch_of)
    # Tensors without a numpy dtype still cross as their bytes.
    from ckptstore.torch._dtypes import _to_numpy

    for dt in (torch.bfloat16, torch.float32, torch.bool):
        t = torch.arange(6).to(dt).reshape(2, 3)
        _, w, a = _to_numpy("t", t)
        assert w == _wire_of[dt] and a.tobytes() == t.view(torch.uint8).numpy().tobytes()


def test_the_native_table_is_the_rust_enum():
    assert _ckptstore.dtype_table() == TABLE
