"""The package's layers (issue 45): no module-level import cycle, the fixes
below the commands, and a vLLM process that loads the plugin holds none of
the command-line, doctor, self-test or reproduction modules."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fix_releases import newest_covered, newest_of_earliest_fix

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_mla_fixes"
TOP = PACKAGE.name


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], module_level: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body``: with ``module_level`` only those
    that run when the module is imported (not under ``if TYPE_CHECKING``,
    not in a function), else every one."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, module_level)
            if not module_level:
                yield from _imports(node.body, module_level)
        elif module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child], module_level)
                elif isinstance(child, ast.ExceptHandler):
                    yield from _imports(child.body, module_level)


def imported_modules(name: str, module_level: bool = True) -> set[str]:
    """The package's modules that ``name`` imports: ``import a.b`` and
    ``from a import b`` name ``a.b`` where it is a module, else ``a`` (a
    parent package, run first by Python, is not counted: a package that
    imports its own parts is no cycle)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text()).body, module_level):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        submodules = {f"{source}.{a.name}" for a in node.names} & MODULES.keys()
        found |= submodules
        if len(submodules) < len(node.names):
            found.add(source)
    return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_level_import_cycle():
    graph = {name: imported_modules(name) for name in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    """The check above on a graph that has a cycle through a package."""
    graph = {"top": {"top.fixes"}, "top.fixes": {"top.fixes.cli"}, "top.fixes.cli": {"top"}}
    assert _cycles({**graph, "leaf": set()}) == [["top", "top.fixes", "top.fixes.cli"]]


def test_fixes_import_neither_the_top_package_nor_the_command_line():
    """A fix sits below the commands: it reaches what it shares with them in
    ``commands``, never the plugin's entry (``__init__``) or ``cli``, even
    inside a function."""
    above = {TOP, f"{TOP}.cli"}
    wrong = {
        name: sorted(imported_modules(name, module_level=False) & above)
        for name in MODULES
        if name.startswith(f"{TOP}.fixes.")
    }
    assert {name: found for name, found in wrong.items() if found} == {}


# What only a command runs: vLLM's processes must never load these.
COMMAND_ONLY = ("cli", "commands", "doctor", "report", "serve_line", "selftest", "reproductions")

LOAD_AS_VLLM_DOES = (
    "import json, sys, vllm.plugins\n"
    "vllm.plugins.load_general_plugins()\n"
    "import vllm_mla_fixes\n"
    "print('RESULT=' + json.dumps({\n"
    "    'loaded': sorted(m for m in sys.modules if m.split('.')[0] == 'vllm_mla_fixes'),\n"
    "    'reasons': [s.reason for s in vllm_mla_fixes.status()]}))\n"
)


@pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())
def test_a_vllm_process_loads_no_command_module(tmp_path):
    """A fresh process loads the plugins through vLLM's own loader, as every
    process ``vllm serve`` starts does (a fix applied where the release
    needs it): no module that only a command runs is in it."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env.update(CUDA_VISIBLE_DEVICES="", VLLM_MLA_FIXES_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AS_VLLM_DOES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT=")]
    result = json.loads(line.removeprefix("RESULT="))
    assert not [r for r in result["reasons"] if r.startswith(("not evaluated", "not loaded"))]
    command_only = [name for name in result["loaded"] if set(name.split(".")) & set(COMMAND_ONLY)]
    assert command_only == []
