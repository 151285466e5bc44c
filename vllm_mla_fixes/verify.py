"""``vllm-mla-fixes verify``: on the installed vLLM, reproduce each failure
that this release has, then show the fix removes it -- on CPU, with the
package's tiny model configs.

Each fix that the installed release is affected by runs its verifier
``verify(report) -> bool`` (:class:`vllm_mla_fixes.fix.Fix`); ``report``
prints one line.  A verifier applies its own fix with the plugin's mechanism
and reverts it before returning.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla_fixes import installed_vllm_version
from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import State, release_decision


def run(report: Callable[[str], None] = print) -> int:
    """Exit status: 0 if every relevant failure reproduced and was fixed."""
    version = installed_vllm_version()
    if version is None:
        report(
            "vLLM is not installed in this environment; install the vLLM release "
            "you serve with, then run verify again."
        )
        return 1
    report(f"vLLM {version}")
    results = []
    for module in ALL_FIXES:
        info = module.INFO
        decided = release_decision(info, version)
        if decided is not None:
            verdict = "not affected" if decided.state is State.NOT_NEEDED else decided.state.value
            report(f"[{info.name}] {verdict}: {decided.reason}")
            continue
        report(f"[{info.name}] {info.summary}")
        ok = bool(module.verify(lambda line: report(f"  {line}")))
        report(f"[{info.name}] {'PASS' if ok else 'FAIL'}")
        results.append(ok)
    return 0 if all(results) else 1
