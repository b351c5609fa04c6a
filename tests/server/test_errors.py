"""Bad requests get an OpenAI-style 400 naming the field (never a 500, never a hang),
unsupported fields are refused, and --api-key guards every route but /health."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import assert_openai_error

API_KEY = "sk-test-key"
NAME = "tiny-llama"
MAX_N = 4
CONTEXT = 1024  # max_position_embeddings of the tiny models


@pytest.fixture(scope="module")
def server_flags():
    return ("--max-total-tokens", "8192", "--served-model-name", NAME, "--max-n", str(MAX_N))


@pytest.fixture(scope="module")
def server_api_key():
    return API_KEY


@pytest.fixture
def http(server):
    # Short timeout: an error must come back at once, not after a hang.
    server.client.timeout = 20.0
    return server.client


def completion(**kw):
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    body.update(kw)
    return body


def chat(**kw):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    body.update(kw)
    return body


def drop(body, key):
    body = dict(body)
    body.pop(key)
    return body


# ---- malformed bodies -------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_malformed_json(http, path):
    r = http.post(path, content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"})
    assert_openai_error(r)
    r = http.post(path, content=b"[1, 2, 3]", headers={"Content-Type": "application/json"})
    assert_openai_error(r)
    r = http.post(path, content=b"", headers={"Content-Type": "application/json"})
    assert_openai_error(r)


COMPLETION_CASES = [
    ("wrong type max_tokens", completion(max_tokens="ten"), ("max_tokens",)),
    ("wrong type temperature", completion(temperature="hot"), ("temperature",)),
    ("wrong type prompt", completion(prompt=5), ("prompt",)),
    ("wrong type prompt list", completion(prompt=[1.5, 2]), ("prompt",)),
    ("wrong type n", completion(n=1.5), ("n",)),
    ("wrong type stream", completion(stream="yes"), ("stream",)),
    ("wrong type stop", completion(stop=5), ("stop",)),
    ("missing prompt", drop(completion(), "prompt"), ("prompt",)),
    ("empty prompt", completion(prompt=""), ("prompt",)),
    ("empty prompt list", completion(prompt=[]), ("prompt",)),
    ("empty token prompt", completion(prompt=[[]]), ("prompt",)),
    ("token id outside vocab", completion(prompt=[5, 10**6]), ("prompt",)),
    ("prompt beyond context", completion(prompt="a" * (CONTEXT + 10)), ("prompt", "max_tokens")),
    ("prompt + max_tokens beyond context", completion(prompt="a" * 1000, max_tokens=100),
     ("max_tokens", "prompt")),
    ("absurd max_tokens", completion(max_tokens=10**9), ("max_tokens",)),
    ("negative max_tokens", completion(max_tokens=-1), ("max_tokens",)),
    ("negative temperature", completion(temperature=-1), ("temperature",)),
    ("top_p above 1", completion(top_p=2), ("top_p",)),
    ("top_p zero", completion(top_p=0), ("top_p",)),
    ("n zero", completion(n=0), ("n",)),
    ("n above --max-n", completion(n=MAX_N + 1), ("n",)),
    ("presence_penalty out of range", completion(presence_penalty=5), ("presence_penalty",)),
    ("frequency_penalty out of range", completion(frequency_penalty=-5), ("frequency_penalty",)),
    ("negative seed", completion(seed=-3), ("seed",)),
    ("negative logprobs", completion(logprobs=-1), ("logprobs",)),
    ("empty stop string", completion(stop=[""]), ("stop",)),
    ("top_k zero", completion(top_k=0), ("top_k",)),
    ("repetition_penalty zero", completion(repetition_penalty=0), ("repetition_penalty",)),
    ("min_p above 1", completion(min_p=3), ("min_p",)),
    ("logit_bias", completion(logit_bias={"5": 10}), ("logit_bias",)),
    ("suffix", completion(suffix="tail"), ("suffix",)),
]


@pytest.mark.parametrize("name,body,fields", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_bad_input(http, name, body, fields):
    assert_openai_error(http.post("/v1/completions", json=body), fields=fields)


CHAT_CASES = [
    ("missing messages", drop(chat(), "messages"), ("messages",)),
    ("empty messages", chat(messages=[]), ("messages",)),
    ("messages not a list", chat(messages="hi"), ("messages",)),
    ("message without role", chat(messages=[{"content": "hi"}]), ("messages", "role")),
    ("message bad role", chat(messages=[{"role": "wizard", "content": "hi"}]), ("messages", "role")),
    ("message content wrong type", chat(messages=[{"role": "user", "content": 5}]),
     ("messages", "content")),
    ("negative temperature", chat(temperature=-1), ("temperature",)),
    ("top_p above 1", chat(top_p=2), ("top_p",)),
    ("negative max_tokens", chat(max_tokens=-1), ("max_tokens",)),
    ("negative max_completion_tokens", drop(chat(max_completion_tokens=-1), "max_tokens"),
     ("max_completion_tokens", "max_tokens")),
    ("n zero", chat(n=0), ("n",)),
    ("n above --max-n", chat(n=MAX_N + 1), ("n",)),
    ("prompt + max_tokens beyond context", chat(messages=[{"role": "user", "content": "a" * 1000}],
                                                max_tokens=100), ("max_tokens", "messages", "prompt")),
    ("top_logprobs out of range", chat(logprobs=True, top_logprobs=-1), ("top_logprobs",)),
    ("top_logprobs wrong type", chat(logprobs=True, top_logprobs="2"), ("top_logprobs",)),
    # This server has no --tool-call-parser: auto tool calling (the default with tools) cannot be served.
    ("tools without --tool-call-parser", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
     ("tools",)),
    ("tool_choice naming no tool", chat(tool_choice={"type": "function", "function": {"name": "f"}}),
     ("tool_choice",)),
    ("functions", chat(functions=[{"name": "f", "parameters": {}}]), ("functions",)),
    ("response_format type", chat(response_format={"type": "xml"}), ("response_format.type",)),
    ("response_format schema", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     ("response_format.json_schema",)),
    ("logit_bias", chat(logit_bias={"5": 10}), ("logit_bias",)),
]


@pytest.mark.parametrize("name,body,fields", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_input(http, name, body, fields):
    assert_openai_error(http.post("/v1/chat/completions", json=body), fields=fields)


@pytest.mark.parametrize("path,body", [("/v1/completions", completion(model="no-such-model")),
                                       ("/v1/chat/completions", chat(model="gpt-4")),
                                       ("/v1/chat/completions", chat(model="gpt-4", stream=True))],
                         ids=["completions", "chat", "chat-stream"])
def test_unknown_model_is_openai_404(http, path, body):
    """OpenAI's (and vLLM's) answer to a model that is not served: 404 model_not_found."""
    r = http.post(path, json=body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    assert err["type"] == "invalid_request_error" and body["model"] in err["message"], err


def test_stream_bad_input_is_400_not_a_broken_stream(http):
    r = http.post("/v1/chat/completions", json=chat(stream=True, temperature=-1))
    assert_openai_error(r, fields=("temperature",))
    r = http.post("/v1/completions", json=completion(stream=True, n=0))
    assert_openai_error(r, fields=("n",))


GENERATE_CASES = [
    ("neither text nor input_ids", {"sampling_params": {"max_new_tokens": 2}}, ("text", "input_ids")),
    ("both text and input_ids", {"text": "a", "input_ids": [6, 7]}, ("text", "input_ids")),
    ("empty text", {"text": ""}, ("text", "prompt")),
    ("text wrong type", {"text": 5}, ("text",)),
    ("input_ids outside vocab", {"input_ids": [6, 10**6]}, ("input_ids",)),
    ("input_ids wrong type", {"input_ids": ["a"]}, ("input_ids",)),
    ("sampling_params wrong type", {"text": "a", "sampling_params": "greedy"}, ("sampling_params",)),
    ("negative temperature", {"text": "a", "sampling_params": {"temperature": -1}}, ("temperature",)),
    ("top_p above 1", {"text": "a", "sampling_params": {"top_p": 2}}, ("top_p",)),
    ("negative max_new_tokens", {"text": "a", "sampling_params": {"max_new_tokens": -1}},
     ("max_new_tokens",)),
    ("n zero", {"text": "a", "sampling_params": {"n": 0}}, ("n",)),
    ("n above --max-n", {"text": "a", "sampling_params": {"n": MAX_N + 1}}, ("n",)),
    ("unknown sampling param", {"text": "a", "sampling_params": {"tempreature": 0}}, ("tempreature",)),
    ("beyond context", {"text": "a" * 1000, "sampling_params": {"max_new_tokens": 100}},
     ("max_new_tokens", "text", "prompt")),
    ("top_logprobs_num out of range", {"text": "a", "return_logprob": True, "top_logprobs_num": 99},
     ("top_logprobs_num",)),
    ("return_logprob wrong type", {"text": "a", "return_logprob": "yes"}, ("return_logprob",)),
    ("sampling_params list length mismatch",
     {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, ("sampling_params",)),
]


@pytest.mark.parametrize("name,body,fields", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_bad_input(http, name, body, fields):
    assert_openai_error(http.post("/generate", json=body), fields=fields)


# Inputs that must not reach an unhandled exception (a 500 also breaks the client's
# keep-alive connection), so each uses a connection of its own.
ODD_CASES = [
    ("generate stop is an int", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop": 5}},
     ("stop",)),
    ("generate stop is a dict", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop": {"a": 1}}}, ("stop",)),
    ("generate stop_token_ids is an int", "/generate",
     {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop_token_ids": 5}}, ("stop_token_ids",)),
    ("generate lone surrogate", "/generate", b'{"text": "a\\ud800", "sampling_params": {"max_new_tokens": 2}}',
     ("text",)),
    ("completions lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', ("prompt",)),
    ("chat lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', ("messages", "content")),
    ("invalid utf-8 body", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', ()),
    ("deeply nested body", "/generate", b"[" * 100000 + b"]" * 100000, ()),
]


@pytest.mark.parametrize("name,path,body,fields", ODD_CASES, ids=[c[0] for c in ODD_CASES])
def test_odd_input_is_400_not_500(server, name, path, body, fields):
    import httpx

    kw = {"content": body, "headers": {"Content-Type": "application/json", **server.headers}} \
        if isinstance(body, bytes) else {"json": body, "headers": server.headers}
    with httpx.Client(base_url=server.url, timeout=20.0) as fresh:
        assert_openai_error(fresh.post(path, **kw), fields=fields)


def test_unknown_route_is_404_and_wrong_method_is_405(http):
    assert http.get("/v1/nope").status_code == 404
    assert http.get("/v1/completions").status_code == 405


# ---- auth ------------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", completion()),
    ("POST", "/v1/chat/completions", chat()),
    ("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/get_server_info", None),
    ("GET", "/health_generate", None),
    ("POST", "/flush_cache", None),
    ("GET", "/metrics", None),
    ("POST", "/abort_request", {"rid": "nothing"}),
]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p[1] for p in PROTECTED])
def test_auth_required(server, method, path, body):
    import httpx

    with httpx.Client(base_url=server.url, timeout=20.0) as anon:
        kw = {"json": body} if body is not None else {}
        r = anon.request(method, path, **kw)
        assert r.status_code == 401, (path, r.status_code, r.text[:300])
        r = anon.request(method, path, headers={"Authorization": "Bearer wrong"}, **kw)
        assert r.status_code == 401, (path, r.status_code, r.text[:300])
        r = anon.request(method, path, headers={"Authorization": API_KEY}, **kw)  # no "Bearer"
        assert r.status_code == 401, (path, r.status_code, r.text[:300])
        r = anon.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"}, **kw)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])


def test_health_is_open(server):
    import httpx

    assert httpx.get(server.url + "/health", timeout=10.0).status_code == 200


def test_openai_client_auth(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=30.0, max_retries=0)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", timeout=30.0, max_retries=0)
    try:
        assert [m.id for m in good.models.list().data] == [NAME]
        out = good.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0)
        assert out.model == NAME and out.choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=NAME, prompt="hello", max_tokens=3)
        with pytest.raises(openai.BadRequestError) as exc:
            good.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=3, tools=[{"type": "function", "function": {
                                             "name": "f", "parameters": {"type": "object"}}}])
        assert "tools" in str(exc.value)
        # Another name is not served (the openai client's NotFoundError, as against OpenAI).
        with pytest.raises(openai.NotFoundError) as missing:
            good.completions.create(model="gpt-3.5-turbo-instruct", prompt="hello", max_tokens=3)
        assert missing.value.code == "model_not_found"
    finally:
        good.close()
        bad.close()


def test_still_serves_after_bad_requests(server, http):
    """Run last: the bad inputs above left the server healthy and leak-free."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=completion(max_tokens=5, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    r = http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    assert server.proc.poll() is None
    server.assert_pools_full()
