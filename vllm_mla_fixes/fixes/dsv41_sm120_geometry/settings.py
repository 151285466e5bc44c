"""The DeepSeek-V4.1 fix's own ``VLLM_MLA_FIXES_DSV41_*`` settings.

:mod:`vllm_mla_fixes.settings` reads and checks them like every setting (the
fix declares them in ``SETTINGS``); this module only says what each one
allows.  Standard library only, as every setting's parser must be.
"""

from __future__ import annotations

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry
from vllm_mla_fixes.settings import PREFIX, Setting

GEOMETRIES = (Geometry.SPLIT.value, Geometry.PER_RATIO.value)  # the two the fix can force
DRAFTER_ROWS_ALLOWED = (64, 128)  # the kernel page rows, and two of them per 128-token page


def _geometry(raw: str) -> str:
    text = raw.lower()
    if text not in GEOMETRIES:
        raise ValueError("not a geometry name")
    return text


def _drafter_rows(raw: str) -> int:
    if raw not in {str(rows) for rows in DRAFTER_ROWS_ALLOWED}:
        raise ValueError("not a page size a drafter's pages can take")
    return int(raw)


DSV41_GEOMETRY = Setting(
    name=f"{PREFIX}_DSV41_GEOMETRY",
    allowed_values=" or ".join(GEOMETRIES),
    default="chosen per engine by the fix (interleaved-split where it fits, else per-ratio)",
    meaning="force the DeepSeek-V4.1 fix's KV page geometry; set it alike on every node",
    parse=_geometry,
)
DSV41_DRAFTER_SWA_ROWS = Setting(
    name=f"{PREFIX}_DSV41_DRAFTER_SWA_ROWS",
    allowed_values="64 or 128",
    default="planned per engine: 128 or 64, whichever holds more KV tokens per GiB (128 only "
    "where the installed FlashInfer takes run-time page sizes)",
    meaning="rows of a DeepSeek-V4.1 drafter's sliding-window pages under the split; 64 keeps "
    "them at the kernel page size, 128 skips the planning",
    parse=_drafter_rows,
)
SETTINGS = (DSV41_GEOMETRY, DSV41_DRAFTER_SWA_ROWS)
