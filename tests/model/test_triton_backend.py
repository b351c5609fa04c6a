"""The triton attention backend inside the engine (under Triton's interpreter on
CPU), the decode graphs' static buffers and padding, and a decode step free of
host reads of device values."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from pdserve.config import ConfigError, ServerArgs
from pdserve.model import device_io
from pdserve.model.cuda_graph import bucket_for, capture_sizes
from pdserve.testing import build_random_draft, build_random_model
from tests.conftest import GREEDY, random_prompts

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs Triton's interpreter or a GPU"),
    # The interpreter's runtime loop bounds trip a numpy deprecation on every launch.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

PROMPTS = random_prompts(3, 20, 40, seed=21)  # longer than a 16-token page: the cache holds a page
NEW = 8


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    from pdserve import Engine

    with Engine(model_path=str(llama_dir), max_total_tokens=4096, attention_backend="torch_native") as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_engine_gives_torch_native_tokens(page_size, reference, make_engine, llama_dir):
    # Chunks smaller than the prompts: extends over a cached prefix; then a prefix-cache hit.
    engine = make_engine(llama_dir, attention_backend="triton", page_size=page_size, chunked_prefill_size=16,
                         max_total_tokens=4096)
    assert engine._scheduler.runner.backend.name == "triton"
    outs = engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert [o["output_ids"] for o in outs] == reference
    again = engine.generate(input_ids=PROMPTS[1], sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == reference[1]


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 5)], ids=["chain", "tree"])
def test_triton_verify_tree_masks_keep_speculative_output_plain(make_engine, tmp_path_factory, shape):
    # The target's tree verification runs the extend kernel with EAGLE's tree masks; the
    # draft's tree steps run the paged decode kernel over each prefix in place, merged
    # with the branch's own slots: the same trees, so the same acceptance as torch_native.
    target = build_random_model(tmp_path_factory.mktemp("tri_t"), "llama", num_layers=2, num_heads=4,
                                num_kv_heads=2, hidden_size=64)
    draft = build_random_draft(target, tmp_path_factory.mktemp("tri_d") / "e", "EAGLE", seed=1)
    params = dict(GREEDY, max_new_tokens=10)
    plain = make_engine(target, attention_backend="torch_native").generate(input_ids=PROMPTS[:2],
                                                                           sampling_params=params)
    eagle = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                 speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
                 speculative_num_draft_tokens=shape[2])
    spec = make_engine(target, attention_backend="triton", **eagle)
    assert spec._scheduler.spec.backend.name == "triton"
    outs = spec.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    native = make_engine(target, attention_backend="torch_native", **eagle).generate(input_ids=PROMPTS[:2],
                                                                                      sampling_params=params)
    assert ([o["meta_info"]["spec_accepted_drafts"] for o in outs]
            == [o["meta_info"]["spec_accepted_drafts"] for o in native])


def test_refusals():
    with pytest.raises(ConfigError, match="--enable-cuda-graph: CUDA graphs need a CUDA device"):
        ServerArgs(enable_cuda_graph=True, device="cpu")
    # --disable-cuda-graph (SGLang's) wins, so the pair is accepted on any device.
    assert not ServerArgs(enable_cuda_graph=True, disable_cuda_graph=True, device="cpu").use_cuda_graph()
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0)
    assert ServerArgs(device="cpu").resolved_attention_backend() == "torch_native"


def test_tp_on_cuda_and_wide_heads_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--tp-size: tensor parallelism on CUDA is refused"):
        ServerArgs(device="cuda", tp_size=2)
    assert ServerArgs(device="cuda").resolved_attention_backend() == "triton"
    # auto on CUDA without triton installed falls back to torch_native (triton named explicitly is refused).
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton"
                        else real_find_spec(name, *a))
    assert ServerArgs(device="cuda").resolved_attention_backend() == "torch_native"
    with pytest.raises(ConfigError, match="--attention-backend: triton is not installed"):
        ServerArgs(device="cuda", attention_backend="triton")
    from pdserve.model.triton_backend import TritonAttention
    with pytest.raises(ValueError, match="head_dim <= 256"):
        TritonAttention(None, 4, 2, 512)  # type: ignore[arg-type]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="--attention-backend: triton needs a CUDA device"):
        ServerArgs(attention_backend="triton", device="cpu")


# ---- decode graphs: sizes, padding, static buffers ---------------------------------------

def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(160)[-3:] == [144, 152, 160]
    sizes = capture_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_decode_graph_buffers_pad_with_the_padding_row(make_engine, llama_dir):
    engine = make_engine(llama_dir, attention_backend="triton", max_total_tokens=4096)
    runner = engine._scheduler.runner
    table = engine._scheduler.kv.req_table
    runner.enable_decode_graphs(max_bs=4, capture=False)
    graphs = runner.decode_graphs
    assert graphs.padding_row == table.padding_row == table.num_rows
    assert bool((table.table[table.padding_row] == 0).all())
    from pdserve.model.attention import RowLayout
    layout = RowLayout.upload([3, 1, 0], [5, 9, 2], [1, 1, 1], runner.device)
    size = graphs.load(torch.tensor([11, 12, 13]), layout)
    assert size == 4
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert graphs.rows[:4].tolist() == [3, 1, 0, table.padding_row]
    assert graphs.prefix_lens[:4].tolist() == [5, 9, 2, 0]
    # Padding that a real row of an earlier batch overwrote is restored.
    graphs.rows[3] = 1
    assert graphs.load(torch.tensor([7, 8, 9]), RowLayout.upload([2, 4, 6], [4, 4, 4], [1, 1, 1],
                                                                 runner.device)) == 4
    assert graphs.rows[:4].tolist() == [2, 4, 6, table.padding_row]
    assert graphs.load(torch.tensor([7]), RowLayout.upload([2], [4], [1], runner.device)) == 1
    assert not graphs.fits(5)


def test_static_buffer_decode_gives_the_eager_tokens(reference, make_engine, llama_dir):
    # Batches of 3 and 2 are padded to 4 and 2; the padding rows write only slot 0.
    engine = make_engine(llama_dir, attention_backend="triton", max_total_tokens=4096)
    engine._scheduler.runner.enable_decode_graphs(max_bs=4, capture=False)
    runs = []
    real = engine._scheduler.runner.decode_graphs.run

    def counting(*args: Any) -> torch.Tensor:
        runs.append(args[1].batch_size)
        return real(*args)
    engine._scheduler.runner.decode_graphs.run = counting
    outs = engine.generate(input_ids=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=NEW))
    assert [o["output_ids"] for o in outs] == reference
    assert 3 in runs


# ---- a decode step reads nothing back but the sampled tokens ------------------------------

_READS = ("item", "tolist", "__bool__", "__int__", "__float__")
HOST_BOOKKEEPING = os.path.join("pdserve", "scheduler", "memory.py")


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[list[str]]:
    """Every Tensor -> Python read raises, except inside device_io.fetch (the step's one read)."""
    allowed = [0]
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    fetched: list[str] = []

    def guard(name: str) -> Any:
        real = saved[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # The page allocator's refcounts are host tensors by design (its reads never
            # wait for the device); everything else must go through fetch.
            host_bookkeeping = sys._getframe(1).f_code.co_filename.endswith(HOST_BOOKKEEPING)
            if not allowed[0] and not host_bookkeeping:
                raise AssertionError(f"Tensor.{name} in a decode step")
            return real(self, *args, **kwargs)
        return read

    real_fetch = device_io.fetch

    def fetch(x: torch.Tensor) -> list:
        allowed[0] += 1
        try:
            fetched.append(str(tuple(x.shape)))
            return real_fetch(x)
        finally:
            allowed[0] -= 1

    for name in _READS:
        setattr(torch.Tensor, name, guard(name))
    device_io.fetch = fetch
    try:
        yield fetched
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        device_io.fetch = real_fetch


def count_reads_of_steady_steps(engine: Any, params: list[dict[str, Any]], steps: int) -> list[int]:
    """Run a mixed batch (one request per ``params``) to its steady decode, then count
    the device reads of each of ``steps`` steps (any read but ``fetch`` raises); the
    requests are aborted afterwards."""
    from pdserve.scheduler.req import samples_from_message

    sched = engine._scheduler
    b = engine.builder
    messages = b.build(list(PROMPTS), b.sampling_params(params, len(params)), True, 3)
    for msg in messages:
        sched.add(samples_from_message(msg)[0])
    while sched.waiting or sched.chunked is not None:
        sched.step()
    assert len(sched.running) == len(params)
    counts = []
    for _ in range(steps):
        with forbid_host_reads() as fetched:
            out = sched.step()
        assert len(out.advanced) == len(params) and not out.finished
        counts.append(len(fetched))
    for msg in messages:
        sched.abort(msg.rid)
    sched.step()
    return counts


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_decode_step_reads_only_the_sampled_tokens(backend, make_engine, llama_dir):
    # torch_native's CPU decode mirror is a CPU-only path (it reads lengths back).
    engine = make_engine(llama_dir, attention_backend=backend, disable_decode_kv_mirror=True,
                         max_total_tokens=4096, page_size=4)
    params = [dict(GREEDY, max_new_tokens=40),
              dict(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_new_tokens=40, ignore_eos=True),
              dict(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2, min_new_tokens=30,
                   max_new_tokens=40)]
    # page size 4: some steps take a new page
    assert count_reads_of_steady_steps(engine, params, 6) == [1] * 6


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("grammar", [False, True], ids=["batched", "views"])
def test_speculative_round_reads(algo, grammar, make_engine, tmp_path):
    """An EAGLE round (draft steps, verify, draws with penalties and min-token bans,
    accept, compaction, page trimming, draft extend) reads the device once: the
    accepted paths' draws. A batch with a constrained request (its grammar's state
    along a path is a host matcher's) reads twice: the tree, then the packed draws.
    No per-request read either way."""
    target = build_random_model(tmp_path / "t", "llama", num_layers=2)
    draft = build_random_draft(target, tmp_path / "d", algo)
    engine = make_engine(target, disable_decode_kv_mirror=True, max_total_tokens=4096, page_size=4,
                         speculative_algorithm=algo, speculative_draft_model_path=str(draft),
                         speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    params = [dict(GREEDY, max_new_tokens=60),
              dict(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_new_tokens=60, ignore_eos=True),
              dict(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2, min_new_tokens=50, seed=9,
                   max_new_tokens=60)]
    if grammar:
        params[1].update(regex="[a-z ]{200}")
    assert count_reads_of_steady_steps(engine, params, 4) == [2 if grammar else 1] * 4


def test_draft_tree_static_buffers_pad_and_keep_the_trees(make_engine, tmp_path_factory):
    """The draft's graphable round (static buffers padded to a captured size, run eagerly
    here: the CPU has no CUDA graphs) grows the same trees as the direct round: outputs
    equal plain decoding and the acceptance is the same, so padding rows touch no
    request's KV."""
    target = build_random_model(tmp_path_factory.mktemp("grt"), "llama", num_layers=2, num_heads=4,
                                num_kv_heads=2, hidden_size=64)
    draft = build_random_draft(target, tmp_path_factory.mktemp("grd") / "e", "EAGLE", seed=1)
    eagle = dict(attention_backend="triton", speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                 speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    params = dict(GREEDY, max_new_tokens=5)
    prompts = PROMPTS[:3]
    plain = [o["output_ids"] for o in make_engine(target).generate(input_ids=prompts, sampling_params=params)]
    engine = make_engine(target, **eagle, disable_radix_cache=True)  # both runs: prefill, then rounds
    direct = engine.generate(input_ids=prompts, sampling_params=params)
    spec = engine._scheduler.spec
    spec.enable_graphs(engine._scheduler.kv.req_table.padding_row, max_bs=4, capture=False)
    assert spec.graphs.fits(4) and not spec.graphs.fits(5)
    sizes: list[int] = []
    real_grow = spec.graphs._grow
    spec.graphs._grow = lambda size: sizes.append(size) or real_grow(size)
    outs = engine.generate(input_ids=prompts, sampling_params=params)  # 3 requests: padded to 4
    assert sizes and set(sizes) == {4}
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in direct] == plain
    assert ([o["meta_info"]["spec_accepted_drafts"] for o in outs]
            == [o["meta_info"]["spec_accepted_drafts"] for o in direct])


def test_draft_tree_static_buffers_record_no_autograd(make_engine, tmp_path_factory):
    """The draft's graphable round (what a CUDA graph captures; run eagerly here), called
    outside the scheduler's inference mode, runs in inference mode with frozen weights: no
    draft forward's output carries autograd state."""
    target = build_random_model(tmp_path_factory.mktemp("gnt"), "llama", num_layers=2)
    draft = build_random_draft(target, tmp_path_factory.mktemp("gnd") / "e", "EAGLE", seed=1)
    engine = make_engine(target, attention_backend="triton", speculative_algorithm="EAGLE",
                         speculative_draft_model_path=str(draft), speculative_num_steps=3,
                         speculative_eagle_topk=2, speculative_num_draft_tokens=4, max_total_tokens=1024)
    spec = engine._scheduler.spec
    pad = engine._scheduler.kv.req_table.padding_row
    spec.enable_graphs(pad, max_bs=2, capture=False)
    seen: list[tuple[bool, bool]] = []
    real = spec.draft.forward

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        h = real(*args, **kwargs)
        seen.append((torch.is_inference_mode_enabled(), h.requires_grad))
        return h
    spec.draft.forward = recording
    # Two padding rows with no prefix: they read and write only the padding slot.
    b, k, width = 2, spec.topk, spec.carried_hidden.shape[1]
    tree = spec.graphs.run(torch.full((b,), pad), torch.zeros(b, dtype=torch.int64), torch.tensor([7, 8]),
                           torch.tensor([[9, 10], [11, 12]]), torch.full((b, k), 0.5), torch.randn(b, width))
    assert tree.tokens.shape == (b, 4)
    assert seen and seen == [(True, False)] * len(seen)
