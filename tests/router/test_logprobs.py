"""Prompt logprobs from the prefill leg merged into decode's answer."""

from __future__ import annotations

import pytest

from pdserve.router.logprobs import merge_prompt_logprobs, results_by_index, wants_prompt_logprobs

pytestmark = pytest.mark.fast


def test_wants_prompt_logprobs():
    assert wants_prompt_logprobs("/v1/completions", {"echo": True, "logprobs": 0})
    assert not wants_prompt_logprobs("/v1/completions", {"echo": True})
    assert not wants_prompt_logprobs("/v1/completions", {"logprobs": 2})
    assert wants_prompt_logprobs("/generate", {"return_logprob": True, "logprob_start_len": 0})
    assert not wants_prompt_logprobs("/generate", {"return_logprob": True})
    assert not wants_prompt_logprobs("/generate", {"return_logprob": True, "logprob_start_len": -1})
    assert not wants_prompt_logprobs("/v1/chat/completions", {"logprobs": True})


def test_merge_generate_fills_what_decode_left_empty():
    prefill = [{"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}},
               {"meta_info": {"input_token_logprobs": [[None, 3, None]]}}]
    decode = [{"meta_info": {"output_token_logprobs": [[-1.0, 9, None]]}},
              {"meta_info": {"input_token_logprobs": [[None, 7, None]]}}]
    merged = merge_prompt_logprobs("/generate", decode, results_by_index("/generate", prefill))
    assert merged == {0, 1}
    assert decode[0]["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]
    assert decode[1]["meta_info"]["input_token_logprobs"] == [[None, 7, None]]  # decode's own wins


def test_merge_generate_fills_decode_empty_lists():
    # A pdserve decode server answers the prompt's part as [] (SGLang's router concatenates
    # prefill's list and decode's, so it must be a list): empty is filled like missing.
    prefill = {"meta_info": {"input_token_logprobs": [[None, 1, None]], "input_top_logprobs": [None]}}
    decode = {"meta_info": {"input_token_logprobs": [], "input_top_logprobs": []}}
    assert merge_prompt_logprobs("/generate", decode, results_by_index("/generate", prefill)) == {0}
    assert decode["meta_info"] == prefill["meta_info"]


def test_merge_completions_echo_fills_prompt_positions():
    prefill = {"choices": [{"index": 0, "logprobs": {"tokens": ["a", "b", "c"],
                                                     "token_logprobs": [None, -0.1, -0.2],
                                                     "top_logprobs": [None, {"b": -0.1}, {"c": -0.2}]}}]}
    decode = {"choices": [{"index": 0, "logprobs": {"tokens": ["a", "b", "c", "d"],
                                                    "token_logprobs": [None, None, None, -0.3],
                                                    "top_logprobs": [None, None, None, {"d": -0.3}]}}]}
    merge_prompt_logprobs("/v1/completions", decode, results_by_index("/v1/completions", prefill))
    lp = decode["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, -0.1, -0.2, -0.3]
    assert lp["top_logprobs"] == [None, {"b": -0.1}, {"c": -0.2}, {"d": -0.3}]
