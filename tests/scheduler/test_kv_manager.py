"""KVManager, the one owner of a rank's KV bookkeeping: every way pages move between
requests, the prefix cache and a failed transfer's quarantine keeps the reference
counts right (the pool returns to full), and shared pages are never written twice."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.kv_manager import KVManager, PoolGeometry
from pdserve.scheduler.req import Req

pytestmark = pytest.mark.fast


def manager(page_size: int) -> KVManager:
    """A KV manager on its pool geometry alone: no model, no runner."""
    return KVManager(PoolGeometry(256 // page_size + 1, page_size, num_layers=2, num_kv_heads=2, head_dim=16,
                                  kv_dtype=torch.float32, device=torch.device("cpu"), max_running_requests=32,
                                  max_positions=1025))


def req(ids: list[int]) -> Req:
    return Req(rid="r", prompt_ids=ids, params=SamplingParams.from_dict({}), seed=0)


def full(kv: KVManager) -> bool:
    kv.flush()
    m = kv.memory_state()
    return m["kv_pages_free"] == m["kv_pages_total"] and m["req_slots_free"] == m["req_slots_total"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_reserve_hold_release_drop_returns_every_page(page_size):
    kv = manager(page_size)
    r = req(list(range(6, 16)))
    slots = kv.reserve(r, 10)
    assert len(set(slots)) == 10 and 0 not in slots and r.kv_len == 10
    held = kv.hold(r)  # a failed transfer: the pages outlive the request
    kv.release(r, cache_kv=False)
    assert kv.memory_state()["kv_pages_free"] == kv.capacity - len(held)
    kv.drop(held)
    assert full(kv)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fork_shares_full_pages_and_copies_the_partial_one(page_size):
    kv = manager(page_size)
    parent, child = req(list(range(6, 17))), req(list(range(6, 17)))
    parent.pending_forks = [child]
    kv.attach(parent, kv.match(parent.fill_ids[:-1]))
    kv.assign(parent, 0, 11)
    parent.kv_len = 11
    parent.pending_forks = []
    kv.fork(parent, [child], own_last_position=False)
    a, b = kv.slots(parent, 0, 11), kv.slots(child, 0, 11)
    shared = 11 // page_size * page_size
    assert a[:shared] == b[:shared]                  # full pages are shared
    assert not set(a[shared:]) & set(b[shared:])     # the partial page is each sample's own
    kv.release(child, cache_kv=True)
    kv.release(parent, cache_kv=True)
    assert full(kv)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_growth_is_per_request_assignment_in_one_upload(page_size):
    """open_rounds gives every request of a speculative round the slots assign gives it
    alone (continuing a partial last page, then new pages), and close_rounds gives back
    exactly the pages past each kept length."""
    room = 12
    lengths = [8, 1, 13, 16, 5]
    slots_of = []
    for batched in (False, True):
        kv = manager(page_size)
        reqs = [req(list(range(6, 6 + n))) for n in lengths]
        for r, n in zip(reqs, lengths):
            kv.reserve(r, n)
        free = kv.memory_state()["kv_pages_free"]
        if batched:
            new = kv.open_rounds(reqs, room)
        else:
            new = [kv.open_rounds([r], room)[0] for r in reqs]  # one request at a time
        assert [len(p) for p in new] == [-(-(n + room) // page_size) - -(-n // page_size) for n in lengths]
        slots_of.append([kv.slots(r, 0, r.kv_len + room) for r in reqs])
        assert len({s for slots in slots_of[-1] for s in slots}) == sum(n + room for n in lengths)
        # Two positions of each round accepted: the pages past them go back.
        for r in reqs:
            r.kv_len += 2
        kv.close_rounds(reqs)
        kept = sum(-(-(n + 2) // page_size) - -(-n // page_size) for n in lengths)
        assert kv.memory_state()["kv_pages_free"] == free - kept
        for r in reqs:
            kv.release(r, cache_kv=False)
        assert full(kv)
    assert slots_of[0] == slots_of[1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_releasing_a_request_mid_round_gives_back_the_round_pages(page_size):
    """A request that ends while its round is open (a fault in the round's forward or
    process) holds pages past its kv_len: release gives those back too."""
    kv = manager(page_size)
    reqs = [req(list(range(6, 6 + n))) for n in (7, 12)]
    for r in reqs:
        kv.reserve(r, r.fill_len)
    kv.open_rounds(reqs, 9)
    reqs[0].kv_len += 3  # it kept part of its round before the fault
    for r in reqs:
        kv.release(r, cache_kv=r is reqs[0])
    assert full(kv)
    kv.close_rounds(reqs)  # ended requests: nothing left to close
    assert full(kv)


def test_the_memory_budget_covers_the_draft_pools(tmp_path):
    """With a draft, the pool is sized so target KV, draft KV and target features of
    every slot fit the budget together (they are indexed by the same slots)."""
    from pdserve.scheduler.memory_budget import size_kv_pages
    from pdserve.scheduler.memory import TokenToKVPool
    from pdserve.scheduler.scheduler import Scheduler
    from pdserve.testing import build_random_draft, build_random_model

    target = build_random_model(tmp_path / "t", "llama", num_layers=2)
    draft = build_random_draft(target, tmp_path / "e", "EAGLE3")
    budget = dict(cpu_kv_budget_gb=0.001, mem_fraction_static=0.5, max_running_requests=4096)
    plain = ServerArgs(model_path=str(target), **budget)
    spec = ServerArgs(model_path=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                      **budget)
    runner = ModelRunner(plain, target, TPGroup())
    plain_pages = size_kv_pages(plain, runner, TPGroup())
    sched = Scheduler(spec, ModelRunner(spec, target, TPGroup()), lambda ids: "")
    spec_pages = sched.kv.capacity + 1
    assert spec_pages < plain_pages
    cfg = runner.config
    per_slot = (TokenToKVPool.bytes_per_token(cfg.num_layers, runner.num_local_kv_heads, cfg.head_dim,
                                              runner.kv_dtype)
                + sum(t.numel() * t.element_size() for t in sched.spec.draft_pool.buffers().values())
                / sched.kv.num_slots
                + sched.spec.features[0].numel() * sched.spec.features.element_size())
    assert (spec_pages - 1) * per_slot <= 0.0005 * (1 << 30) < spec_pages * per_slot + per_slot


def test_the_device_budget_is_a_share_of_the_whole_device(caplog):
    """--mem-fraction-static is the share of the whole device for weights + KV, so two
    servers sharing one GPU (0.4 each) get the same pools whichever starts first; an
    impossible share is refused with the flag's name."""
    from pdserve.scheduler.memory_budget import MemoryBudgetError, device_kv_budget

    gib = 1 << 30
    total, weights = 80 * gib, 2 * gib
    # The first server starts on an empty device, the second after the first took its 40%.
    first = device_kv_budget(free=total - weights, total=total, held=weights, fraction=0.4)
    second = device_kv_budget(free=total - 32 * gib - weights, total=total, held=weights, fraction=0.4)
    assert first == second == int(total * 0.4) - weights
    # A share smaller than the weights, and a share larger than what is free.
    with pytest.raises(MemoryBudgetError, match="--mem-fraction-static 0.02.*raise"):
        device_kv_budget(free=total - weights, total=total, held=weights, fraction=0.02)
    with pytest.raises(MemoryBudgetError, match="--mem-fraction-static 0.85.*only 46.00 GiB.*lower"):
        device_kv_budget(free=total - 32 * gib - weights, total=total, held=weights, fraction=0.85)
    # Fitting, but with under 1 GiB left for activations: said in the log.
    with caplog.at_level("WARNING"):
        device_kv_budget(free=10 * gib, total=10 * gib + weights, held=weights, fraction=0.99)
    assert "leaves" in caplog.text


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_reserved_or_prefilled_request_gets_consecutive_slots_on_a_fragmented_pool(page_size):
    """A transfer writes one entry per run of consecutive slots on both sides: a PD
    reserve and a prompt's chunk skip the holes single pages left (the stack's top)."""
    kv = manager(page_size)
    singles = [kv.alloc_pages(1) for _ in range(20)]
    kv.allocator.release(torch.cat(singles[::2]))  # 10 one-page holes, on top of the stack
    r = req(list(range(6, 70)))
    slots = kv.reserve(r, 64)
    assert slots == list(range(slots[0], slots[0] + 64))
    prompt = req(list(range(6, 70)))
    prompt.row = kv.req_table.alloc()
    kv.assign(prompt, 0, 32)
    kv.assign(prompt, 32, 64)
    first, second = kv.slots(prompt, 0, 32), kv.slots(prompt, 32, 64)
    assert first == list(range(first[0], first[0] + 32)) and second == list(range(second[0], second[0] + 32))
    # The holes are still there for a decode step's single pages.
    assert sorted(kv.alloc_page_ids(10)) == sorted(p.item() for p in singles[::2])
