"""The result builders alone: SGLang's native result (shared by /generate and the
Engine) and the OpenAI pieces (finish reason, usage, logprobs)."""

from __future__ import annotations

import pytest

import asyncio

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.server.results import (SampleOutput, TokenTexts, chat_logprobs, completion_logprobs, native_result,
                                    openai_finish, usage)
from pdserve.server.tokenizer_manager import RequestState, SampleResult

pytestmark = pytest.mark.fast


def output(**kw) -> SampleOutput:
    base = dict(rid="r1", prompt_tokens=3, text="ab", output_ids=[7, 8], finish={"type": "stop", "matched": 2},
                cached_tokens=1, retractions=0, spec_verify_ct=0, spec_accepted_drafts=0, logprobs=None,
                top_logprobs=None)
    base.update(kw)
    return SampleOutput(**base)


def test_native_result_fields():
    out = native_result(output())
    assert out == {"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "r1", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,
        "finish_reason": {"type": "stop", "matched": 2}, "retractions": 0}}
    # SGLang's key order (clients and the router's merge read them by name, people by eye).
    assert list(out["meta_info"]) == ["id", "prompt_tokens", "completion_tokens", "cached_tokens",
                                      "finish_reason", "retractions"]


def test_length_finish_says_the_length_without_touching_the_input():
    finish = {"type": "length"}
    out = native_result(output(finish=finish, output_ids=[1, 2, 3]))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert finish == {"type": "length"}
    assert native_result(output(finish=None))["meta_info"]["finish_reason"] is None  # still running


def test_logprobs_present_exactly_when_asked_for():
    plain = native_result(output())["meta_info"]
    assert "output_token_logprobs" not in plain and "output_top_logprobs" not in plain
    meta = native_result(output(logprobs=[-0.5, -1.0], top_logprobs=[[(-0.5, 7), (-2.0, 9)], [(-1.0, 8)]]))
    assert meta["meta_info"]["output_token_logprobs"] == [(-0.5, 7, None), (-1.0, 8, None)]
    assert meta["meta_info"]["output_top_logprobs"] == [[(-0.5, 7, None), (-2.0, 9, None)], [(-1.0, 8, None)]]
    # Asked for, nothing generated yet: present and empty.
    empty = native_result(output(output_ids=[], logprobs=[], top_logprobs=None))["meta_info"]
    assert empty["output_token_logprobs"] == [] and "output_top_logprobs" not in empty


def test_spec_counters_only_with_speculation():
    meta = native_result(output(spec_verify_ct=4, spec_accepted_drafts=9))["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_accepted_drafts"]) == (4, 9)
    assert "spec_verify_ct" not in native_result(output())["meta_info"]


def test_engine_and_server_records_give_the_same_result():
    """A finished Req (the Engine's) and the HTTP process's SampleResult for the same
    sample build identical results: one builder, one format."""
    params = SamplingParams(max_new_tokens=2)
    req = Req(rid="x", prompt_ids=[1, 2, 3], params=params, seed=0, return_logprob=True, top_logprobs_num=1,
              output_ids=[5, 6], output_logprobs=[-0.1, -0.2], output_top_logprobs=[[(-0.1, 5)], [(-0.2, 6)]],
              cached_tokens=2, retractions=1, finish=FinishReason(FinishKind.LENGTH), spec_verify_ct=1,
              spec_accepted_drafts=1)
    state = RequestState("x", [1, 2, 3], params, [SampleResult(0)], asyncio.Queue(), return_logprob=True,
                         top_logprobs_num=1)
    s = state.samples[0]
    s.text, s.output_ids, s.logprobs = "hi", [5, 6], [-0.1, -0.2]
    s.top_logprobs = [((-0.1, 5),), ((-0.2, 6),)]
    s.finish, s.cached_tokens, s.retractions = {"type": "length"}, 2, 1
    s.spec_verify_ct, s.spec_accepted_drafts = 1, 1
    from_engine = native_result(SampleOutput.of_req(req, "hi"))
    from_server = native_result(SampleOutput.of_sample(state, s))
    assert from_engine == from_server
    assert from_engine["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert req.finish.to_dict() == {"type": "length"}


def test_openai_finish():
    assert openai_finish(None) is None
    assert openai_finish({"type": "stop", "matched": 1}) == "stop"
    assert openai_finish({"type": "length"}) == "length"
    assert openai_finish({"type": "abort", "message": "x"}) == "abort"


def test_usage_counts_a_prompts_cached_tokens_once():
    params = SamplingParams(n=2)
    states = []
    for rid, prompt, outs in (("a", [1, 2, 3], [[4], [5, 6]]), ("b", [7, 8], [[9, 9, 9], []])):
        st = RequestState(rid, prompt, params, [SampleResult(0), SampleResult(1)], asyncio.Queue())
        for s, ids in zip(st.samples, outs):
            s.output_ids, s.cached_tokens = ids, 2
        states.append(st)
    assert usage(states) == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 4}}


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return {1: "a", 2: "bc", 3: "é"}[ids[0]]


def test_token_texts_decode_each_token_once():
    tok = CountingTokenizer()
    texts = TokenTexts(tok)
    assert [texts(t) for t in (1, 2, 1, 2, 1)] == ["a", "bc", "a", "bc", "a"]
    assert tok.calls == 2


def test_completion_logprobs_offsets_follow_the_text():
    texts = TokenTexts(CountingTokenizer())
    lp = completion_logprobs(texts, [1, 2, 3], [-0.1, -0.2, -0.3], [[(-0.1, 1), (-0.5, 2)], [(-0.2, 2)], [(-0.3, 3)]],
                             offset=4)
    assert lp == {"tokens": ["a", "bc", "é"], "token_logprobs": [-0.1, -0.2, -0.3],
                  "top_logprobs": [{"a": -0.1, "bc": -0.5}, {"bc": -0.2}, {"é": -0.3}],
                  "text_offset": [4, 5, 7]}
    assert completion_logprobs(texts, [1], [-0.1], (), 0)["top_logprobs"] == [None]
    assert completion_logprobs(texts, [], [], (), 9)["text_offset"] == []


def test_chat_logprobs_carry_bytes():
    texts = TokenTexts(CountingTokenizer())
    out = chat_logprobs(texts, [3, 1], [-0.3, -0.1], [[(-0.3, 3), (-1.0, 1)], [(-0.1, 1)]])
    assert out[0] == {"token": "é", "logprob": -0.3, "bytes": [0xC3, 0xA9], "top_logprobs": [
        {"token": "é", "logprob": -0.3, "bytes": [0xC3, 0xA9]}, {"token": "a", "logprob": -1.0, "bytes": [97]}]}
    assert chat_logprobs(texts, [1], [-0.1], None)[0]["top_logprobs"] == []
