"""Tool calling's pieces without a server (pdserve/server/tool_calls.py and the chat
builders of openai_routes.py): the native-format parsers on whole texts and on every
split of them (char by char, every two- and three-way cut), calls of undeclared tools and
malformed JSON staying content, the required / named readers of constrained output, the
JSON schemas those choices constrain to, the `tool_choice` checks, the streamed chat
builder with and after a reasoning parser, and the chat template rendering `tools`,
assistant `tool_calls` and `tool` messages (a Qwen-like template on the demo tokenizer)."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from pdserve import assets
from pdserve.server.openai_requests import render_chat
from pdserve.server.openai_routes import ChatChunks, chat_message
from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.reasoning import ReasoningParser
from pdserve.server.tool_calls import (TOOL_CALL_PARSERS, HermesParser, Llama3JsonParser, NamedCall, RequiredCalls,
                                       ToolOutput, finish_reason, merge_deltas, tool_plan)
from tests.server.test_reasoning_parser import fake_updates

pytestmark = pytest.mark.fast

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes none
TOOLS = [WEATHER, ADD, NOW]
NAMES = frozenset({"get_weather", "add", "now"})


def call(name: str, args: dict) -> dict:
    return {"name": name, "arguments": json.dumps(args)}


# (parser, output, content, calls as {"name", "arguments"}) -- arguments re-serialized by json.dumps
HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [call("get_weather", {"city": "Paris"})]),
    ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n',
     "Let me check both.", [call("get_weather", {"city": "Paris", "unit": "c"}), call("add", {"a": 1, "b": 2})]),
    ("No call here, just <tool and </tool_call> text.  \n", "No call here, just <tool and </tool_call> text.  \n", []),
    ('<tool_call>{"name": broken json}</tool_call> then text',
     '<tool_call>{"name": broken json}</tool_call> then text', []),
    ('Before <tool_call>{"name": "not_declared", "arguments": {}}</tool_call>',
     'Before <tool_call>{"name": "not_declared", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', []),
    ('<tool_call>{"name": "now"}</tool_call> Done.', "Done.", [call("now", {})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>', "", [call("add", {"a": 5, "b": 6})]),
    # the model stopped before the closing tag: a complete call is still a call
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', "", [call("add", {"a": 1, "b": 2})]),
    # cut at max_tokens inside the JSON: text
    ('Sure <tool_call>\n{"name": "add", "argum', 'Sure <tool_call>\n{"name": "add", "argum', []),
    ("ends on a partial tag <tool_ca", "ends on a partial tag <tool_ca", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> x <tool_call>{"name": "now"}</tool_call>',
     "x", [call("add", {"a": 1, "b": 2}), call("now", {})]),
    ("", "", []),
]
LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [call("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "now", "parameters": {}}',
     "", [call("add", {"a": 2, "b": 3}), call("now", {})]),
    ('  \n{"name": "add", "arguments": {"a": 1, "b": 1}}', "", [call("add", {"a": 1, "b": 1})]),
    ('Checking. <|python_tag|>{"name": "now", "parameters": {}}', "Checking.", [call("now", {})]),
    ('{"answer": 4}', '{"answer": 4}', []),
    ("The answer is {4}.", "The answer is {4}.", []),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1', '<|python_tag|>{"name": "add", "parameters": {"a": 1', []),
    ('{"name": "now", "parameters": {}} and then some words', "and then some words", [call("now", {})]),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("hello <|python_ta", "hello <|python_ta", []),
    ("   ", "   ", []),
]
CASES = [(HermesParser, *c) for c in HERMES_CASES] + [(Llama3JsonParser, *c) for c in LLAMA3_CASES]


def without_ids(calls: list[dict]) -> list[dict]:
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function", c
    return [c["function"] for c in calls]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_whole_text(cls, text, content, calls):
    got_content, got_calls = cls(NAMES).parse(text)
    assert got_content == content
    assert without_ids(got_calls) == calls
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def stream(output: ToolOutput, pieces) -> tuple[str, list[dict]]:
    content, deltas = [], []
    for p in pieces:
        c, d = output.feed(p)
        content.append(c)
        deltas += d
    c, d = output.flush()
    return "".join(content) + c, deltas + d


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_every_split_adds_up_to_the_whole(cls, text, content, calls):
    """Chunk boundaries anywhere (inside tags and JSON too): the content deltas concatenate
    to the whole parse's content, the tool-call deltas merge to its calls."""
    n = len(text)
    cuts = [(i,) for i in range(n + 1)] + list(itertools.combinations(range(0, n + 1, 3), 2))
    splits = [[text[a:b] for a, b in zip((0, *cut), (*cut, n))] for cut in cuts] + [list(text)]
    for pieces in splits:
        got_content, deltas = stream(cls(NAMES), pieces)
        assert got_content == content, pieces
        assert without_ids(merge_deltas(deltas)) == calls, pieces
        assert [d["index"] for d in deltas] == list(range(len(calls)))  # one delta per whole call


def test_registry_uses_sglang_names():
    assert TOOL_CALL_PARSERS["qwen"] is TOOL_CALL_PARSERS["qwen25"] is TOOL_CALL_PARSERS["hermes"] is HermesParser
    assert TOOL_CALL_PARSERS["llama3"] is Llama3JsonParser


# ---- constrained choices -----------------------------------------------------------------
def test_required_schema_admits_exactly_calls_of_declared_tools():
    schema = json.loads(tool_plan(TOOLS, "required", None, None).json_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "add", "parameters": {"a": "x", "b": 2}}], [{"name": "other", "parameters": {}}],
                [{"name": "now", "parameters": {"extra": 1}}], [{"name": "get_weather", "parameters": {}}], {}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tool_plan(TOOLS, "required", False, None).json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)  # parallel_tool_calls false: one call
    jsonschema.validate(ok[:1], single)


def test_named_schema_is_the_functions_parameters():
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "qwen25")
    assert json.loads(plan.json_schema()) == WEATHER["function"]["parameters"]
    assert plan.constrained and plan.parser is None
    assert json.loads(tool_plan(TOOLS, {"type": "function", "function": {"name": "now"}}, None, None)
                      .json_schema()) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_auto_and_none_add_no_constraint():
    assert tool_plan(TOOLS, None, None, "qwen25").json_schema() is None
    assert tool_plan(TOOLS, "auto", None, "llama3").new_output().__class__ is Llama3JsonParser
    none = tool_plan(TOOLS, "none", None, None)
    assert none.json_schema() is None and none.new_output() is None and none.tools == TOOLS
    assert tool_plan(None, "auto", None, None) is None and tool_plan([], "none", None, None) is None


@pytest.mark.parametrize("tools, choice, parser, field", [
    (TOOLS, "auto", None, "tools: tool_choice 'auto'"),
    (TOOLS, None, None, "--tool-call-parser"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "qwen25", "missing"),
    (None, "required", "qwen25", "tools"),
    (None, {"type": "function", "function": {"name": "add"}}, "qwen25", "tools"),
    ([ADD, ADD], "auto", "qwen25", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "qwen25", "tools[0].function.name"),
])
def test_tool_plan_refusals_name_the_field(tools, choice, parser, field):
    with pytest.raises(ValueError) as e:
        tool_plan(tools, choice, None, parser)
    assert field in str(e.value)


def test_required_output_becomes_calls_and_anything_else_content():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]'
    content, calls = RequiredCalls(NAMES).parse(text)
    assert content == "" and without_ids(calls) == [call("add", {"a": 1, "b": 2}), call("now", {})]
    for pieces in ([text], list(text), [text[:20], text[20:52], text[52:]]):
        content, deltas = stream(RequiredCalls(NAMES), pieces)
        assert content == "" and without_ids(merge_deltas(deltas)) == without_ids(calls)
    # cut at max_tokens: the complete calls; the cut item is dropped, never content
    cut = '[{"name": "now", "parameters": {}}, {"name": "add", "param'
    content, calls = RequiredCalls(NAMES).parse(cut)
    assert content == "" and without_ids(calls) == [call("now", {})]
    content, deltas = stream(RequiredCalls(NAMES), list(cut))
    assert content == "" and without_ids(merge_deltas(deltas)) == [call("now", {})]
    assert RequiredCalls(NAMES).parse('  [{"name": "add", "parameters": {"a": 1111111') == ("", [])
    # Not such an array (never, under the grammar): all content.
    for text in ('[{"name": "x", "parameters": {}}]', "no json"):
        assert RequiredCalls(NAMES).parse(text) == (text.strip(), [])


def test_named_call_streams_its_arguments():
    out = NamedCall("add")
    deltas = [d for piece in ['{"a"', ": 1,", ' "b": 2}'] for d in out.feed(piece)[1]] + out.flush()[1]
    assert deltas[0]["function"] == {"name": "add", "arguments": '{"a"'} and deltas[0]["id"].startswith("call_")
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in deltas[1:])
    assert without_ids(merge_deltas(deltas)) == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]


def test_finish_reason_is_tool_calls_only_for_a_stop_with_calls():
    out = HermesParser(NAMES)
    assert finish_reason("stop", out) == "stop"
    out.parse('<tool_call>{"name": "now"}</tool_call>')
    assert finish_reason("stop", out) == "tool_calls"
    assert finish_reason("length", out) == "length"  # cut short: the client should know
    assert finish_reason(None, out) is None and finish_reason("stop", None) == "stop"


# ---- the chat builders ---------------------------------------------------------------------
def test_chat_message_with_calls_reasoning_and_plain_text():
    text = '<think>need the weather</think>Checking.\n<tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Rome"}}</tool_call>'
    m = chat_message(text, ReasoningParser(False), HermesParser(NAMES))
    assert m["reasoning_content"] == "need the weather" and m["content"] == "Checking."
    assert without_ids(m["tool_calls"]) == [call("get_weather", {"city": "Rome"})]
    only_call = chat_message('<tool_call>{"name": "now"}</tool_call>', None, HermesParser(NAMES))
    assert only_call["content"] is None and len(only_call["tool_calls"]) == 1
    assert chat_message("plain", None, HermesParser(NAMES)) == {"role": "assistant", "content": "plain"}
    assert chat_message("plain", None, None) == {"role": "assistant", "content": "plain"}


def test_streamed_chat_deltas_add_up_to_the_message():
    text = '<think>hmm</think>Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n' \
           '</tool_call>\n<tool_call>{"name": "now"}</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    state, updates = fake_updates(pieces)
    chunks = ChatChunks(None, lambda: ReasoningParser(False), lambda: HermesParser(NAMES))
    choices = [c for u in updates for c in chunks(state, u)]
    deltas = [c["delta"] for c in choices]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "Let me add."
    streamed = merge_deltas([t for d in deltas for t in d.get("tool_calls", [])])
    whole = chat_message(text, ReasoningParser(False), HermesParser(NAMES))
    assert without_ids(streamed) == without_ids(whole["tool_calls"])
    kinds = [k for d in deltas for k in d if k != "role" and d[k]]
    assert kinds.index("tool_calls") > max(i for i, k in enumerate(kinds) if k == "content")
    assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_streamed_chat_without_calls_is_plain_content():
    state, updates = fake_updates(["Just ", "text, no ", "calls.\n"])
    chunks = ChatChunks(None, lambda: None, lambda: HermesParser(NAMES))
    choices = [c for u in updates for c in chunks(state, u)]
    assert "".join(c["delta"].get("content", "") for c in choices) == "Just text, no calls.\n"
    assert not any("tool_calls" in c["delta"] for c in choices)
    assert choices[-1]["finish_reason"] == "stop"


# ---- rendering: tools, assistant tool_calls, tool results -----------------------------------
# Qwen 2.5's shape on the demo tokenizer's role tokens: the tools in the system turn, calls
# as <tool_call> JSON (arguments written with tojson: they must arrive as an object), tool
# results as <tool_response> in a user turn.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call></s>"
    "{%- elif messages[0].role == 'system' %}<|system|>{{ messages[0].content }}</s>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|user|>{{ m.content }}</s>"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>\n{{ m.content }}\n</tool_response></s>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


class _Builder:
    """What render_chat needs of a RequestBuilder."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def check_chars(self, n: int, field: str, what: str) -> None:
        assert n < 100_000


@pytest.fixture(scope="module")
def builder():
    tok = AutoTokenizer.from_pretrained(str(assets.path("demo")))
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return _Builder(tok)


def test_template_renders_tools_calls_and_results(builder):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    text = render_chat(builder, req.messages, None, True, tools=[WEATHER])
    assert text == (
        "<|system|>Be brief.\n\n# Tools\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n"
        'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call></s>'
        "<|user|>Weather in Paris?</s>"
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call></s>'
        "<|user|><tool_response>\n18 C, sunny\n</tool_response></s><|assistant|>")
    # without tools the template leaves the tool section out
    assert "<tools>" not in render_chat(builder, req.messages, None, True)


@pytest.mark.parametrize("messages, field", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{not json"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_history_names_the_field(builder, messages, field):
    req = ChatCompletionRequest.model_validate({"messages": messages})
    with pytest.raises(ValueError) as e:
        render_chat(builder, req.messages, None, True)
    assert str(e.value).startswith(field + ":"), e.value
