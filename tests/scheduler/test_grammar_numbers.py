"""Number literals in grammars compiled from JSON schemas are bounded to what a double or
an int64 holds (pdserve/scheduler/grammar_numbers.py): xgrammar's own grammar lets every
digit run go on for ever, and the demo model, sampled, then writes digits until
max_tokens; bounded, its answers end as JSON that validates."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from pdserve.assets import path as asset_path
from pdserve.bench.grammar import object_schema
from pdserve.scheduler.grammar import parse_grammar
from pdserve.scheduler.grammar_numbers import bound_numbers, unbounded_digit_runs

pytestmark = pytest.mark.fast

SCHEMAS: list[dict[str, Any]] = [
    {"type": "number"}, {"type": "integer"}, {}, {"type": "object"},
    {"type": "integer", "minimum": 5}, {"type": "integer", "exclusiveMaximum": 5},
    {"type": "number", "minimum": 0}, {"type": "number", "maximum": -1.5},
    {"type": ["integer", "string", "null"]}, {"type": "array", "items": {"type": "number"}},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"$defs": {"basic_integer": {"type": "integer"}}, "type": "object",
     "properties": {"n": {"$ref": "#/$defs/basic_integer"}}},
    *(object_schema(random.Random(seed)) for seed in range(8)),
]


def xgrammar_ebnf(schema: dict[str, Any]) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:60])
def test_no_unbounded_digit_run_is_left(schema):
    ebnf = xgrammar_ebnf(schema)
    assert unbounded_digit_runs(ebnf), "xgrammar's own grammar: unbounded (the check can fail)"
    bounded = str(parse_grammar("json_schema", json.dumps(schema)))
    assert unbounded_digit_runs(bounded) == [], bounded
    # Only number rules change: the rest of the grammar is xgrammar's, rule for rule.
    before, after = rules(ebnf), rules(bound_numbers(ebnf))
    changed = {name for name, body in after.items() if before.get(name) != body}
    assert changed <= set(unbounded_digit_runs(ebnf)) | {n for n in after if n.startswith("pdserve_json")} | \
        {n for n, body in after.items() if body in ("((pdserve_json_number))", "((pdserve_json_integer))")}, changed


def rules(ebnf: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in ebnf.splitlines() if line.strip())


def test_literals_within_a_double_and_an_int64():
    integer = parse_grammar("json_schema", json.dumps({"type": "integer"}))
    for text in ("0", "-7", "9223372036854775807", "-9223372036854775808", "1" * 19):
        assert accepts(integer, text), text
    for text in ("1" * 20, "-" + "1" * 20, "-0", "01", "1.5", "1e3"):
        assert not accepts(integer, text), text
    number = parse_grammar("json_schema", json.dumps({"type": "number"}))
    for text in ("0", "-0", "0.5", "-12.25", "1.7976931348623157e308", "2.2250738585072014E-308", "1" * 17,
                 "1234567890.1234567", "0." + "0" * 16 + "1", "5e+07", "3E001", "1e308"):
        assert accepts(number, text), text
    for text in ("1" * 18, "1234567890.12345678", "0." + "1" * 18, "1e309", "1e1000", "1e", "1.", ".5", "01"):
        assert not accepts(number, text), text
    # A range's open end: at most 19 integer digits (xgrammar's range grammar: 6 decimals).
    above = parse_grammar("json_schema", json.dumps({"type": "number", "minimum": 0}))
    assert accepts(above, "9" * 19 + ".5") and not accepts(above, "9" * 20)
    # A string's pattern is the client's own: untouched.
    digits = parse_grammar("json_schema", json.dumps({"type": "string", "pattern": "^[0-9]+$"}))
    assert accepts(digits, '"' + "7" * 40 + '"')


def test_sampled_answers_with_unbounded_numbers_validate(make_engine):
    """The demo model at temperature 0.7: without the bounds every one of these answers runs
    to max_tokens inside a number (`{"pt": {"x": 1e-6061636363...`)."""
    schema = {"type": "object", "properties": {
        "pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
               "required": ["x", "y"]},
        "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
        "required": ["pt", "n", "tags"]}
    engine = make_engine(asset_path("demo"))
    seeds = range(8)
    outs = engine.generate(["Give a point as JSON."] * len(seeds),
                           [{"json_schema": json.dumps(schema), "max_new_tokens": 200, "temperature": 0.7,
                             "seed": seed} for seed in seeds])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        value = json.loads(out["text"])
        jsonschema.validate(value, schema)
        for m in re.finditer(r"(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?", out["text"]):  # (no digits in the keys)
            assert len(m[1] + (m[2] or "")) <= 19 and len(m[3] or "") <= 3, out["text"]
