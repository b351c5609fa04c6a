"""Radix prefix cache: matching, splitting, page references, locks, LRU eviction.

The tests follow the scheduler's ownership protocol: allocate pages, build
slots = page * page_size + offset, insert into the tree (the tree retains the
pages it keeps), then release the test's own references.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.scheduler.memory import PageAllocator
from pdserve.scheduler.radix_cache import ChunkCache, RadixCache

pytestmark = pytest.mark.fast

PAGE_SIZES = [1, 4]


class Harness:
    def __init__(self, page_size: int, num_pages: int = 65) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(num_pages, page_size)
        self.tree = RadixCache(self.alloc)

    def new_slots(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh pages for num_tokens tokens (a partial last page gets a whole page)."""
        pages = self.alloc.alloc(-(-num_tokens // self.ps))
        slots = (pages.unsqueeze(1) * self.ps + torch.arange(self.ps)).flatten()[:num_tokens]
        return pages, slots

    def cache(self, ids: list[int]) -> tuple[int, torch.Tensor]:
        """Compute `ids` into fresh pages, insert, drop our references.
        Returns (already cached length, the slots we offered)."""
        pages, slots = self.new_slots(len(ids))
        cached = self.tree.insert(ids, slots)
        self.alloc.release(pages)
        return cached, slots

    def tree_pages(self) -> set[int]:
        out: set[int] = set()
        for node in self.tree._all_nodes():
            if node is not self.tree.root:
                out.update((node.slots[:: self.ps] // self.ps).tolist())
        return out

    def tree_tokens(self, locked: bool | None = None) -> int:
        total = 0
        for node in self.tree._all_nodes():
            if node is self.tree.root:
                continue
            if locked is None or (node.lock_ref > 0) == locked:
                total += len(node.key)
        return total

    def check_invariants(self) -> None:
        tree_pages = self.tree_pages()
        # Each cached page is held exactly once (by the tree); everything else is free.
        for p in tree_pages:
            assert self.alloc.refcount[p] == 1, (p, int(self.alloc.refcount[p]))
        assert self.alloc.num_free == self.alloc.capacity - len(tree_pages)
        assert self.tree.evictable_tokens == self.tree_tokens(locked=False)
        assert self.tree.protected_tokens == self.tree_tokens(locked=True)
        for node in self.tree._all_nodes():
            if node is self.tree.root:
                continue
            assert len(node.key) % self.ps == 0 and len(node.key) > 0
            assert node.slots.numel() == len(node.key)
            assert int(node.slots[0]) % self.ps == 0  # node starts on a page boundary
            assert node.parent is not None and node.parent.children[node.key[: self.ps]] is node

    def drain(self) -> None:
        self.tree.reset()
        assert self.alloc.num_free == self.alloc.capacity
        assert (self.alloc.refcount[1:] == 0).all()


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"ps{ps}")
def h(request) -> Harness:
    return Harness(request.param)


def seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- insert / match ---------------------------------------------------------------------
def test_empty_tree_matches_nothing(h):
    m = h.tree.match_prefix(seq(8))
    assert m.slots.numel() == 0 and m.node is None
    assert h.tree.insert([], torch.empty(0, dtype=torch.int64)) == 0


def test_insert_then_match_same_slots(h):
    ids = seq(4 * h.ps)
    cached, slots = h.cache(ids)
    assert cached == 0
    m = h.tree.match_prefix(ids)
    assert torch.equal(m.slots, slots)
    assert m.node is not None
    # the tree's references keep the pages alive after we released ours
    assert h.alloc.num_free == h.alloc.capacity - 4
    h.check_invariants()
    h.drain()


def test_only_page_aligned_prefix_is_cached(h):
    ids = seq(3 * h.ps + h.ps - 1) if h.ps > 1 else seq(3)
    cached, slots = h.cache(ids)
    aligned = len(ids) // h.ps * h.ps
    m = h.tree.match_prefix(ids + [7, 7, 7, 7])
    assert torch.equal(m.slots, slots[:aligned])
    # the partial last page was not kept by the tree: it was freed with our reference
    assert h.alloc.num_free == h.alloc.capacity - aligned // h.ps
    h.check_invariants()
    h.drain()


def test_match_of_longer_and_shorter_queries(h):
    ps = h.ps
    ids = seq(4 * ps)
    _, slots = h.cache(ids)
    # longer query: whole cached prefix
    assert torch.equal(h.tree.match_prefix(ids + seq(3 * ps, 900)).slots, slots)
    # shorter query: page-aligned part of it (this splits the node)
    q = ids[: 2 * ps + (ps - 1)]
    m = h.tree.match_prefix(q)
    assert torch.equal(m.slots, slots[: 2 * ps])
    # the split keeps the rest matchable
    assert torch.equal(h.tree.match_prefix(ids).slots, slots)
    # fewer tokens than one page: nothing
    if ps > 1:
        assert h.tree.match_prefix(ids[: ps - 1]).slots.numel() == 0
    h.check_invariants()
    h.drain()


def test_partial_match_splits_and_both_branches_match(h):
    ps = h.ps
    a = seq(4 * ps)
    b = a[: 2 * ps] + seq(3 * ps, 500)  # shares 2 pages with a
    _, slots_a = h.cache(a)
    cached_b, slots_b = h.cache(b)
    assert cached_b == 2 * ps
    ma = h.tree.match_prefix(a)
    mb = h.tree.match_prefix(b)
    assert torch.equal(ma.slots, slots_a)
    # b's shared part is a's KV; its own suffix is b's KV
    assert torch.equal(mb.slots, torch.cat([slots_a[: 2 * ps], slots_b[2 * ps:]]))
    # shared node is the parent of both leaves
    assert ma.node is not mb.node
    assert ma.node.parent is mb.node.parent
    assert ma.node.parent.key == tuple(a[: 2 * ps])
    assert len(ma.node.key) == 2 * ps and len(mb.node.key) == 3 * ps
    # matching only the shared prefix returns the shared node
    m = h.tree.match_prefix(a[: 2 * ps] + [1, 2, 3, 4, 5])
    assert m.node is ma.node.parent
    assert torch.equal(m.slots, slots_a[: 2 * ps])
    # b's duplicate pages for the shared part were released (not kept by the tree)
    assert h.alloc.num_free == h.alloc.capacity - (4 + 3)
    h.check_invariants()
    h.drain()


def test_divergence_inside_a_page(h):
    ps = h.ps
    a = seq(3 * ps)
    b = list(a)
    b[ps + ps // 2] = 7  # differs inside the second page (or at token 1 for ps 1)
    _, slots_a = h.cache(a)
    cached_b, slots_b = h.cache(b)
    shared = ps + (ps // 2) // ps * ps  # whole pages before the difference
    assert cached_b == shared
    assert torch.equal(h.tree.match_prefix(a).slots, slots_a)
    assert torch.equal(h.tree.match_prefix(b).slots, torch.cat([slots_a[:shared], slots_b[shared:]]))
    h.check_invariants()
    h.drain()


def test_insert_cached_prefix_takes_no_extra_refs(h):
    ps = h.ps
    ids = seq(4 * ps)
    _, slots = h.cache(ids)
    before_free = h.alloc.num_free
    before_ref = h.alloc.refcount.clone()
    # a second request computed the same prompt into its own pages
    cached, _ = h.cache(ids)
    assert cached == 4 * ps
    assert h.alloc.num_free == before_free
    assert torch.equal(h.alloc.refcount, before_ref)
    # re-inserting the tree's own slots (a request that matched, then finished)
    m = h.tree.match_prefix(ids)
    h.alloc.retain(m.slots[::ps] // ps)
    assert h.tree.insert(ids, m.slots) == 4 * ps
    h.alloc.release(m.slots[::ps] // ps)
    assert torch.equal(h.alloc.refcount, before_ref)
    # a prefix of a cached sequence is already cached too
    assert h.cache(ids[: 2 * ps])[0] == 2 * ps
    assert torch.equal(h.alloc.refcount, before_ref)
    assert torch.equal(h.tree.match_prefix(ids).slots, slots)
    h.check_invariants()
    h.drain()


def test_extend_cached_prefix(h):
    ps = h.ps
    short = seq(2 * ps)
    _, slots_short = h.cache(short)
    # a request matched `short`, then computed 2 more pages
    m = h.tree.match_prefix(short)
    h.alloc.retain(m.slots[::ps] // ps)
    h.tree.lock(m.node)
    extra_pages, extra_slots = h.new_slots(2 * ps)
    full_ids = short + seq(2 * ps, 300)
    full_slots = torch.cat([m.slots, extra_slots])
    assert h.tree.insert(full_ids, full_slots) == 2 * ps
    h.alloc.release(full_slots[::ps] // ps)
    h.tree.unlock(m.node)
    assert torch.equal(h.tree.match_prefix(full_ids).slots, full_slots)
    assert torch.equal(h.tree.match_prefix(short).slots, slots_short)
    h.check_invariants()
    h.drain()


# ---- lock / unlock --------------------------------------------------------------------------
def test_lock_unlock_moves_tokens(h):
    ps = h.ps
    ids = seq(4 * ps)
    h.cache(ids)
    assert h.tree.evictable_tokens == 4 * ps and h.tree.protected_tokens == 0
    assert h.tree.evictable_pages == 4
    m = h.tree.match_prefix(ids)
    h.tree.lock(m.node)
    assert h.tree.evictable_tokens == 0 and h.tree.protected_tokens == 4 * ps
    h.tree.lock(m.node)  # a second user
    assert h.tree.protected_tokens == 4 * ps
    h.tree.unlock(m.node)
    assert h.tree.evictable_tokens == 0 and h.tree.protected_tokens == 4 * ps
    h.tree.unlock(m.node)
    assert h.tree.evictable_tokens == 4 * ps and h.tree.protected_tokens == 0
    with pytest.raises(RuntimeError):
        h.tree.unlock(m.node)
    h.tree.lock(None)  # no match: no-op
    h.tree.unlock(None)
    h.check_invariants()
    h.drain()


def test_lock_partial_match_protects_only_the_path(h):
    ps = h.ps
    a = seq(4 * ps)
    b = a[: 2 * ps] + seq(2 * ps, 600)
    h.cache(a)
    h.cache(b)
    m = h.tree.match_prefix(a[: 3 * ps])  # splits a's leaf at 3 pages
    assert m.slots.numel() == 3 * ps
    h.tree.lock(m.node)
    assert h.tree.protected_tokens == 3 * ps
    assert h.tree.evictable_tokens == (4 + 2) * ps - 3 * ps
    h.check_invariants()
    # a split of a locked node keeps the lock on both halves
    m2 = h.tree.match_prefix(a[: 1 * ps])
    assert h.tree.protected_tokens == 3 * ps
    h.check_invariants()
    h.tree.unlock(m.node)
    assert h.tree.protected_tokens == 0
    assert h.tree.evictable_tokens == 6 * ps
    assert m2.slots.numel() == ps
    h.check_invariants()
    h.drain()


# ---- eviction ------------------------------------------------------------------------------
def test_evict_lru_leaf_first(h):
    ps = h.ps
    a, b, c = seq(2 * ps, 100), seq(2 * ps, 200), seq(2 * ps, 300)
    _, sa = h.cache(a)
    _, sb = h.cache(b)
    _, sc = h.cache(c)
    h.tree.match_prefix(a)  # a is now the most recently used; b is the least
    free_before = h.alloc.num_free
    released = h.tree.evict(1)
    assert released == 2  # a whole leaf goes
    assert h.alloc.num_free == free_before + 2
    assert h.tree.match_prefix(b).slots.numel() == 0
    assert torch.equal(h.tree.match_prefix(a).slots, sa)
    assert torch.equal(h.tree.match_prefix(c).slots, sc)
    # b's pages are free again
    assert (h.alloc.refcount[sb[::ps] // ps] == 0).all()
    # next victim: c (a was touched after c)
    h.tree.match_prefix(a)
    assert h.tree.evict(2) == 2
    assert h.tree.match_prefix(c).slots.numel() == 0
    assert torch.equal(h.tree.match_prefix(a).slots, sa)
    assert h.tree.evictable_tokens == 2 * ps
    h.check_invariants()
    h.drain()


def test_evict_never_locked(h):
    ps = h.ps
    a, b = seq(3 * ps, 100), seq(2 * ps, 200)
    _, sa = h.cache(a)
    h.cache(b)
    m = h.tree.match_prefix(a)
    h.tree.lock(m.node)
    # a is older than b after this? make a the LRU explicitly by touching b
    h.tree.match_prefix(b)
    released = h.tree.evict(100)
    assert released == 2
    assert torch.equal(h.tree.match_prefix(a).slots, sa)
    assert h.tree.match_prefix(b).slots.numel() == 0
    assert h.tree.evictable_tokens == 0 and h.tree.protected_tokens == 3 * ps
    assert h.tree.evict(100) == 0
    h.tree.unlock(m.node)
    assert h.tree.evict(100) == 3
    assert h.alloc.num_free == h.alloc.capacity
    h.check_invariants()


def test_evict_locked_path_spares_ancestors_evicts_sibling(h):
    ps = h.ps
    a = seq(4 * ps)
    b = a[: 2 * ps] + seq(2 * ps, 700)
    _, sa = h.cache(a)
    h.cache(b)
    m = h.tree.match_prefix(a)
    h.tree.lock(m.node)
    assert h.tree.evict(100) == 2  # only b's own suffix
    assert torch.equal(h.tree.match_prefix(a).slots, sa)
    assert torch.equal(h.tree.match_prefix(b).slots, sa[: 2 * ps])
    h.tree.unlock(m.node)
    h.check_invariants()
    h.drain()


def test_evict_cascades_to_parents(h):
    ps = h.ps
    a = seq(4 * ps)
    b = a[: 2 * ps] + seq(2 * ps, 700)
    h.cache(a)
    h.cache(b)
    assert h.tree.evictable_pages == 6
    assert h.tree.evict(6) == 6
    assert h.alloc.num_free == h.alloc.capacity
    assert h.tree.evictable_tokens == 0 and h.tree.protected_tokens == 0
    assert h.tree.match_prefix(a).slots.numel() == 0
    assert not h.tree.root.children
    h.check_invariants()


def test_evict_zero_does_nothing(h):
    h.cache(seq(2 * h.ps))
    assert h.tree.evict(0) == 0
    assert h.tree.evictable_pages == 2
    h.drain()


def test_evicted_prefix_pages_reusable_and_reinsertable(h):
    ps = h.ps
    ids = seq(3 * ps)
    h.cache(ids)
    h.tree.evict(3)
    assert h.alloc.num_free == h.alloc.capacity
    cached, slots = h.cache(ids)
    assert cached == 0
    assert torch.equal(h.tree.match_prefix(ids).slots, slots)
    h.check_invariants()
    h.drain()


# ---- reset ---------------------------------------------------------------------------------
def test_reset_returns_every_page(h):
    ps = h.ps
    for i in range(5):
        base = seq(2 * ps, 100)  # all share two pages
        h.cache(base + seq((i + 1) * ps, 1000 * (i + 1)))
    m = h.tree.match_prefix(seq(2 * ps, 100))
    h.tree.lock(m.node)
    h.tree.unlock(m.node)
    assert h.alloc.num_free < h.alloc.capacity
    h.tree.reset()
    assert h.alloc.num_free == h.alloc.capacity
    assert (h.alloc.refcount[1:] == 0).all()
    assert h.tree.evictable_tokens == 0 and h.tree.protected_tokens == 0
    assert h.tree.match_prefix(seq(2 * ps, 100)).slots.numel() == 0


def test_reset_while_a_request_holds_its_own_refs(h):
    ps = h.ps
    ids = seq(2 * ps)
    h.cache(ids)
    m = h.tree.match_prefix(ids)
    h.alloc.retain(m.slots[::ps] // ps)  # a running request's references
    h.tree.reset()
    # the request's pages survive the reset...
    assert (h.alloc.refcount[m.slots[::ps] // ps] == 1).all()
    assert h.alloc.num_free == h.alloc.capacity - 2
    # ...and go back when it releases them
    h.alloc.release(m.slots[::ps] // ps)
    assert h.alloc.num_free == h.alloc.capacity


# ---- randomized against a reference ------------------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_against_reference(page_size, seed):
    rng = random.Random(seed)
    h = Harness(page_size, num_pages=400)
    ps = page_size
    ref: dict[tuple[int, ...], torch.Tensor] = {}  # page-aligned prefix -> its last page's slots
    history: list[list[int]] = []

    def expected(ids: list[int]) -> torch.Tensor:
        parts = []
        for j in range(len(ids) // ps):
            key = tuple(ids[: (j + 1) * ps])
            if key not in ref:
                break
            parts.append(ref[key])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    locked = []
    for _ in range(150):
        op = rng.random()
        if op < 0.55 or not history:
            if history and rng.random() < 0.6:  # extend / diverge from an earlier sequence
                base = rng.choice(history)
                ids = base[: rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(1, 3 * ps))]
            else:
                ids = [rng.randint(0, 2) for _ in range(rng.randint(1, 4 * ps))]
            if len(ids) // ps == 0:
                continue
            exp_cached = expected(ids).numel()
            cached, slots = h.cache(ids)
            assert cached == exp_cached
            for j in range(cached // ps, len(ids) // ps):
                ref[tuple(ids[: (j + 1) * ps])] = slots[j * ps:(j + 1) * ps]
            history.append(ids)
        elif op < 0.8:
            ids = rng.choice(history)
            ids = ids[: rng.randint(1, len(ids))] + [rng.randint(0, 2)]
            m = h.tree.match_prefix(ids)
            assert torch.equal(m.slots, expected(ids)), ids
            if m.node is not None and rng.random() < 0.5:
                h.tree.lock(m.node)
                locked.append(m.node)
        elif op < 0.9:
            if locked:
                h.tree.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            # evict a few pages; locked paths must survive, the reference forgets the rest
            locked_paths = []
            for node in locked:
                path, n = [], node
                while n is not h.tree.root:
                    path = list(n.key) + path
                    n = n.parent
                locked_paths.append(path)
            evictable = h.tree.evictable_pages
            free_before = h.alloc.num_free
            want = rng.randint(1, 4)
            released = h.tree.evict(want)
            assert released >= min(want, evictable)
            assert h.alloc.num_free == free_before + released
            for path in locked_paths:
                assert torch.equal(h.tree.match_prefix(path).slots, expected(path))
            for key in list(ref):
                if h.tree.match_prefix(list(key)).slots.numel() < len(key):
                    del ref[key]
        h.check_invariants()
    for ids in history:
        assert torch.equal(h.tree.match_prefix(ids).slots, expected(ids))
    while locked:
        h.tree.unlock(locked.pop())
    h.check_invariants()
    cached_pages = len(h.tree_pages())
    assert h.tree.evict(10**6) == cached_pages
    assert h.alloc.num_free == h.alloc.capacity
    h.drain()


# ---- ChunkCache ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunk_cache_shares_nothing(page_size):
    alloc = PageAllocator(9, page_size)
    cache = ChunkCache(alloc)
    pages = alloc.alloc(2)
    slots = (pages.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
    ids = seq(2 * page_size)
    assert cache.insert(ids, slots) == 0
    alloc.release(pages)
    assert alloc.num_free == alloc.capacity  # took no reference
    m = cache.match_prefix(ids)
    assert m.slots.numel() == 0 and m.node is None
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.evictable_pages == 0 and cache.evict(5) == 0
    assert cache.evictable_tokens == 0 and cache.protected_tokens == 0
    cache.reset()
    assert alloc.num_free == alloc.capacity
