"""The request bodies SGLang's own benchmark client (sglang/benchmark/serving.py,
``--backend sglang`` and ``--backend sglang-oai``) sends, field for field, explicit
nulls included: every one succeeds and gives the plain request's tokens. The
client itself was run against pdserve with scripts/sglang_bench_client.py."""

from __future__ import annotations

from tests.conftest import random_prompts
from tests.server.conftest import parse_sse_lines

IDS = random_prompts(2, 8, 30, seed=17)


def sglang_generate_body(prompt: str | list[int], output_len: int, stream: bool) -> dict:
    """async_request_sglang_generate's payload with the client's default flags."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


def sglang_oai_body(model: str, prompt: str | list[int], output_len: int, stream: bool) -> dict:
    """async_request_openai_completions' payload (``--backend sglang-oai``)."""
    return {"model": model, "prompt": prompt, "best_of": 1, "max_tokens": output_len, "stream": stream,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}


def test_sglang_native_backend_bodies(server):
    plain = server.client.post("/generate", json={
        "input_ids": IDS[0], "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}})
    assert plain.status_code == 200, plain.text
    r = server.client.post("/generate", json=sglang_generate_body(IDS[0], 12, stream=False))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == plain.json()["output_ids"]
    with server.client.stream("POST", "/generate", json=sglang_generate_body(IDS[0], 12, stream=True)) as resp:
        assert resp.status_code == 200
        events, done = parse_sse_lines(resp.iter_lines())
    assert done and events[-1]["meta_info"]["completion_tokens"] == 12
    assert events[-1]["text"] == plain.json()["text"]
    text = server.client.post("/generate", json=sglang_generate_body("The quick brown fox", 6, stream=False))
    assert text.status_code == 200, text.text
    # The fields the client sends only when asked stay refused when they would change the answer.
    for field, value in (("lora_path", "adapter"), ("return_routed_experts", True), ("token_ids_logprob", [5]),
                         ("image_data", ["x"])):
        bad = server.client.post("/generate", json=dict(sglang_generate_body(IDS[0], 4, False), **{field: value}))
        assert bad.status_code == 400 and field in bad.json()["error"]["message"], (field, bad.text)


def test_sglang_oai_backend_bodies(server):
    model = server.client.get("/v1/models").json()["data"][0]["id"]
    r = server.client.post("/v1/completions", json=sglang_oai_body(model, IDS[1], 10, stream=False))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 10
    with server.client.stream("POST", "/v1/completions", json=sglang_oai_body(model, IDS[1], 10, True)) as resp:
        assert resp.status_code == 200
        events, done = parse_sse_lines(resp.iter_lines())
    assert done
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    assert streamed == r.json()["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 10
