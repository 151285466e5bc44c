"""The supported matrix (fix x release x GPU), rendered from the fixes' records.

The README embeds this table; a test keeps the two equal, so the facts live in
one place (each fix's ``INFO``).
"""

from __future__ import annotations

from vllm_mla_fixes.fixes import ALL_FIXES


def matrix_markdown() -> str:
    lines = [
        "| fix | vLLM releases fixed here | affected, not covered | newest release reviewed "
        "| fixed upstream in | GPUs | upstream |",
        "|---|---|---|---|---|---|---|",
    ]
    for module in ALL_FIXES:
        info = module.INFO
        uncovered = "; ".join(f"{', '.join(n.releases)} ({n.why})" for n in info.not_covered) or "-"
        lines.append(
            f"| `{info.name}` | {', '.join(info.covered_releases)} | {uncovered} | "
            f"{info.newest_reviewed} | {info.fixed_in or 'open'} | {info.hardware} | "
            f"{', '.join(info.upstream)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(matrix_markdown())
