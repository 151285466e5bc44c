"""Run the release test sessions and the verify sessions two at a time.

`nox` (every release's tests) and `nox -t verify` run the same sessions one
after another; on CI's two cores a release session leaves a core idle while
its last test file runs alone, or while it waits on the package index, and a
verify session is mostly one process.  Here each release is a chain -- its test
session, then its verify session (same environment, so never both at once) --
and LANES chains run side by side, the ones with a verify session first, newest
release first.  A verify session runs only after its release's tests passed.

Each session's output is printed whole when it ends.  Every session runs in a
process group of its own with a time limit; a signal to this script ends them
all.  Exit status: 0 when every session passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LANES = 2
SESSION_LIMIT_S = 45 * 60
NOX = ("nox", "--non-interactive")

running: set[subprocess.Popen] = set()
printing = threading.Lock()
stopping = threading.Event()


def sessions(*selection: str) -> list[str]:
    listed = subprocess.run(
        [*NOX, "--list", "--json", *selection], capture_output=True, text=True, check=True
    )
    return [entry["session"] for entry in json.loads(listed.stdout)]


def release_of(session: str) -> tuple[int, ...]:
    return tuple(int(part) for part in session.split("-", 1)[1].split("."))


def chains() -> list[list[str]]:
    """One chain per release: its tests, then its verify session where it has one."""
    verify = {release_of(s): s for s in sessions("-t", "verify")}
    tests = sessions()
    if not set(verify) <= {release_of(s) for s in tests}:
        raise SystemExit(f"a verify session without a test session: {sorted(verify)} {tests}")
    chained = [[s, *([verify[release_of(s)]] if release_of(s) in verify else [])] for s in tests]
    return sorted(chained, key=lambda chain: (len(chain) == 1, [-n for n in release_of(chain[0])]))


def run_session(session: str, folder: Path) -> tuple[str, bool, float]:
    log = folder / f"{session}.log"
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(
            [*NOX, "--report", str(folder / f"{session}.json"), "-s", session],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        running.add(process)
        try:
            passed = process.wait(timeout=SESSION_LIMIT_S) == 0
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
            passed = False
            with log.open("a") as late:
                late.write(f"\n{session}: stopped at its limit of {SESSION_LIMIT_S} s\n")
        finally:
            running.discard(process)
    elapsed = time.monotonic() - started
    with printing:
        print(f"\n===== {session}: {'passed' if passed else 'FAILED'} in {elapsed:.0f} s =====")
        print(log.read_text(errors="replace"), flush=True)
    return session, passed, elapsed


def lane(queue: list[list[str]], folder: Path, results: list[tuple[str, bool, float]]) -> None:
    while not stopping.is_set():
        with printing:
            if not queue:
                return
            chain = queue.pop(0)
        for session in chain:
            result = run_session(session, folder)
            results.append(result)
            if not result[1] or stopping.is_set():
                break  # a verify session needs its release's tests green


def end_everything(signum: int, _frame: object) -> None:
    stopping.set()
    for process in list(running):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, end_everything)
    signal.signal(signal.SIGINT, end_everything)
    queue = chains()
    print("chains, in the order they start:", " | ".join(" -> ".join(c) for c in queue))
    results: list[tuple[str, bool, float]] = []
    with tempfile.TemporaryDirectory(prefix="ci-sessions-") as tmp:
        threads = [
            threading.Thread(target=lane, args=(queue, Path(tmp), results), daemon=True)
            for _ in range(LANES)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=SESSION_LIMIT_S * 8)  # never forever: each session has a limit
    print("\nper-session wall time (install + tests; two sessions at a time):")
    for session, passed, elapsed in results:
        print(f"  {session:<16} {'success' if passed else 'failed':<8} {elapsed:7.0f} s")
    return 0 if results and all(passed for _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
