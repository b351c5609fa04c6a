"""The decode KV mirror must give exactly the attention of the paged-pool gather path."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.model.attention import ForwardContext, RowLayout, TorchNativeAttention
from pdserve.model.decode_mirror import DecodeKVMirror
from pdserve.model.layers import PREPACK_MIN_WEIGHTS, Linear, cpu_prepack
from pdserve.scheduler.memory import ReqToTokenPool, TokenToKVPool

pytestmark = pytest.mark.fast

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


class World:
    """A paged pool holding a few requests' prefixes at scattered slots."""

    def __init__(self, mirror_tokens: int = 1 << 16) -> None:
        self.rng = random.Random(0)
        self.pool = TokenToKVPool("t", LAYERS, 4096, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
        for k, v in zip(self.pool.k, self.pool.v):
            k.normal_()
            v.normal_()
        self.table = ReqToTokenPool(8, 1024, torch.device("cpu"))
        self.free_slots = list(range(1, 4096))
        self.rng.shuffle(self.free_slots)
        self.lens: dict[int, int] = {}  # row -> tokens in the pool
        self.mirror = DecodeKVMirror(self.pool, LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"),
                                     max_tokens=mirror_tokens)
        self.backend = TorchNativeAttention(self.pool, HEADS, KV_HEADS, DIM, self.mirror)

    def admit(self, length: int) -> int:
        row = self.table.alloc()
        self.table.table[row, :length] = torch.tensor([self.free_slots.pop() for _ in range(length)])
        self.lens[row] = length
        return row

    def finish(self, row: int) -> None:
        self.table.free(row)
        del self.lens[row]

    def step(self, rows: list[int]) -> bool:
        """One decode step of ``rows`` (in this order) through both paths; returns
        whether the mirror served it."""
        prefix = [self.lens[r] for r in rows]
        for r, n in zip(rows, prefix):
            self.table.table[r, n] = self.free_slots.pop()
        layout = RowLayout.upload(rows, prefix, [1] * len(rows), torch.device("cpu"))
        ref_ctx = ForwardContext.build(self.table.table, layout)
        ctx = ForwardContext.build(self.table.table, layout)
        ctx.plan.mirror = self.mirror.prepare([self.table.key(r) for r in rows], self.table.table, layout.rows,
                                              layout.prefix_lens)
        for layer in range(LAYERS):
            q = torch.randn(len(rows), HEADS, DIM)
            k, v = torch.randn(len(rows), KV_HEADS, DIM), torch.randn(len(rows), KV_HEADS, DIM)
            want = self.backend.forward(layer, q, k, v, ref_ctx)
            got = self.backend.forward(layer, q, k, v, ctx)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for r in rows:
            self.lens[r] += 1
        return ctx.plan.mirror is not None


def test_mirror_matches_gather_through_joins_leaves_reorders_and_row_reuse():
    w = World()
    a, b, c = w.admit(5), w.admit(250), w.admit(17)
    for _ in range(3):
        assert w.step([a, b, c])
    assert w.mirror.fills == 3  # each prefix copied once; later steps only append
    w.finish(a)
    d = w.admit(8)
    assert d == a  # the row is reused by another request of a's length: only its key differs
    assert w.step([c, d, b])  # reordered, one left, one joined
    assert w.mirror.fills == 4
    for _ in range(8):  # b crosses the 256-token capacity step: the mirror grows
        assert w.step([b, c, d])
    assert w.mirror.capacity[1] >= w.lens[b]
    w.finish(c)
    assert w.step([d, b])
    e, f = w.admit(3), w.admit(600)
    assert w.step([e, b, f, d])  # more rows than held before: capacity grows
    assert w.mirror.fills == 6
    assert len(w.mirror.row_of) == 4


def test_mirror_refills_a_request_that_skipped_steps():
    # A request absent from a step is dropped; if it comes back it is copied in again.
    w = World()
    a, b = w.admit(9), w.admit(30)
    assert w.step([a, b])
    assert w.step([b])
    assert w.step([a, b])
    assert w.mirror.fills == 3


def test_over_budget_falls_back_to_the_gather_path():
    w = World(mirror_tokens=512)
    a, b = w.admit(100), w.admit(200)
    assert w.step([a, b])            # 2 rows x 256 fit
    c = w.admit(10)
    assert not w.step([a, b, c])     # 3 x 256 do not: the gather path serves, same output
    assert w.mirror.row_of == {} and w.mirror.capacity == (0, 0)
    w.finish(c)
    assert w.step([a, b])            # back under budget: refilled from the pool
    assert w.mirror.fills == 4


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_tokens_identical_with_and_without_mirror(llama_dir, make_engine, page_size):
    """Requests of different lengths finishing at different steps (the batch changes
    often), n > 1 forks and a cache hit, greedy: the same tokens either way."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(5, 300))] for _ in range(6)]
    params = [{"temperature": 0.0, "max_new_tokens": rng.randint(3, 40), "ignore_eos": True} for _ in prompts]
    params[2] = dict(params[2], n=2, temperature=0.8, seed=5)
    outs = {}
    for off in (False, True):
        engine = make_engine(llama_dir, page_size=page_size, disable_decode_kv_mirror=off)
        first = engine.generate(input_ids=prompts, sampling_params=params)
        again = engine.generate(input_ids=prompts[:2], sampling_params=params[:2])  # radix hits
        outs[off] = [o["output_ids"] for o in first + again]
    assert outs[False] == outs[True]


def test_prepack_only_for_large_weights():
    assert cpu_prepack(torch.randn(256, 1024)) is None  # small: F.linear is faster
    big = torch.randn(1024, PREPACK_MIN_WEIGHTS // 1024)
    if torch.backends.mkldnn.is_available():
        assert cpu_prepack(big) is not None
    lin = Linear()
    lin.weight = torch.nn.Parameter(big)
    lin.prepack()
    for rows in (1, 8):  # one row takes F.linear, several the packed kernel
        x = torch.randn(rows, big.shape[1])
        torch.testing.assert_close(lin._matmul(x, None), torch.nn.functional.linear(x, big),
                                   rtol=1e-4, atol=1e-4)


def test_exact_row_count_when_a_power_of_two_would_not_fit():
    w = World(mirror_tokens=768)  # 3 rows x 256 fit, 4 (the next power of two) do not
    rows = [w.admit(n) for n in (10, 100, 200)]
    assert w.step(rows)
    assert w.mirror.capacity == (3, 256)
    for _ in range(60):  # the longest row passes 256 tokens: 3 x 512 is over budget
        served = w.step(rows)
    assert not served and w.mirror.capacity == (0, 0)
