"""/tokenize and /detokenize through the router (plain mode, with --api-key on the router
and the server): the worker's answers pass through, 400s included, and the key is
required. The PD case is in test_pd_names_and_logs.py."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.router.conftest import RouterProcess
from tests.server.conftest import ServerProcess, assert_openai_error

KEY = "sk-router-tokenize"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def deployment(llama_dir):
    procs: list = []
    try:
        s = ServerProcess(llama_dir, "--max-total-tokens", "2048", api_key=KEY)
        procs.append(s)
        r = RouterProcess("--worker-urls", s.url, "--api-key", KEY)
        procs.append(r)
        yield s, r
    finally:
        for p in reversed(procs):
            p.close()


def test_tokenize_and_detokenize_round_trip_through_the_router(deployment, llama_dir):
    server, router = deployment
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    text = "Round trip: 1, 2, 3."
    for body in ({"prompt": text}, {"messages": MESSAGES}, {"messages": MESSAGES, "add_generation_prompt": False}):
        via = httpx.post(router.url + "/tokenize", json=body, headers=AUTH, timeout=30)
        direct = server.client.post("/tokenize", json=body)
        assert via.status_code == 200, via.text
        assert via.json() == direct.json()
        back = httpx.post(router.url + "/detokenize", json={"tokens": via.json()["tokens"]}, headers=AUTH, timeout=30)
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": tok.decode(via.json()["tokens"])}
    assert httpx.post(router.url + "/detokenize", json={"tokens": tok(text)["input_ids"]}, headers=AUTH,
                      timeout=30).json()["prompt"].endswith(text)


def test_worker_400s_pass_through_and_the_key_is_required(deployment):
    _, router = deployment
    r = httpx.post(router.url + "/detokenize", json={"tokens": [10**6]}, headers=AUTH, timeout=30)
    assert_openai_error(r, 400, ("tokens",))
    r = httpx.post(router.url + "/tokenize", content=b"{not json", headers=AUTH, timeout=30)
    assert_openai_error(r, 400, ("body",))
    for path in ("/tokenize", "/detokenize"):
        assert httpx.post(router.url + path, json={"prompt": "a"}, timeout=30).status_code == 401
