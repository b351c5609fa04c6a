"""OpenAI-compatible API through the `openai` client: the served outputs equal the offline
Engine's on the same model, streaming equals non-streaming, and the usage is right."""

from __future__ import annotations

import math

import openai
import pytest

from tests.conftest import random_prompts

PROMPT = "The quick brown fox"
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60.0, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(llama_dir):
    # Without --served-model-name the model is named by its path.
    return str(llama_dir)


def chat_prompt(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def greedy(max_new_tokens, **kw):
    return dict(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


# ---- models ---------------------------------------------------------------------------
def test_models_lists_the_model(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]


# ---- greedy parity ---------------------------------------------------------------------
def test_completion_greedy_equals_engine(client, model, engine):
    for prompt in PROMPTS:
        ref = engine.generate(prompt, greedy(12))
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert len(out.choices) == 1
        c = out.choices[0]
        assert c.index == 0
        assert c.text == ref["text"], prompt
        assert c.finish_reason == ref["meta_info"]["finish_reason"]["type"]
        assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.model == model
        assert out.object == "text_completion"


def test_chat_greedy_equals_engine(client, model, engine):
    conversations = [
        MESSAGES,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "count to 3"}],
    ]
    for messages in conversations:
        ref = engine.generate(chat_prompt(engine, messages), greedy(12))
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                             temperature=0)
        assert len(out.choices) == 1
        c = out.choices[0]
        assert c.message.role == "assistant"
        assert c.message.content == ref["text"]
        assert c.finish_reason == ref["meta_info"]["finish_reason"]["type"]
        assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        assert out.object == "chat.completion"


def test_chat_max_completion_tokens(client, model, engine):
    ref = engine.generate(chat_prompt(engine, MESSAGES), greedy(7, ignore_eos=True))
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=7,
                                         temperature=0, extra_body=IGNORE_EOS)
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.completion_tokens == 7
    assert out.choices[0].finish_reason == "length"


def test_completion_prompt_forms(client, model, engine):
    """A list of strings, a token-id list and a list of token-id lists."""
    refs = engine.generate(PROMPTS, greedy(8))
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert sorted(c.index for c in out.choices) == list(range(len(PROMPTS)))
    by_index = {c.index: c.text for c in out.choices}
    assert [by_index[i] for i in range(len(PROMPTS))] == [r["text"] for r in refs]
    assert out.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in refs)
    assert out.usage.completion_tokens == sum(r["meta_info"]["completion_tokens"] for r in refs)

    ids = random_prompts(2, 5, 30, seed=11)
    refs = engine.generate(input_ids=ids, sampling_params=greedy(8))
    single = client.completions.create(model=model, prompt=ids[0], max_tokens=8, temperature=0)
    assert len(single.choices) == 1
    assert single.choices[0].text == refs[0]["text"]
    assert single.usage.prompt_tokens == len(ids[0])
    batch = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index == {0: refs[0]["text"], 1: refs[1]["text"]}


# ---- streaming --------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True))
    assert chunks, "no chunks"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_equals_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles and roles[0] == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]


def test_stream_include_usage(client, model, engine):
    ref = engine.generate(PROMPT, greedy(9, ignore_eos=True))
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    last = chunks[-1]
    assert last.usage is not None, last
    assert not last.choices
    assert last.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert last.usage.completion_tokens == 9
    assert last.usage.total_tokens == last.usage.prompt_tokens + 9
    assert all(c.usage is None for c in chunks[:-1])

    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    last = chunks[-1]
    assert last.usage is not None and not last.choices
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(engine.tokenizer(chat_prompt(engine, MESSAGES))["input_ids"])
    # Without include_usage no usage chunk.
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                                 temperature=0, stream=True))
    assert all(c.choices for c in chunks)


# ---- n, seed, stop, max_tokens ------------------------------------------------------------
def test_n_choices(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                    n=3, seed=5, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 3, [c.text for c in out.choices]
    assert out.usage.completion_tokens == 30
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                          temperature=1.0, n=3, seed=5, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert chat.usage.completion_tokens == 18


def test_n_stream_has_every_index(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                     n=3, seed=21, extra_body=IGNORE_EOS)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                            temperature=1.0, n=3, seed=21, stream=True,
                                            extra_body=IGNORE_EOS))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in full.choices}


def test_seed_reproducible_and_equals_engine(client, model, engine):
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(model=model, prompt=PROMPT, extra_body=IGNORE_EOS, **params)
    b = client.completions.create(model=model, prompt=PROMPT, extra_body=IGNORE_EOS, **params)
    assert a.choices[0].text == b.choices[0].text
    other = client.completions.create(model=model, prompt=PROMPT, extra_body=IGNORE_EOS,
                                      **dict(params, seed=99))
    assert other.choices[0].text != a.choices[0].text
    ref = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                                   "seed": 1234, "ignore_eos": True})
    assert a.choices[0].text == ref["text"]


def test_stop_string(client, model, engine):
    full = engine.generate(PROMPT, greedy(30, ignore_eos=True))["text"]
    assert len(full) >= 12, full
    stop = full[5:8]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0,
                                    stop=[stop, "\x00never"], extra_body=IGNORE_EOS)
    assert out.choices[0].text == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    chat_full = engine.generate(chat_prompt(engine, MESSAGES), greedy(30, ignore_eos=True))["text"]
    assert len(chat_full) >= 12, chat_full
    stop = chat_full[4:6]
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30,
                                         temperature=0, stop=stop, extra_body=IGNORE_EOS)
    assert out.choices[0].message.content == chat_full[:chat_full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    # Streaming: the stop string is not leaked in the deltas either.
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30,
                                                 temperature=0, stop=stop, stream=True,
                                                 extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat_full[:chat_full.find(stop)]


def test_max_tokens_gives_length(client, model):
    for n in (1, 5, 13):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                        extra_body=IGNORE_EOS)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == n


# ---- logprobs, echo ---------------------------------------------------------------------------
def test_chat_logprobs(client, model, engine):
    ref = engine.generate(chat_prompt(engine, MESSAGES), greedy(8, ignore_eos=True),
                          return_logprob=True, top_logprobs_num=2)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body=IGNORE_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    for entry, ref_lp in zip(content, ref_lps):
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0.0
        assert math.isclose(entry.logprob, ref_lp, abs_tol=1e-3), (entry.logprob, ref_lp)
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # Without logprobs: none.
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, model, engine):
    ref = engine.generate(PROMPT, greedy(6, ignore_eos=True), return_logprob=True, top_logprobs_num=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=2, extra_body=IGNORE_EOS)
    lp = out.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    if all(t >= 6 for t in ref["output_ids"]):  # no special token to be skipped in the text
        assert "".join(lp.tokens) == out.choices[0].text
    ref_lps = [x for x, _, _ in ref["meta_info"]["output_token_logprobs"]]
    for got, want in zip(lp.token_logprobs, ref_lps):
        assert math.isclose(got, want, abs_tol=1e-3), (got, want)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        # Keyed by token text: two ids decoding alike may collapse into one entry.
        assert 1 <= len(top) <= 2, top
        assert math.isclose(max(top.values()), chosen, abs_tol=1e-4)


def test_completion_logprobs_text_offset(client, model):
    """OpenAI: `text_offset[i]` is where token i starts in the choice's text."""
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                    extra_body=IGNORE_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.text_offset) == len(lp.tokens) == 5, lp
    assert lp.text_offset == sorted(lp.text_offset)
    pos = 0
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert off == pos, (lp.tokens, lp.text_offset)
        pos += len(tok)


def test_chat_stream_logprobs(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                                 temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True, extra_body=IGNORE_EOS))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 6
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_echo(client, model, engine):
    ref = engine.generate(PROMPT, greedy(8))
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + ref["text"]
    assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]


# ---- penalties and SGLang extras ---------------------------------------------------------------
def test_penalties_equal_engine(client, model, engine):
    ref = engine.generate(PROMPT, greedy(16, presence_penalty=0.8, frequency_penalty=0.5))
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                    presence_penalty=0.8, frequency_penalty=0.5)
    assert out.choices[0].text == ref["text"]
    plain = engine.generate(PROMPT, greedy(16))
    assert plain["text"] != ref["text"], "penalties should change this output (test premise)"


def test_sglang_extras_equal_engine(client, model, engine):
    base = engine.generate(PROMPT, greedy(20, ignore_eos=True))
    stop_tok = base["output_ids"][6]
    params = dict(temperature=0.0, max_new_tokens=20, top_k=5, min_p=0.01, repetition_penalty=1.3,
                  stop_token_ids=[stop_tok], min_new_tokens=2, ignore_eos=True, no_stop_trim=False,
                  skip_special_tokens=True)
    ref = engine.generate(PROMPT, params)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0,
        extra_body=dict(top_k=5, min_p=0.01, repetition_penalty=1.3, stop_token_ids=[stop_tok],
                        min_tokens=2, ignore_eos=True, no_stop_trim=False, skip_special_tokens=True))
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]


def test_no_stop_trim_keeps_stop(client, model, engine):
    full = engine.generate(PROMPT, greedy(30, ignore_eos=True))["text"]
    stop = full[5:8]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0,
                                    stop=stop, extra_body=dict(ignore_eos=True, no_stop_trim=True))
    assert out.choices[0].text.endswith(stop)
    assert out.choices[0].text.startswith(full[:full.find(stop)])


# ---- prefix cache -----------------------------------------------------------------------------------
def test_cached_tokens_on_repeat(client, model):
    prompt = "A prompt long enough to be worth caching, repeated twice. " * 3
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 < details.cached_tokens <= second.usage.prompt_tokens
    # Chat too.
    msgs = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_no_leak_after_module(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    server.assert_pools_full()


def test_explicit_nulls_mean_defaults(server, model):
    """OpenAI's optional fields are nullable; many clients send `null` for unset ones."""
    nulls = {"top_p": None, "n": None, "stop": None, "presence_penalty": None,
             "frequency_penalty": None, "seed": None, "stream": None, "stream_options": None,
             "user": None, "logit_bias": None}
    base = {"model": model, "max_tokens": 5, "temperature": 0}
    r = server.client.post("/v1/completions", json={**base, "prompt": PROMPT, **nulls, "logprobs": None,
                                                    "echo": None, "suffix": None})
    assert r.status_code == 200, r.text
    want = server.client.post("/v1/completions", json={**base, "prompt": PROMPT}).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    r = server.client.post("/v1/chat/completions", json={**base, "messages": MESSAGES, **nulls,
                                                         "logprobs": None, "top_logprobs": None,
                                                         "tools": None, "response_format": None,
                                                         "max_completion_tokens": None})
    assert r.status_code == 200, r.text
    r = server.client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                                         "max_tokens": 3, "temperature": None})
    assert r.status_code == 200, r.text
