"""The part of this fix's GPU test a CPU can run: its serve lines, parsed and
built by the release's own ``vllm serve`` parser (``tests/gpu/serve_lines.py``
collects them from ``gpu/test_fp8_ds_mla_reshape_gpu.py``)."""

from __future__ import annotations

import pytest
from fix_releases import covered
from gpu_case_helpers import assert_built, read_serve_lines

from vllm_mla_fixes.fixes import fp8_ds_mla_reshape


@pytest.mark.vllm_release(*covered(fp8_ds_mla_reshape.INFO))
def test_fp8_gpu_lines_parse_and_build_with_the_releases_own_parser():
    serve = read_serve_lines()["serve"]
    for name in ("fp8 (cuda graphs)", "fp8 --enforce-eager"):
        assert_built(serve[name])
        assert serve[name]["engine_config"]["architectures"] == ["GlmMoeDsaForCausalLM"]
        assert (serve[name]["attention_backend"], serve[name]["kv_cache_dtype"]) == (
            "FLASHMLA_SPARSE",
            "fp8",
        )
    assert serve["fp8 --enforce-eager"]["enforce_eager"] is True
