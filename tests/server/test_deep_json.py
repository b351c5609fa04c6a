"""Issue 39, finding 13 at the unit level: JSON nested deeper than Python's parser goes
raises RecursionError, which is not a ValueError. A string field carrying such JSON is a
ValueError naming the field (the routes' 400; tests/security/test_request_cost.py replays
it over HTTP), and a model output holding it is text, not a call and not a crash."""

from __future__ import annotations

import pytest

from pdserve.server.protocol import json_field
from pdserve.server.tool_calls import HermesParser, Llama3JsonParser, RequiredCalls

pytestmark = pytest.mark.fast

DEEP = "[" * 100_000 + "]" * 100_000


def test_json_field_names_the_field_for_deep_and_for_invalid_json():
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: JSON nested too deeply"):
        json_field(DEEP, "messages[1].tool_calls[0].function.arguments")
    with pytest.raises(ValueError, match=r"^args: is not valid JSON"):
        json_field("{", "args")
    assert json_field('{"a": [1]}', "args") == {"a": [1]}


@pytest.mark.parametrize("parser, text", [
    (HermesParser, '<tool_call>{"name": "f", "arguments": ' + DEEP + "}</tool_call>"),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),  # arguments as a string
    (Llama3JsonParser, '{"name": "f", "parameters": ' + DEEP + "}"),
    (RequiredCalls, '[{"name": "f", "parameters": ' + DEEP + "}]"),
], ids=["hermes", "hermes-string-arguments", "llama3", "required"])
def test_tool_parsers_leave_deep_json_in_the_output_as_text(parser, text):
    content, calls = parser(frozenset({"f"})).parse(text)
    assert calls == [] and content == text
