"""``review`` of a wheel whose DeepSeek-V4.1 module is cut off (the shared
wheel-input tests are in ``tests/test_wheel_inputs.py``)."""

from __future__ import annotations

import zipfile
from importlib.metadata import version

import pytest
from cli_runs import cli

from vllm_mla_fixes import review


@pytest.mark.vllm_release("0.34.0")
def test_review_of_a_wheel_with_a_syntax_error_in_a_reviewed_module(tmp_path):
    """The installed release's reviewed modules, packed as its wheel, one of
    them cut off mid-definition: reported as missing definitions and a failing
    source screen, exit status 1, never a traceback."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry  # in scope of 0.34.0
    from vllm_mla_fixes.screen_cache import source_file

    modules = sorted(m for m in review.reviewed_modules() if source_file(m) is not None)
    broken = sorted(m for m, _ in dsv41_sm120_geometry.REVIEWED)[0]
    release = version("vllm")
    path = tmp_path / f"vllm-{release}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for module in modules:
            source = source_file(module)
            assert source is not None
            arcname = "/".join(module.split(".")) + (
                "/__init__.py" if source.name == "__init__.py" else ".py"
            )
            text = source.read_text(encoding="utf-8")
            archive.writestr(arcname, text + ("\ndef broken(:\n" if module == broken else ""))
    proc = cli("review", "--vllm-wheel", str(path), cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"missing    {broken}:" in proc.stdout, proc.stdout
    assert "SyntaxError" in proc.stdout and "NEEDS REVIEW" in proc.stdout
