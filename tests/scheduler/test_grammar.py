"""Constrained decoding in the scheduler: outputs always match their JSON schema / regex /
EBNF grammar, with sampling, n > 1, penalties, stop strings, a random model and EAGLE;
grammars compile off the step; invalid grammars are refused naming the field."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from typing import Any

import jsonschema
import pytest

from pdserve.assets import path as asset_path
from pdserve.bench.grammar import object_schema
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar import GrammarBackend, check_constraint
from pdserve.testing import build_random_model

pytestmark = pytest.mark.fast

def assert_valid(out: dict[str, Any], schema: dict[str, Any]) -> None:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("grammar") / "m", "llama", num_layers=2)


def test_random_schemas_always_validate(make_engine, random_model):
    """Demo model and a random model, greedy and sampled with n = 3 and penalties."""
    rng = random.Random(0)
    schemas = [object_schema(rng) for _ in range(10)]
    for model in (asset_path("demo"), random_model):
        engine = make_engine(model)
        prompts = [f"Describe item {i} as JSON." for i in range(len(schemas))]
        greedy = engine.generate(prompts, [{"json_schema": json.dumps(s), "max_new_tokens": 200, "temperature": 0}
                                           for s in schemas])
        for out, schema in zip(greedy, schemas):
            assert_valid(out, schema)
        sampled = engine.generate(prompts[:4], [{"json_schema": json.dumps(s), "max_new_tokens": 200, "n": 3,
                                                 "temperature": 1.2, "seed": 11, "frequency_penalty": 0.5,
                                                 "repetition_penalty": 1.2} for s in schemas[:4]])
        assert len(sampled) == 12
        for j, out in enumerate(sampled):
            assert_valid(out, schemas[j // 3])
        # The same seed gives the same constrained tokens.
        again = engine.generate(prompts[0], {"json_schema": json.dumps(schemas[0]), "max_new_tokens": 200, "n": 3,
                                             "temperature": 1.2, "seed": 11, "frequency_penalty": 0.5,
                                             "repetition_penalty": 1.2})
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in sampled[:3]]
        state = engine.memory_state()
        assert state["req_slots_free"] == state["req_slots_total"]


def test_regex_and_ebnf_fully_match(make_engine):
    engine = make_engine(asset_path("demo"))
    pattern = r"(yes|no), [0-9]{2,3}( [a-z]{1,5})?\."
    outs = engine.generate(["Answer:"] * 2, [{"regex": pattern, "max_new_tokens": 40, "temperature": t, "seed": 3,
                                              "n": 2} for t in (0.0, 1.0)])
    for out in outs:
        assert re.fullmatch(pattern, out["text"]), out["text"]
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*'
    out = engine.generate("Compute:", {"ebnf": grammar, "max_new_tokens": 30, "temperature": 0})
    text = out["text"]
    finished = out["meta_info"]["finish_reason"]["type"]
    # Ended by the grammar (whole match) or by the budget (a prefix of one).
    assert re.fullmatch(r"\([0-9]+([+*][0-9]+)*\)", text) if finished == "stop" else \
        re.fullmatch(r"\([0-9]+([+*][0-9]+)*[+*]?", text), (text, finished)


def test_constraint_with_stop_string_and_ignore_eos(make_engine):
    engine = make_engine(asset_path("demo"))
    # A stop string inside the constrained text ends the output there (what stop asks for).
    out = engine.generate("Answer:", {"regex": "abc[0-9]{5}", "max_new_tokens": 20, "temperature": 0,
                                      "stop": ["c"]})
    assert out["text"] == "ab" and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "c"}
    # With ignore_eos the grammar still ends the output once it is complete.
    out = engine.generate("Answer:", {"regex": "(yes|no)", "max_new_tokens": 20, "temperature": 0,
                                      "ignore_eos": True})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_eagle_constrained_equals_plain(make_engine, algo):
    """The verify step masks every tree node by the grammar state along its path: greedy
    constrained output is the plain constrained output."""
    rng = random.Random(5)
    schemas = [object_schema(rng) for _ in range(4)]
    params = [{"json_schema": json.dumps(s), "max_new_tokens": 120, "temperature": 0} for s in schemas]
    prompts = [f"Item {i}:" for i in range(len(schemas))]
    plain = make_engine(asset_path("demo")).generate(prompts, params)
    draft = asset_path("demo-eagle" if algo == "EAGLE" else "demo-eagle3")
    spec = make_engine(asset_path("demo"), speculative_algorithm=algo, speculative_draft_model_path=str(draft))
    outs = spec.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    for out, schema in zip(outs, schemas):
        assert_valid(out, schema)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    regex = spec.generate("Answer:", {"regex": r"[a-c]{3}-[0-9]{4}", "max_new_tokens": 20, "temperature": 0})
    assert re.fullmatch(r"[a-c]{3}-[0-9]{4}", regex["text"])


def test_a_compiling_grammar_does_not_hold_the_batch(make_engine, monkeypatch):
    """While one request's grammar compiles, requests behind it run to the end."""
    engine = make_engine(asset_path("demo"))
    sched = engine._scheduler
    release = threading.Event()
    real = GrammarBackend._compile_inline

    def slow(self: GrammarBackend, job: Any) -> Any:
        release.wait(timeout=60)
        return real(self, job)

    monkeypatch.setattr(GrammarBackend, "_compile_inline", slow)
    from pdserve.scheduler.req import samples_from_message

    msgs = engine.builder.build([[10, 11, 12], [13, 14]],
                                [SamplingParams(regex="[0-9]{3}", max_new_tokens=8, temperature=0),
                                 SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)], False, 0)
    constrained, plain = (samples_from_message(m)[0] for m in msgs)
    sched.add(constrained)
    sched.add(plain)
    for _ in range(20):
        sched.step()
        if plain.finished:
            break
    assert plain.finished and len(plain.output_ids) == 4
    assert not constrained.finished and constrained.row is None  # still waiting, holding nothing
    release.set()
    deadline = time.monotonic() + 60
    while not constrained.finished and time.monotonic() < deadline:
        sched.step()
    text = engine.tokenizer.decode(constrained.output_ids, skip_special_tokens=True)
    assert re.fullmatch("[0-9]{3}", text), text


@pytest.mark.parametrize("params, field", [
    ({"json_schema": '{"type": "objec"}'}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"regex": "(ab"}, "regex"),
    ({"ebnf": 'rule ::= "a"'}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex, ebnf"),
    ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens"),
    ({"regex": 5}, "regex"),
])
def test_invalid_constraints_name_the_field(params, field):
    with pytest.raises(ValueError) as err:
        check_constraint(SamplingParams.from_dict(params))
    assert str(err.value).startswith(field + ":"), str(err.value)
