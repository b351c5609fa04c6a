"""With an fp8 KV cache, scheduling variants still change no greedy token: every read
goes through the pool (the new tokens' KV too), so chunked prefill, radix-cache hits,
retraction and the CPU decode mirror all see the same fp8-rounded values."""

from __future__ import annotations

import pytest

from tests.conftest import GREEDY
from tests.scheduler.test_scheduling import NEW, PROMPTS, run

KV = ["fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module", params=KV)
def fp8_reference(request, llama_dir):
    from pdserve import Engine

    with Engine(model_path=str(llama_dir), max_total_tokens=8192, chunked_prefill_size=-1,
                disable_radix_cache=True, disable_decode_kv_mirror=True, kv_cache_dtype=request.param) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    return request.param, [o["output_ids"] for o in outs]


def test_chunked_prefill_and_the_decode_mirror(fp8_reference, make_engine, llama_dir):
    kv, reference = fp8_reference
    engine, outs = run(make_engine, llama_dir, chunked_prefill_size=7, kv_cache_dtype=kv)
    assert engine._scheduler.runner.decode_mirror is not None
    assert [o["output_ids"] for o in outs] == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_hit_and_retraction(fp8_reference, make_engine, llama_dir, page_size):
    kv, reference = fp8_reference
    engine = make_engine(llama_dir, page_size=page_size, kv_cache_dtype=kv)
    first = engine.generate(input_ids=PROMPTS[3], sampling_params=dict(GREEDY, max_new_tokens=NEW))
    again = engine.generate(input_ids=PROMPTS[3], sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"] == reference[3]
    # Room for every prompt but only part of the generated tokens: decode must retract.
    ps = page_size
    prompt_pages = sum(-(-(len(p) + 1) // ps) for p in PROMPTS)
    final_pages = sum(-(-(len(p) + NEW) // ps) for p in PROMPTS)
    largest = max(-(-(len(p) + NEW) // ps) for p in PROMPTS)
    pages = max(largest, prompt_pages + (final_pages - prompt_pages) // 4)
    small, outs = run(make_engine, llama_dir, page_size=ps, max_total_tokens=pages * ps, kv_cache_dtype=kv)
    assert [o["output_ids"] for o in outs] == reference
    assert small._scheduler.queues.num_retractions > 0
