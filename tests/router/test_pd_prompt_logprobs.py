"""Prompt logprobs across the split: the router in front of a prefill and a decode server
answers /generate's logprob_start_len and completions' echo + logprobs (max_tokens 0
included) with the colocated server's prompt logprobs: prefill computes them, decode
answers the prompt's part empty, the router fills it from prefill's answer."""

from __future__ import annotations

import math
from typing import Any, Iterator

import pytest

from tests.conftest import random_prompts
from tests.router.conftest import RouterProcess
from tests.server.conftest import free_port, parse_sse_lines, start_servers

FLAGS = ("--max-total-tokens", "8192", "--chunked-prefill-size", "8", "--log-level", "warning")
IDS = random_prompts(2, 12, 30, seed=8)
TEXT = "Prompt logprobs across the split"


class Deployment:
    def __init__(self, model_dir: Any) -> None:
        boot = free_port()
        specs = {"prefill": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)),
                 "decode": ("--disaggregation-mode", "decode"), "colocated": ()}
        self.servers = start_servers(model_dir, specs, *FLAGS)
        self.router = RouterProcess("--pd-disaggregation", "--prefill", self.servers["prefill"].url, str(boot),
                                    "--decode", self.servers["decode"].url)

    def both(self, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
        """(through the router, colocated)"""
        out = []
        for client in (self.router.client, self.servers["colocated"].client):
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, body, r.status_code, r.text[:1000])
            out.append(r.json())
        return out[0], out[1]

    def both_streamed(self, path: str, body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        out = []
        for client in (self.router.client, self.servers["colocated"].client):
            with client.stream("POST", path, json=dict(body, stream=True)) as r:
                assert r.status_code == 200
                events, done = parse_sse_lines(r.iter_lines())
            assert done
            out.append(events)
        return out[0], out[1]

    def close(self) -> None:
        if hasattr(self, "router"):
            self.router.close()
        for s in self.servers.values():
            s.close()


@pytest.fixture(scope="module")
def pd(llama_dir) -> Iterator[Deployment]:
    d = Deployment(llama_dir)
    yield d
    d.close()


def close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, abs_tol=1e-4))


def same_entries(got: list, want: list) -> None:
    """SGLang logprob entries [logprob, id, text]; top entries lists of them or None."""
    assert len(got) == len(want) and got
    for g, w in zip(got, want):
        if w is None:  # the first prompt token's top entry
            assert g is None
        elif isinstance(w[0], list):  # one position's top-k
            same_entries(g, w)
        else:
            assert g[1:] == w[1:] and close(g[0], w[0]), (g, w)


@pytest.mark.parametrize("start", [0, 4])
def test_generate_prompt_logprobs_equal_colocated(pd, start):
    body = {"input_ids": IDS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": start,
            "return_text_in_logprobs": True}
    got, want = pd.both("/generate", body)
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs"):
        same_entries(got["meta_info"][key], want["meta_info"][key])
    assert len(got["meta_info"]["input_token_logprobs"]) == len(IDS[0]) - start
    # n = 2: each sample crosses in its own room; each carries the prompt logprobs.
    got, want = pd.both("/generate", dict(body, sampling_params={"max_new_tokens": 3, "n": 2, "seed": 5}))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        same_entries(g["meta_info"]["input_token_logprobs"], w["meta_info"]["input_token_logprobs"])
    # Streamed: every event of the router's stream carries them (events are cumulative).
    got_ev, want_ev = pd.both_streamed("/generate", body)
    same_entries(got_ev[-1]["meta_info"]["input_token_logprobs"], want_ev[-1]["meta_info"]["input_token_logprobs"])
    assert all(ev["meta_info"]["input_token_logprobs"] for ev in got_ev)


def test_generate_prompt_scoring_without_output(pd):
    body = {"input_ids": IDS[1], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    got, want = pd.both("/generate", body)
    assert got["output_ids"] == [] and got["meta_info"]["finish_reason"]["type"] == "length"
    same_entries(got["meta_info"]["input_token_logprobs"], want["meta_info"]["input_token_logprobs"])


def same_completion_logprobs(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["text_offset"] == want["text_offset"]
    assert all(close(a, b) for a, b in zip(got["token_logprobs"], want["token_logprobs"]))
    assert got["token_logprobs"][0] is None and all(x is not None for x in got["token_logprobs"][1:])
    for g, w in zip(got["top_logprobs"], want["top_logprobs"]):
        assert (g is None) == (w is None)
        if w is not None:
            assert g.keys() == w.keys() and all(close(g[k], w[k]) for k in w)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_completions_echo_logprobs_equal_colocated(pd, max_tokens):
    # lm-evaluation-harness's loglikelihood shape (max_tokens 0), and with an output.
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    got, want = pd.both("/v1/completions", body)
    (g,), (w,) = got["choices"], want["choices"]
    assert g["text"] == w["text"] and g["text"].startswith(TEXT)
    same_completion_logprobs(g["logprobs"], w["logprobs"])
    if max_tokens:
        got_ev, want_ev = pd.both_streamed("/v1/completions", body)

        def joined(events: list[Any]) -> dict[str, list]:
            acc: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for ev in events:
                for c in ev["choices"]:
                    for key in acc:
                        acc[key] += (c["logprobs"] or {}).get(key, [])
            return acc
        same_completion_logprobs(joined(got_ev), joined(want_ev))
