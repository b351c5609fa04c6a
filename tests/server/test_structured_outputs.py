"""Structured outputs over HTTP: OpenAI `response_format` (json_object, json_schema) and
SGLang's `json_schema` / `regex` / `ebnf`, colocated and through a 1P1D router with
EAGLE on the decode server; streamed answers equal the whole ones; bad grammars are 400s."""

from __future__ import annotations

import contextlib
import json
import random
import re
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from pdserve.assets import path as asset_path
from tests.router.conftest import RouterProcess
from pdserve.bench.grammar import object_schema
from tests.server.conftest import assert_openai_error, free_port, start_servers

FLAGS = ("--max-total-tokens", "16384", "--log-level", "warning")
SCHEMAS = [object_schema(random.Random(seed)) for seed in range(6)]


class Deployment:
    """A colocated server, and a prefill server + a decode server with EAGLE behind the router."""

    def __init__(self) -> None:
        demo = asset_path("demo")
        boot = free_port()
        eagle = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(asset_path("demo-eagle")))
        specs = {"colocated": (), "prefill": ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                              str(boot)),
                 "decode": ("--disaggregation-mode", "decode", *eagle)}
        self.servers = start_servers(demo, specs, *FLAGS)
        self.router = RouterProcess("--pd-disaggregation", "--prefill", self.servers["prefill"].url, str(boot),
                                    "--decode", self.servers["decode"].url)
        self.colocated = self.servers["colocated"]
        self.ref = openai.OpenAI(base_url=self.colocated.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.pd = openai.OpenAI(base_url=self.router.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.router.close()
        for s in self.servers.values():
            with contextlib.suppress(Exception):
                s.close()


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = Deployment()
    try:
        yield d
    finally:
        d.close()


def chat(client: openai.OpenAI, schema: dict[str, Any], **kw: Any) -> Any:
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe an item as JSON."}], max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}, **kw)


def test_response_format_json_schema_validates_colocated_and_1p1d(deployment):
    for schema in SCHEMAS:
        ref = chat(deployment.ref, schema, temperature=0)
        got = chat(deployment.pd, schema, temperature=0)
        # Greedy through the split (EAGLE on decode) is the colocated answer.
        assert got.choices[0].message.content == ref.choices[0].message.content
        jsonschema.validate(json.loads(got.choices[0].message.content), schema)
        assert got.choices[0].finish_reason == "stop"
    # n = 3 sampled, with penalties: every choice validates, on both deployments.
    for client in (deployment.ref, deployment.pd):
        out = chat(client, SCHEMAS[0], n=3, temperature=1.0, seed=7, frequency_penalty=0.5)
        assert len(out.choices) == 3
        for c in out.choices:
            jsonschema.validate(json.loads(c.message.content), SCHEMAS[0])


def test_streamed_constrained_answers_equal_whole_ones(deployment):
    for client in (deployment.ref, deployment.pd):
        whole = chat(client, SCHEMAS[1], n=3, temperature=1.0, seed=3)
        parts: dict[int, str] = {}
        for chunk in chat(client, SCHEMAS[1], n=3, temperature=1.0, seed=3, stream=True):
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
        assert [parts[i] for i in range(3)] == [c.message.content for c in whole.choices]
        for text in parts.values():
            jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_json_object_regex_and_ebnf(deployment):
    for client in (deployment.ref, deployment.pd):
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=120, temperature=0, response_format={"type": "json_object"})
        assert isinstance(json.loads(out.choices[0].message.content), dict)
        out = client.completions.create(model="default", prompt="Answer:", max_tokens=20, temperature=0.8, seed=1,
                                        n=2, extra_body={"regex": r"(yes|no)-[0-9]{3}"})
        assert all(re.fullmatch(r"(yes|no)-[0-9]{3}", c.text) for c in out.choices), [c.text for c in out.choices]
    body = {"text": "Compute:", "sampling_params": {"ebnf": 'root ::= "<" [a-c]{2,4} ">"', "max_new_tokens": 12,
                                                     "temperature": 0}}
    ref = deployment.colocated.client.post("/generate", json=body).json()
    got = deployment.router.client.post("/generate", json=body).json()
    assert re.fullmatch(r"<[a-c]{2,4}>", got["text"]) and got["output_ids"] == ref["output_ids"]


def test_invalid_grammars_are_400s_naming_the_field(deployment):
    for url in (deployment.colocated.url, deployment.router.url):
        client = deployment.colocated.client if url == deployment.colocated.url else deployment.router.client
        chat_body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
        cases = [
            ("/v1/chat/completions", dict(chat_body, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
             "response_format.json_schema"),
            ("/v1/chat/completions", dict(chat_body, response_format={"type": "xml"}), "response_format.type"),
            ("/v1/chat/completions", dict(chat_body, response_format={"type": "json_object"}, regex="a"),
             "regex"),
            ("/v1/completions", {"model": "default", "prompt": "x", "regex": "(ab"}, "regex"),
            ("/generate", {"text": "x", "sampling_params": {"ebnf": 'rule ::= "a"'}}, "ebnf"),
            ("/generate", {"text": "x", "sampling_params": {"json_schema": "{", "regex": "a"}}, "json_schema"),
        ]
        for path, body, field in cases:
            err = assert_openai_error(client.post(path, json=body))
            assert field in err["message"], (path, err)
    for s in deployment.servers.values():
        s.assert_pools_full()
