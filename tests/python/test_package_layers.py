"""The Python package's layers, checked from its source (the twin of tests/layers.rs).

The written order (python/README.md, "How the package is built"), lowest first:

0. the engine and the package's words: ``_ckptstore`` (native), ``errors``, ``_faults``,
   ``_types``, ``_dtypes``, ``_codec``, ``_prep``;
1. the numpy API: ``ckptstore`` itself, ``atomic``;
2. PyTorch: ``ckptstore.torch`` and its modules;
3. what the frameworks share: ``ckptstore.integrations`` and its ``_tree``, ``_common``,
   ``_stock``;
4. one package per framework: ``ckptstore.integrations.<framework>``.

Rules, for every import (at the top of a module or inside a function):

- a module imports only from its own layer or below;
- no import cycle between modules;
- a private name (``_x``) is imported only from a module of the same package, and a
  private module of another package only if it is one that serves several (:data:`SERVING`);
  ``ckptstore.torch.internal`` gives the integrations the torch helpers under public names;
- every public module says its public face in ``__all__``, each name of which exists.

Each rule is also run on a planted breach, so that a scan that finds nothing cannot pass
by seeing nothing.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "python" / "py_src" / "ckptstore"

#: Private modules that serve other packages (one internal module may serve several).
SERVING = {
    "ckptstore._ckptstore",
    "ckptstore._prep",
    "ckptstore._faults",
    "ckptstore._dtypes",
    "ckptstore._types",
    "ckptstore._codec",
    "ckptstore.integrations._tree",
    "ckptstore.integrations._common",
    "ckptstore.integrations._stock",
}

FLOOR0 = {"ckptstore._ckptstore", "ckptstore.errors", "ckptstore._faults", "ckptstore._types",
          "ckptstore._dtypes", "ckptstore._codec", "ckptstore._prep"}


def floor(module: str) -> int:
    if module in FLOOR0:
        return 0
    if module in ("ckptstore", "ckptstore.atomic"):
        return 1
    if module == "ckptstore.torch" or module.startswith("ckptstore.torch."):
        return 2
    if module == "ckptstore.integrations" or module.count(".") == 2 and module.startswith("ckptstore.integrations._"):
        return 3
    if module.startswith("ckptstore.integrations."):
        return 4
    raise AssertionError(f"{module} is in no layer: give it one here and in python/README.md")


def modules(root: Path = PKG) -> dict[str, tuple[Path, str]]:
    """Module name -> (file, its package's name)."""
    out = {"ckptstore._ckptstore": (root / "_ckptstore.pyi", "ckptstore")}
    for p in sorted(root.rglob("*.py")):
        parts = ["ckptstore", *p.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
            out[".".join(parts)] = (p, ".".join(parts))
        else:
            out[".".join(parts)] = (p, ".".join(parts[:-1]))
    return out


def imports(mods: dict, name: str, text: str) -> list[tuple[str, str]]:
    """``(module imported, name taken from it or "")`` for each ckptstore import of a module."""
    pkg = mods[name][1]
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "ckptstore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "ckptstore":
                src = node.module
            else:
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.append((sub, "") if sub in mods else (src, a.name))
    return out


def breaches(mods: dict, texts: dict) -> dict[str, list[str]]:
    """Every breach of the rules, by rule."""
    found: dict[str, list[str]] = {"layer": [], "private": [], "cycle": []}
    graph: dict[str, set] = {}
    for name, text in texts.items():
        for target, attr in imports(mods, name, text):
            if target not in mods:
                found["private"].append(f"{name}: imports {target}, which is no module of the package")
                continue
            if target != name:
                graph.setdefault(name, set()).add(target)
            if floor(target) > floor(name):
                found["layer"].append(f"{name} (layer {floor(name)}) imports {target} (layer {floor(target)})")
            same = mods[target][1] == mods[name][1] or target == mods[name][1]
            private_module = any(part.startswith("_") for part in target.split(".")[1:])
            if private_module and not same and target not in SERVING and not name.startswith(target + "."):
                found["private"].append(f"{name} imports the private module {target} of another package")
            if attr.startswith("_") and not same:
                found["private"].append(f"{name} imports the private name {target}.{attr}")
    # Cycles: Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found["cycle"].append(" <-> ".join(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_texts() -> tuple[dict, dict]:
    mods = modules()
    return mods, {n: p.read_text() for n, (p, _) in mods.items() if p.suffix == ".py"}


def test_the_scan_sees_the_whole_package():
    mods, texts = package_texts()
    assert len(texts) > 45 and "ckptstore.torch.tiered" in texts and "ckptstore.integrations.lightning._io" in texts
    for name in mods:
        floor(name)  # every module has a layer


def test_layers_no_cycles_no_private_reach():
    mods, texts = package_texts()
    assert breaches(mods, texts) == {"layer": [], "private": [], "cycle": []}


def test_each_rule_catches_a_planted_breach():
    mods, texts = package_texts()
    planted = dict(texts)
    # A cycle (as distributed.py <-> tiered.py had, closed by a module __getattr__).
    planted["ckptstore.torch._sharded"] += "\ndef _late():\n    from .tiered import CheckpointManager\n"
    # Reaching up a layer, and into another package's private name and private module.
    planted["ckptstore._prep"] += "\ndef _up():\n    import ckptstore.torch\n"
    planted["ckptstore.integrations._tree"] += "\nfrom ..torch._state import _check_fit\n"
    planted["ckptstore.integrations.lightning._io"] += "\nfrom ... import _check_id\n"
    got = breaches(mods, planted)
    cycles = [set(c.split(" <-> ")) for c in got["cycle"]]
    assert len(cycles) == 2, got["cycle"]  # the one planted, and the one the upward import closes
    assert any({"ckptstore.torch._sharded", "ckptstore.torch.tiered"} <= c for c in cycles), got["cycle"]
    assert any({"ckptstore._prep", "ckptstore.torch"} <= c for c in cycles), got["cycle"]
    assert got["layer"] == ["ckptstore._prep (layer 0) imports ckptstore.torch (layer 2)"], got["layer"]
    assert sorted(got["private"]) == [
        "ckptstore.integrations._tree imports the private module ckptstore.torch._state of another package",
        "ckptstore.integrations._tree imports the private name ckptstore.torch._state._check_fit",
        "ckptstore.integrations.lightning._io imports the private name ckptstore._check_id",
    ], got["private"]


@pytest.mark.parametrize("name", sorted(n for n in modules() if not any(p.startswith("_") for p in n.split(".")[1:])))
def test_every_public_module_says_its_face_in_all(name):
    if name.startswith("ckptstore.integrations.") or name == "ckptstore.torch.tiered":
        pytest.importorskip("torch")
    frameworks = {"lightning": "lightning", "transformers": "transformers", "deepspeed": "deepspeed",
                  "torchtitan": "torchtitan"}
    fw = name.split(".")[2] if name.count(".") >= 2 and name.startswith("ckptstore.integrations.") else None
    if fw in frameworks:
        pytest.importorskip(frameworks[fw])
    text = modules()[name][0].read_text()
    assert "\n__all__" in text, f"{name} has no __all__"
    mod = importlib.import_module(name)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert missing == [], f"{name}.__all__ names what it lacks: {missing}"
    assert not [n for n in mod.__all__ if n.startswith("_")], f"{name}.__all__ lists private names"
