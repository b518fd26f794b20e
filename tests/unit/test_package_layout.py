"""The package's shape: no import cycle between mrl's packages (function-local imports included) and no
module importing another's private name. Read from the source (ast), nothing imported."""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "mrl").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _package(module: str) -> str:
    """``mrl.sglang.client`` -> ``mrl.rollout``; top-level modules (``mrl.cli``) are their own."""
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


def _package_edges() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """package -> the packages it imports (at any depth), and where each edge is first drawn."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for module, path in _modules().items():
        for target, _, line in _imports(path):
            a, b = _package(module), _package(target)
            if a != b:
                edges[a].add(b)
                where.setdefault((a, b), f"{path.relative_to(ROOT)}:{line}")
    return edges, where


def test_no_import_cycle_between_packages():
    edges, where = _package_edges()
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


def _module_edges() -> dict[str, set[str]]:
    """module -> the mrl modules it imports (at any depth): ``from a.b import c`` names ``a.b.c`` when that is a
    module, else ``a.b``; a module's own parent packages are left out (Python loads them first anyway)."""
    modules = _modules()
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in modules.items():
        for target, names, _ in _imports(path):
            for t in [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names] or [target]:
                if t in modules and t != module and not module.startswith(t + "."):
                    edges[module].add(t)
    return edges


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or around a loop (a function-local import included): the
    shared names live in the lower module."""
    edges = _module_edges()
    cycles = set()
    for start in list(edges):
        path, stack = {start: None}, [start]
        while stack:
            x = stack.pop()
            for y in edges.get(x, ()):
                if y == start:
                    loop, at = [start], x
                    while at != start:
                        loop.append(at)
                        at = path[at]
                    cycles.add(" -> ".join(sorted(loop)))
                elif y not in path:
                    path[y] = x
                    stack.append(y)
    assert not cycles, f"module import cycles: {sorted(cycles)}"


def test_no_private_name_imported_from_another_module():
    bad = []
    for module, path in _modules().items():
        for target, names, line in _imports(path):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != module:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{n}")
    assert not bad, bad


def test_the_checks_see_cycles_and_a_private_import(tmp_path, monkeypatch):
    """The walkers above find what they look for (a fixture package with both faults)."""
    pkg = tmp_path / "mrl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "__init__.py").write_text("from mrl.b.x import _hidden\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "x.py").write_text("def f():\n    import mrl.a\n_hidden = 1\n")
    (pkg / "b" / "low.py").write_text("def g():\n    from mrl.b import up\n")
    (pkg / "b" / "up.py").write_text("from mrl.b.low import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="mrl.b.low -> mrl.b.up"):
        test_no_import_cycle_between_modules()
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


# -- folders are processes -----------------------------------------------------------------------------
PROCESS_FOLDERS = {
    # starts, watches and stops SGLang servers (rank 0, engine nodes)
    "engine": ["launcher", "restart", "cpu_mode", "gpu_mode", "fp8_model", "moe_tuning"],
    # loaded into the SGLang servers mrl starts
    "engine/server": ["patches", "replayed_load", "cpu_attention", "cpu/pyshim/sitecustomize",
                      "shim/sitecustomize"],
    # speaks SGLang's wire protocol from outside the server
    "sglang": ["client", "protocol", "endpoint", "keys", "pipeline", "wire"],
    # the rollout process
    "rollout": ["manager", "producer", "buffer", "service", "multiturn", "sample", "lora"],
    # the trainer ranks
    "trainer": ["loop", "controller", "state", "batch", "warm_start"],
}
SERVER_IMPORTS = ("mrl.engine.server", "mrl.sglang.wire")
"""All that ``mrl/engine/server`` may import of mrl: code loaded into SGLang's servers pulls in nothing of
the trainer, the rollout process or the launcher; the wire contract is the one module both sides share."""
SGLANG_IMPORTS = ("mrl.sglang",)
"""``mrl/sglang`` is the floor the three sides stand on: it imports nothing else of mrl."""
INDEPENDENT = ("mrl.rollout", "mrl.engine", "mrl.weight_sync")
"""The rollout process, the launcher and the weight sync talk to engines through ``mrl.sglang``, never through
each other; only the trainer (and the jobs above it) composes them."""
MAX_LINES = 500
MAX_FLOORS = 8


def test_each_process_has_its_folder():
    missing = [f"mrl/{d}/{m}.py" for d, mods in PROCESS_FOLDERS.items() for m in mods
               if not (ROOT / "mrl" / d / f"{m}.py").is_file()]
    assert not missing, missing
    assert not (ROOT / "mrl" / "train.py").exists(), "the loop lives in mrl/trainer; `mrl train` is the one entry"
    server_side = {"patches", "replayed_load", "cpu_attention", "sitecustomize"}
    strays = [str(p.relative_to(ROOT)) for p in (ROOT / "mrl").rglob("*.py")
              if p.stem in server_side and "engine/server" not in p.as_posix()]
    assert not strays, f"engine-server modules outside mrl/engine/server: {strays}"
    speaks = [f"mrl/{d}/{m}.py" for d in ("rollout", "engine", "weight_sync") for m in PROCESS_FOLDERS["sglang"]
              if (ROOT / "mrl" / d / f"{m}.py").is_file()]
    assert not speaks, f"SGLang protocol modules outside mrl/sglang: {speaks}"


def _bad_imports(prefix: str, allowed) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {target}"
            for module, path in _modules().items() if module == prefix or module.startswith(prefix + ".")
            for target, _, line in _imports(path) if not allowed(target)]


def test_engine_server_code_imports_no_trainer_rollout_or_launcher_code():
    bad = _bad_imports("mrl.engine.server", lambda t: t.startswith(SERVER_IMPORTS))
    assert not bad, bad


def test_the_sglang_package_imports_nothing_else_of_mrl():
    bad = _bad_imports("mrl.sglang", lambda t: t.startswith(SGLANG_IMPORTS))
    assert not bad, bad


def test_rollout_engine_and_weight_sync_do_not_import_each_other():
    bad = []
    for a in INDEPENDENT:
        others = tuple(b for b in INDEPENDENT if b != a)
        bad += _bad_imports(a, lambda t, others=others: not any(t == o or t.startswith(o + ".") for o in others))
    assert not bad, bad


def _path_between(edges: dict[str, set[str]], a: str, b: str) -> list[str] | None:
    """An import path from package ``a`` to package ``b`` through any packages, or None."""
    prev, stack = {a: None}, [a]
    while stack:
        x = stack.pop()
        for y in sorted(edges.get(x, ())):
            if y not in prev:
                prev[y] = x
                if y == b:
                    path = [b]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1]
                stack.append(y)
    return None


def test_rollout_engine_and_weight_sync_do_not_reach_each_other_through_any_package():
    """Not even through a package between them (the rollout process reaching the launcher through the scoring
    pool): servers a side pool needs are built by the trainer and handed over."""
    edges, where = _package_edges()
    found = [" -> ".join(p) + f" ({where[(p[0], p[1])]})" for a in INDEPENDENT for b in INDEPENDENT
             if a != b and (p := _path_between(edges, a, b))]
    assert not found, found


def _floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """A package's floor: 1 + the highest floor it imports (cycles are refused by another test)."""
    memo: dict[str, int] = {}

    def floor(x: str) -> int:
        if x not in memo:
            memo[x] = 1 + max((floor(y) for y in edges.get(x, ())), default=0)
        return memo[x]

    return {x: floor(x) for x in set(edges).union(*edges.values())}


def test_the_package_has_at_most_max_floors():
    """The longest chain of package imports, entry point to floor: the house stays low."""
    edges, where = _package_edges()
    floors = _floors(edges)
    top = max(floors, key=floors.get)
    chain = [top]
    while edges.get(chain[-1]):
        chain.append(max(edges[chain[-1]], key=floors.get))
    assert floors[top] <= MAX_FLOORS, f"{floors[top]} floors: " + " -> ".join(chain)


def test_the_floor_and_reach_checks_see_a_long_chain_and_a_path():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "x": {"d"}}
    assert _floors(edges)["a"] == 4 and _floors(edges)["x"] == 2 and _floors(edges)["d"] == 1
    assert _path_between(edges, "a", "d") == ["a", "b", "c", "d"] and _path_between(edges, "x", "a") is None


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


# -- no test-only code in the package ------------------------------------------------------------------
FAULT = re.compile(r"fault", re.I)
PUBLIC_BY_CONFIG = ("mrl/reward/builtin.py",)
"""Modules whose functions a config names by dotted path (``reward.fn=mrl.reward.builtin.<name>``)."""


def _defined_names(tree: ast.AST):
    """(name, line) of every function, class, argument, keyword and assigned name."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value.lineno
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.attr, node.lineno


def test_no_fault_switch_or_hook_in_the_package():
    """Faults are injected from tests/ (wrappers, monkeypatching, test jobs), never through a name, a flag or
    a module-level hook list in mrl/."""
    bad = []
    for path in _modules().values():
        text = path.read_text()
        for name, line in _defined_names(ast.parse(text)):
            if FAULT.search(name.replace("default", "")):
                bad.append(f"{path.relative_to(ROOT)}:{line} {name}")
        options = re.findall(r"add_argument\(\s*\"(--[\w-]*fault[\w-]*)\"", text, re.I)
        bad += [f"{path.relative_to(ROOT)}: option {m}" for m in options]
        for node in ast.parse(text).body:  # a module-level list/dict of callables others append to
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.List, ast.Dict)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {t.id}" for t in targets
                        if isinstance(t, ast.Name) and "HOOK" in t.id.upper()]
    assert not bad, f"fault switches or hooks in mrl/: {bad}"


def _words(globs: list[str]) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for g in globs:
        for p in ROOT.glob(g):
            if p.is_file():
                out.update(re.findall(r"\w+", p.read_text(errors="ignore")))
    return out


def test_no_name_in_the_package_is_used_by_tests_alone():
    """Every function, class and method mrl/ defines is used by mrl/ itself, bench/, scripts/, conf/ or named
    in the docs (public API); one that only tests call belongs in tests/ (``tests/peek.py``, test jobs)."""
    defined: dict[str, list[str]] = collections.defaultdict(list)
    for path in _modules().values():
        if str(path.relative_to(ROOT)) in PUBLIC_BY_CONFIG:
            continue
        for node in ast.parse(path.read_text()).body:
            members = node.body if isinstance(node, ast.ClassDef) else []
            for n in [node, *members]:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("__"):
                    defined[n.name].append(f"{path.relative_to(ROOT)}:{n.lineno}")
    package = _words(["mrl/**/*.py", "mrl/**/*.sh"])
    elsewhere = _words(["bench/**/*.py", "scripts/**/*", "conf/**/*.yaml", "pyproject.toml", "docs/*.md", "README.md"])
    tests = _words(["tests/**/*.py", "tests/**/*.sh"])
    only_tests = [f"{name} ({', '.join(where)})" for name, where in defined.items()
                  if package[name] <= len(where) and not elsewhere[name] and tests[name]]
    assert not only_tests, f"used by tests alone: {only_tests}"


def test_the_checks_see_a_fault_switch_a_hook_and_a_test_only_name(tmp_path, monkeypatch):
    """The test-only checks above find what they look for (a fixture tree with each)."""
    (tmp_path / "mrl").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "mrl" / "x.py").write_text(
        "PUSH_HOOKS = []\n\n\ndef push(buckets, fault_bucket=None):\n    return buckets\n\n\n"
        "def peek(state):\n    return state\n\n\ndef used():\n    return push([])\n")
    (tmp_path / "tests" / "test_x.py").write_text("from mrl.x import peek, push\n\npeek(push([]))\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as e:
        test_no_fault_switch_or_hook_in_the_package()
    assert "fault_bucket" in str(e.value) and "PUSH_HOOKS" in str(e.value)
    with pytest.raises(AssertionError) as e:
        test_no_name_in_the_package_is_used_by_tests_alone()
    assert "peek" in str(e.value) and "push" not in str(e.value).replace("PUSH", "")


# -- no benchmark-only code in the package -------------------------------------------------------------
BENCH_ONLY = {
    # engine switches that existed only for comparisons, and the engine's update figures: bench/_engine_shim
    # leaves the patches out (BENCH_BASELINE) and installs the figures as the patches' ``watch``
    "MRL_COMPACT_ROUTES", "MRL_REPLAYED_LOAD", "MRL_LOAD_STREAM", "MRL_SYNC_STATS_DIR", "COMPACT_ROUTES_ENV",
    "REPLAYED_LOAD_ENV", "LOAD_STREAM_ENV", "SYNC_STATS_ENV", "STATS_OFF", "engine_env", "observed", "top_ops",
    # the executor's per-bucket timings and its one-request-per-bucket switch: bench/_live_sync_worker.py
    # (a ``PushWatch`` of its own, the engines' announcement hidden from the clients)
    "timings", "posted_at", "batch_requests", "_timed",
}
"""Names removed from mrl/ because only bench/ set or read them; the figures and comparisons live in bench/, and
the package offers at most a neutral seam (``executor.PushWatch``, ``patches.UpdateWatch``)."""
PLAIN_WORDS = {"timings", "posted_at"}
"""Of ``BENCH_ONLY``, words an argument may well be called (``moe_tuning``'s timings): refused as attributes."""


def test_no_benchmark_only_name_in_the_package():
    """None of ``BENCH_ONLY`` is defined in mrl/ (a function, class, attribute, argument or module-level name) or
    named in a string there (an environment variable), no module is named after one, and nothing in mrl/
    names the bench's own engine environment (``BENCH_*``)."""
    bad = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(ROOT))
        if set(module.split(".")) & BENCH_ONLY or path.stem == "update_stats":
            bad.append(f"{where}: a module of its own")
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.arg):
                names = [node.arg] if node.arg not in PLAIN_WORDS else []
            elif isinstance(node, ast.keyword) and node.arg:
                names = [node.arg] if node.arg not in PLAIN_WORDS else []
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and id(node) in top:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [w for w in re.findall(r"\b(?:MRL|BENCH)_[A-Z0-9_]+", node.value)
                         if w in BENCH_ONLY or w.startswith("BENCH_")]
            bad += [f"{where}:{getattr(node, 'lineno', '?')} {n}" for n in names if n in BENCH_ONLY or
                    n.startswith("BENCH_")]
    assert not bad, f"benchmark-only names in mrl/: {bad}"


def test_the_check_sees_benchmark_only_names(tmp_path, monkeypatch):
    """The check above finds each kind: an attribute, an environment variable in a string, a module-level
    constant, a module named after the engine's figures."""
    (tmp_path / "mrl" / "engine").mkdir(parents=True)
    (tmp_path / "mrl" / "x.py").write_text(
        "import os\n\nLOAD_STREAM_ENV = 'MRL_LOAD_STREAM'\n\n\nclass Ex:\n    def __init__(self):\n"
        "        self.timings = None\n        self.on = os.environ.get('BENCH_BASELINE')\n")
    (tmp_path / "mrl" / "engine" / "update_stats.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as e:
        test_no_benchmark_only_name_in_the_package()
    for found in ("LOAD_STREAM_ENV", "MRL_LOAD_STREAM", "timings", "BENCH_BASELINE", "update_stats.py"):
        assert found in str(e.value), found


# -- one interface per seam ----------------------------------------------------------------------------
def _class_methods(path: Path, cls: str) -> dict[str, bool]:
    """name -> abstract, of the methods class ``cls`` defines in ``path``."""
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name: any(getattr(d, "attr", None) == "abstractmethod" for d in f.decorator_list)
            for f in node.body if isinstance(f, ast.FunctionDef)}


def test_both_sides_of_the_rank_interface_implement_every_call_the_loop_makes():
    """The loop talks to rank 0's ``Controller`` and the other ranks' ``OtherRank`` through ``RankDuties``
    only: every call it makes is an abstract method there, and both sides define each one."""
    path = ROOT / "mrl" / "trainer" / "controller.py"
    interface = {m for m, abstract in _class_methods(path, "RankDuties").items() if abstract}
    calls = {node.func.attr for f in ("loop.py", "warm_start.py")
             for node in ast.walk(ast.parse((ROOT / "mrl" / "trainer" / f).read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, (ast.Attribute, ast.Name))
             and getattr(node.func.value, "attr", getattr(node.func.value, "id", None)) == "duties"}
    assert calls and calls <= interface, f"calls outside RankDuties: {calls - interface}"
    for side in ("Controller", "OtherRank"):
        missing = interface - set(_class_methods(path, side))
        assert not missing, f"{side} misses {missing}"


def test_the_loop_holds_one_weight_channel():
    """Full-weight and adapter sync are both a ``WeightChannel``; the loop's annotation names only that."""
    loop = (ROOT / "mrl" / "trainer" / "loop.py").read_text()
    assert "self.syncer: WeightChannel | None" in loop and "FullWeightChannel | AdapterChannel" not in loop
    for path, cls in (("full.py", "FullWeightChannel"), ("adapter.py", "AdapterChannel")):
        node = next(n for n in ast.parse((ROOT / "mrl" / "weight_sync" / path).read_text()).body
                    if isinstance(n, ast.ClassDef) and n.name == cls)
        assert [b.id for b in node.bases if isinstance(b, ast.Name)] == ["WeightChannel"], cls
