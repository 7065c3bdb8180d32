"""The package's layout rules, checked from the source: no import circle between its modules
(module-level imports, as Python runs them at import time), no file over 500 lines, no
`utils.py`, and `rollout.engine` read by one builder and one validation only."""

from __future__ import annotations

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ba_jax")


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, every .py file of the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PKG))[:-3]
                name = rel.replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = (
                    os.path.join(root, f))
    return out


def _imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
    """The package modules `name` imports at module level (not inside functions): `from X
    import Y` counts X.Y where that is a module, else X; relative imports resolved."""
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in tree.body:  # module level only, and inside if/try blocks at that level
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for a in n.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            elif isinstance(n, (ast.If, ast.Try)):
                stack.extend(n.body + getattr(n, "orelse", []) + getattr(n, "finalbody", [])
                             + [h for t in getattr(n, "handlers", []) for h in t.body])
    return {m for m in found if m in modules and m != name}


def test_no_import_circle():
    modules = _modules()
    graph = {m: _imports(p, m, modules) for m, p in modules.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_circle_check_finds_a_circle(tmp_path, monkeypatch):
    """The check above fails on a package that has a circle (so a pass means something)."""
    pkg = tmp_path / "ba_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ba_jax import b\n")
    (pkg / "b.py").write_text("import ba_jax.a\n")
    monkeypatch.setattr(__import__(__name__), "PKG", str(pkg))
    with pytest.raises(AssertionError, match="import circle: ba_jax.a -> ba_jax.b -> ba_jax.a"):
        test_no_import_circle()


def test_files_by_concern():
    for name, path in _modules().items():
        with open(path) as f:
            n = sum(1 for _ in f)
        assert n <= 500, f"{path}: {n} lines (the limit is 500: split it by concern)"
        assert not name.endswith(".utils"), f"{path}: no utils.py"


def test_rollout_engine_is_read_by_one_builder():
    """`rollout.engine` (the config value) is read in build.py (the builder) and the
    config checks (run_config.py, update_config.py: which engine gives pi_old) only:
    everything else holds a RolloutEngine."""
    readers = set()
    for name, path in _modules().items():
        src = open(path).read()
        if "rollout.engine" in src.replace("config.rollout.engine=", "") or "r.engine" in src:
            tree = ast.parse(src)
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and n.attr == "engine" and isinstance(
                        n.value, ast.Attribute) and n.value.attr == "rollout":
                    readers.add(name)
                if isinstance(n, ast.Attribute) and n.attr == "engine" and isinstance(
                        n.value, ast.Name) and n.value.id == "r":
                    readers.add(name)
    assert readers <= {"ba_jax.build", "ba_jax.run_config", "ba_jax.update_config"}, readers
