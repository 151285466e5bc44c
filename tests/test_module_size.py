"""No module of the package over 800 lines (issue 45): a longer one is split
along a real seam, as ``reproductions/fa4_compile_strides.py`` (the
reproduction) and ``fa4_on_cpu.py`` (FA4 on a CPU-only machine) were."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_mla_fixes"
MOST_LINES = 800


def test_no_module_of_the_package_is_over_800_lines():
    lines = {
        str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert lines, PACKAGE
    assert {name: n for name, n in lines.items() if n > MOST_LINES} == {}
