"""SamplingParams: SGLang field names, normalisation, validation naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast


def test_defaults():
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert p.temperature == 1.0
    assert p.top_k == -1
    assert p.stop == () and p.stop_token_ids == ()
    assert p.n == 1 and p.seed is None
    assert not p.greedy
    assert not p.needs_penalties
    assert SamplingParams.from_dict(None) == p
    assert SamplingParams.from_dict({}) == p


def test_from_dict_sglang_names():
    p = SamplingParams.from_dict({
        "max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "stop": ["\n", "END"], "stop_token_ids": [2, 3], "ignore_eos": True, "n": 3, "seed": 42,
        "skip_special_tokens": False, "no_stop_trim": True,
    })
    assert p.max_new_tokens == 7
    assert p.min_new_tokens == 2
    assert p.temperature == 0.7
    assert p.top_p == 0.9
    assert p.top_k == 20
    assert p.min_p == 0.05
    assert p.repetition_penalty == 1.1
    assert p.frequency_penalty == 0.5
    assert p.presence_penalty == -0.5
    assert p.stop == ("\n", "END")
    assert p.stop_token_ids == (2, 3)
    assert p.ignore_eos is True
    assert p.n == 3
    assert p.seed == 42
    assert p.skip_special_tokens is False
    assert p.no_stop_trim is True
    assert p.needs_penalties
    assert not p.greedy
    hash(p)  # tuples everywhere: hashable


def test_from_dict_passthrough_and_type_check():
    p = SamplingParams(max_new_tokens=3)
    assert SamplingParams.from_dict(p) is p
    with pytest.raises(ValueError, match="^sampling_params"):
        SamplingParams.from_dict([("max_new_tokens", 3)])  # type: ignore[arg-type]


def test_none_values_mean_default():
    p = SamplingParams.from_dict({"temperature": None, "top_p": None, "seed": None, "max_new_tokens": 5})
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.seed is None and p.max_new_tokens == 5


def test_single_stop_string_becomes_tuple():
    p = SamplingParams.from_dict({"stop": "###"})
    assert p.stop == ("###",)
    assert isinstance(p.stop, tuple)
    assert SamplingParams(stop="x").stop == ("x",)
    assert isinstance(SamplingParams.from_dict({"stop_token_ids": [5]}).stop_token_ids, tuple)


@pytest.mark.parametrize("params, greedy", [
    ({"temperature": 0}, True),
    ({"temperature": 0.0}, True),
    ({"top_k": 1}, True),
    ({"temperature": 0.5}, False),
    ({"top_k": 2}, False),
])
def test_greedy_property(params, greedy):
    assert SamplingParams.from_dict(params).greedy is greedy


def test_unknown_key_raises_naming_it():
    with pytest.raises(ValueError) as exc:
        SamplingParams.from_dict({"max_new_tokens": 4, "max_tokens_typo": 4})
    assert "max_tokens_typo" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        SamplingParams.from_dict({"zzz": 1, "aaa": 2})
    assert "zzz" in str(exc.value) and "aaa" in str(exc.value)


@pytest.mark.parametrize("field_name, params", [
    ("max_new_tokens", {"max_new_tokens": -1}),
    ("max_new_tokens", {"max_new_tokens": 1.5}),
    ("max_new_tokens", {"max_new_tokens": True}),
    ("min_new_tokens", {"min_new_tokens": 5, "max_new_tokens": 4}),
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 2}),
    ("min_p", {"min_p": -0.1}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("presence_penalty", {"presence_penalty": -3}),
    ("n", {"n": 0}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": 1.0}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("skip_special_tokens", {"skip_special_tokens": 0}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": {"a": 1}}),
    ("stop_token_ids", {"stop_token_ids": 5}),
    ("stop_token_ids", {"stop_token_ids": "5"}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
])
def test_invalid_value_message_starts_with_field(field_name, params):
    with pytest.raises(ValueError) as exc:
        SamplingParams.from_dict(params)
    assert str(exc.value).startswith(field_name + ":"), str(exc.value)


@pytest.mark.parametrize("params", [
    {"max_new_tokens": 0},
    {"min_new_tokens": 4, "max_new_tokens": 4},
    {"temperature": 0}, {"temperature": 2},
    {"top_p": 1.0}, {"top_p": 0.01},
    {"top_k": -1}, {"top_k": 1},
    {"min_p": 0.0}, {"min_p": 1.0},
    {"repetition_penalty": 2.0},
    {"frequency_penalty": -2.0}, {"frequency_penalty": 2},
    {"seed": 0}, {"seed": 2**63 - 1},
])
def test_boundary_values_accepted(params):
    p = SamplingParams.from_dict(params)
    for k, v in params.items():
        assert getattr(p, k) == v


def test_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
