"""The fix's words, typed: the page geometries an engine can get, and the
kinds of DeepSeek-V4.1 KV cache.  Both are ``str`` enums, so a member compares
equal to (and prints as) the name operators read in ``status``, ``doctor``
and the ``VLLM_MLA_FIXES_DSV41_GEOMETRY`` setting."""

from __future__ import annotations

import enum


class Geometry(str, enum.Enum):
    SPLIT = "interleaved-split"
    PER_RATIO = "per-ratio"
    UPSTREAM = "upstream"  # the fix steps aside: upstream's own layout is in force

    def __str__(self) -> str:
        return self.value


class CacheKind(str, enum.Enum):
    SLIDING_WINDOW = "sliding-window KV"
    COMPRESSED = "compressed KV"
    INDEXER = "indexer K"
    COMPRESSOR_STATE = "compressor state"

    def __str__(self) -> str:
        return self.value
