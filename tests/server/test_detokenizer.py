"""Streaming text must concatenate to the final text, stop strings included."""

from __future__ import annotations

import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.server.detokenizer import Detokenizer, held_back
from pdserve.server.messages import TokenUpdate

pytestmark = pytest.mark.fast


def test_held_back():
    assert held_back("abc", ()) == 0
    assert held_back("ab\ufffd", ()) == 1
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello w", ("xyz", "wo")) == 1
    assert held_back("hello", ("hello",)) == 0  # a whole stop string is the scheduler's business


def _update(ids, finish=None, params=None):
    return TokenUpdate(rid="r", index=0, new_ids=tuple(ids), new_logprobs=(), new_top_logprobs=(),
                       finish=finish, prompt_tokens=1, cached_tokens=0, completion_tokens=0, retractions=0,
                       spec_verify_ct=0, spec_accepted_drafts=0,
                       params=params)


@pytest.mark.parametrize("stop, no_trim", [((), False), (("lo w",), False), (("lo w",), True), (("xyz",), False)])
def test_deltas_concatenate_to_final_text(llama_dir, stop, no_trim):
    from pdserve.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_dir)
    ids = tok("hello world")["input_ids"]
    detok = Detokenizer(tok)
    params = SamplingParams(stop=stop, no_stop_trim=no_trim)
    text = tok.decode(ids)
    end = len(ids)
    finish = {"type": "length"}
    if stop and stop[0] in text:
        end = next(i for i in range(1, len(ids) + 1) if stop[0] in tok.decode(ids[:i]))
        finish = {"type": "stop", "matched": stop[0]}
    deltas = []
    for i in range(end):
        last = i == end - 1
        deltas.append(detok.process(_update([ids[i]], finish if last else None,
                                            params if i == 0 else None)).text_delta)
        if stop and not last:
            assert not any(s in "".join(deltas) for s in stop)
    expected = tok.decode(ids[:end])
    if finish["type"] == "stop" and not no_trim:
        expected = expected[: expected.find(stop[0])]
    assert "".join(deltas) == expected
    assert not detok.samples  # state dropped once finished
