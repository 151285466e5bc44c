"""Time `vllm-mla-fixes review` of vLLM 0.34.0 against the registry as of 0.33.0.

Cold: an empty wheel cache (a fresh HOME, so the user's cache is untouched),
so both wheels (0.34.0 to review, 0.33.0 for the diffs) are downloaded and
sha256-checked.  Warm: the same HOME again, three times.  Writes the timings
and the review's output to benchmarks/results/review_0.33.0_to_0.34.0.txt.

    python benchmarks/release_review.py   # in an environment with vllm-mla-fixes installed
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

COMMAND = ["review", "--vllm", "0.34.0", "--against", "0.33.0"]
RESULT = Path(__file__).resolve().parent / "results" / "review_0.33.0_to_0.34.0.txt"


def timed_review(home: Path) -> tuple[float, subprocess.CompletedProcess]:
    cli = Path(sys.executable).parent / "vllm-mla-fixes"
    start = time.perf_counter()
    proc = subprocess.run(
        [str(cli), *COMMAND], capture_output=True, text=True, env=dict(os.environ, HOME=str(home))
    )
    return time.perf_counter() - start, proc


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="review-bench-") as home:
        cold, first = timed_review(Path(home))
        warm = []
        for _ in range(3):
            seconds, proc = timed_review(Path(home))
            assert proc.stdout == first.stdout and proc.returncode == first.returncode
            warm.append(seconds)
        sizes = {
            p.name: p.stat().st_size
            for p in Path(home, ".cache", "vllm-mla-fixes", "wheels").iterdir()
        }
    lines = [
        f"# vllm-mla-fixes {' '.join(COMMAND)}",
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} (other work running), python benchmarks/release_review.py",
        "# wheels downloaded cold: "
        + ", ".join(f"{n} ({s / 2**20:.0f} MiB)" for n, s in sorted(sizes.items())),
        f"# cold (empty wheel cache): {cold:.1f} s",
        f"# warm (cached wheels, sha256 re-checked): median {statistics.median(warm):.1f} s "
        f"({', '.join(f'{w:.1f}' for w in warm)})",
        f"# exit status {first.returncode} (0 nothing to review, 1 needs review, 2 could not review)",
        "# stderr:",
        *(f"#   {line}" for line in first.stderr.splitlines()),
        "",
        first.stdout.rstrip("\n"),
    ]
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
