"""What vLLM says about the kernels on SM12x (``get_paged_mqa_page_sizes()``, the
backends' kernel block sizes), read from its source without importing it, and
where a kernel's own declaration contradicts it.  vLLM's statements are never
used as an envelope."""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from vllm_mla_fixes import patching

from .installed import module_path
from .model import (
    COMPRESSED,
    DEEPGEMM_LOGITS_FP4,
    DEEPGEMM_LOGITS_FP8,
    FLASHINFER_DECODE_EXTRA,
    FLASHINFER_PREFILL_EXTRA,
    INDEXER,
    INDEXER_GATHER,
    SM120,
    Declaration,
    KernelEnvelope,
)
from .table import kernel_envelopes


@dataclasses.dataclass(frozen=True)
class Statement:
    """What vLLM's own code says about a kernel on SM12x, read from its source.

    ``pages``: the page rows the statement implies, per (cache, compress
    ratio); ``exhaustive``: the statement lists every size the kernel takes
    (so a size the kernel takes beyond it is a disagreement too)."""

    name: str
    claim: str
    kernels: tuple[str, ...]
    cache: str
    pages: dict[tuple[str, int], frozenset[int]]
    exhaustive: bool
    source: Declaration | None
    unknown: str | None = None


@dataclasses.dataclass(frozen=True)
class Disagreement:
    statement: Statement
    envelope: KernelEnvelope
    cache: str
    compress_ratio: int
    rows: frozenset[int]
    detail: str

    def __str__(self) -> str:
        kernel_source = "; ".join(str(s) for s in self.envelope.sources[:1])
        return f"{self.detail} (vLLM: {self.statement.source}; kernel: {kernel_source})"


class _NotEvaluable(Exception):
    pass


class _NoReturn(Exception):
    pass


def _evaluate(node: ast.AST, capability: tuple[int, int]) -> Any:
    """A vLLM expression as it evaluates on a ``capability`` CUDA device; only
    constants, lists, conditionals and ``current_platform``'s capability
    queries (vLLM's interface: a family is every <major>.x)."""
    here = capability[0] * 10 + capability[1]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(e, capability) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.IfExp):
        chosen = node.body if _evaluate(node.test, capability) else node.orelse
        return _evaluate(chosen, capability)
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v, capability) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, capability)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "current_platform"
    ):
        query = node.func.attr
        args = [_evaluate(a, capability) for a in node.args]
        if query == "is_device_capability_family" and len(args) == 1:
            return here // 10 == args[0] // 10
        if query == "has_device_capability" and len(args) == 1:
            return here >= args[0]
        if query == "is_cuda" and not args:
            return True
        if query in ("is_rocm", "is_xpu", "is_cpu", "is_tpu") and not args:
            return False
    raise _NotEvaluable(ast.unparse(node))


def _returned(body: list[ast.stmt], capability: tuple[int, int]) -> object:
    for statement in body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        if isinstance(statement, ast.Return) and statement.value is not None:
            return _evaluate(statement.value, capability)
        if isinstance(statement, ast.If):
            branch = statement.body if _evaluate(statement.test, capability) else statement.orelse
            try:
                return _returned(branch, capability)
            except _NoReturn:
                continue
        raise _NotEvaluable(ast.unparse(statement))
    raise _NoReturn


def _answer_on(module: str, qualname: str, capability: tuple[int, int]) -> tuple[Any, Declaration]:
    """What vLLM's ``module.qualname`` returns on a ``capability`` device,
    evaluated from its source (vLLM is not imported)."""
    text, tree = patching.vllm_source(module)
    node = patching.find_definition(tree, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise patching.TargetMismatch(f"{module}.{qualname} does not exist")
    answer = _returned(node.body, capability)
    return answer, Declaration(
        module_path(module),
        node.lineno,
        f"def {qualname}(...) -> {answer!r} on SM{capability[0]}{capability[1]}",
    )


RATIOS = (1, 2)  # DeepSeek-V4.1's compress ratios of its compressed and indexer caches
STATEMENTS = (
    (
        "get_paged_mqa_page_sizes()",
        "vllm.utils.deep_gemm",
        "get_paged_mqa_page_sizes",
        (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4),
        INDEXER,
        True,
    ),
    (
        "DEEPSEEK_V41_INDEXER kernel block sizes",
        "vllm.v1.attention.backends.mla.indexer",
        "DeepseekV41IndexerBackend.get_supported_kernel_block_sizes",
        (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4, INDEXER_GATHER),
        INDEXER,
        False,
    ),
    (
        "FLASHINFER_MLA_SPARSE_DSV41 kernel block sizes",
        "vllm.models.deepseek_v41.nvidia.flashinfer_sparse",
        "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes",
        (FLASHINFER_DECODE_EXTRA, FLASHINFER_PREFILL_EXTRA),
        COMPRESSED,
        False,
    ),
)


@functools.cache
def vllm_statements(capability: tuple[int, int] = SM120) -> tuple[Statement, ...]:
    """vLLM's own claims about the kernels on a ``capability`` device.

    ``get_paged_mqa_page_sizes()`` names page sizes (states) directly; the
    backends' kernel block sizes count tokens, so they imply pages of
    ``block // ratio`` states for each compress ratio."""
    statements = []
    for name, module, qualname, kernels, cache, exhaustive in STATEMENTS:
        try:
            answer, source = _answer_on(module, qualname, capability)
            sizes = [int(s) for s in answer]
        except (patching.CannotProbe, patching.TargetMismatch, _NotEvaluable, _NoReturn) as exc:
            statements.append(
                Statement(
                    name, "", kernels, cache, {}, exhaustive, None, f"{module}.{qualname}: {exc}"
                )
            )
            continue
        except (TypeError, ValueError):
            statements.append(
                Statement(
                    name,
                    "",
                    kernels,
                    cache,
                    {},
                    exhaustive,
                    None,
                    f"{module}.{qualname} returns {answer!r}",
                )
            )
            continue
        if exhaustive:
            pages = {(cache, r): frozenset(sizes) for r in RATIOS}
            claim = f"{name} = {tuple(sizes)}: the page sizes the kernels take"
        else:
            pages = {(cache, r): frozenset(b // r for b in sizes if b % r == 0) for r in RATIOS}
            claim = f"{name} = {sizes} tokens: " + ", ".join(
                f"ratio-{r} {cache} pages of {', '.join(map(str, sorted(pages[cache, r])))}"
                for r in RATIOS
            )
        statements.append(Statement(name, claim, kernels, cache, pages, exhaustive, source))
    return tuple(statements)


def disagreements(capability: tuple[int, int] = SM120) -> list[Disagreement]:
    """Every vLLM statement a kernel's own declaration contradicts: a page
    the statement implies and the kernel rejects, or, for a statement that
    lists the sizes a kernel takes, a size the kernel takes and the statement
    leaves out.  Unknown envelopes and unreadable statements contradict
    nothing (each reports itself as unknown)."""
    envelopes = kernel_envelopes()
    found = []
    for statement in vllm_statements(capability):
        if statement.unknown is not None:
            continue
        for kernel in statement.kernels:
            envelope = envelopes[kernel]
            if envelope.rows is None:
                continue
            for (cache, ratio), rows in sorted(statement.pages.items()):
                rejected = frozenset(r for r in rows if r not in envelope.rows)
                if rejected:
                    found.append(
                        Disagreement(
                            statement,
                            envelope,
                            cache,
                            ratio,
                            rejected,
                            f"{statement.name} on SM{capability[0]}{capability[1]} gives "
                            f"ratio-{ratio} {cache} pages of {_listed(rejected)} rows; "
                            f"{envelope.title} takes {envelope.rows}",
                        )
                    )
            claimed = frozenset().union(*statement.pages.values())
            if statement.exhaustive and envelope.rows.exact is not None:
                omitted = envelope.rows.exact - claimed
                if omitted:
                    found.append(
                        Disagreement(
                            statement,
                            envelope,
                            statement.cache,
                            0,
                            omitted,
                            f"{statement.name} on SM{capability[0]}{capability[1]} says "
                            f"{envelope.title} takes pages of {_listed(claimed)} only; "
                            f"its declaration takes {envelope.rows}",
                        )
                    )
    return found


def _listed(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in sorted(values))
