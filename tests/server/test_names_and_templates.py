"""What SGLang and vLLM users send, through a real server: `model="default"` and every
`--served-model-name` (repeatable) are served, any other name is OpenAI's 404
`model_not_found`; `--chat-template` (a Jinja file or a built-in name) replaces the
tokenizer's template for /v1/chat/completions, and a bad one stops the server at startup."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pdserve.chat_templates import BUILTIN_CHAT_TEMPLATES
from tests.server.conftest import MAX_TOTAL_TOKENS, REPO_ROOT

NAMES = ("tiny", "alias")
# Differs from the tiny models' own template (pdserve.testing.CHAT_TEMPLATE) in every part.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ANSWER] {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("template") / "chat.jinja"
    f.write_text(TEMPLATE)
    return f


@pytest.fixture(scope="module")
def server_flags(template_file):
    return ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--served-model-name", *NAMES,
            "--chat-template", str(template_file))


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60.0, max_retries=0)
    yield c
    c.close()


def rendered_reference(engine, template: str | None) -> dict:
    """The engine's greedy answer to MESSAGES rendered with `template` (None: the tokenizer's)."""
    kw = {"chat_template": template} if template is not None else {}
    text = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kw)
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return engine.generate(input_ids=ids, sampling_params=GREEDY)


# ---- model names --------------------------------------------------------------------------------
def test_models_lists_every_served_name_the_first_first(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)


def test_server_info_reports_the_served_name_where_sglang_router_reads_it(server):
    """SGLang's router takes a worker's model id from the top-level `served_model_name`
    string of /server_info (else `model_path`, a directory requests cannot name)."""
    for route in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        info = server.client.get(route).json()
        assert info["served_model_name"] == NAMES[0], (route, info)
    assert server.client.get("/server_info").json()["model_path"] != NAMES[0]


def test_default_and_every_served_name_are_served(server):
    answers = []
    for model in ("default", *NAMES, None):
        body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        if model is not None:
            body["model"] = model
        r = server.client.post("/v1/completions", json=body)
        assert r.status_code == 200, (model, r.text)
        assert r.json()["model"] == NAMES[0]  # responses report the first name
        answers.append(r.json()["choices"][0]["text"])
        r = server.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 3, "temperature": 0, **({"model": model} if model else {})})
        assert r.status_code == 200 and r.json()["model"] == NAMES[0], (model, r.text)
    assert len(set(answers)) == 1


def test_other_names_are_openai_404(server, client, llama_dir):
    # The model path is a name only when no --served-model-name is given (as before).
    for model in ("gpt-4", str(llama_dir), "Default", "tiny "):
        for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True})):
            r = server.client.post(path, json=dict(body, model=model))
            assert r.status_code == 404, (model, path, r.text)
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                          "param": "model", "code": "model_not_found"}}, r.text
            assert repr(model) in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=3)
    assert exc.value.code == "model_not_found" and exc.value.status_code == 404


# ---- --chat-template ----------------------------------------------------------------------------
def test_chat_template_file_replaces_the_tokenizers(server, engine, client):
    ref = rendered_reference(engine, TEMPLATE)
    own = rendered_reference(engine, None)
    assert ref["meta_info"]["prompt_tokens"] != own["meta_info"]["prompt_tokens"]  # the two really differ
    for model in ("default", NAMES[1]):
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=GREEDY["max_new_tokens"],
                                             temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert out.choices[0].message.content == ref["text"]
    # Streaming renders the same prompt.
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, stream=True, temperature=0,
                                                 max_tokens=GREEDY["max_new_tokens"], extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    # Completions are not templated.
    r = server.client.post("/v1/completions", json={"model": "default", "prompt": "[ANSWER] ", "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len("[ANSWER] ")


@pytest.mark.parametrize("name", ["chatml", "llama-3-instruct"])
def test_builtin_chat_template_through_the_server(start_server, llama_dir, engine, name):
    """A built-in name; without --served-model-name the model path and "default" are the names."""
    s = start_server(llama_dir, "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--chat-template", name)
    try:
        ref = rendered_reference(engine, BUILTIN_CHAT_TEMPLATES[name])
        for model in ("default", str(llama_dir)):
            r = s.client.post("/v1/chat/completions", json={
                "model": model, "messages": MESSAGES, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == str(llama_dir)
            assert r.json()["usage"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
            assert r.json()["choices"][0]["message"]["content"] == ref["text"]
        assert s.client.get("/get_server_info").json()["server_args"]["chat_template"] == name
        assert [m["id"] for m in s.client.get("/v1/models").json()["data"]] == [str(llama_dir)]
    finally:
        s.close()


def launch_fails(llama_dir, *flags: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "--model-path", str(llama_dir), *flags],
                       capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT))
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r.stderr


def test_bad_chat_template_stops_the_server_at_startup(llama_dir, tmp_path):
    err = launch_fails(llama_dir, "--chat-template", str(tmp_path / "missing.jinja"))
    assert "--chat-template" in err and "missing.jinja" in err and "chatml" in err, err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    err = launch_fails(llama_dir, "--chat-template", str(broken))
    assert "--chat-template" in err and "not a valid Jinja template" in err, err
