"""Reasoning content and /tokenize + /detokenize through real servers on the tiny llama.

The module's server runs `--reasoning-parser deepseek-r1` with a chat template that opens
the thinking in the prompt (as DeepSeek-R1's does), and an API key. The tiny random model
never writes `</think>`, so its whole answer is reasoning (an unclosed block: SGLang's
reading too) and `content` is empty; `separate_reasoning: false` gives the same text as
`content`. Servers without a parser and with `qwen3` are started by their tests. The
parser's own cases (tags split across chunks, ...) are in test_reasoning_parser.py."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MAX_TOTAL_TOKENS, REPO_ROOT, assert_openai_error, parse_sse_lines

KEY = "sk-reasoning"
# DeepSeek-R1's shape: the generation prompt ends inside an opened think block. With
# enable_thinking false (Qwen3's variable) the block is closed in the prompt instead.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("template") / "r1.jinja"
    f.write_text(TEMPLATE)
    return f


@pytest.fixture(scope="module")
def server_flags(template_file):
    return ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--reasoning-parser", "deepseek-r1",
            "--chat-template", str(template_file))


@pytest.fixture(scope="module")
def server_api_key():
    return KEY


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(str(llama_dir))


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, **body})


def streamed(client: httpx.Client, **body) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": MESSAGES, **GREEDY, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events, done = parse_sse_lines(r.iter_lines())
    assert done
    return [e["choices"][0] for e in events if e["choices"]]


# ---- reasoning: deepseek-r1 ---------------------------------------------------------------------
def test_deepseek_r1_answer_without_closing_tag_is_all_reasoning(server):
    plain = chat(server.client, separate_reasoning=False)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["message"]["content"]
    assert len(text) > 0 and "</think>" not in text
    assert "reasoning_content" not in plain.json()["choices"][0]["message"]

    for body in ({}, {"separate_reasoning": True}):  # the default separates
        r = chat(server.client, **body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "", "reasoning_content": text}


def test_deepseek_r1_stream_sends_reasoning_deltas(server):
    whole = chat(server.client).json()["choices"][0]["message"]
    choices = streamed(server.client)
    deltas = [c["delta"] for c in choices]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert choices[-1]["finish_reason"] == "length"

    kept = [c["delta"] for c in streamed(server.client, separate_reasoning=False)]
    assert not any("reasoning_content" in d for d in kept)
    assert "".join(d.get("content", "") for d in kept) == whole["reasoning_content"]


def test_separate_reasoning_must_be_a_boolean(server):
    assert_openai_error(chat(server.client, separate_reasoning="yes"), 400, ("separate_reasoning",))


def test_stream_reasoning_false_is_refused_true_accepted(server):
    assert_openai_error(chat(server.client, stream_reasoning=False), 400, ("stream_reasoning",))
    r = chat(server.client, stream_reasoning=True)
    assert r.status_code == 200, r.text


# ---- reasoning: no parser, qwen3 ----------------------------------------------------------------
def test_without_a_parser_separate_reasoning_changes_nothing(start_server, llama_dir, template_file):
    # SGLang's router sends separate_reasoning: true with every request; without a parser
    # there is nothing to separate: the same answer, all of it content.
    s = start_server(llama_dir, "--max-total-tokens", "2048", "--chat-template", str(template_file))
    try:
        answers = []
        for body in ({}, {"separate_reasoning": False}, {"separate_reasoning": True}):
            r = chat(s.client, **body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert set(message) == {"role", "content"}
            answers.append(message["content"])
        assert answers[0] == answers[1] == answers[2]
        r = s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "separate_reasoning": True})
        assert r.status_code == 200, r.text
    finally:
        s.close()


def test_qwen3_parser_and_enable_thinking(start_server, llama_dir, template_file):
    """qwen3: reasoning only where the output opens <think> (the tiny model never does),
    so everything is content; enable_thinking reaches the template (its closed block
    shows in the rendered prompt) and leaves the answer all content."""
    s = start_server(llama_dir, "--max-total-tokens", "2048", "--chat-template", str(template_file),
                     "--reasoning-parser", "qwen3")
    try:
        plain = chat(s.client, separate_reasoning=False).json()["choices"][0]["message"]
        message = chat(s.client).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": plain["content"], "reasoning_content": None}
        off = chat(s.client, chat_template_kwargs={"enable_thinking": False})
        assert off.status_code == 200, off.text
        # thinking off: nothing to separate, the answer is all content (no reasoning_content)
        assert set(off.json()["choices"][0]["message"]) == {"role", "content"}
        assert off.json()["choices"][0]["message"]["content"]
        for kwargs, tail in (({"enable_thinking": False}, "<think>\n\n</think>\n\n"), ({}, "<think>\n")):
            r = s.client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
            prompt = s.client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
            assert prompt.endswith("<|assistant|>" + tail), prompt
    finally:
        s.close()


def test_unknown_reasoning_parser_stops_the_server_at_startup(llama_dir):
    r = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "--model-path", str(llama_dir),
                        "--reasoning-parser", "nope"], cwd=str(REPO_ROOT), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "--reasoning-parser" in err and "deepseek-r1" in err and "qwen3" in err, err[-2000:]


# ---- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_a_prompt_round_trips(server, tokenizer):
    text = "Hello, pdserve! 2 + 3 = 5"
    r = server.client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text)["input_ids"]
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.client.get("/v1/models").json()["data"][0]["max_model_len"]
    back = server.client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert back.json()["prompt"].endswith(text)
    no_special = server.client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert no_special["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokenize_messages_applies_the_chat_template(server, tokenizer):
    for add, tail in ((None, "<|assistant|><think>\n"), (True, "<|assistant|><think>\n"), (False, "</s>")):
        body = {"messages": MESSAGES} if add is None else {"messages": MESSAGES, "add_generation_prompt": add}
        r = server.client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        rendered = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                                 add_generation_prompt=add is not False)
        assert rendered.endswith(tail)
        assert r.json()["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        text = server.client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == tokenizer.decode(r.json()["tokens"]) and text.endswith(tail)


@pytest.mark.parametrize("path, body, field", [
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "tokenz": 1}, "tokenz"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(server, path, body, field):
    status = 404 if field == "model" else 400
    assert_openai_error(server.client.post(path, json=body), status, (field,))


def test_tokenize_routes_need_the_api_key(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(server.url + path, json=body, timeout=10)
        assert r.status_code == 401, r.text
        r = httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401, r.text
