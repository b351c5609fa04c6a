"""The wire messages into the scheduler: what the RequestBuilder puts in a NewRequest,
the Reqs a scheduler rank builds from it, and the checks on the way (naming the
field as the caller's API spells it)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pdserve.requests import (ApiFields, RequestBuilder, bootstrap_addresses, check_new_tokens,
                              sample_seed)
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.messages import Bootstrap, Command, NewRequest
from pdserve.scheduler.req import samples_from_message

pytestmark = pytest.mark.fast

OPENAI = ApiFields(max_new_tokens="max_tokens", min_new_tokens="min_tokens")


def builder(max_n: int = 4, context_len: int = 64) -> RequestBuilder:
    return RequestBuilder(None, context_len, 1000, max_n, random_seed=0)


def test_group_is_a_frozen_message_with_one_seed_per_sample():
    msg = builder().group([5, 6, 7], SamplingParams(n=3, seed=11), False, 2, rid="r")
    assert msg == NewRequest(rid="r", prompt_ids=(5, 6, 7), params=SamplingParams(n=3, seed=11),
                             seeds=(11, sample_seed(11, 1), sample_seed(11, 2)), return_logprob=True,
                             top_logprobs_num=2, bootstrap=None)  # top logprobs imply logprobs
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.rid = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(Command(add=(msg,)))) == Command(add=(msg,))
    # Without a seed the builder draws one; with a fresh rid each time.
    a, b = builder().group([5], SamplingParams(), False, 0), builder().group([5], SamplingParams(), False, 0)
    assert a.seeds == b.seeds and a.rid != b.rid


def test_a_message_must_describe_every_sample():
    with pytest.raises(ValueError, match="2 seeds for n=3"):
        NewRequest("r", (1,), SamplingParams(n=3), seeds=(1, 2))
    with pytest.raises(ValueError, match="1 bootstrap addresses for n=2"):
        NewRequest("r", (1,), SamplingParams(n=2), seeds=(1, 2), bootstrap=(Bootstrap("h", 1, 1),))


def test_samples_from_message_forks_from_the_first():
    where = (Bootstrap("10.0.0.1", 8998, 5), Bootstrap("10.0.0.1", 8998, 6))
    msg = NewRequest("r", (1, 2), SamplingParams(n=2), seeds=(3, 4), return_logprob=True, top_logprobs_num=1,
                     bootstrap=where)
    first, second = samples_from_message(msg)
    assert first.pending_forks == [second] and second.pending_forks == []
    assert [(r.sample_index, r.seed, r.bootstrap_room) for r in (first, second)] == [(0, 3, 5), (1, 4, 6)]
    assert all(r.rid == "r" and r.return_logprob and r.top_logprobs_num == 1 and r.params is msg.params
               and r.bootstrap_host == "10.0.0.1" and r.bootstrap_port == 8998 for r in (first, second))
    first.prompt_ids.append(9)  # each sample owns its prompt list: the message stays as sent
    assert second.prompt_ids == [1, 2] and msg.prompt_ids == (1, 2)
    colocated = samples_from_message(dataclasses.replace(msg, bootstrap=None))
    assert all(r.bootstrap_host is r.bootstrap_port is r.bootstrap_room is None for r in colocated)


def test_command_merge_keeps_order_and_flags():
    m1, m2 = (builder().group([i], SamplingParams(), False, 0) for i in (1, 2))
    merged = Command.merge([Command(add=(m1,)), Command(abort=("x",), get_state=True), Command(add=(m2,))])
    assert merged == Command(add=(m1, m2), abort=("x",), get_state=True)


def test_build_checks_in_the_callers_terms():
    b = builder(context_len=10)
    msgs = b.build([[1, 2], [3]], [SamplingParams(max_new_tokens=2)] * 2, False, 0, rids=["a", "b"])
    assert [m.rid for m in msgs] == ["a", "b"]
    with pytest.raises(ValueError, match=r"^max_new_tokens: prompt \(8 tokens\) \+ max_new_tokens \(5\)"):
        b.build([[1] * 8], [SamplingParams(max_new_tokens=5)], False, 0)
    with pytest.raises(ValueError, match=r"^max_tokens: prompt \(8 tokens\) \+ max_tokens \(5\) exceeds"):
        b.build([[1] * 8], [SamplingParams(max_new_tokens=5)], False, 0, names=OPENAI)
    with pytest.raises(ValueError, match="^prompt: 10 tokens do not fit the context length 10"):
        b.build([[1] * 10], [SamplingParams(max_new_tokens=0)], False, 0, names=OPENAI)
    with pytest.raises(ValueError, match=r"^n: 5 is above the limit 4 \(--max-n\)"):
        b.build([[1]], [SamplingParams(n=5, max_new_tokens=1)], False, 0)
    with pytest.raises(ValueError, match="^top_logprobs_num: must be an integer in"):
        b.build([[1]], [SamplingParams(max_new_tokens=1)], False, 21)
    with pytest.raises(ValueError, match="^rid: one distinct rid per prompt"):
        b.build([[1], [2]], [SamplingParams(max_new_tokens=1)] * 2, False, 0, rids=["a", "a"])


def test_check_new_tokens_names_the_api_fields():
    check_new_tokens(5, 5, OPENAI)
    with pytest.raises(ValueError, match=r"^max_tokens: must be in \[0, 2\^20\], got -1$"):
        check_new_tokens(-1, 0, OPENAI)
    chat = ApiFields(max_new_tokens="max_completion_tokens", min_new_tokens="min_tokens")
    with pytest.raises(ValueError, match=r"^min_tokens: must be in \[0, max_completion_tokens\], got 6$"):
        check_new_tokens(5, 6, chat)
    # The same words SamplingParams uses under its own names.
    with pytest.raises(ValueError, match=r"^min_new_tokens: must be in \[0, max_new_tokens\], got 6$"):
        SamplingParams(max_new_tokens=5, min_new_tokens=6)


def test_bootstrap_addresses_one_room_per_sample():
    assert bootstrap_addresses("null", 8998, "h", None, 3, [1]) is None  # colocated: ignored
    assert bootstrap_addresses("decode", 8998, "h", None, 3, [1]) == [(Bootstrap("h", 8998, 3),)]
    # Lists are per sample, prompt-major; scalars apply to every sample.
    got = bootstrap_addresses("prefill", 8998, "h", [1, None, 3], [10, 11, 12], [2, 1])
    assert got == [(Bootstrap("h", 1, 10), Bootstrap("h", 8998, 11)), (Bootstrap("h", 3, 12),)]
    for args, message in [
        (("h", None, None, [1]), "^bootstrap_room: a decode server needs bootstrap_host and bootstrap_room"),
        (("h", None, 3, [2]), r"^bootstrap_room: 2 samples need one room each \(a list\)"),
        (("h", None, [1, 1], [2]), "^bootstrap_room: every sample needs a distinct room"),
        (("h", None, [1], [2]), r"^bootstrap_room: 1 values for 2 samples \(1 prompts x n\)"),
        (("h", 0, 1, [1]), r"^bootstrap_port: must be in \[1, 65535\], got 0"),
        (("h", None, -1, [1]), r"^bootstrap_room: must be in \[0, 2\^63\), got -1"),
    ]:
        with pytest.raises(ValueError, match=message):
            bootstrap_addresses("decode", 8998, *args)
