"""Issue 39, findings 5, 6 (the request side), 13 and the "Also" items, replayed by a
client against a real server process on the demo model.

- 5: `stop_token_ids` of 1.9 million ids (n=8) made a concurrent stream 60x slower: the
  count is capped, ids outside the vocabulary are refused, and the most a request may
  ask for (with the most stop strings) leaves a concurrent stream's pace alone.
- 6: 16 stop strings of 20,000 characters multiplied the detokenizer's work: stop strings
  are bounded (the detokenizer itself: tests/server/test_detokenizer_incremental.py).
- 13: JSON nested too deeply inside a string (a tool call's arguments in the history, the
  `json_schema` string of /generate, /v1/completions and chat, /tokenize with messages)
  was a plain-text 500: a 400 in the API's error shape naming the field.
- Also: /detokenize and prompt logprobs answered 6-2000 times the request's size: both
  are bounded, and a refusal names the limit.

Every refusal is an OpenAI-shaped 400 naming the field or the limit, and the server
answers a normal request as before after each.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any, Iterator

import httpx
import pytest

from pdserve import assets
from pdserve.config import ServerArgs
from pdserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.tokenizer import load_tokenizer
from tests.conftest import GREEDY
from tests.security.served import Target
from tests.server.conftest import ServerProcess, assert_openai_error

VOCAB = 157        # the demo model's vocabulary
CONTEXT = 2048     # and its context length
NORMAL = {"text": "The capital of France is", "sampling_params": dict(GREEDY, max_new_tokens=8)}
DEEP = "[" * 100_000 + "]" * 100_000   # far deeper than Python's JSON parser goes
PLP_LIMIT = ServerArgs.max_prompt_logprob_entries  # the default --max-prompt-logprob-entries
LOAD_TOKENS, STREAM_TOKENS = 240, 60  # the concurrency replay's load (x 16 samples) and stream


@pytest.fixture(scope="module")
def demo() -> Iterator[Target]:
    s = ServerProcess(assets.path("demo"))
    try:
        yield Target(s, NORMAL)
    finally:
        s.close()


def chat(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


# ---- finding 5: stop_token_ids ---------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_million_stop_token_ids_are_refused_at_once(demo, path):
    ids = ",".join(["100"] * 1_900_000)  # 7.6 MB: under --max-request-bytes
    body = ('{"prompt": "a", "max_tokens": 4, "n": 8, "stop_token_ids": [' + ids + "]}" if path == "/v1/completions"
            else '{"text": "a", "sampling_params": {"max_new_tokens": 4, "n": 8, "stop_token_ids": [' + ids + "]}}")
    start = time.monotonic()
    err = assert_openai_error(demo.post_raw(path, body), 400, ("stop_token_ids",))
    assert time.monotonic() - start < 30
    assert f"at most {MAX_STOP_TOKEN_IDS}" in err["message"] and len(err["message"]) < 200
    demo.assert_serving()


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [3, VOCAB]}}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stop_token_ids": [10**12]}),
    ("/v1/chat/completions", chat(stop_token_ids=[VOCAB + 5])),
])
def test_stop_token_ids_outside_the_vocabulary_are_refused(demo, path, body):
    err = assert_openai_error(demo.post(path, body), 400, ("stop_token_ids",))
    assert "outside the vocabulary" in err["message"] and f"[0, {VOCAB})" in err["message"]


def test_many_stop_token_ids_within_the_limit_still_stop_where_they_should(demo):
    """The set is built once per request; the first output token in it ends the output."""
    out = demo.post("/generate", NORMAL).json()["output_ids"]
    k = next(i for i in range(1, len(out)) if out[i] not in out[:i])  # the first token not seen before
    ids = [t for t in range(VOCAB) if t not in out[:k]]  # every id but the first k tokens'
    assert len(ids) <= MAX_STOP_TOKEN_IDS
    r = demo.post("/generate", {"text": NORMAL["text"],
                                "sampling_params": dict(GREEDY, max_new_tokens=8, stop_token_ids=ids)})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == out[:k + 1]
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[k]}


# ---- finding 6: stop strings -------------------------------------------------------------------
@pytest.mark.parametrize("path, body, words", [
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop": ["x" * 20_000] * 16}},
     (f"at most {MAX_STOP_CHARS}",)),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 16, "stop": ["y" * (MAX_STOP_CHARS + 1)]},
     (f"{MAX_STOP_CHARS + 1} characters",)),
    ("/v1/chat/completions", chat(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)]),
     (f"at most {MAX_STOP_STRINGS}",)),
])
def test_oversize_stop_strings_are_refused(demo, path, body, words):
    err = assert_openai_error(demo.post(path, body), 400, ("stop",))
    assert all(w in err["message"] for w in words), err
    demo.assert_serving()


def stream_seconds(url: str, max_new_tokens: int) -> float:
    body = {"text": "Once upon a time", "stream": True, "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens)}
    start = time.monotonic()
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass
    return time.monotonic() - start


def test_the_costliest_allowed_stops_leave_a_concurrent_stream_alone(demo):
    """Finding 5/6's measure: a stream next to an n=16 request carrying the most stop
    strings (16 x 256 characters, never matching) and stop token ids (with min_new_tokens,
    so that they are banned every step) takes about as long as next to the same request
    without them (before: 60x slower with 1.9 million ids, past 600 s with 16 x
    20,000-character stop strings)."""
    plain = {"text": "Tell me", "sampling_params": dict(GREEDY, max_new_tokens=LOAD_TOKENS, n=16,
                                                         min_new_tokens=LOAD_TOKENS)}
    costly = json.loads(json.dumps(plain))
    costly["sampling_params"].update(
        stop=["\x01" * (MAX_STOP_CHARS - 1) + chr(0x2460 + i) for i in range(MAX_STOP_STRINGS)],
        stop_token_ids=list(range(40, VOCAB)))  # banned every step: the output draws from 0..39

    def beside(load: dict[str, Any]) -> float:
        def run_load() -> float:
            assert demo.post("/generate", load, 600).status_code == 200
            return time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(run_load)
            time.sleep(0.2)  # the load is admitted
            took = stream_seconds(demo.url, STREAM_TOKENS)
            stream_end = time.monotonic()
            assert other.result() > stream_end, "the load ended before the stream: nothing was measured"
        return took

    base, loaded = beside(plain), beside(costly)
    if loaded >= 2.5 * base + 1.0:  # the machine is shared: a second pair before judging
        base, loaded = min(base, beside(plain)), min(loaded, beside(costly))
    print(f"stream beside the plain load {base:.2f} s, beside the costliest stops {loaded:.2f} s")
    assert loaded < 2.5 * base + 1.0, (base, loaded)


# ---- finding 13: JSON nested too deeply inside strings ------------------------------------------
def history_with_arguments(arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "content": "done", "tool_call_id": "c1"}]


ARGUMENTS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("path, body, field_name", [
    ("/v1/chat/completions", {"messages": history_with_arguments(DEEP), "max_tokens": 1}, ARGUMENTS),
    ("/tokenize", {"messages": history_with_arguments(DEEP)}, ARGUMENTS),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1, "json_schema": DEEP}}, "json_schema"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "json_schema": DEEP}, "json_schema"),
    ("/v1/chat/completions", chat(json_schema=DEEP), "json_schema"),
], ids=["chat-arguments", "tokenize-arguments", "generate-json_schema", "completions-json_schema",
        "chat-json_schema"])
def test_deep_json_inside_a_string_is_a_400_naming_the_field(demo, path, body, field_name):
    err = assert_openai_error(demo.post(path, body), 400, (field_name,))
    assert err["param"] == field_name and "nested" in err["message"], err
    demo.assert_serving()


def test_deep_tool_parameters_are_a_400(demo):
    """Parameters schemas as deep as the body parser allows reach the chat template's
    `tojson`, which recurses too far: refused like any schema the template cannot render."""
    schema = '{"type":"object","properties":{"a":' * 450 + '{"type":"object"}' + "}}" * 450
    tools = '[{"type":"function","function":{"name":"f","parameters":' + schema + "}}]"
    for path, head in (("/v1/chat/completions", '{"max_tokens":1,"tool_choice":"required",'), ("/tokenize", "{")):
        r = demo.post_raw(path, head + '"messages":[{"role":"user","content":"hi"}],"tools":' + tools + "}")
        assert_openai_error(r, 400, ("messages", "tools", "body"))
    demo.assert_serving()


# ---- Also: responses many times the request ---------------------------------------------------
def test_detokenize_is_bounded_by_the_context_length(demo):
    tok = load_tokenizer(assets.path("demo"))
    longest = max(range(VOCAB), key=lambda t: len(tok.decode([t])))  # 13 characters from "6,"
    r = demo.post("/detokenize", {"tokens": [longest] * (CONTEXT + 1)})
    err = assert_openai_error(r, 400, ("tokens",))
    assert f"above the limit {CONTEXT} (the context length)" in err["message"]
    # At the limit the answer is served, and is at most 32 characters per token.
    r = demo.post("/detokenize", {"tokens": [longest] * CONTEXT})
    assert r.status_code == 200 and len(r.json()["prompt"]) <= CONTEXT * 32
    demo.assert_serving()


def prompt_logprob_bodies(n: int, top: int) -> dict[str, tuple[str, dict[str, Any], str]]:
    prompt = [10 + i % 100 for i in range(2000)]
    return {
        "generate": ("/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                   "top_logprobs_num": top, "return_text_in_logprobs": True,
                                   "sampling_params": {"max_new_tokens": 1, "n": n}}, "logprob_start_len"),
        "completions": ("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": top, "max_tokens": 0,
                                            "n": n}, "echo"),
    }


@pytest.mark.parametrize("route", ["generate", "completions"])
def test_prompt_logprobs_above_the_limit_are_refused_naming_it(demo, route):
    path, body, field_name = prompt_logprob_bodies(n=16, top=20)[route]
    entries = 2000 * 21 * 16  # before: about 2000x the body's size in the response
    err = assert_openai_error(demo.post(path, body), 400, (field_name,))
    assert err["param"] == field_name
    assert f"{entries} entries" in err["message"] and "--max-prompt-logprob-entries" in err["message"]
    assert str(PLP_LIMIT) in err["message"]
    demo.assert_serving()


@pytest.mark.parametrize("route", ["generate", "completions"])
def test_prompt_logprobs_within_the_limit_are_served(demo, route):
    path, body, _ = prompt_logprob_bodies(n=2, top=5)[route]
    assert 2000 * 6 * 2 <= PLP_LIMIT
    r = demo.post(path, body)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    if route == "generate":
        assert len(out) == 2 and all(len(o["meta_info"]["input_token_logprobs"]) == 2000 for o in out)
    else:
        assert len(out["choices"]) == 2
        assert all(len(c["logprobs"]["tokens"]) == 2000 for c in out["choices"])
