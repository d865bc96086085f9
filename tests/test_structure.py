"""The package's shape: mokv's import graph has no circle (type-only and function-local
imports included), and no class spreads its state over more than two files (its own
and at most one base's)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
from pathlib import Path

import mokv
import pytest

PACKAGE = Path(mokv.__file__).resolve().parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the mokv modules it imports anywhere in its text (`from x import y`
    names module `x.y` when that is a module, else `x`). A package's own __init__ that
    Python runs before a submodule is not an edge: that is how packages load, not a
    choice of the importing module."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(m for m in found if m in modules and m != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_are_found():
    """The check itself: a circle of three and a self-contained tail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_import_graph_has_no_circle():
    graph = import_graph()
    assert "mokv.config.params" in graph and "mokv.config.tiers" in graph["mokv.config.params"]
    found = circles(graph)
    assert not found, "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    )


def test_config_floor_imports_nothing_above_it():
    """`mokv.config` imports only itself and `mokv.errors`."""
    graph = import_graph()
    above = {
        module: sorted(
            m for m in imported if not m.startswith("mokv.config") and m != "mokv.errors"
        )
        for module, imported in graph.items()
        if module.startswith("mokv.config")
    }
    assert not any(above.values()), above


def test_no_class_spreads_over_more_than_two_files():
    """A class keeps its state in its own file and at most one base's (no mixins that
    redeclare a host's fields); Protocols, which hold no state, do not count."""
    spread = {}
    for info in pkgutil.walk_packages(mokv.__path__, "mokv."):
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            files = {
                inspect.getfile(base)
                for base in cls.__mro__
                if base.__module__.startswith("mokv") and not getattr(base, "_is_protocol", False)
            }
            if len(files) > 2:
                spread[f"{module.__name__}.{name}"] = sorted(files)
    assert not spread, spread


def test_every_package_is_shipped():
    """pyproject.toml lists its packages by hand: a new subpackage must be listed too, or
    a wheel lacks it (an editable install would not tell)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(path.parent.relative_to(PACKAGE.parent).parts)
        for path in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)


def test_every_config_has_its_builder_in_a_fresh_process():
    """A process that imports only the paged manager (as MAX's model worker does, through
    mokv.pipelines) finds a builder for every config a manager builds from."""
    import subprocess
    import sys

    code = (
        "from mokv.managers.paged import PagedKVCacheManager\n"
        "from mokv.config import HostTierConfig, KVEventsConfig, RemoteTierConfig, SessionConfig\n"
        "from mokv.registry import BUILDERS\n"
        "missing = [c.__name__ for c in (HostTierConfig, RemoteTierConfig, KVEventsConfig,"
        " SessionConfig) if not BUILDERS.knows(c)]\n"
        "assert not missing, missing\n"
    )
    # Python's view of the environment: MAX's native code, once loaded (the walk above),
    # leaves PYTHONEXECUTABLE in the C one, which would start the child outside this venv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONEXECUTABLE", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
