"""Aborts a router relies on: a non-streaming request whose client disconnects is aborted
(KV freed); batched completions take one rid per prompt; prompt logprobs outside the
prompt are refused, not ignored. Aborts for rids not seen yet (kept only for the admin) are in
tests/security/test_http_front.py."""

from __future__ import annotations

import json
import socket

import pytest

from tests.conftest import GREEDY
from tests.server.conftest import assert_openai_error
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def server_flags():
    return ()  # the server's defaults


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "long", "sampling_params": dict(GREEDY, max_new_tokens=960)}),
    ("/v1/completions", {"prompt": "long", "max_tokens": 960, "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long"}], "max_tokens": 960,
                              "temperature": 0, "ignore_eos": True}),
])
def test_non_streaming_client_disconnect_aborts(server, llama_dir, path, body):
    if path != "/generate":
        body = dict(body, model=str(llama_dir))
    server.assert_pools_full()
    aborts = server.finished("abort")
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**server.headers, "Content-Type": "application/json",
                                                 "Content-Length": str(len(data)), "Host": "x"}.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + data)
        # Disconnect once the request runs (event-ordered: a fixed client timeout could fire
        # before the server read the body, or so late that the request already finished).
        wait_until(lambda: server.state()["num_running_reqs"] == 1, 30, step=0.01)
    # Ended as an abort, not run out to its length.
    wait_until(lambda: server.finished("abort") == aborts + 1, 10.0,
               what=lambda: f"an abort after the disconnect (state: {server.state()})")
    server.assert_pools_full()


def test_batched_completions_take_one_rid_per_prompt(server, llama_dir):
    body = {"model": str(llama_dir), "prompt": ["a", "b"], "max_tokens": 3, "temperature": 0}
    r = server.client.post("/v1/completions", json=dict(body, rid=["c-1", "c-2"]))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert_openai_error(server.client.post("/v1/completions", json=dict(body, rid=["c-3"])), fields=("rid",))


def test_prompt_logprobs_outside_the_prompt_are_refused(server):
    body = {"text": "abc", "return_logprob": True, "sampling_params": dict(GREEDY, max_new_tokens=2)}
    for start in (1000, -2):
        assert_openai_error(server.client.post("/generate", json=dict(body, logprob_start_len=start)),
                            fields=("logprob_start_len",))
    for start in (-1, 0):
        assert server.client.post("/generate", json=dict(body, logprob_start_len=start)).status_code == 200
