"""Prompt logprobs over HTTP: /generate's logprob_start_len (SGLang's shape, with
return_text_in_logprobs) and /v1/completions' echo + logprobs (OpenAI's and vLLM's),
equal to the offline Engine (itself checked against transformers in
tests/scheduler/test_prompt_logprobs.py), through a small prefill chunk."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import random_prompts
from tests.server.conftest import MAX_TOTAL_TOKENS, parse_sse_lines

IDS = random_prompts(2, 20, 40, seed=21)
TEXT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def server_flags() -> tuple[str, ...]:
    return ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--chunked-prefill-size", "8")


def post(server, path, body):
    r = server.client.post(path, json=body)
    assert r.status_code == 200, (path, body, r.status_code, r.text[:1000])
    return r.json()


def close(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, abs_tol=1e-4))


def test_generate_prompt_logprobs_equal_the_engine(server, engine):
    greedy = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    for start in (0, 5):
        got = post(server, "/generate", {"input_ids": IDS, "sampling_params": greedy, "return_logprob": True,
                                         "top_logprobs_num": 2, "logprob_start_len": start})
        want = engine.generate(input_ids=IDS, sampling_params=greedy, return_logprob=True, top_logprobs_num=2,
                               logprob_start_len=start)
        for g, w, ids in zip(got, want, IDS):
            gi, wi = g["meta_info"]["input_token_logprobs"], w["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in gi] == ids[start:] == [t for _, t, _ in wi]
            assert all(close(a[0], b[0]) for a, b in zip(gi, wi))
            assert (gi[0][0] is None) == (start == 0)
            gt, wt = g["meta_info"]["input_top_logprobs"], w["meta_info"]["input_top_logprobs"]
            assert len(gt) == len(ids) - start
            assert (gt[0] is None) == (start == 0)
            for gs, ws in zip(gt, wt):
                if ws is not None:
                    assert len(gs) == 2 and all(close(a[0], b[0]) for a, b in zip(gs, ws))
            assert g["output_ids"] == w["output_ids"]


def test_generate_return_text_in_logprobs_and_stream(server):
    body = {"text": TEXT, "sampling_params": {"temperature": 0, "max_new_tokens": 2}, "return_logprob": True,
            "logprob_start_len": 0, "return_text_in_logprobs": True, "top_logprobs_num": 1}
    out = post(server, "/generate", body)
    meta = out["meta_info"]
    tok = post(server, "/tokenize", {"prompt": TEXT})["tokens"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == tok
    for lp, t, text in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert text == post(server, "/detokenize", {"tokens": [t]})["prompt"]
    assert all(isinstance(text, str) for step in meta["input_top_logprobs"][1:] for _, _, text in step)
    # Without the flag the texts are null, as before.
    plain = post(server, "/generate", dict(body, return_text_in_logprobs=False))["meta_info"]
    assert all(text is None for _, _, text in plain["input_token_logprobs"] + plain["output_token_logprobs"])
    with server.client.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        events, done = parse_sse_lines(r.iter_lines())
    assert done and events[-1]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]


@pytest.mark.parametrize("start", [-2, 10_000])
def test_generate_bad_logprob_start_len_is_a_400(server, start):
    r = server.client.post("/generate", json={"input_ids": IDS[0], "return_logprob": True,
                                              "logprob_start_len": start})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logprob_start_len"


def check_echo_logprobs(choice, prompt_ids, n_out, engine_lps):
    lp = choice["logprobs"]
    n = len(prompt_ids) + n_out
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(close(a, b) for a, b in zip(lp["token_logprobs"][:len(prompt_ids)], engine_lps))
    assert all(x is not None for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and len(t) >= 1 for t in lp["top_logprobs"][1:])
    # Offsets: each token starts where the previous one's text ends, over the echoed
    # prompt then the output.
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(n - 1))
    assert "".join(lp["tokens"]) == choice["text"]


def test_completions_echo_logprobs(server, engine):
    prompt_ids = post(server, "/tokenize", {"prompt": TEXT})["tokens"]
    ref = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    ref_lps = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"]]
    # lm-evaluation-harness's loglikelihood request: score the prompt, generate nothing.
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    out = post(server, "/v1/completions", body)
    (choice,) = out["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    check_echo_logprobs(choice, prompt_ids, 0, ref_lps)
    assert out["usage"]["completion_tokens"] == 0
    # With output tokens and n = 2: every sample echoes the same prompt logprobs.
    body = dict(body, max_tokens=3, n=2, temperature=1.0, seed=3)
    out = post(server, "/v1/completions", body)
    for choice in out["choices"]:
        check_echo_logprobs(choice, prompt_ids, 3, ref_lps)
    # Streamed: the chunks' logprobs concatenate to the whole answer's.
    streamed = {}
    with server.client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        events, done = parse_sse_lines(r.iter_lines())
    assert done
    for ev in events:
        for c in ev["choices"]:
            acc = streamed.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
            acc["text"] += c["text"]
            if c["logprobs"]:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    acc[key] += c["logprobs"][key]
    for choice in out["choices"]:
        acc = streamed[choice["index"]]
        assert acc["text"] == choice["text"]
        for key in ("tokens", "text_offset"):
            assert acc[key] == choice["logprobs"][key], key
        assert all(close(a, b) for a, b in zip(acc["token_logprobs"], choice["logprobs"]["token_logprobs"]))
    # Echo without logprobs is unchanged: no logprobs at all.
    plain = post(server, "/v1/completions", {"prompt": TEXT, "echo": True, "max_tokens": 1})
    assert plain["choices"][0]["logprobs"] is None
    json.dumps(out)  # (the whole body is plain JSON)
