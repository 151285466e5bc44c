"""The supported matrix (fix x release x GPU), rendered from the fixes' records.

The README embeds this table; a test keeps the two equal, so the facts live in
one place (each fix's ``INFO``).
"""
from __future__ import annotations

from vllm_mla_fixes.fixes import ALL_FIXES


def matrix_markdown() -> str:
    lines = ["| fix | vLLM releases affected | fixed upstream in | GPUs | upstream |",
             "|---|---|---|---|---|"]
    for module in ALL_FIXES:
        info = module.INFO
        lines.append(f"| `{info.name}` | {', '.join(info.affected_releases)} | "
                     f"{info.fixed_in or 'open'} | {info.hardware} | {', '.join(info.upstream)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(matrix_markdown())
