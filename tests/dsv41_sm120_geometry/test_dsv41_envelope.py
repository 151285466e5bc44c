"""The kernel envelope of DeepSeek-V4.1 on SM12x (issue 25, item 1), on the
real vLLM 0.32.0, 0.33.0 and 0.34.0 releases and the FlashInfer each installs.

Three kinds of test:

* the declarations: the exact text each envelope is read from, found at its
  line in the installed files (the compiled host checks as whole strings of
  the extension), read here without the ``envelope`` package; and the table of
  envelopes that ``kernel_envelopes()`` must return.  Each expectation is keyed
  by the build of the package that declares it, as found installed: the
  FlashInfer release, the DeepGEMM vLLM imports (its folder and version), the
  vLLM release.  A build with no row fails, rather than being taken for the
  one the same vLLM release locked (0.34.0 with a FlashInfer other than 0.7.4),
  and a kernel release that changes a declaration fails here first;
* the self-test's CPU stand-ins for the readers accept exactly the pages the
  kernels' own declarations accept;
* an unknown release or an unreadable declaration gives an unknown envelope,
  which accepts nothing and names what it could not read.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from importlib.metadata import version
from pathlib import Path

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope as env
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO

DSV41 = fix_releases.covered(DSV41_INFO)
pytestmark = pytest.mark.vllm_release(*DSV41)


def _site() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


def _release() -> str:
    import vllm

    return str(vllm.__version__)


def _flashinfer() -> str:
    """The installed FlashInfer release, as its distribution records it."""
    return version("flashinfer-python")


def _deep_gemm() -> str:
    """The DeepGEMM vLLM imports, as found: its folder under site-packages (an
    installed ``deep_gemm`` first, else the copy vendored in vLLM) and the
    ``__version__`` its ``__init__.py`` assigns, e.g. ``vllm/third_party/deep_gemm 2.8.1``."""
    spec = importlib.util.find_spec("deep_gemm")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:
        folder = _site() / DEEP_GEMM
    assigned = re.search(
        r"^__version__ = ['\"]([^'\"]+)['\"]", (folder / "__init__.py").read_text(), re.M
    )
    assert assigned is not None, folder
    return f"{folder.relative_to(_site()).as_posix()} {assigned.group(1)}"


def _recorded(table: dict, build, what: str):
    """The expectations recorded for this build; a build nobody reviewed fails
    here, rather than being taken for a reviewed one of the same vLLM release."""
    assert build in table, (
        f"no {what} recorded for {build}: review its declarations, then add them here"
    )
    return table[build]


@pytest.fixture
def fresh():
    """Envelopes and statements read anew, and again after the test."""
    env.kernel_envelopes.cache_clear()
    env.vllm_statements.cache_clear()
    yield env
    env.kernel_envelopes.cache_clear()
    env.vllm_statements.cache_clear()


# ------------------------------------------------------------ declarations

DEEP_GEMM = "vllm/third_party/deep_gemm"
FP8_KERNEL = f"{DEEP_GEMM}/include/deep_gemm/impls/sm120_fp8_paged_mqa_logits.cuh"
FP4_KERNEL = f"{DEEP_GEMM}/include/deep_gemm/impls/sm120_fp4_paged_mqa_logits.cuh"
PLAN_H = "flashinfer/data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h"
RESOLVE = "flashinfer/data/csrc/sparse_mla_sm120/attention_resolve.cu"
PREFILL_070 = "flashinfer/data/csrc/sparse_mla_sm120_prefill.cu"
DECODE_070 = "flashinfer/data/csrc/sparse_mla_sm120_decode_dsv4.cu"
DEEP_GEMM_COMMON = [
    (FP8_KERNEL, 54, "static constexpr uint32_t BLOCK_KV = PAGE_KV < 64 ? PAGE_KV : 64;"),
    (
        FP8_KERNEL,
        55,
        "DG_STATIC_ASSERT(PAGE_KV == 32 or PAGE_KV == 64 or PAGE_KV == 128 or PAGE_KV == 256, "
        '"Unsupported FP8 page size");',
    ),
    (FP4_KERNEL, 54, "static constexpr uint32_t BLOCK_KV = PAGE_KV < 64 ? PAGE_KV : 64;"),
    (
        FP4_KERNEL,
        55,
        "DG_STATIC_ASSERT(PAGE_KV == 32 or PAGE_KV == 64 or PAGE_KV == 128 or PAGE_KV == 256, "
        '"Unsupported FP4 page size");',
    ),
]
RUNTIME_PAGES_072 = [
    (PLAN_H, 16, "constexpr bool runtime_page(ModelType model) {"),
    (PLAN_H, 23, "return runtime_page(model) ? page > 0 : page == FixedPageSize;"),
    (PLAN_H, 27, "PrefillLaunchResult visit_prefill_heads(int heads, F&& call) {"),
    (
        RESOLVE,
        110,
        'TVM_FFI_ICHECK(main_page_supported(mt, m.page_size)) << "unsupported sparse-MLA main '
        'page size";',
    ),
]
# (path, line, the line's text stripped), per build of the package that declares it.
FLASHINFER_DECLARATIONS = {
    "0.7.0.post1": [
        (
            DECODE_070,
            165,
            "int extra_topk, int pbs_extra, size_t stride_extra_kv_block, "
            "int chunks_per_block_override,",
        ),
        (DECODE_070, 173, "if (page_block_size != 64) return false;"),
        (PREFILL_070, 396, "if (page_block_size != 64) return false;"),
        (PREFILL_070, 447, "if (page_block_size != 64) return false;"),
        (PREFILL_070, 449, "(extra_page_block_size == 64 || extra_page_block_size == 2)) {"),
    ],
    "0.7.2.post1": RUNTIME_PAGES_072
    + [
        (
            PLAN_H,
            17,
            "return model == ModelType::DSV4 || model == ModelType::DSV4_1 || "
            "model == ModelType::DSV3_2 ||",
        ),
        (RESOLVE, 123, "TVM_FFI_ICHECK(!dual || (main_page_supported(mt, m.extra_page_size) &&"),
    ],
    "0.7.4": RUNTIME_PAGES_072
    + [
        (
            PLAN_H,
            17,
            "return model == ModelType::DSV4 || is_dsv41(model) || model == ModelType::DSV3_2 ||",
        ),
        (RESOLVE, 125, "(main_page_supported(mt, m.extra_page_size) &&"),
    ],
}
DEEP_GEMM_DECLARATIONS = {
    f"{DEEP_GEMM} 2.8.0": DEEP_GEMM_COMMON,
    f"{DEEP_GEMM} 2.8.1": DEEP_GEMM_COMMON,
}
VLLM_DECLARATIONS = {
    "0.32.0": [
        (
            "vllm/utils/deep_gemm.py",
            36,
            "return (64,) if current_platform.is_device_capability_family(120) else (32, 64)",
        ),
        (
            "vllm/v1/attention/backends/mla/indexer.py",
            372,
            "return [64 if current_platform.is_device_capability_family(90) else 128]",
        ),
        ("vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py", 118, "return [128]"),
        (
            "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py",
            271,
            "CACHE_BLOCK=kv_cache.shape[1],",
        ),
        ("vllm/models/deepseek_v41/common/ops/indexer_k_store.py", 105, "k_cache.shape[1],"),
    ],
    "0.33.0": [
        (
            "vllm/utils/deep_gemm.py",
            40,
            "return (64,) if current_platform.is_device_capability_family(120) else (32, 64)",
        ),
        (
            "vllm/v1/attention/backends/mla/indexer.py",
            367,
            "return [64 if current_platform.is_device_capability_family(90) else 128]",
        ),
        ("vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py", 118, "return [128]"),
        (
            "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py",
            343,
            "CACHE_BLOCK=kv_cache.shape[1],",
        ),
        ("vllm/models/deepseek_v41/common/ops/indexer_k_store.py", 108, "k_cache.shape[1],"),
    ],
    "0.34.0": [
        (
            "vllm/utils/deep_gemm.py",
            43,
            "return (64,) if current_platform.is_device_capability_family(120) else (32, 64)",
        ),
        (
            "vllm/v1/attention/backends/mla/indexer.py",
            320,
            "if current_platform.is_device_capability_family(120):",
        ),
        ("vllm/v1/attention/backends/mla/indexer.py", 321, "return [64]"),
        (
            "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py",
            69,
            "if current_platform.is_device_capability_family(120):",
        ),
        ("vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py", 70, "return [64]"),
        (
            "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py",
            343,
            "CACHE_BLOCK=kv_cache.shape[1],",
        ),
        ("vllm/models/deepseek_v41/common/ops/indexer_k_store.py", 108, "k_cache.shape[1],"),
    ],
}
HOST_CHECK = (
    "(arch_major == 10 and (block_kv == 32 or block_kv == 64 or block_kv == 128)) or "
    "(arch_major == 9 and (block_kv == 32 or block_kv == 64)) or "
    "(arch_major == 12 and (block_kv == 32 or block_kv == 64))"
)
# Whole NUL-terminated strings of the compiled extensions: DeepGEMM's per build,
# vLLM's the same in every covered release.
DEEP_GEMM_CHECKS = [
    (f"{DEEP_GEMM}/_C_extension.abi3.so", HOST_CHECK),
    (f"{DEEP_GEMM}/_C_extension.abi3.so", "num_heads == 16 or num_heads == 32 or num_heads == 64"),
]
DEEP_GEMM_COMPILED = {
    f"{DEEP_GEMM} 2.8.0": DEEP_GEMM_CHECKS,
    f"{DEEP_GEMM} 2.8.1": DEEP_GEMM_CHECKS,
}
VLLM_COMPILED = [
    (
        "vllm/_C_stable_libtorch.abi3.so",
        "cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor! dst_k, Tensor! dst_scale, "
        "Tensor block_table, Tensor cu_seq_lens) -> ()",
    ),
    (
        "vllm/_C_stable_libtorch.abi3.so",
        "fused_deepseek_v4_kv_rope_insert(Tensor kv, Tensor! k_cache, Tensor slot_mapping, "
        "Tensor position_ids, Tensor cos_sin_cache, int cache_block_size, Tensor? fp8_scale=None, "
        "bool kv_mxfp8=False) -> ()",
    ),
    (
        "vllm/_C_stable_libtorch.abi3.so",
        "top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor! indices, "
        "int numRows, int stride0, int stride1, int topK) -> ()",
    ),
]


def test_each_declaration_is_where_the_table_says():
    site = _site()
    declarations = [
        *_recorded(FLASHINFER_DECLARATIONS, _flashinfer(), "FlashInfer declarations"),
        *_recorded(DEEP_GEMM_DECLARATIONS, _deep_gemm(), "DeepGEMM declarations"),
        *_recorded(VLLM_DECLARATIONS, _release(), "vLLM declarations"),
    ]
    for path, line, text in declarations:
        lines = (site / path).read_text(encoding="utf-8").splitlines()
        assert lines[line - 1].strip() == text, (path, line)


def test_each_compiled_check_is_a_whole_string_of_its_extension():
    site = _site()
    deep_gemm = _recorded(DEEP_GEMM_COMPILED, _deep_gemm(), "DeepGEMM compiled checks")
    for path, text in [*deep_gemm, *VLLM_COMPILED]:
        data = (site / path).read_bytes()
        assert b"\0" + text.encode() + b"\0" in data, (path, text)


# FlashInfer: whether its DSV4 kernels take the page size at run time (else 64 only).
RUNTIME_PAGES = {"0.7.0.post1": False, "0.7.2.post1": True, "0.7.4": True}


def test_flashinfer_decode_config_is_the_reviewed_one():
    """FlashInfer's own decode envelope for the 584-B DeepSeek-V4 record."""
    from flashinfer.mla import supported_sparse_mla_sm120_configs

    config = supported_sparse_mla_sm120_configs()["dsv4"]
    runtime = _recorded(RUNTIME_PAGES, _flashinfer(), "FlashInfer's DSV4 page size")
    assert (config.page_block_size, getattr(config, "page_block_size_is_runtime", False)) == (
        64,
        runtime,
    )
    assert (config.max_num_heads, config.head_counts, config.min_topk, config.topk_is_runtime) == (
        128,
        None,
        1,
        True,
    )
    assert (config.kv_cache_format, config.bytes_per_token, config.max_num_tokens) == (
        "fp8",
        584,
        64,
    )


# ------------------------------------------------------------------- the table

ANY = "any"
HEADS_1_128 = "1-128"
PREFILL_HEADS = (8, 16, 32, 64, 128)
DEEP_GEMM_ROWS = (32, 64)
RUNTIME_FLASHINFER = {
    env.FLASHINFER_DECODE: (ANY, HEADS_1_128, ANY),
    env.FLASHINFER_DECODE_EXTRA: (ANY, HEADS_1_128, ANY),
    env.FLASHINFER_PREFILL: (ANY, PREFILL_HEADS, ANY),
    env.FLASHINFER_PREFILL_EXTRA: (ANY, PREFILL_HEADS, ANY),
}
# kernel -> (page rows, heads, top-k), per build of the package that declares it.
FLASHINFER_ENVELOPES = {
    "0.7.0.post1": {
        env.FLASHINFER_DECODE: ((64,), HEADS_1_128, ANY),
        env.FLASHINFER_DECODE_EXTRA: (ANY, HEADS_1_128, ANY),
        env.FLASHINFER_PREFILL: ((64,), PREFILL_HEADS, ANY),
        env.FLASHINFER_PREFILL_EXTRA: ((2, 64), PREFILL_HEADS, ANY),
    },
    "0.7.2.post1": RUNTIME_FLASHINFER,
    "0.7.4": RUNTIME_FLASHINFER,
}
DEEP_GEMM_LOGITS = {
    env.DEEPGEMM_LOGITS_FP8: (DEEP_GEMM_ROWS, (16, 32, 64), None),
    env.DEEPGEMM_LOGITS_FP4: (DEEP_GEMM_ROWS, (16, 32, 64), None),
}
DEEP_GEMM_ENVELOPES = {
    f"{DEEP_GEMM} 2.8.0": DEEP_GEMM_LOGITS,
    f"{DEEP_GEMM} 2.8.1": DEEP_GEMM_LOGITS,
}
VLLM_OPS = {
    env.INDEXER_GATHER: (ANY, None, None),
    env.INDEXER_TOP_K: (ANY, None, ANY),
    env.SWA_WRITER: (ANY, None, None),
    env.COMPRESSED_WRITER: (ANY, None, None),
    env.INDEXER_WRITER: (ANY, None, None),
}
VLLM_ENVELOPES = {"0.32.0": VLLM_OPS, "0.33.0": VLLM_OPS, "0.34.0": VLLM_OPS}


def _shown(values: env.Values | None) -> str | tuple[int, ...] | None:
    if values is None:
        return None
    if values.exact is not None:
        return tuple(sorted(values.exact))
    if values.most is not None:
        return f"{values.least}-{values.most}"
    return ANY if values.least == 1 else f">={values.least}"


def test_kernel_envelopes_are_the_table_of_this_release(fresh):
    envelopes = fresh.kernel_envelopes()
    assert list(envelopes) == list(env.KERNELS)
    got = {k: (_shown(e.rows), _shown(e.heads), _shown(e.topk)) for k, e in envelopes.items()}
    assert got == {
        **_recorded(FLASHINFER_ENVELOPES, _flashinfer(), "FlashInfer envelopes"),
        **_recorded(DEEP_GEMM_ENVELOPES, _deep_gemm(), "DeepGEMM envelopes"),
        **_recorded(VLLM_ENVELOPES, _release(), "vLLM's kernel envelopes"),
    }
    for envelope in envelopes.values():
        assert envelope.known and envelope.sources, envelope
    site = _site()
    for envelope in envelopes.values():
        for source in envelope.sources:
            assert (site / source.path).is_file(), source  # every source names an installed file


def test_every_source_line_is_the_declaration_read():
    site = _site()
    for envelope in env.kernel_envelopes().values():
        for source in envelope.sources:
            if source.line is None:
                assert b"\0" + source.text.encode() + b"\0" in (site / source.path).read_bytes()
            elif not source.text.startswith("dsv4:"):  # the config as called, at its definition
                line = (
                    (site / source.path).read_text(encoding="utf-8").splitlines()[source.line - 1]
                )
                assert line.strip() == source.text, source


def test_rows_per_cache_and_the_kernels_that_reject_them():
    dsv4_runtime = _recorded(RUNTIME_PAGES, _flashinfer(), "FlashInfer's DSV4 page size")
    assert env.accepts_rows(env.INDEXER, 32) is True
    assert env.accepts_rows(env.INDEXER, 128) is False
    assert {e.kernel for e in env.rejecting_kernels(env.INDEXER, 128)} == {
        env.DEEPGEMM_LOGITS_FP8,
        env.DEEPGEMM_LOGITS_FP4,
    }
    assert env.accepts_rows(env.SWA, 32) is dsv4_runtime
    assert env.accepts_rows(env.COMPRESSED, 128) is dsv4_runtime
    if not dsv4_runtime:
        assert [e.kernel for e in env.rejecting_kernels(env.COMPRESSED, 128)] == [
            env.FLASHINFER_PREFILL_EXTRA
        ]


# ------------------------------------------------------ vLLM's own statements

STATEMENTS = {
    "0.32.0": {"paged": (64,), "indexer": [128], "flashinfer": [128]},
    "0.33.0": {"paged": (64,), "indexer": [128], "flashinfer": [128]},
    "0.34.0": {"paged": (64,), "indexer": [64], "flashinfer": [64]},
}
# (statement, kernel, cache, compress ratio (0: the statement leaves rows out), rows)
# per (vLLM release, FlashInfer, DeepGEMM): vLLM's statements against the kernels'.
DISAGREEMENTS = {
    ("0.32.0", "0.7.0.post1", f"{DEEP_GEMM} 2.8.0"): {
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP8, env.INDEXER, 0, (32,)),
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP4, env.INDEXER, 0, (32,)),
        (
            "DEEPSEEK_V41_INDEXER kernel block sizes",
            env.DEEPGEMM_LOGITS_FP8,
            env.INDEXER,
            1,
            (128,),
        ),
        (
            "DEEPSEEK_V41_INDEXER kernel block sizes",
            env.DEEPGEMM_LOGITS_FP4,
            env.INDEXER,
            1,
            (128,),
        ),
        (
            "FLASHINFER_MLA_SPARSE_DSV41 kernel block sizes",
            env.FLASHINFER_PREFILL_EXTRA,
            env.COMPRESSED,
            1,
            (128,),
        ),
    },
    ("0.33.0", "0.7.2.post1", f"{DEEP_GEMM} 2.8.1"): {
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP8, env.INDEXER, 0, (32,)),
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP4, env.INDEXER, 0, (32,)),
        (
            "DEEPSEEK_V41_INDEXER kernel block sizes",
            env.DEEPGEMM_LOGITS_FP8,
            env.INDEXER,
            1,
            (128,),
        ),
        (
            "DEEPSEEK_V41_INDEXER kernel block sizes",
            env.DEEPGEMM_LOGITS_FP4,
            env.INDEXER,
            1,
            (128,),
        ),
    },
    ("0.34.0", "0.7.4", f"{DEEP_GEMM} 2.8.1"): {
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP8, env.INDEXER, 0, (32,)),
        ("get_paged_mqa_page_sizes()", env.DEEPGEMM_LOGITS_FP4, env.INDEXER, 0, (32,)),
    },
}


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
def test_statements_are_what_vllm_answers_on_sm12x(fresh, capability):
    """Read from vLLM's source, and equal to what vLLM's real functions return
    on an SM12x platform stand-in (only the capability query is stood in)."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend as FlashInferBackend,
    )
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.simulated import sm120_platform

    statements = {s.name: s for s in fresh.vllm_statements(capability)}
    expected = STATEMENTS[_release()]
    with sm120_platform(capability):
        real = {
            "paged": get_paged_mqa_page_sizes(),
            "indexer": DeepseekV41IndexerBackend.get_supported_kernel_block_sizes(),
            "flashinfer": FlashInferBackend.get_supported_kernel_block_sizes(),
        }
    assert real == expected
    paged = statements["get_paged_mqa_page_sizes()"]
    assert paged.pages == {(env.INDEXER, r): frozenset(expected["paged"]) for r in (1, 2)}
    for name, key, cache in (
        ("DEEPSEEK_V41_INDEXER kernel block sizes", "indexer", env.INDEXER),
        ("FLASHINFER_MLA_SPARSE_DSV41 kernel block sizes", "flashinfer", env.COMPRESSED),
    ):
        (block,) = expected[key]
        assert statements[name].pages == {
            (cache, 1): frozenset({block}),
            (cache, 2): frozenset({block // 2}),
        }
    for statement in statements.values():
        assert statement.unknown is None and statement.source is not None
        assert str(statement.source).startswith("vllm/"), statement.source


def test_disagreements_name_both_sources(fresh):
    found = fresh.disagreements()
    got = {
        (d.statement.name, d.envelope.kernel, d.cache, d.compress_ratio, tuple(sorted(d.rows)))
        for d in found
    }
    build = (_release(), _flashinfer(), _deep_gemm())
    assert got == _recorded(DISAGREEMENTS, build, "disagreements")
    for d in found:
        text = str(d)
        assert d.statement.source is not None and d.statement.source.path in text
        assert d.envelope.sources[0].path in text
    report = json.loads(json.dumps(fresh.report()))  # what status --json can carry
    assert report["vllm"] == _release() and list(report["envelopes"]) == list(env.KERNELS)
    assert report["disagreements"] == [str(d) for d in found]


def test_unset_block_size_is_what_vllm_picks_on_sm12x():
    """``--block-size`` unset: vLLM's own choice among the real layers'
    backends (``Platform._preferred_block_size_for_backends`` from
    ``update_block_size_for_backend``): 128 on 0.32.0/0.33.0, 64 on 0.34.0."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.platforms import current_platform

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

    with repro.sm120_platform():
        config = VllmConfig(
            device_config=DeviceConfig(device="cuda"), cache_config=CacheConfig(cache_dtype="fp8")
        )
        assert not config.cache_config.user_specified_block_size
        repro.build_layers(config, repro.DSV41_FLASH)
        platform = type(current_platform)
        backends = platform._find_non_ssm_backends(config)
        picked = platform._preferred_block_size_for_backends(
            backends, CacheConfig.DEFAULT_BLOCK_SIZE, config
        )
    assert picked == (64 if _release() == "0.34.0" else 128)


# ------------------------------------------------------------- the stand-ins

ROWS = (2, 16, 32, 64, 128, 256)


def test_paged_logits_stand_in_takes_the_pages_deepgemm_declares():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import simulated_sm120_host
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import paged_mqa_logits_stand_in

    declared = env.kernel_envelopes()[env.DEEPGEMM_LOGITS_FP8]
    heads = 32
    for rows in ROWS:
        q = torch.zeros(1, 1, heads, 128).to(torch.float8_e4m3fn)
        kv = torch.zeros(2, rows, 1, 132, dtype=torch.uint8)
        weights = torch.ones(1, heads)
        lens = torch.tensor([[rows]], dtype=torch.int32)
        table = torch.tensor([[1]], dtype=torch.int32)
        with simulated_sm120_host():
            try:
                paged_mqa_logits_stand_in(q, kv, weights, lens, table, rows)
                accepted = True
            except ValueError as exc:
                assert "DeepGEMM" in str(exc), exc
                accepted = False
        assert accepted == declared.accepts_rows(rows), rows


def test_sparse_mla_stand_in_takes_the_pages_flashinfer_declares():
    """A call may be routed to decode or prefill: a page is taken when both
    kernels' declarations take it (primary and extra cache alike)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import flashinfer_page_problem

    envelopes = env.kernel_envelopes()

    def taken(rows: int, *kernels: str) -> bool:
        return all(envelopes[k].accepts_rows(rows) for k in kernels)

    for primary in ROWS:
        for extra in (None, *ROWS):
            want = taken(primary, env.FLASHINFER_DECODE, env.FLASHINFER_PREFILL) and (
                extra is None
                or taken(extra, env.FLASHINFER_DECODE_EXTRA, env.FLASHINFER_PREFILL_EXTRA)
            )
            problem = flashinfer_page_problem(primary, extra, num_heads=8, topk=128)
            assert (problem is None) == want, (primary, extra, problem)


def test_gather_stand_in_takes_any_page_as_the_op_does():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import gather_indexer_k_stand_in

    assert env.kernel_envelopes()[env.INDEXER_GATHER].rows == env.ANY
    for rows in ROWS:
        cache = torch.zeros(2, rows, 1, 132, dtype=torch.uint8)
        k = torch.zeros(rows, 128, dtype=torch.float8_e4m3fn)
        scale = torch.zeros(rows, 4, dtype=torch.uint8)
        table = torch.tensor([[1]], dtype=torch.int32)
        gather_indexer_k_stand_in(
            cache, k, scale, table, torch.tensor([0, rows], dtype=torch.int32)
        )


# ------------------------------------------------------------------ unknown


def test_an_uncovered_vllm_release_gives_unknown_envelopes(fresh, monkeypatch):
    real = env.installed_version
    monkeypatch.setattr(
        env.installed, "installed_version", lambda d: "0.31.0" if d == "vllm" else real(d)
    )
    envelopes = fresh.kernel_envelopes()
    for envelope in envelopes.values():
        assert not envelope.known and envelope.accepts_rows(64) is None
        assert envelope.unknown == f"vLLM 0.31.0 is not a covered release ({', '.join(DSV41)})"
        assert "unknown (vLLM 0.31.0" in envelope.describe()
    assert env.accepts_rows(env.INDEXER, 64) is None
    assert env.rejecting_kernels(env.INDEXER, 128) == []
    assert fresh.disagreements() == []  # an unknown envelope contradicts nothing


def test_an_unreviewed_flashinfer_gives_unknown_flashinfer_envelopes(fresh, monkeypatch):
    real = env.installed_version
    monkeypatch.setattr(
        env.installed,
        "installed_version",
        lambda d: "0.7.3" if d == "flashinfer-python" else real(d),
    )
    envelopes = fresh.kernel_envelopes()
    flashinfer = [k for k in env.KERNELS if k.startswith("flashinfer")]
    for kernel in flashinfer:
        assert envelopes[kernel].accepts_rows(64) is None
        assert "FlashInfer 0.7.3's SM120 declarations were not reviewed" in (
            envelopes[kernel].unknown or ""
        )
    assert all(envelopes[k].known for k in env.KERNELS if k not in flashinfer)
    assert env.accepts_rows(env.SWA, 64) is None  # the writer takes it, FlashInfer is unknown


def test_an_unreadable_deep_gemm_declaration_gives_unknown(fresh, monkeypatch, tmp_path):
    """A DeepGEMM whose FP8 kernel no longer states its page sizes, and one
    whose extension has no SM120 host check."""
    vendored = _site() / DEEP_GEMM
    copy = tmp_path / "deep_gemm"
    impls = copy / "include" / "deep_gemm" / "impls"
    impls.mkdir(parents=True)
    for name in ("sm120_fp8_paged_mqa_logits.cuh", "sm120_fp4_paged_mqa_logits.cuh"):
        shutil.copy(vendored / "include" / "deep_gemm" / "impls" / name, impls / name)
    fp8 = impls / "sm120_fp8_paged_mqa_logits.cuh"
    fp8.write_text(fp8.read_text().replace('"Unsupported FP8 page size"', '"page size"'))
    (copy / "_C_extension.abi3.so").symlink_to(vendored / "_C_extension.abi3.so")
    monkeypatch.setattr(env.installed, "deep_gemm_dir", lambda: copy)
    envelopes = fresh.kernel_envelopes()
    unknown = envelopes[env.DEEPGEMM_LOGITS_FP8]
    assert unknown.accepts_rows(32) is None and unknown.accepts_rows(128) is None
    assert unknown.unknown is not None
    assert "the FP8 kernel's page-size static assertion not found in" in unknown.unknown
    assert "sm120_fp8_paged_mqa_logits.cuh" in unknown.unknown
    assert envelopes[env.DEEPGEMM_LOGITS_FP4].rows == env.Values.of({32, 64})
    assert (
        env.accepts_rows(env.INDEXER, 128) is False
    )  # the FP4 kernel's declaration still rejects it

    (copy / "_C_extension.abi3.so").unlink()
    (copy / "_C_extension.abi3.so").write_bytes(b"\0no host check here\0")
    fresh.kernel_envelopes.cache_clear()
    for kernel in (env.DEEPGEMM_LOGITS_FP8, env.DEEPGEMM_LOGITS_FP4):
        reason = fresh.kernel_envelopes()[kernel].unknown or ""
        assert reason.startswith(
            "DeepGEMM's paged MQA logits host check (arch_major == 12 and (block_kv == ...)) "
            "not found in"
        ), reason
    assert env.accepts_rows(env.INDEXER, 32) is None


def test_an_unreadable_flashinfer_declaration_gives_unknown(fresh, monkeypatch, tmp_path):
    """FlashInfer's package folder without its C++ declarations."""
    real = env.package_dir
    monkeypatch.setattr(
        env.installed, "package_dir", lambda n: tmp_path if n == "flashinfer" else real(n)
    )
    for envelope in fresh.kernel_envelopes().values():
        if envelope.kernel.startswith("flashinfer"):
            assert envelope.accepts_rows(64) is None
            assert "attention_plan.h" in (envelope.unknown or ""), envelope.unknown


def test_an_unreadable_vllm_statement_is_unknown_and_contradicts_nothing(fresh, tmp_path):
    from vllm_mla_fixes import patching

    utils = tmp_path / "vllm" / "utils"
    utils.mkdir(parents=True)
    (utils / "deep_gemm.py").write_text(
        "def get_paged_mqa_page_sizes():\n    return tuple(sizes_from_somewhere())\n"
    )
    fresh.kernel_envelopes()  # from the installed packages
    with patching.sources_from(tmp_path):
        statements = {s.name: s for s in fresh.vllm_statements()}
        assert fresh.disagreements() == []
    paged = statements["get_paged_mqa_page_sizes()"]
    assert paged.source is None and paged.pages == {}
    assert paged.unknown == (
        "vllm.utils.deep_gemm.get_paged_mqa_page_sizes: tuple(sizes_from_somewhere())"
    )
    assert "has no Python source" in (
        statements["DEEPSEEK_V41_INDEXER kernel block sizes"].unknown or ""
    )
