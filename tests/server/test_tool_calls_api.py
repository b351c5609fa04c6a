"""Tool calling through a real server on the embedded demo model (`--tool-call-parser
qwen25`, a chat template that renders `tools`, assistant `tool_calls` and `tool` results).

The demo model never writes a call by itself: with `tool_choice: auto` its answer stays
content (and equals the `none` answer: the same prompt, nothing parsed). `required` and a
named function constrain the output by the tools' JSON schemas, so every answer is a
valid call of a declared tool whose arguments validate (`jsonschema`), for sampled
`n = 3` answers too; streamed deltas add up to the non-streamed answer; malformed
`tools` / `tool_choice` / history are 400s naming the field. A server without
`--tool-call-parser` refuses `auto` and still serves `required`, named and `none`.
Through a 1P1D router (EAGLE on decode) the answers and streams equal the colocated ones.
The parsers' own cases are in test_tool_calls.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from pdserve import assets
from tests.server.conftest import MAX_TOTAL_TOKENS, assert_openai_error, parse_sse_lines

# The demo model's own conversation format (what it was trained on), plus a tools turn and
# tool results as user turns.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|># Tools{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}</s>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|user|>' + m.content + '\\n' }}"
    "{%- elif m.role == 'system' %}{{ '<|system|>' + m.content + eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{{ '<|user|><tool_response>' + m.content + '</tool_response>\\n' }}"
    "{%- endif %}{%- endfor %}")

# Bounded values (enums, ranges, short strings): a random answer inside the schema ends
# well within max_tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": -5, "maximum": 5},
        "exact": {"type": "boolean"}}, "required": ["a", "b", "exact"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is 2 + 3?", "Repeat: abc123xyz", "Weather in Oslo?"]
MAX_TOKENS = 400


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("template") / "tools.jinja"
    f.write_text(TEMPLATE)
    return f


@pytest.fixture(scope="module")
def tool_server(start_server, template_file):
    s = start_server(assets.path("demo"), "--max-total-tokens", str(MAX_TOTAL_TOKENS),
                     "--tool-call-parser", "qwen25", "--chat-template", str(template_file))
    yield s
    s.close()


def chat(server, content: str = PROMPTS[0], **body):
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "tools": TOOLS, "max_tokens": MAX_TOKENS,
        "temperature": 0, **body})
    return r


def streamed(server, content: str = PROMPTS[0], **body) -> list[dict]:
    with server.client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "tools": TOOLS, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events, done = parse_sse_lines(r.iter_lines())
    assert done
    return [e["choices"][0] for e in events if e["choices"]]


def assert_valid_calls(choice: dict, only: str | None = None, may_be_cut: bool = False) -> list[dict]:
    """At least one call; every call names a declared tool (`only`, when given) and its
    arguments validate. `may_be_cut`: parallel calls may go on until max_tokens; then the
    complete calls are kept and the cut one is dropped (never content: half a call is
    neither), and finish_reason says "length"."""
    message = choice["message"]
    assert message["content"] is None, message
    if not (may_be_cut and choice["finish_reason"] == "length"):
        assert choice["finish_reason"] == "tool_calls", choice
    assert message["tool_calls"], message
    for c in message["tool_calls"]:
        assert c["type"] == "function" and c["id"].startswith("call_"), c
        name = c["function"]["name"]
        assert name in SCHEMAS and (only is None or name == only), c
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])
    assert len({c["id"] for c in message["tool_calls"]}) == len(message["tool_calls"])
    return message["tool_calls"]


# ---- auto / none -----------------------------------------------------------------------------
def test_auto_leaves_plain_text_as_content(tool_server):
    auto = chat(tool_server, "Repeat: abc123xyz")
    assert auto.status_code == 200, auto.text
    choice = auto.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "abc123xyz"
    assert "tool_calls" not in choice["message"]
    none = chat(tool_server, "Repeat: abc123xyz", tool_choice="none")
    assert none.status_code == 200, none.text
    assert none.json()["choices"][0] == choice  # the same prompt (tools rendered), nothing parsed


def n_tokens(text: str) -> int:
    return len(AutoTokenizer.from_pretrained(str(assets.path("demo")))(text, add_special_tokens=False)["input_ids"])


def test_tools_reach_the_template(tool_server):
    """The tools turn is in the prompt: exactly its tokens more than without tools."""
    with_tools = chat(tool_server, max_tokens=1).json()["usage"]["prompt_tokens"]
    r = tool_server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 1})
    assert with_tools - r.json()["usage"]["prompt_tokens"] == n_tokens("<|system|># Tools get_weather add</s>")


# ---- required / named: always a valid call ------------------------------------------------------
@pytest.mark.parametrize("content", PROMPTS)
def test_required_always_gives_valid_calls(tool_server, content):
    for parallel in (False, None):
        # Parallel calls may go on to max_tokens: 150 holds a few whole calls and a cut one.
        r = chat(tool_server, content, tool_choice="required", temperature=1.0, n=3, seed=11,
                 parallel_tool_calls=parallel, **({"max_tokens": 150} if parallel is None else {}))
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            calls = assert_valid_calls(choice, may_be_cut=parallel is None)
            if parallel is False:
                assert len(calls) == 1


# Unbounded numbers (no minimum / maximum): the grammar bounds their literals (an int64's
# 19 digits, a double's 17 significant digits), so a sampled answer ends as JSON instead
# of writing digits until max_tokens.
POINT = {"type": "function", "function": {
    "name": "move", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "pt": {"type": "object", "properties": {"x": {"type": "number"},
                                                                          "y": {"type": "number"}},
                                          "required": ["x", "y"]}}, "required": ["a", "pt"]}}}


def test_required_with_unbounded_numbers_ends_as_valid_calls(tool_server):
    for seed in range(3):
        # (Long numbers: ~250 tokens each; the loaded test machine may take a minute.)
        r = tool_server.client.post("/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Move the point."}], "tools": [POINT], "max_tokens": 400,
            "tool_choice": "required", "temperature": 0.7, "seed": seed, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
            (c,) = choice["message"]["tool_calls"]
            jsonschema.validate(json.loads(c["function"]["arguments"]), POINT["function"]["parameters"])
    # Cut by max_tokens inside the call: "length", and the half call is not content.
    r = chat(tool_server, "Move the point.", tools=[POINT], tool_choice="required", max_tokens=8)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    assert "tool_calls" not in choice["message"], choice


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_function_always_gives_its_call(tool_server, name):
    for content in PROMPTS:
        r = chat(tool_server, content, tool_choice=named(name), temperature=1.0, n=3, seed=5)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert len(assert_valid_calls(choice, only=name)) == 1


# ---- streaming adds up to the whole answer ------------------------------------------------------
def merge(choices: list[dict]) -> tuple[str, list[dict], str]:
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls: dict[int, dict] = {}
    for c in choices:
        for d in c["delta"].get("tool_calls") or ():
            if d["index"] not in calls:  # the first delta of a call names it
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"], d
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert "id" not in d and "name" not in d["function"], d
            calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], choices[-1]["finish_reason"]


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_streamed_deltas_add_up_to_the_answer(tool_server, choice):
    body = {"tool_choice": named("add") if choice == "named" else choice}
    content = "Repeat: abc123xyz" if choice == "auto" else PROMPTS[2]
    whole = chat(tool_server, content, **body).json()["choices"][0]
    got_content, got_calls, finish = merge(streamed(tool_server, content, **body))
    assert finish == whole["finish_reason"]
    assert got_content == (whole["message"]["content"] or "")
    assert got_calls == [c["function"] for c in whole["message"].get("tool_calls", [])]
    if choice != "auto":
        assert got_calls and finish in ("tool_calls", "length")


def test_tokenize_renders_tools_as_chat_does(tool_server):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    r = tool_server.client.post("/tokenize", json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == chat(tool_server, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert_openai_error(tool_server.client.post("/tokenize", json={"prompt": "x", "tools": TOOLS}), 400, ("tools",))
    assert_openai_error(tool_server.client.post("/tokenize", json={"messages": messages, "tools": [ADD, ADD]}),
                        400, ("tools[1].function.name",))


# ---- history ---------------------------------------------------------------------------------
def test_history_with_a_tool_result_renders_and_continues(tool_server):
    call = {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "5"}]
    r = tool_server.client.post("/v1/chat/completions", json={
        "messages": messages, "tools": TOOLS, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    # the call (arguments as an object) and the result are in the prompt
    rendered = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call></s>'
                "<|user|><tool_response>5</tool_response>\n")
    short = tool_server.client.post("/v1/chat/completions", json={
        "messages": messages[:1], "tools": TOOLS, "max_tokens": 1}).json()
    assert body["usage"]["prompt_tokens"] - short["usage"]["prompt_tokens"] == n_tokens(rendered)


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("body, fields", [
    ({"tools": [{"type": "function"}]}, ("tools",)),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, ("tools",)),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "not an object"}}]}, ("tools",)),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, ("tools",)),
    ({"tools": [ADD, ADD]}, ("tools[1].function.name",)),
    ({"tools": "add"}, ("tools",)),
    ({"tool_choice": "sometimes"}, ("tool_choice",)),
    ({"tool_choice": named("missing")}, ("tool_choice",)),
    ({"tool_choice": {"type": "function"}}, ("tool_choice",)),
    ({"tools": None, "tool_choice": "required"}, ("tool_choice",)),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, ("tool_choice",)),
    ({"messages": [{"role": "tool", "content": "5"}]}, ("messages[0].tool_call_id",)),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     ("messages[0].tool_calls[0].function.arguments",)),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add"}}]}]},
     ("messages",)),
])
def test_bad_tools_and_choices_are_400s(tool_server, body, fields):
    r = tool_server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4, **body})
    assert_openai_error(r, 400, fields)


def test_server_without_parser_refuses_auto_only(start_server, template_file):
    s = start_server(assets.path("demo"), "--max-total-tokens", "2048", "--chat-template", str(template_file))
    try:
        for choice in (None, "auto"):
            err = assert_openai_error(chat(s, tool_choice=choice, max_tokens=4), 400, ("tool_choice",))
            assert "--tool-call-parser" in err["message"]
        assert chat(s, tool_choice="none", max_tokens=4).status_code == 200
        assert chat(s, max_tokens=4, tools=None).status_code == 200  # no tools: nothing to parse
        r = chat(s, tool_choice=named("add"))
        assert r.status_code == 200, r.text
        assert_valid_calls(r.json()["choices"][0], only="add")
    finally:
        s.close()


@pytest.fixture(scope="module")
def pd_router(start_server, template_file):
    """A 1P1D deployment (the decode server with EAGLE) behind the router, tool flags on both."""
    from tests.router.conftest import RouterProcess
    from tests.server.conftest import free_port

    boot = free_port()
    flags = ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--tool-call-parser", "qwen25",
             "--chat-template", str(template_file))
    prefill = start_server(assets.path("demo"), *flags, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(boot))
    decode = start_server(assets.path("demo"), *flags, "--disaggregation-mode", "decode",
                          "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                          str(assets.path("demo-eagle")))
    router = RouterProcess("--pd-disaggregation", "--prefill", prefill.url, str(boot), "--decode", decode.url)
    yield router
    router.close()
    decode.close()
    prefill.close()


@pytest.mark.parametrize("body", [{"tool_choice": "auto"}, {"tool_choice": "required"},
                                  {"tool_choice": named("get_weather")}],
                         ids=["auto", "required", "named"])
def test_through_the_pd_router_as_colocated(tool_server, pd_router, body):
    """Greedy: the router's 1P1D answer (and its stream) equals the colocated server's."""
    content = "Repeat: abc123xyz" if body["tool_choice"] == "auto" else PROMPTS[2]
    ref = chat(tool_server, content, **body).json()["choices"][0]
    got = chat(pd_router, content, **body)
    assert got.status_code == 200, got.text
    got = got.json()["choices"][0]
    strip = lambda m: {**m, "tool_calls": [c["function"] for c in m.get("tool_calls", [])]}  # noqa: E731
    assert strip(got["message"]) == strip(ref["message"]) and got["finish_reason"] == ref["finish_reason"]
    s_content, s_calls, s_finish = merge(streamed(pd_router, content, **body))
    assert (s_content, s_calls, s_finish) == (ref["message"]["content"] or "", strip(ref["message"])["tool_calls"],
                                              ref["finish_reason"])
    if body["tool_choice"] != "auto":
        assert_valid_calls(got, may_be_cut=True)


def test_router_forwards_tool_fields_unchanged():
    """The PD router's legs carry the client's body as it came (tools and all)."""
    from pdserve.router.rooms import leg_body

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": named("add"),
            "parallel_tool_calls": False}
    leg = leg_body(body, rid="r1", host="h", port=1, rooms=7)
    assert {k: leg[k] for k in body} == body
