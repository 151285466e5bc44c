"""The fix's :class:`~vllm_mla_fixes.patching.FixInfo` and the constants every part
shares: page rows, geometry names, environment variables, vLLM module names,
and the error the parts raise.  The fix's header (upstream, releases, why,
how, when to remove) is the package docstring."""

from __future__ import annotations

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.settings import (
    DSV41_DRAFTER_SWA_ROWS,
    DSV41_GEOMETRY,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry
from vllm_mla_fixes.patching import FixInfo

INFO = FixInfo(
    name="dsv41-sm120-geometry",
    # verify's header on every covered release: which block size fails, and how,
    # differs between releases, so the verifier's first line says it from its run.
    summary="DeepSeek-V4.1 on SM120/SM121 (FLASHINFER_MLA_SPARSE_DSV41): upstream's KV layout "
    "fails to start, or hands the SM120 kernels pages they reject, at --block-size 64 or 128 "
    "(which, and how, the release's own rows below say); the fix keeps upstream's layout where "
    "it works, else lays out 64-state pages, by default with 128-token blocks and interleaved "
    "64-state ratio-1 kernel pages (more KV capacity than upstream), else per-ratio blocks",
    upstream=(
        "vllm#59203",
        "vllm#56702",
        "vllm#56509",
        "vllm#57292",
        "flashinfer#5323",
        "flashinfer#5174",
        "flashinfer#5244",
    ),
    affected=">=0.32.0.dev0",  # up to the newest covered release: newer ones are not reviewed
    covered_releases=("0.32.0", "0.33.0", "0.34.0"),
    fixed_in=None,
    hardware="SM120, SM121 (FLASHINFER_MLA_SPARSE_DSV41)",
    error="ValueError: No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128]).",
    not_covered=(
        patching.NotCovered(
            ">=0.30.0.dev0,<0.32.0.dev0",
            ("0.30.0", "0.31.0"),
            "0.30/0.31 choose kernel block sizes through a different API, which this fix does not wrap",
        ),
    ),
    has_selftest=True,
)


# doctor --json's top-level key for this fix's facts (``Finding.facts``; null
# where no DeepSeek-V4.1 line was judged), documented in docs/install.md.
DOCTOR_JSON_KEY = "dsv41"

PAGE_ROWS = 64
"""States per page that FlashInfer's SM120 sparse-MLA kernels (primary page) and
SM120's paged-MQA indexer kernels take."""


SPLIT_MANAGER_BLOCK = 2 * PAGE_ROWS
"""Tokens per manager block of every compressed/indexer cache under the split:
64 states at ratio 2, two 64-state kernel pages at ratio 1."""


DRAFTER_SWA_ROWS = 2 * PAGE_ROWS
"""Tokens per sliding-window page of a drafter layer (DSpark's three are
sliding-window only), where the installed FlashInfer takes the primary page
size at run time (0.7.2.post1, 0.33.0's pin, and later).  vLLM charges every
sliding-window group (window - 1 + in-flight tokens) / block size blocks per
request whatever its layer count, and the backbone's 40 sliding-window layers
fill seven 64-token groups of six; three drafter layers more would open an
eighth.  At 128 tokens they share one group of half the cost, and the split
holds more tokens than upstream with DSpark too."""


DRAFTER_SWA_ENV = DSV41_DRAFTER_SWA_ROWS.name
"""Set to 64 to keep drafter sliding-window pages at 64 rows (should a
FlashInfer build refuse 128-row pages that its envelope lists); read through
:mod:`vllm_mla_fixes.settings`, like every setting (declared in
:mod:`.settings`)."""


UPSTREAM_SWA_BLOCK = 32


FLASHINFER_BACKEND = "FLASHINFER_MLA_SPARSE_DSV41"


INDEXER_BACKEND = "DEEPSEEK_V41_INDEXER"


V4_RECORD_BYTES = 584  # the fp8_ds_mla V4 record SM120 uses (the split was proven on it)


FP8_INDEXER_ROW = 132  # 128 fp8 + one fp32 scale


SPLIT, PER_RATIO, UPSTREAM = Geometry.SPLIT, Geometry.PER_RATIO, Geometry.UPSTREAM
GAIN_TO_APPLY = 1.02
"""Where upstream's layout works, a layout nobody has run on hardware must hold
at least this much more KV to be worth it (issue 25's 2% rule)."""


GEOMETRY_ENV = DSV41_GEOMETRY.name


ATTENTION_MODULE = "vllm.models.deepseek_v41.attention"


FLASHINFER_MODULE = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"


INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"


SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"


WARMUP_MODULE = "vllm.v1.attention.backends.mla.compressor_utils"


WORKER_UTILS_MODULE = "vllm.v1.worker.utils"


SPARSE_MLA_MODULE = "vllm.models.deepseek_v41.sparse_mla"


COMPRESSOR_MODULE = "vllm.models.deepseek_v41.compressor"


class PageGeometryError(ValueError):
    """A DeepSeek-V4.1 cache reaches FlashInfer or the indexer with pages of
    the wrong size, or the packed block cannot hold the interleaved pages
    (raised at start-up, before any request)."""
