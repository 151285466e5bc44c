"""Release-matrix safety: each fix's decision on every installed release.

    python benchmarks/release_matrix.py     # after `nox` has built the environments

Runs tests/test_release_matrix.py in each release environment under
``$VLLM_MLA_FIXES_ENV_DIR`` (default ~/.cache/vllm-mla-fixes/envs) and prints
one table with the count of wrong states.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = Path(
    os.environ.get("VLLM_MLA_FIXES_ENV_DIR", Path.home() / ".cache" / "vllm-mla-fixes" / "envs")
)


def main() -> None:
    releases = sorted(
        (p.name[len("vllm-") : -len(".txt")] for p in (ROOT / "envs").glob("vllm-*.txt")),
        key=lambda v: tuple(map(int, v.split("."))),
    )
    with tempfile.TemporaryDirectory() as out:
        for release in releases:
            python = ENV_DIR / f"vllm-{release.replace('.', '-')}" / "bin" / "python"
            if not python.exists():
                print(f"(no environment for {release}: run `nox -s vllm-{release}` first)")
                continue
            subprocess.run(
                [
                    str(python),
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    str(ROOT / "tests" / "test_release_matrix.py"),
                    "--vllm-release",
                    release,
                ],
                cwd=ROOT,
                env=dict(os.environ, VLLM_MLA_FIXES_MATRIX_OUT=out, CUDA_VISIBLE_DEVICES=""),
                capture_output=True,
            )
        rows = [row for f in sorted(Path(out).glob("*.json")) for row in json.loads(f.read_text())]
    print("| release | fix | hardware | state | expected | |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mark = "ok" if r["state"] == r["expected"] else "WRONG"
        print(
            f"| {r['release']} | {r['fix']} | {r['hardware']} | {r['state']} | {r['expected']} | {mark} |"
        )
    wrong = sum(r["state"] != r["expected"] for r in rows)
    print(f"\n{len(rows)} decisions on {len({r['release'] for r in rows})} releases, {wrong} wrong")


if __name__ == "__main__":
    main()
