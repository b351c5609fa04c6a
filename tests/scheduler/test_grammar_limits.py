"""Issue 39, grammar work bounded: size and depth limits before any parse, schemas parsed
once (the HTTP process's EBNF is what the scheduler compiles), compile deadlines, compiles
nobody waits for stopped, caches keyed by digest and bounded in bytes.

Process-level replays (a decode server's streams while a grammar compiles, a client that
leaves, the deadline over HTTP) are in tests/security/test_grammar_isolation.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import xgrammar as xgr

from pdserve.assets import path as asset_path
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar import (COMPILING, FAILED, READY, ByteLRU, GrammarBackend, GrammarLimits, GrammarState,
                                       canonical_ebnf, check_constraint, check_limits, digest, nesting_depth)
from pdserve.server import grammar_check
from pdserve.server.grammar_check import GrammarChecker
from pdserve.server.openai_requests import response_format_schema
from pdserve.tokenizer import load_tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.fast


def nested_schema(levels: int) -> str:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(asset_path("demo"))


def backend(tokenizer: Any, **limits: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer, 157, [tokenizer.eos_token_id], GrammarLimits(**limits))


# ---- limits before parsing ------------------------------------------------------------------
def test_nesting_depth_counts_structure_not_text():
    assert nesting_depth("json_schema", nested_schema(10)) == 21  # each level: an object and its properties
    # Brackets inside JSON strings, regex classes / escapes and EBNF strings / classes do not nest.
    assert nesting_depth("json_schema", json.dumps({"enum": ["[[[[", "{{{{", "\\\"[["]})) == 2
    assert nesting_depth("regex", r"((a)|[(((]|\(\()") == 2
    assert nesting_depth("ebnf", 'root ::= ("(((" | [(] (x))\nx ::= "a" # (((') == 2


@pytest.mark.parametrize("kind, text, flag", [
    ("json_schema", nested_schema(40), "--grammar-max-depth"),      # 81 levels
    ("regex", "(" * 70 + "a" + ")" * 70, "--grammar-max-depth"),
    ("ebnf", "root ::= " + "(" * 70 + '"a"' + ")" * 70, "--grammar-max-depth"),
    ("json_schema", json.dumps({"enum": ["x" * 1000] * 1100}), "--grammar-max-bytes"),  # 1.1 MB
    ("regex", "é" * 600_000, "--grammar-max-bytes"),  # 600k characters, 1.2 MB of UTF-8
])
def test_limits_refuse_before_parsing_naming_the_flag(kind, text, flag):
    checker = GrammarChecker()  # the HTTP process's checks, default limits
    try:
        with pytest.raises(ValueError) as err:
            checker.build(build_params, {kind: text})
        assert str(err.value).startswith(f"{kind}: ") and flag in str(err.value), str(err.value)
        assert checker.stats()["parsed"] == 0 and checker.stats()["parsing"] == 0  # refused before any parse
    finally:
        checker.close()
    check_limits(kind, text, GrammarLimits(max_bytes=4 << 20, max_depth=200))  # within larger limits


def test_canonical_ebnf_is_the_same_language():
    """The scheduler compiles the EBNF the HTTP process parsed: same strings accepted."""
    cases = [
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"},
                                                                      "s": {"type": "string", "maxLength": 3}},
                                    "required": ["a", "s"], "additionalProperties": False}),
         ['{"a": 5, "s": "ab"}'], ['{"a": 5, "s": "abcd"}', '{"a":5,"s":"ab"}', '{"a": 5, "s": "a\tb"}']),
        ("regex", r"(yes|no)-[0-9]{2,3}", ["yes-12", "no-123"], ["yes-1", "maybe-12"]),
        ("ebnf", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*', ["(1+2*3)"], ["(1+)", "1+2"]),
    ]
    for kind, text, good, bad in cases:
        again = xgr.Grammar.from_ebnf(canonical_ebnf(kind, text))
        for s in good:
            assert xgr.testing._is_grammar_accept_string(again, s), (kind, s)
        for s in bad:
            assert not xgr.testing._is_grammar_accept_string(again, s), (kind, s)


def test_byte_lru_stays_within_its_bound():
    cache: ByteLRU[str] = ByteLRU(100)
    for i in range(10):
        assert cache.put(bytes([i]), "v", 30)
        assert cache.bytes <= 100
    assert len(cache) == 3 and cache.get(bytes([9])) == "v" and cache.get(bytes([0])) is None
    assert not cache.put(b"big", "v", 101) and cache.get(b"big") is None
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


# ---- the scheduler's backend ------------------------------------------------------------------
def test_compiled_cache_is_keyed_by_digest_and_bounded(tokenizer):
    b = backend(tokenizer, cache_bytes=64 << 10)
    try:
        texts = [json.dumps({"enum": [f"v{k}-{i:05d}" for i in range(300)]}) for k in range(8)]
        sizes = []
        for text in texts:
            compiled = b.compile("json_schema", text).result(timeout=120)
            sizes.append(compiled.memory_size_bytes)
            stats = b.stats()
            assert stats["cache_bytes"] <= 64 << 10, stats
        assert sum(sizes) > 64 << 10  # (the bound was reached)
        assert 0 < b.stats()["cache_entries"] < len(texts)
        assert all(isinstance(k, bytes) and len(k) == 32 for k in b._cache._items)  # digests, never texts
        hit = b.compile("json_schema", texts[-1])
        assert hit.done()  # the most recent one is served from the cache
        b.flush()
        assert b.stats()["cache_bytes"] == 0 and b.stats()["cache_entries"] == 0
    finally:
        b.close()


def slow_inline(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Inline compiles wait for the returned event before they start."""
    go = threading.Event()
    real = GrammarBackend._compile_inline

    def slow(self: GrammarBackend, job: Any) -> None:
        go.wait(60)
        real(self, job)
    monkeypatch.setattr(GrammarBackend, "_compile_inline", slow)
    return go


def test_deadline_fails_the_request_naming_the_flag_and_stops_the_compile(tokenizer, monkeypatch):
    go = slow_inline(monkeypatch)
    b = backend(tokenizer, timeout=0.3)
    try:
        state = b.state(SamplingParams(regex="[a-z]{4}"))
        assert state is not None and state.local_code() == COMPILING and state.error is None
        wait_until(lambda: state.local_code() == FAILED, 10, step=0.05, what="the deadline")
        state.settle()
        assert state.ready and "0.3 s" in state.error and "--grammar-compile-timeout" in state.error
        with pytest.raises(RuntimeError):  # never blocks on a compile
            state.matcher
        go.set()
        wait_until(lambda: b.stats()["timed_out"] == 1, 10, step=0.05, what="the compile dropped")
        assert b.stats()["compiled"] == 0 and b.stats()["compiling"] == 0
        # Asked again later, it compiles afresh (a dropped compile is not cached as failed).
        again = b.state(SamplingParams(regex="[a-z]{4}"))
        wait_until(lambda: again.local_code() == READY, 30, step=0.05, what="a fresh compile")
    finally:
        b.close()


def test_a_compile_nobody_waits_for_is_dropped_but_a_shared_one_is_not(tokenizer, monkeypatch):
    go = slow_inline(monkeypatch)
    b = backend(tokenizer)
    try:
        left = b.state(SamplingParams(regex="[a-c]{5}"))
        shared = [b.state(SamplingParams(regex="[d-f]{5}")) for _ in range(2)]
        assert shared[0].compiled is shared[1].compiled  # one compile for both
        left.release()
        shared[0].release()
        go.set()
        wait_until(lambda: shared[1].local_code() == READY, 30, step=0.05, what="the shared compile")
        wait_until(lambda: b.stats()["cancelled"] == 1, 10, step=0.05, what="the abandoned compile dropped")
        assert left.compiled.cancelled() and b.stats()["compiled"] == 1
    finally:
        b.close()


def test_settle_agreement_is_final_and_a_rank_failure_wins():
    from concurrent.futures import Future

    done: Future[Any] = Future()
    done.set_result(object())
    state = GrammarState(done, kind="regex", timeout=5)
    state.settle(COMPILING)  # another rank still compiles: not ready here either
    assert not state.ready
    state.settle(FAILED)     # failed on another rank
    assert state.ready and "another tensor-parallel rank" in state.error
    state.settle(READY)      # final: no change
    assert state.error is not None


def test_engine_deadline_ends_that_request_alone(make_engine, monkeypatch):
    go = slow_inline(monkeypatch)
    engine = make_engine(asset_path("demo"), grammar_compile_timeout=0.5)
    try:
        outs = engine.generate(["Answer:", "Hello"], [{"regex": "[0-9]{3}", "max_new_tokens": 8},
                                                      {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}])
    finally:
        go.set()
    slow, plain = outs
    assert slow["meta_info"]["finish_reason"]["type"] == "abort"
    assert "--grammar-compile-timeout" in slow["meta_info"]["finish_reason"]["message"]
    assert plain["meta_info"]["finish_reason"]["type"] == "length" and len(plain["output_ids"]) == 6
    # The request ended (released its grammar) past its deadline: the compile is dropped as timed out.
    grammars = engine._scheduler.grammars
    wait_until(lambda: grammars.stats()["timed_out"] == 1, 10, step=0.05, what=lambda: str(grammars.stats()))
    assert grammars.stats()["compiled"] == 0


# ---- the HTTP process's checker ----------------------------------------------------------------
def build_params(params: dict[str, Any]) -> SamplingParams:
    p = SamplingParams.from_dict(params)
    check_constraint(p)
    return p


def test_http_checks_defer_the_parse_and_cache_by_digest():
    checker = GrammarChecker(GrammarLimits(cache_bytes=1 << 20))
    try:
        # Limits are checked at once, on the building thread, naming the flag.
        with pytest.raises(ValueError, match="--grammar-max-depth"):
            checker.build(build_params, {"json_schema": nested_schema(40)})
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
        p, pending = checker.build(build_params, {"json_schema": schema})
        assert list(pending.values()) == [("json_schema", schema)]
        assert asyncio.run(checker.resolve(pending)) == {}
        _, pending = checker.build(build_params, {"json_schema": schema})
        assert pending == {}  # known now: parsed once
        assert checker.parsed == 1 and list(checker._cache._items) == [digest("json_schema", schema)]
        # The scheduler gets the parsed grammar, not the schema.
        from pdserve.scheduler.messages import NewRequest

        sent = checker.to_scheduler(NewRequest("r", (1, 2), p, (7,)))
        assert sent.params.json_schema is None and sent.params.ebnf == canonical_ebnf("json_schema", schema)
        assert sent.params.max_new_tokens == p.max_new_tokens
        checker.flush()
        assert checker.stats()["cache_entries"] == 0
    finally:
        checker.close()


def test_http_invalid_schema_is_named_as_the_caller_names_it():
    checker = GrammarChecker()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
        _, pending = checker.build(response_format_schema, fmt, None)
        failures = asyncio.run(checker.resolve(pending))
        assert len(failures) == 1
        with pytest.raises(ValueError) as err:
            checker.build(response_format_schema, fmt, None, failures=failures)
        assert str(err.value).startswith("response_format.json_schema: invalid json schema"), str(err.value)
        # Cached: the next build refuses it at once, without a parse.
        with pytest.raises(ValueError, match="^json_schema: invalid json schema"):
            checker.build(build_params, {"json_schema": json.dumps({"type": "objec"})})
        assert checker.parsed == 1
    finally:
        checker.close()


def test_http_parse_deadline_names_the_flag_and_drops_queued_work(monkeypatch):
    go = threading.Event()
    started: list[str] = []
    real = grammar_check.canonical_ebnf

    def slow(kind: str, text: str) -> str:
        started.append(text)
        go.wait(60)
        return real(kind, text)
    monkeypatch.setattr(grammar_check, "canonical_ebnf", slow)
    checker = GrammarChecker(GrammarLimits(timeout=0.3))
    try:
        _, first = checker.build(build_params, {"regex": "a+"})
        _, second = checker.build(build_params, {"regex": "b+"})

        async def both() -> list[dict[bytes, str]]:
            return await asyncio.gather(checker.resolve(first), checker.resolve(second))
        t0 = time.monotonic()
        failures = asyncio.run(both())
        assert time.monotonic() - t0 < 5
        for f in failures:
            (message,) = f.values()
            assert "--grammar-compile-timeout" in message and "0.3 s" in message
        go.set()
        wait_until(lambda: checker.stats()["parsing"] == 0, 10, step=0.05, what="parses settled")
        assert started == ["a+"]  # the queued parse nobody waited for any more never ran
    finally:
        go.set()
        checker.close()
