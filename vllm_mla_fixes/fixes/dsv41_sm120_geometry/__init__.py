"""dsv41-sm120-geometry: DeepSeek-V4.1 on SM120/SM121 cannot start, or reads the wrong pages.

Upstream:   vllm-project/vllm#59203 (report), #56702 (closed report), #56509 and
            #57292 (open candidate fixes; #56509 starts but every output is
            U+FFFD), flashinfer-ai/flashinfer#5323 (report), #5174 (extra page
            32) and #5244/#5121 (extra page 128) -- all open
Affected:   vLLM 0.32.0 (FlashInfer 0.7.0.post1), 0.33.0 (FlashInfer 0.7.2.post1) and
            0.34.0 (pins FlashInfer 0.7.3); 0.30.0/0.31.0 carry it but are not covered
Fixed in:   open
Hardware:   SM120 (RTX PRO 6000 Blackwell) and SM121 (GB10), where
            FLASHINFER_MLA_SPARSE_DSV41 is the only DeepSeek-V4.1 backend

Why it breaks
    Every compressed-KV cache and every indexer-K cache takes the global
    ``--block-size`` B (``tokens_per_state`` = the layer's compress ratio, so a
    page holds B / ratio states) and the sliding-window cache is hard-wired to
    32-token blocks.  FlashInfer's SM120 sparse-MLA kernels (0.7.0.post1) are
    instantiated for 64-row primary pages only, and SM120's paged-MQA indexer
    kernels take 64 states per page.  Mixed ratios 1 and 2 leave no B that
    works: B=64 fails at start-up in ``select_common_block_size`` ("No common
    block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128]).", both backends
    declare [128]); B=128 starts, but the SWA page is 32 (FlashInfer 0.7.0.post1
    rejects it on the first request: "SM120 sparse-MLA has no decode kernel for
    this shape ... page_block_size=32") and ratio-1 pages hold 128 states.
    #56509 splits 128-token manager blocks into 64-token kernel blocks, but the
    ratio-1 writers keep addressing manager slots while readers use the kernel
    table, so writes land in other layers' pages: garbage, not a crash.
    0.34.0 declares 64-token kernel blocks on SM12x: --block-size 64 (and an
    unset block size, for which vLLM picks 64) then starts with 32-state
    ratio-2 pages and 32-token SWA pages, which the installed kernels' own
    declarations take (FlashInfer 0.7.4 takes run-time page sizes; the vendored
    DeepGEMM's SM120 host check takes 32 and 64 rows, although vLLM's
    ``get_paged_mqa_page_sizes()`` says 64 only), so that line works upstream;
    128 fails at start-up ("... needs 64-token kernel blocks, which packed
    128-token KV cache blocks cannot be split into").  Counter-evidence,
    weighed: vllm#57292 reports the pinned DeepGEMM SM120 FP8 path rejecting
    page 32 (see docs/fixes/dsv41-sm120-geometry.md for which build it speaks
    of); no GPU run of ours settles it, so ``selftest`` runs upstream's layout
    through the real kernels on the operator's GPU.

When it steps aside
    Every kernel's envelope is read from its own declaration in the installed
    build (``envelope``).  Where upstream's own layout for the line starts and
    every page of it is inside those envelopes (0.34.0 with --block-size 64 or
    unset), the fix applies only where its own layout holds at least 2% more
    KV tokens per GiB (``GAIN_TO_APPLY``), at the engine's max-model-len, with
    the layers the engine really builds.  The first spec vLLM asks of a
    DeepSeek-V4.1 cache plans both layouts with vLLM's planner on those layers
    (``gain``): without speculation or with ngram the fix's would hold 1.007x /
    1.012x (8k / 128k), not worth a layout nobody has run on hardware, so it
    steps aside (decision ``upstream``, logged as "not-needed: upstream's
    --block-size N layout is within the installed kernels' envelopes; planned
    on the engine's layers ...  (1.007x, under the 1.02x ...)"); with DSpark's
    three drafter layers the split holds 1.066x / 1.034x (they share one
    128-row group), so it applies, its sliding-window caches taking its page
    rows before any spec is handed out.  An envelope that cannot be read is
    never "accepts": the fix then keeps its layout.
    ``VLLM_MLA_FIXES_DSV41_GEOMETRY`` still forces a geometry.  ``python -m
    vllm_mla_fixes.reproductions.dsv41_truth_table`` derives, on CPU, every
    cell (release, block size, speculation, SM120/SM121).

How we fix it
    On SM12x only, every page FlashInfer or the indexer reads holds 64 states,
    the sliding-window cache gets 64-token blocks, and both backends declare
    the kernel block size per spec (tokens_per_state 1 -> [64], 2 -> [128]; no
    spec -> upstream's answer).  Two geometries deliver that; which one is in
    force is decided per engine configuration (:func:`geometry_decision`),
    logged once, and reported by ``status``:

    interleaved-split (default)
        Every compressed-KV and indexer-K cache keeps 128-token manager blocks
        in the one packed group (ratio-2 pages: 64 states, not split).  The
        ratio-1 compressed/indexer pair (128 states per block) is split into
        64-state kernel pages that interleave: each unit is one compressed
        kernel page followed by one indexer kernel page (46,080 B for the V4
        584-B record; derived from the real pair of page sizes), the block
        stride is a multiple of the unit, and each ratio-1 cache is bound as a
        strided view with the unit as page stride.  The ratio-1 writers get
        kernel-block slots: when an attention group hands its builders the
        kernel block table, it also hands them ``ktable[req, pos // 64] * 64 +
        pos % 64``, computed elementwise from the manager slot into persistent
        per-builder buffers (no allocation or host sync per step; stable
        addresses for CUDA graphs).  Zeroing a newly allocated block clears
        the block's whole pair region (both caches' interleaved pages), and a
        prefix-cache block copy copies that region whole, also on vLLM's
        per-cache copy path.  vLLM's planner then holds 1.118x the
        tokens of upstream's --block-size 128 layout at 8k and 1.042x at 128k.
        A DSpark drafter's sliding-window caches (layers numbered past the
        backbone) get 128-token pages where FlashInfer's own envelope takes
        run-time page sizes (0.7.2.post1 on) and planning both ways with
        vLLM's planner on the engine's layers finds they hold more (three
        layers then share one KV-cache group instead of opening another
        64-token one; one layer fits the 64-token groups and keeps 64):
        1.051x / 1.019x of upstream with the same drafter (0.993x / 0.997x on
        FlashInfer 0.7.0.post1, where they keep 64 rows: putting two 64-row
        kernel pages in a 128-token drafter block would need the drafter's own
        slot mappings translated, and DSpark computes those in its own kernel
        and replays them in FULL graphs, past any metadata-build hook).
    per-ratio (fallback)
        Each cache gets ``64 x compress_ratio``-token blocks (ratio-1 64,
        ratio-2 128), so the hybrid manager gives each ratio its own group and
        no block is split (0.88x / 0.65x of upstream's capacity).  Used where
        the split is not proven safe: a speculative method other than DSpark
        (whose drafter layers hold no ratio-1 cache), ngram or suffix; a KV
        connector other than vLLM's CPU offloading one (which moves whole
        packed blocks); DCP/PCP > 1, HiSparse, a KV record other than the V4
        fp8_ds_mla one with the fp8 indexer row, a model whose ratio-1 caches
        do not pair up, a split target whose source was not reviewed, or
        ``VLLM_MLA_FIXES_DSV41_GEOMETRY=per-ratio``.

    The compressed-slot-mapping warm-up also compiles the key of the 64-state
    pages, for the ratios of the caches the fix made.  Only the fix's own
    backends, caches and specs are touched, so other models on SM12x see no
    change.  Workers whose specs show different geometries stop the engine
    core with an error naming each (vLLM's own check is an ``assert``).  A start-up self-check, run when the KV-cache views are bound to the
    layers, raises a clear error naming layer, compress ratio and page size if
    any FlashInfer-bound cache or indexer cache does not have 64-row pages.
    ``--block-size`` no longer decides these caches' pages on SM12x; 64 and 128
    both start.  SM90/SM100 and every other platform see no change.

Remove when
    vLLM chooses 64-state pages on SM12x itself (the probe reports not-needed
    once the targets change), or FlashInfer and DeepGEMM accept every page the
    default geometry produces and vLLM's backends say so.

Layout
    One module per part; imports point one way, from ``apply`` down through
    the parts to ``decision``, ``gate``, ``state`` and ``info``:

    info      FixInfo, the shared constants and PageGeometryError
    gate      reviewed vLLM definitions and the probe
    state     what the fix made in this process (reset by apply)
    decision  which geometry an engine configuration gets, and why
    planning  candidate layouts planned with vLLM's planner on the real layers
    drafter_pages  a DSpark drafter's sliding-window page rows
    gain      the 2% rule where upstream's layout works
    slots     ratio-1 writer slots under the split
    views     interleaved ratio-1 kernel views, block zeroing and copies
    specs     KV-cache specs, kernel block sizes, SWA pages, warm-up keys
    checks    start-up page check and workers' agreement
    apply     installs the wrappers; for_capability
    doctor    ``vllm-mla-fixes doctor``'s findings
"""

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.apply import apply, for_capability
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import (
    bound_pages,
    check_no_split_drafter,
    check_page_geometry,
    check_workers_agree,
    specs_geometry,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    Decision,
    decide,
    decide_for,
    flashinfer_takes_runtime_swa_pages,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.doctor import (
    DOCTOR_JSON_KEY,
    INDEXER_FP8_FLAG,
    MOE_MARLIN_FLAG,
    SPLIT_ERROR_0_34,
    diagnose,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import (
    SIMPLE_OFFLOAD_ENV,
    EngineConfig,
    ModelLayout,
    engine_config,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import (
    REVIEWED,
    SPLIT_TARGETS,
    probe,
    source_screen,
    split_unreviewed,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    DRAFTER_SWA_ENV,
    DRAFTER_SWA_ROWS,
    FLASHINFER_BACKEND,
    FLASHINFER_MODULE,
    GAIN_TO_APPLY,
    GEOMETRY_ENV,
    INDEXER_BACKEND,
    INDEXER_MODULE,
    INFO,
    PAGE_ROWS,
    PER_RATIO,
    SPLIT,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM,
    UPSTREAM_SWA_BLOCK,
    WORKER_UTILS_MODULE,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import kernel_slots
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import (
    engine_report,
    engine_reports,
    status_detail,
    status_in_process,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind, Geometry

__all__ = [
    "ATTENTION_MODULE",
    "CacheKind",
    "DOCTOR_JSON_KEY",
    "DRAFTER_SWA_ENV",
    "DRAFTER_SWA_ROWS",
    "Decision",
    "EngineConfig",
    "FLASHINFER_BACKEND",
    "FLASHINFER_MODULE",
    "GAIN_TO_APPLY",
    "GEOMETRY_ENV",
    "Geometry",
    "INDEXER_BACKEND",
    "INDEXER_FP8_FLAG",
    "INDEXER_MODULE",
    "INFO",
    "MOE_MARLIN_FLAG",
    "ModelLayout",
    "PAGE_ROWS",
    "PER_RATIO",
    "PageGeometryError",
    "REVIEWED",
    "SIMPLE_OFFLOAD_ENV",
    "SPLIT",
    "SPLIT_ERROR_0_34",
    "SPLIT_MANAGER_BLOCK",
    "SPLIT_TARGETS",
    "STATE",
    "UPSTREAM",
    "UPSTREAM_SWA_BLOCK",
    "WORKER_UTILS_MODULE",
    "apply",
    "bound_pages",
    "check_no_split_drafter",
    "check_page_geometry",
    "check_workers_agree",
    "decide",
    "decide_for",
    "diagnose",
    "engine_config",
    "engine_report",
    "engine_reports",
    "flashinfer_takes_runtime_swa_pages",
    "for_capability",
    "kernel_slots",
    "probe",
    "source_screen",
    "specs_geometry",
    "split_unreviewed",
    "status_detail",
    "status_in_process",
]
