"""The JSON contract of ``doctor --json`` and ``status --json`` is a schema (issue 44).

``vllm_mla_fixes/schemas/{doctor,status}.schema.json`` list every key, and
every object in them forbids keys it does not list.  Real outputs are held to
them where they are made: every report of ``tests/test_doctor_consistency.py``'s
matrix (its ``json_matches_its_schema`` check: the documented lines on every
release it covers) and every ``status --json`` of ``tests/test_properties.py``
(``assert_contract``).  Here: the schemas are valid, docs/install.md names
them and documents no key they lack, and the check fails on a documented key
missing or an undocumented one present.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
from json_schemas import SCHEMAS, schema, schema_problems

from vllm_mla_fixes.report import Environment, Finding

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "docs" / "install.md"


def test_the_schemas_are_json_schema_and_ship_in_the_package():
    for command in ("doctor", "status"):
        jsonschema.Draft202012Validator.check_schema(schema(command))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"schemas/*.json"' in pyproject
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == [
        "doctor.schema.json",
        "status.schema.json",
    ]


def test_install_md_names_the_schemas_and_documents_only_their_keys():
    text = INSTALL.read_text()
    for command in ("doctor", "status"):
        assert f"vllm_mla_fixes/schemas/{command}.schema.json" in text
    dsv41 = schema("doctor")["$defs"]["dsv41"]["properties"]
    table_keys = re.findall(r"^\| `([a-z_0-9]+)` \|", text, flags=re.M)
    assert table_keys and set(table_keys) <= set(dsv41), set(table_keys) - set(dsv41)
    paragraph = text.split("It also has ", 1)[1].split(". `status", 1)[0]
    named = set(re.findall(r"`([a-z_0-9]+)`", paragraph))
    assert named and named <= set(dsv41), named - set(dsv41)


def _document() -> dict:
    """doctor's own JSON for a report of one finding, no serve line."""
    from vllm_mla_fixes import doctor

    env = Environment({"vllm": None}, None, None, None, None, None, {})
    printed: list[str] = []
    doctor.report(env, None, [Finding("ok", "environment", "fine")], True, printed.append)
    return json.loads(printed[0])


def test_the_check_fails_on_a_documented_key_missing_or_an_undocumented_one_present():
    document = _document()
    assert schema_problems("doctor", document) == []
    missing = {k: v for k, v in document.items() if k != "reason"}
    assert any("'reason' is a required property" in p for p in schema_problems("doctor", missing))
    extra = {**document, "vs_best_upstream": 1.0}
    assert any("vs_best_upstream" in p for p in schema_problems("doctor", extra))
    nested = {**document, "findings": [{**document["findings"][0], "hint": ""}]}
    assert any("/findings/0" in p for p in schema_problems("doctor", nested))
    error = {"error": "doctor: the serve line has no model", "exit_status": 2}
    assert schema_problems("doctor", error) == []
    assert schema_problems("status", {**error, "fixes": []}) != []
