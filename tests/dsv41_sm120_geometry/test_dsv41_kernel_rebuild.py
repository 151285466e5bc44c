"""dsv41-sm120-geometry: decisions and caches follow the installed kernel
files, not their version strings (issue 37).

Operators on SM12x rebuild FlashInfer and DeepGEMM from patched sources under
the same version string.  Here DeepGEMM is "rebuilt": a copy of the DeepGEMM
that vLLM 0.34.0 vendors, installed as a ``deep_gemm`` package (which vLLM
imports before its vendored one), with its SM120 FP8 paged-MQA kernel's
static assertion narrowed to 64-row pages.  The files are copied, never
hard-linked, so the environment's own files stay as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_release("0.34.0")

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "include/deep_gemm/impls/sm120_fp8_paged_mqa_logits.cuh"


def decided_here() -> dict:
    """What this process reads of the DeepGEMM FP8 envelope, its cache key,
    and the decision for 0.34.0's --block-size 64 line on SM120."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import truth_table as table

    envelopes = envelope.kernel_envelopes()
    with repro.sm120_platform():
        config = repro.make_vllm_config(64)
        repro.attach_model(config, repro.DSV41_FLASH)
        decision = fix.decide(config)
    assert decision.upstream is not None
    return {
        "rows": str(envelopes[envelope.DEEPGEMM_LOGITS_FP8].rows),
        "key": envelope.content_key(),
        "cache": str(table._cache_file()),
        "decision": decision.geometry.value,
        "rejected": [r.as_dict() for r in decision.upstream.rejected],
    }


def _decided_in_a_new_process(site: Path, cache_dir: Path) -> dict:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_MLA_FIXES_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join(
            [str(site), str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
        ),
    }
    code = "import json, test_dsv41_kernel_rebuild as t; print(json.dumps(t.decided_here()))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rebuilt_kernel_under_the_same_version_is_decided_from_its_own_files(
    tmp_path, monkeypatch
):
    import vllm

    vendored = Path(vllm.__file__).parent / "third_party" / "deep_gemm"
    site = tmp_path / "site-packages"
    rebuilt = site / "deep_gemm"
    shutil.copytree(vendored, rebuilt, copy_function=shutil.copyfile)  # bytes, not links
    kernel = rebuilt / KERNEL
    text = kernel.read_text(encoding="utf-8")
    narrowed = text.replace("PAGE_KV == 32 or ", "", 1)
    assert narrowed != text, "the reviewed static assertion moved"
    kernel.unlink()  # a new file: the copy's old inode keeps nothing of the original
    kernel.write_text(narrowed, encoding="utf-8")

    monkeypatch.setenv("VLLM_MLA_FIXES_CACHE_DIR", str(tmp_path / "cache"))
    installed = decided_here()
    after = _decided_in_a_new_process(site, tmp_path / "cache")

    assert installed["rows"] == "32, 64"
    assert installed["decision"] == "upstream"  # 0.34.0's --block-size 64 works upstream
    assert after["rows"] == "64"
    # the next process decides from the rebuilt file: upstream's 32-state
    # ratio-2 indexer pages are now refused, so the fix lays out its split
    assert after["decision"] == "interleaved-split", after
    assert {"cache": "indexer K, compress ratio 2", "rows": 32} in [
        {k: r[k] for k in ("cache", "rows")} for r in after["rejected"]
    ]
    # the truth table's cache is keyed by the bytes read, not the versions
    assert after["key"] != installed["key"] and after["cache"] != installed["cache"]
    assert vendored.joinpath(KERNEL).read_text(encoding="utf-8") == text  # untouched
