"""The embedded demo model: loadable by transformers and pdserve, and the default model."""

from __future__ import annotations

import pytest


def test_asset_paths():
    from pdserve import assets

    assert (assets.path("demo") / "config.json").is_file()
    with pytest.raises(ValueError, match="nope"):
        assets.path("nope")


def test_demo_loads_in_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve import assets

    d = assets.path("demo")
    model = AutoModelForCausalLM.from_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|assistant|>")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA


def test_engine_defaults_to_demo_and_copies(make_engine):
    from pdserve import assets

    engine = make_engine(assets.path("demo"))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Repeat: abc123xyz"}],
                                                  add_generation_prompt=True, tokenize=False)
    out = engine.generate(input_ids=engine.tokenizer(prompt, add_special_tokens=False)["input_ids"],
                          sampling_params={"max_new_tokens": 40, "temperature": 0})
    assert out["text"] == "abc123xyz"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
