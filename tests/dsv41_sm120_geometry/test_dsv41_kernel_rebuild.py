"""dsv41-sm120-geometry: decisions and caches follow the installed kernel
files, not their version strings (issue 37).

Operators on SM12x rebuild FlashInfer and DeepGEMM from patched sources under
the same version string.  Here DeepGEMM is installed as a ``deep_gemm``
package (which vLLM imports before its vendored one): a copy of the DeepGEMM
that vLLM 0.34.0 vendors, then "rebuilt" in place, its SM120 FP8 paged-MQA
kernel's static assertion narrowed to 64-row pages in the same file at the
same size (issue 46).  The files are copied, never hard-linked, so the
environment's own files stay as they are.
"""

from __future__ import annotations

import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
from fix_releases import covered

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41

pytestmark = pytest.mark.vllm_release(*covered(DSV41))

KERNEL = "include/deep_gemm/impls/sm120_fp8_paged_mqa_logits.cuh"


def decided_here() -> dict:
    """What this process reads of the DeepGEMM FP8 envelope, its cache key,
    and the decision for 0.34.0's --block-size 64 line on SM120."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import decide
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import truth_table as table

    envelopes = envelope.kernel_envelopes()
    with repro.sm120_platform():
        config = repro.make_vllm_config(64)
        repro.attach_model(config, repro.DSV41_FLASH)
        decision = decide(config)
    assert decision.upstream is not None
    return {
        "rows": str(envelopes[envelope.DEEPGEMM_LOGITS_FP8].rows),
        "key": envelope.content_key(),
        "cache": str(table._cache_file()),
        "decision": decision.geometry.value,
        "rejected": [r.as_dict() for r in decision.upstream.rejected],
    }


def _read_afresh() -> None:
    """Forget what this process read of the installed kernels, as the next
    process starts without it."""
    import importlib

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope

    importlib.invalidate_caches()
    envelope.kernel_envelopes.cache_clear()


# Same length: the 32-row page leaves the assertion, 64 stays (written twice).
WIDE = b"PAGE_KV == 32 or "
NARROW = b"PAGE_KV == 64 or "


def test_a_kernel_rebuilt_in_place_under_the_same_version_is_decided_from_its_bytes(
    tmp_path, monkeypatch
):
    """Issue 46: the rebuilt copy sat at a new path, so a key of paths and
    versions changed too.  Here one installed DeepGEMM file is rewritten in
    place: same path, same names, same versions, same size; only bytes
    differ.  What is read afresh (as by the next process) decides anew, and
    the truth table's cache key follows."""
    import vllm

    vendored = Path(vllm.__file__).parent / "third_party" / "deep_gemm"
    site = tmp_path / "site-packages"
    shutil.copytree(vendored, site / "deep_gemm", copy_function=shutil.copyfile)  # no links
    kernel = site / "deep_gemm" / KERNEL
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("VLLM_MLA_FIXES_CACHE_DIR", str(tmp_path / "cache"))
    try:
        _read_afresh()
        installed = decided_here()
        data = kernel.read_bytes()
        assert data.count(WIDE) == 1, "the reviewed static assertion moved"
        size, versions = len(data), (version("vllm"), version("flashinfer-python"))
        with kernel.open("r+b") as f:  # in place: the same file, the same inode
            f.seek(data.index(WIDE))
            f.write(NARROW)
        assert kernel.stat().st_size == size
        _read_afresh()
        after = decided_here()
        assert (version("vllm"), version("flashinfer-python")) == versions
    finally:
        monkeypatch.undo()
        _read_afresh()

    assert installed["rows"] == "32, 64"
    assert after["rows"] == "64"
    if installed["decision"] == "upstream":  # 0.34.0: --block-size 64 works upstream
        # decided from the rewritten bytes: upstream's 32-state ratio-2 indexer
        # pages are now refused, so the fix lays out its split
        assert after["decision"] == "interleaved-split", after
        assert {"cache": "indexer K, compress ratio 2", "rows": 32} in [
            {k: r[k] for k in ("cache", "rows")} for r in after["rejected"]
        ]
    # (0.32/0.33 declare [128]: upstream's --block-size 64 does not start either way)
    # the truth table's cache is keyed by the bytes read, not paths or versions
    assert after["key"] != installed["key"] and after["cache"] != installed["cache"]
    assert vendored.joinpath(KERNEL).read_bytes() == data  # the environment's own, untouched
