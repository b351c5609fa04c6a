"""Shared fixtures: tiny random checkpoints built once per session, the
transformers reference, and the no-leak check every engine test ends with."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from pdserve.testing import build_random_model

# Without a GPU, pdserve's Triton kernels run under Triton's interpreter (numpy on
# CPU tensors). It is read when a kernel is decorated, so set it before any import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ---- the fast tier (`pytest -m fast`) ------------------------------------------------
# Tests marked `fast` start no processes and launch no Triton-interpreter kernels. That
# promise is enforced: while such a test (its fixtures included) runs, each way of starting
# a process, and a Triton kernel launch under TRITON_INTERPRET, raises.
FAST_TIER_PROMISE = "the fast tier (-m fast) starts no processes and runs no Triton-interpreter kernels"


def fast_tier_refusal(nodeid: str, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{nodeid} is marked fast but called {what}: {FAST_TIER_PROMISE}; "
                             "drop its `fast` mark or keep it in-process")
    return refuse


def install_fast_tier_guard(mp: pytest.MonkeyPatch, nodeid: str) -> None:
    """Make starting a process (or launching an interpreted Triton kernel) raise for ``nodeid``."""
    import multiprocessing.process
    import subprocess

    mp.setattr(subprocess.Popen, "__init__", fast_tier_refusal(nodeid, "subprocess.Popen"))
    mp.setattr(multiprocessing.process.BaseProcess, "start",
               fast_tier_refusal(nodeid, "multiprocessing.Process.start"))
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp",
                 "spawnv", "spawnve", "spawnvp", "spawnvpe"):
        if hasattr(os, name):
            mp.setattr(os, name, fast_tier_refusal(nodeid, f"os.{name}"))
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    mp.setattr(InterpretedFunction, "run", fast_tier_refusal(nodeid, "a Triton kernel (TRITON_INTERPRET)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _fast_tier_guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _fast_tier_guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _fast_tier_guarded(item)


def _fast_tier_guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("fast") is None:
        yield
        return
    mp = pytest.MonkeyPatch()
    install_fast_tier_guard(mp, item.nodeid)
    try:
        yield
    finally:
        mp.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report carries the log tails of the server / router processes running then."""
    from tests import process_logs

    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for label, tail in process_logs.tails():
            report.sections.append((f"log of {label} (last {process_logs.TAIL_CHARS} chars)", tail))


MODEL_SPECS: dict[str, dict[str, Any]] = {
    "llama_gqa": dict(arch="llama", num_heads=4, num_kv_heads=2),
    # The same shape with room for thousands of tokens: a request that decodes for seconds.
    "llama_long_context": dict(arch="llama", num_heads=4, num_kv_heads=2, max_position_embeddings=8192),
    "llama_tied": dict(arch="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(arch="llama", num_heads=4, num_kv_heads=1,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
    "qwen3": dict(arch="qwen3", num_heads=4, num_kv_heads=2),
    # Mixture of experts (tests/model/test_moe.py). Layer 1 dense (mlp_only_layers),
    # renormalised top-2 of 8.
    "qwen3_moe": dict(arch="qwen3_moe", num_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1]),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; raw (unnormalised) top-3 of 6.
    "qwen3_moe_step2": dict(arch="qwen3_moe", num_layers=2, num_experts=6, num_experts_per_tok=3,
                            moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=2),
    "mixtral": dict(arch="mixtral", num_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            spec = dict(MODEL_SPECS[name])
            arch = spec.pop("arch")
            built[name] = build_random_model(tmp_path_factory.mktemp(name), arch, **spec)
        return built[name]
    return get


@pytest.fixture(scope="session")
def llama_dir(model_dirs: Callable[[str], Path]) -> Path:
    return model_dirs("llama_gqa")


def assert_pools_full(engine: Any) -> None:
    """No KV page or request slot leaked: everything is free once the cache is dropped."""
    assert engine.flush_cache(), "engine still has work"
    state = engine.memory_state()
    assert state["kv_pages_free"] == state["kv_pages_total"], state
    assert state["req_slots_free"] == state["req_slots_total"], state


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Any]]:
    """Build engines; each is checked for leaks and shut down after the test."""
    from pdserve import Engine

    engines: list[Any] = []

    def make(model_dir: Path, **kwargs: Any) -> Any:
        kwargs.setdefault("max_total_tokens", 8192)
        engine = Engine(model_path=str(model_dir), **kwargs)
        engines.append(engine)
        return engine
    yield make
    try:
        for engine in engines:
            assert_pools_full(engine)
    finally:
        for engine in engines:
            engine.shutdown()


def random_prompts(n: int, lo: int, hi: int, vocab: int = 90, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids >= 6 skip the special tokens of the character tokenizer.
    return [[rng.randrange(6, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@torch.no_grad()
def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int
              ) -> list[tuple[list[int], list[float]]]:
    """transformers reference: greedy tokens and their logprobs, one prompt at a time,
    recomputing the whole sequence each step (no cache: the simplest correct thing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        seq = torch.tensor([ids])
        toks, lps = [], []
        for _ in range(max_new_tokens):
            logits = model(seq).logits[0, -1].float()
            t = int(logits.argmax())
            toks.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
        out.append((toks, lps))
    return out


GREEDY = {"temperature": 0.0, "ignore_eos": True}
