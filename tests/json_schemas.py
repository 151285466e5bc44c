"""``doctor --json`` and ``status --json`` against their JSON Schema files
(``vllm_mla_fixes/schemas/``, the contract docs/install.md points to): each
problem names the key, a documented key missing or an undocumented one present
(every object of the schemas forbids keys it does not list)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

SCHEMAS = Path(__file__).resolve().parent.parent / "vllm_mla_fixes" / "schemas"


def schema(command: str) -> dict:
    return json.loads((SCHEMAS / f"{command}.schema.json").read_text())


def schema_problems(command: str, document: dict) -> list[str]:
    """What in ``document`` (``<command> --json``'s output) breaks its schema."""
    whole = schema(command)
    branch = "error" if "error" in document else "report"
    validator = jsonschema.Draft202012Validator({**whole["$defs"][branch], "$defs": whole["$defs"]})
    return [
        f"{command} --json at /{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]
