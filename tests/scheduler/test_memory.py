"""KV memory: page allocator refcounts, request slots, named KV buffers."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.scheduler.memory import OutOfPages, PageAllocator, ReqToTokenPool, TokenToKVPool

pytestmark = pytest.mark.fast


# ---- PageAllocator ---------------------------------------------------------------
def test_allocator_needs_two_pages():
    with pytest.raises(ValueError):
        PageAllocator(1, 4)
    a = PageAllocator(2, 4)
    assert a.capacity == 1 and a.num_free == 1


def test_capacity_excludes_padding_page():
    a = PageAllocator(8, 4)
    assert a.capacity == 7
    assert a.num_free == 7
    assert a.page_size == 4


def test_alloc_all_pages_never_page_zero():
    a = PageAllocator(9, 2)
    pages = a.alloc(8)
    assert pages.dtype == torch.int64
    assert sorted(pages.tolist()) == list(range(1, 9))
    assert 0 not in pages.tolist()
    assert a.num_free == 0
    assert (a.refcount[pages] == 1).all()
    with pytest.raises(OutOfPages):
        a.alloc(1)


def test_alloc_in_pieces_distinct_and_low_first():
    a = PageAllocator(6, 1)
    first = a.alloc(2)
    second = a.alloc(3)
    assert first.tolist() == [1, 2]  # low pages first, ascending
    assert set(first.tolist()).isdisjoint(second.tolist())
    assert sorted(first.tolist() + second.tolist()) == [1, 2, 3, 4, 5]
    assert a.num_free == 0


def test_alloc_zero_and_too_many():
    a = PageAllocator(4, 1)
    empty = a.alloc(0)
    assert empty.numel() == 0 and empty.dtype == torch.int64
    assert a.num_free == 3
    with pytest.raises(OutOfPages):
        a.alloc(4)
    # a failed alloc takes nothing
    assert a.num_free == 3
    assert a.alloc(3).numel() == 3


def test_release_returns_pages():
    a = PageAllocator(5, 4)
    pages = a.alloc(3)
    a.release(pages)
    assert a.num_free == a.capacity
    assert (a.refcount[1:] == 0).all()
    assert a.refcount[0] == 1
    again = a.alloc(4)
    assert sorted(again.tolist()) == [1, 2, 3, 4]


def test_retain_release_refcounting():
    a = PageAllocator(5, 1)
    pages = a.alloc(2)
    a.retain(pages)
    assert (a.refcount[pages] == 2).all()
    a.release(pages)  # one owner left
    assert a.num_free == 2
    assert (a.refcount[pages] == 1).all()
    a.release(pages[:1])  # last owner of the first page
    assert a.num_free == 3
    assert a.refcount[pages[0]] == 0 and a.refcount[pages[1]] == 1
    a.release(pages[1:])
    assert a.num_free == a.capacity


def test_shared_page_not_handed_out_while_held():
    a = PageAllocator(3, 1)
    p = a.alloc(1)
    a.retain(p)
    a.release(p)
    other = a.alloc(1)
    assert other.item() != p.item()
    with pytest.raises(OutOfPages):
        a.alloc(1)


def test_double_release_raises():
    a = PageAllocator(4, 2)
    pages = a.alloc(2)
    a.release(pages)
    with pytest.raises(RuntimeError):
        a.release(pages)


def test_rejected_release_leaves_allocator_unchanged():
    """A release that raises must not half-apply: here page `ok` would lose its last
    owner without reaching the free list (leaked forever) and `bad` would go to -1."""
    a = PageAllocator(4, 1)
    ok, bad = a.alloc(2).tolist()
    a.release(torch.tensor([bad]))
    before = a.refcount.clone()
    with pytest.raises(RuntimeError):
        a.release(torch.tensor([ok, bad]))
    assert torch.equal(a.refcount, before)
    a.release(torch.tensor([ok]))  # the legitimate release still works
    assert a.num_free == a.capacity


def test_release_of_never_allocated_page_raises():
    a = PageAllocator(4, 2)
    with pytest.raises(RuntimeError):
        a.release(torch.tensor([3]))


def test_release_padding_page_raises():
    a = PageAllocator(4, 2)
    with pytest.raises(RuntimeError):
        a.release(torch.tensor([0]))


def test_retain_of_free_page_raises():
    a = PageAllocator(4, 2)
    with pytest.raises(RuntimeError):
        a.retain(torch.tensor([2]))
    pages = a.alloc(1)
    a.release(pages)
    with pytest.raises(RuntimeError):
        a.retain(pages)


def test_empty_retain_release_are_noops():
    a = PageAllocator(4, 2)
    a.retain(torch.empty(0, dtype=torch.int64))
    a.release(torch.empty(0, dtype=torch.int64))
    assert a.num_free == 3


def test_accounting_returns_to_full_after_mixed_use():
    a = PageAllocator(17, 4)
    held = []
    for n in (3, 5, 2):
        held.append(a.alloc(n))
    a.retain(held[1])
    assert a.num_free == 16 - 10
    for p in held:
        a.release(p)
    assert a.num_free == 16 - 5  # held[1] still has one owner
    a.release(held[1])
    assert a.num_free == a.capacity == 16
    assert sorted(a.alloc(16).tolist()) == list(range(1, 17))


# ---- ReqToTokenPool --------------------------------------------------------------
def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(3, 10, torch.device("cpu"))
    # One more row than requests: the padding row, never handed out, all slot 0.
    assert pool.table.shape == (4, 10) and pool.padding_row == 3
    assert pool.table.dtype == torch.int64
    assert pool.num_free == 3
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.num_free == 0
    assert bool((pool.table[pool.padding_row] == 0).all())
    with pytest.raises(OutOfPages):
        pool.alloc()
    pool.free(rows[1])
    assert pool.num_free == 1
    assert pool.alloc() == rows[1]


def test_req_to_token_pool_double_free_raises():
    pool = ReqToTokenPool(2, 4, torch.device("cpu"))
    r = pool.alloc()
    pool.free(r)
    with pytest.raises(RuntimeError):
        pool.free(r)
    assert pool.num_free == 2


# ---- TokenToKVPool -----------------------------------------------------------------
def _pool(name="target", layers=3, slots=16, heads=2, dim=4, dtype=torch.float32):
    return TokenToKVPool(name, layers, slots, heads, dim, dtype, torch.device("cpu"))


def test_buffers_names_and_shapes():
    pool = _pool(layers=3)
    bufs = pool.buffers()
    assert list(bufs) == ["target.L0.K", "target.L0.V", "target.L1.K", "target.L1.V",
                          "target.L2.K", "target.L2.V"]
    for t in bufs.values():
        assert t.shape == (16, 2, 4)
        assert t.is_contiguous()
        assert torch.count_nonzero(t) == 0
    assert bufs["target.L1.K"] is pool.k[1]
    assert bufs["target.L2.V"] is pool.v[2]
    # every buffer is its own storage
    ptrs = {t.data_ptr() for t in bufs.values()}
    assert len(ptrs) == 6
    assert list(_pool(name="draft", layers=1).buffers()) == ["draft.L0.K", "draft.L0.V"]


def test_write_gather_round_trip():
    pool = _pool()
    loc = torch.tensor([3, 7, 8])
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pool.write(1, loc, k, v)
    # gather: indices [B, L] -> [B, L, kv_heads, head_dim]
    idx = torch.tensor([[8, 3, 0], [7, 7, 8]])
    gk, gv = pool.gather(1, idx)
    assert gk.shape == (2, 3, 2, 4) and gv.shape == (2, 3, 2, 4)
    by_slot_k = {3: k[0], 7: k[1], 8: k[2], 0: torch.zeros(2, 4)}
    by_slot_v = {3: v[0], 7: v[1], 8: v[2], 0: torch.zeros(2, 4)}
    for b in range(2):
        for j in range(3):
            s = int(idx[b, j])
            assert torch.equal(gk[b, j], by_slot_k[s])
            assert torch.equal(gv[b, j], by_slot_v[s])
    # other layers and slots untouched
    assert torch.count_nonzero(pool.k[0]) == 0 and torch.count_nonzero(pool.v[2]) == 0
    assert torch.count_nonzero(pool.k[1][[0, 1, 2, 4, 5, 6, 9]]) == 0
    # K and V are not swapped
    assert not torch.equal(pool.k[1][3], pool.v[1][3])


def test_write_casts_to_pool_dtype_and_gather_keeps_it():
    pool = _pool(dtype=torch.bfloat16)
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 2, 4)
    pool.write(0, torch.tensor([1, 2]), k, v)
    assert pool.k[0].dtype == torch.bfloat16
    gk, gv = pool.gather(0, torch.tensor([1, 2]))
    assert gk.dtype == torch.bfloat16 and gk.shape == (2, 2, 4)
    assert torch.allclose(gk.float(), k, atol=2e-2, rtol=2e-2)
    assert torch.allclose(gv.float(), v, atol=2e-2, rtol=2e-2)
    assert torch.equal(gk, k.to(torch.bfloat16))


def test_copy_slots_all_layers():
    pool = _pool(layers=2)
    src = torch.tensor([1, 2])
    dst = torch.tensor([10, 11])
    for layer in range(2):
        pool.write(layer, src, torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    pool.copy_slots(dst, src)
    for layer in range(2):
        assert torch.equal(pool.k[layer][dst], pool.k[layer][src])
        assert torch.equal(pool.v[layer][dst], pool.v[layer][src])
    # sources unchanged, other slots untouched
    assert torch.count_nonzero(pool.k[0][3:10]) == 0
    assert torch.count_nonzero(pool.v[1][12:]) == 0


def test_bytes_per_token():
    assert TokenToKVPool.bytes_per_token(2, 4, 8, torch.float32) == 2 * 2 * 4 * 8 * 4
    assert TokenToKVPool.bytes_per_token(3, 1, 16, torch.bfloat16) == 2 * 3 * 1 * 16 * 2


# ---- runs of consecutive pages (what a transfer coalesces) -------------------------
def runs(pages: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))


def fragmented() -> tuple[PageAllocator, list[int]]:
    """Pages 1..19 held one by one, then 2-4, 7-12 and 15-19 freed: free runs of 3, 6, 5."""
    a = PageAllocator(20, 1)
    held = a.alloc_ids(19)
    assert held == list(range(1, 20))
    a.release(torch.tensor([*range(2, 5), *range(7, 13), *range(15, 20)]))
    return a, held


def test_contiguous_alloc_takes_the_shortest_free_run_that_holds_it():
    a, _ = fragmented()
    assert a.alloc_ids(4, contiguous=True) == [15, 16, 17, 18]
    assert a.alloc_ids(3, contiguous=True) == [2, 3, 4]
    assert a.alloc_ids(6, contiguous=True) == list(range(7, 13))
    assert a.num_free == 1 and a.alloc_ids(1) == [19]


def test_contiguous_alloc_without_a_long_enough_run_takes_the_longest_runs_in_address_order():
    a, _ = fragmented()
    assert a.alloc_ids(10, contiguous=True) == [*range(7, 13), *range(15, 19)]
    # The stack still hands out exactly the pages left free (the run pages left stale entries).
    assert sorted(a.alloc_ids(4)) == [2, 3, 4, 19]
    with pytest.raises(OutOfPages):
        a.alloc_ids(1)


def test_a_freed_run_comes_back_ascending_from_the_stack():
    a = PageAllocator(12, 1)
    first = a.alloc_ids(5)
    a.alloc_ids(3)
    a.release(torch.tensor(first[::-1]))
    assert a.alloc_ids(5) == first


def test_mixed_stack_and_run_allocations_keep_every_page_accounted():
    rng = random.Random(0)
    a = PageAllocator(300, 1)
    held: list[list[int]] = []
    for step in range(3000):
        if held and (rng.random() < 0.45 or a.num_free < 40):
            pages = held.pop(rng.randrange(len(held)))
            a.release(torch.tensor(pages))
        else:
            n = rng.randint(1, 40)
            held.append(a.alloc_ids(n, contiguous=rng.random() < 0.5))
            assert len(held[-1]) == n
        flat = [p for pages in held for p in pages]
        assert len(flat) == len(set(flat)) and 0 not in flat
        assert a.num_free == a.capacity - len(flat) == int((a.refcount[1:] == 0).sum())
    for pages in held:
        a.release(torch.tensor(pages))
    assert sorted(a.alloc_ids(a.capacity)) == list(range(1, 300))


def interleaved_pool() -> PageAllocator:
    """8 running requests whose decode steps took one page each from the stack, 300
    times, interleaving their pages; then 5 of them finished."""
    rng = random.Random(1)
    a = PageAllocator(4001, 1)
    live = [a.alloc_ids(100, contiguous=True) for _ in range(8)]
    for _ in range(300):
        for pages, new in zip(live, a.alloc_ids(len(live))):
            pages.append(new)
    for pages in rng.sample(live, 5):
        a.release(torch.tensor(pages))
    return a


def test_a_prompt_stays_in_long_runs_after_decode_steps_interleaved_the_pool():
    """A new prompt taken from the stack is scattered in short runs there; run
    allocation finds it whole runs."""
    assert runs(interleaved_pool().alloc_ids(512)) > 100
    assert runs(interleaved_pool().alloc_ids(512, contiguous=True)) <= 2


def test_single_page_takes_leave_a_freed_prompt_run_for_the_next_prompt():
    """A finished request frees its prompt (a run) and its decode pages (scattered among
    other requests'); the next decode steps take the scattered ones first, so the run is
    still whole when the next prompt asks for one."""
    a = PageAllocator(64, 1)
    prompt = a.alloc_ids(20, contiguous=True)              # pages 1-20
    others = a.alloc_ids(10, contiguous=True)              # pages 21-30
    decoded = [p for i, p in enumerate(a.alloc_ids(20)) if i % 2 == 0]  # interleaved with another request
    a.release(torch.tensor(prompt + decoded))
    assert sorted(a.alloc_ids(len(decoded))) == sorted(decoded)
    assert a.alloc_ids(20, contiguous=True) == prompt
    assert others == list(range(21, 31))
