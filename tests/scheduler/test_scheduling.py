"""Scheduling variants must not change a single greedy token."""

from __future__ import annotations

import pytest

from tests.conftest import GREEDY, random_prompts

pytestmark = pytest.mark.fast

NEW = 24
PROMPTS = random_prompts(6, 5, 120, seed=11)


@pytest.fixture(scope="module")
def reference(llama_dir):
    from pdserve import Engine

    with Engine(model_path=str(llama_dir), max_total_tokens=8192, chunked_prefill_size=-1) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    return [o["output_ids"] for o in outs]


def run(make_engine, llama_dir, prompts=PROMPTS, **kwargs):
    engine = make_engine(llama_dir, **kwargs)
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    return engine, outs


@pytest.mark.parametrize("chunk", [7, 32, 50])
def test_chunked_prefill_gives_plain_tokens(chunk, reference, make_engine, llama_dir):
    # Chunk sizes smaller than the prompts and not dividing them.
    _, outs = run(make_engine, llama_dir, chunked_prefill_size=chunk)
    assert [o["output_ids"] for o in outs] == reference


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False])
def test_page_sizes(page_size, radix, reference, make_engine, llama_dir):
    _, outs = run(make_engine, llama_dir, page_size=page_size, disable_radix_cache=not radix,
                  chunked_prefill_size=40)
    assert [o["output_ids"] for o in outs] == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_cache_hit_reports_cached_tokens_and_same_output(page_size, reference, make_engine,
                                                               llama_dir):
    engine = make_engine(llama_dir, page_size=page_size)
    first = engine.generate(input_ids=PROMPTS[3], sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert first["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=PROMPTS[3], sampling_params=dict(GREEDY, max_new_tokens=NEW))
    cached = again["meta_info"]["cached_tokens"]
    assert cached > 0 and cached % page_size == 0 and cached < len(PROMPTS[3])
    assert again["output_ids"] == first["output_ids"] == reference[3]
    # A request extending a cached conversation (prompt + answer + more) hits the
    # prompt and the generated part.
    longer = PROMPTS[3] + first["output_ids"] + [7, 8, 9]
    ext = engine.generate(input_ids=longer, sampling_params=dict(GREEDY, max_new_tokens=4))
    assert ext["meta_info"]["cached_tokens"] >= len(PROMPTS[3]) // page_size * page_size


def test_disabled_radix_cache_never_hits(make_engine, llama_dir):
    engine = make_engine(llama_dir, disable_radix_cache=True)
    for _ in range(2):
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=4))
        assert out["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_under_small_kv_budget_keeps_output(page_size, reference, make_engine, llama_dir):
    # Room for every prompt but for only part of the generated tokens, so decode
    # runs out of pages and must retract.
    ps = page_size
    prompt_pages = sum(-(-(len(p) + 1) // ps) for p in PROMPTS)
    final_pages = sum(-(-(len(p) + NEW) // ps) for p in PROMPTS)
    largest = max(-(-(len(p) + NEW) // ps) for p in PROMPTS)
    pages = max(largest, prompt_pages + (final_pages - prompt_pages) // 4)
    engine, outs = run(make_engine, llama_dir, page_size=ps, max_total_tokens=pages * ps)
    assert [o["output_ids"] for o in outs] == reference
    assert sum(o["meta_info"]["retractions"] for o in outs) > 0
    assert engine._scheduler.queues.num_retractions > 0


def test_lpm_policy_same_tokens(reference, make_engine, llama_dir):
    shared = PROMPTS[1]
    prompts = PROMPTS + [shared + [10, 11], shared + [12]]
    engine = make_engine(llama_dir, schedule_policy="lpm")
    engine.generate(input_ids=shared, sampling_params=dict(GREEDY, max_new_tokens=2))
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert [o["output_ids"] for o in outs[: len(PROMPTS)]] == reference
    assert outs[-1]["meta_info"]["cached_tokens"] > 0


def test_max_running_requests_queues(reference, make_engine, llama_dir):
    _, outs = run(make_engine, llama_dir, max_running_requests=2)
    assert [o["output_ids"] for o in outs] == reference


def test_request_larger_than_pool_aborts_cleanly(make_engine, llama_dir):
    engine = make_engine(llama_dir, max_total_tokens=64)
    out = engine.generate(input_ids=[7] * 100, sampling_params=dict(GREEDY, max_new_tokens=4))
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "max-total-tokens" in out["meta_info"]["finish_reason"]["message"]


@pytest.mark.parametrize("prompt_len,max_new,chunk,n,expect", [
    (100, 4, 16, 1, "request needs"),        # the prompt alone outgrows the pool (its first chunk fits)
    (8, 4, -1, 5, "--max-running-requests"),  # more samples than request slots
    (40, 20, -1, 1, None),                    # fits, with its growth estimate
    # The prompt fits, its growth estimate does not: it runs (it might stop early) and,
    # as it really outgrows the pool, ends when the pool is full.
    (50, 40, -1, 1, "cannot hold this request's length"),
])
def test_requests_that_cannot_wait_their_way_in_end_or_run(make_engine, llama_dir, prompt_len, max_new, chunk, n,
                                                          expect):
    """A request that can never be admitted ends at once with a clear reason, and one
    whose prompt fits runs alone even when its growth estimate does not fit beside it
    (each used to hold the queue forever)."""
    engine = make_engine(llama_dir, max_total_tokens=64, chunked_prefill_size=chunk, max_running_requests=4)
    prompt = random_prompts(1, prompt_len, prompt_len, seed=3)[0]
    outs = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=max_new, n=n))
    outs = outs if isinstance(outs, list) else [outs]
    for out in outs:
        finish = out["meta_info"]["finish_reason"]
        if expect is None:
            assert finish["type"] == "length" and len(out["output_ids"]) == max_new
        else:
            assert finish["type"] == "abort" and expect in finish["message"], finish
