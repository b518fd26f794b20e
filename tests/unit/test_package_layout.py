"""The package's shape: no import cycle between mrl's packages (function-local imports included) and no
module importing another's private name. Read from the source (ast), nothing imported."""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "mrl").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _package(module: str) -> str:
    """``mrl.rollout.client`` -> ``mrl.rollout``; top-level modules (``mrl.cli``) are their own."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path):
    """(imported module, names) of every absolute ``mrl`` import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.startswith("mrl"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mrl"):
                    yield a.name, [], node.lineno


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = collections.defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for module, path in _modules().items():
        for target, _, line in _imports(path):
            a, b = _package(module), _package(target)
            if a != b:
                edges[a].add(b)
                where.setdefault((a, b), f"{path.relative_to(ROOT)}:{line}")
    cycles = []
    for a in list(edges):
        for b in edges[a]:
            seen, stack = set(), [b]
            while stack:
                x = stack.pop()
                if x == a:
                    cycles.append(f"{a} -> {b} ({where[(a, b)]})")
                    break
                if x not in seen:
                    seen.add(x)
                    stack.extend(edges.get(x, ()))
    assert not cycles, "package import cycles: " + "; ".join(sorted(cycles))


def test_no_private_name_imported_from_another_module():
    bad = []
    for module, path in _modules().items():
        for target, names, line in _imports(path):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != module:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{n}")
    assert not bad, bad


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The walkers above find what they look for (a fixture package with both faults)."""
    pkg = tmp_path / "mrl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "__init__.py").write_text("from mrl.b.x import _hidden\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "x.py").write_text("def f():\n    import mrl.a\n_hidden = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_no_import_cycle_between_packages()
    except AssertionError as e:
        assert "mrl.a -> mrl.b" in str(e) or "mrl.b -> mrl.a" in str(e)
    else:
        raise AssertionError("the cycle mrl.a <-> mrl.b was not found")
    try:
        test_no_private_name_imported_from_another_module()
    except AssertionError as e:
        assert "mrl.b.x._hidden" in str(e)
    else:
        raise AssertionError("the private import was not found")
