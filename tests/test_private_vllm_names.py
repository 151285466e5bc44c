"""Every private vLLM helper the package reads on a decision or patch path is
in some fix's ``REVIEWED`` (issue 45): a release that changes one is then a
finding of ``vllm-mla-fixes review`` (and, for a fix whose screen checks its
fingerprints, a refusal), never a silent change of what the fix decides.

The package's uses of private names are found in its syntax: names starting
with one ``_`` imported from a ``vllm`` module, read as an attribute, or
written as a string naming a definition (``"AttentionGroup._with_kernel_block_table"``).
A name is vLLM's where a vLLM module the package names (an import, or a
``"vllm.…"`` string) defines a class or function of that name in the
installed release; each session checks its own release.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import CannotProbe, TargetMismatch

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_mla_fixes"
# Not on a decision or patch path: these run vLLM's code to show what it does
# (``verify``'s reproductions, the GPU self-test), and their tests assert the
# outcome, so a changed helper turns a test red rather than a decision.
TOOL_FOLDERS = frozenset({"reproductions", "selftest"})
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
VLLM_MODULE = re.compile(r"vllm(\.\w+)+")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def decision_and_patch_modules() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if not TOOL_FOLDERS & set(path.relative_to(PACKAGE).parts)
    )


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def named_vllm_modules(tree: ast.Module) -> set[str]:
    """The vLLM modules a file names: what it imports (a ``from`` import's
    names may be submodules) and every ``"vllm.…"`` string."""
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names if is_vllm(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and is_vllm(node.module):
            named |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if VLLM_MODULE.fullmatch(node.value):
                named.add(node.value)
    return named


def non_vllm_bindings(tree: ast.Module) -> set[str]:
    """Local names bound by an import from outside vLLM (``os``, ``torch``,
    ``flashinfer``, this package): their private attributes are not vLLM's."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if not is_vllm(a.name)}
        elif isinstance(node, ast.ImportFrom) and not (node.module and is_vllm(node.module)):
            bound |= {a.asname or a.name for a in node.names}
    return bound


def private_uses(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(private name, line) for each use that may reach into vLLM."""
    outside = non_vllm_bindings(tree) | {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and is_vllm(node.module):
            for part in (*node.module.split("."), *(a.name for a in node.names)):
                if is_private(part):
                    yield part, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_vllm(alias.name):
                    yield from ((p, node.lineno) for p in alias.name.split(".") if is_private(p))
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in outside):
                yield node.attr, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if DOTTED_NAME.fullmatch(node.value):
                yield from ((p, node.lineno) for p in node.value.split(".") if is_private(p))


def vllm_definitions(modules: set[str]) -> dict[str, set[tuple[str, str]]]:
    """Private name -> the (module, qualified name) of each class or function
    (at module or class level) that defines it in the installed release; a
    private module's own name maps to (module, "")."""
    found: dict[str, set[tuple[str, str]]] = {}
    for module in sorted(modules):
        for part in module.split("."):
            if is_private(part):
                found.setdefault(part, set()).add((module, ""))
        try:
            _, tree = patching.vllm_source(module)
        except (TargetMismatch, CannotProbe, SyntaxError):
            continue  # not a module of this release (or a name inside one)
        scopes: list[tuple[ast.AST, str]] = [(tree, "")]
        while scopes:
            scope, prefix = scopes.pop()
            for node in ast.iter_child_nodes(scope):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualname = f"{prefix}{node.name}"
                    if is_private(node.name):
                        found.setdefault(node.name, set()).add((module, qualname))
                    if isinstance(node, ast.ClassDef):
                        scopes.append((node, f"{qualname}."))
    return found


def reviewed(module: str, qualname: str) -> bool:
    """Whether some fix's REVIEWED holds the definition, or one that contains
    it (a reviewed class covers its methods); a private module is reviewed
    where a reviewed definition lives in it."""
    for fix in ALL_FIXES:
        for reviewed_module, reviewed_name in fix.REVIEWED:
            if not qualname:
                if reviewed_module == module or reviewed_module.startswith(f"{module}."):
                    return True
            elif reviewed_module == module and (
                qualname == reviewed_name or qualname.startswith(f"{reviewed_name}.")
            ):
                return True
    return False


def unreviewed_private_names() -> list[str]:
    trees = {path: parsed(path) for path in decision_and_patch_modules()}
    modules = {m for tree in trees.values() for m in named_vllm_modules(tree)}
    modules |= {m for fix in ALL_FIXES for m, _ in fix.REVIEWED}
    definitions = vllm_definitions(modules)
    missing = []
    for path, tree in trees.items():
        for name, line in private_uses(tree):
            defined = definitions.get(name, set())
            if defined and not any(reviewed(*d) for d in defined):
                where = ", ".join(f"{m}:{q}" if q else m for m, q in sorted(defined))
                missing.append(f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({where})")
    return sorted(set(missing))


def test_every_private_vllm_helper_the_fixes_read_is_reviewed():
    missing = unreviewed_private_names()
    assert not missing, (
        "private vLLM definitions on a decision or patch path without a fingerprint in any "
        "fix's REVIEWED (add them: `vllm-mla-fixes review` compares them per release):\n  "
        + "\n  ".join(missing)
    )


def test_the_walk_finds_the_private_names_it_is_for():
    """The walk sees each kind of use: an attribute of a module bound inside a
    function, a ``from vllm…`` import, a string naming a method; and leaves
    out a private attribute of a module imported from outside vLLM."""
    tree = ast.parse(
        "import os\n"
        "def f():\n"
        "    from vllm.models.deepseek_v41 import attention\n"
        "    from vllm.x import _helper\n"
        "    os._exit(0)\n"
        "    return attention._resolve(), 'Group._with_table'\n"
    )
    assert sorted(name for name, _ in private_uses(tree)) == [
        "_helper",
        "_resolve",
        "_with_table",
    ]
    assert "vllm.models.deepseek_v41.attention" in named_vllm_modules(tree)
