"""bench.kv_transfer: the churn simulation that places a request's slots (distinct slots
inside the pool, the allocation policy passed where the scheduler passes it, deterministic
per seed), the run-length statistic (what the transfer plan coalesces), the table and the
flags; and one end-to-end run on both engines between two processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.bench import kv_transfer as kt
from pdserve.disagg.landing import landing_regions, slot_runs, worth_landing
from pdserve.disagg.layout import BufferSpec, HeadRange, KVLayout, plan_transfer
from pdserve.scheduler.kv_manager import pages_for
from pdserve.scheduler.memory import PageAllocator

REPO = Path(__file__).resolve().parents[2]


class RecordingAllocator(PageAllocator):
    """The real allocator (the stack); each call's page count and `contiguous` recorded."""

    calls: list[tuple[int, bool | None]]
    last: "RecordingAllocator"  # the latest one built (churn_slots builds its own)

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.calls = []
        RecordingAllocator.last = self

    def alloc_ids(self, n: int, contiguous: bool | None = None) -> list[int]:  # type: ignore[override]
        self.calls.append((n, contiguous))
        return super().alloc_ids(n)


def _check_slots(slots: list[int], tokens: int, page_size: int, churn: kt.Churn) -> None:
    num_pages = pages_for(churn.pool_tokens(tokens), page_size) + 1
    assert len(slots) == tokens
    assert len(set(slots)) == tokens, "a slot handed out twice"
    assert all(page_size <= s < num_pages * page_size for s in slots), "a slot outside the pool (or in page 0)"
    for i in range(tokens):  # positions fill their pages in order
        if i % page_size:
            assert slots[i] == slots[i - 1] + 1


@pytest.mark.fast
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("tokens", [1, 37, 700, 3000])
def test_churned_slots_are_distinct_and_inside_the_pool(tokens, page_size):
    churn = kt.Churn(steps=60)
    for reserve in (False, True):
        slots = kt.churn_slots(tokens, page_size, seed=3, extent=False, reserve=reserve, churn=churn)
        _check_slots(slots, tokens, page_size, churn)
        assert slots == kt.churn_slots(tokens, page_size, seed=3, extent=False, reserve=reserve, churn=churn)
    assert kt.pool_slots(tokens, [page_size], churn) >= max(kt.churn_slots(tokens, page_size, seed=4, extent=False,
                                                                            churn=churn)) + 1


@pytest.mark.fast
def test_churn_scatters_the_request_and_the_seeds_differ():
    """The point of the simulation: after churn a page-size-1 request is not one run, and
    the two sides (seeds) place it differently."""
    a = kt.churn_slots(4096, 1, seed=0, extent=False)
    b = kt.churn_slots(4096, 1, seed=1, extent=False, reserve=True)
    assert a != b
    assert kt.joint_runs(a, b) > 16
    assert kt.joint_runs(list(range(4096)), list(range(4096))) == 1


@pytest.mark.fast
def test_prompt_chunks_and_reserves_ask_for_runs_and_decode_growth_does_not():
    churn = kt.Churn(steps=40, chunk=64)
    tokens = 300
    kt.churn_slots(tokens, 1, seed=2, extent=True, churn=churn, allocator_cls=RecordingAllocator)
    calls = RecordingAllocator.last.calls
    # The measured request's chunks close the list: 64, 64, 64, 64, 44 pages, each with runs.
    assert calls[-5:] == [(64, True)] * 4 + [(44, True)]
    assert {c for _, c in calls} == {True, None}  # decode steps pass nothing: the stack
    assert all(n <= churn.chunk for n, c in calls if c)  # a prompt is allocated a chunk at a time
    decode_steps = [n for n, c in calls if c is None]
    assert len(decode_steps) >= churn.steps and max(decode_steps) > 1  # one call per step for all requests
    kt.churn_slots(tokens, 1, seed=2, extent=True, reserve=True, churn=churn, allocator_cls=RecordingAllocator)
    assert RecordingAllocator.last.calls[-1] == (tokens, True)  # decode's PD reserve: one allocation
    kt.churn_slots(tokens, 1, seed=2, extent=False, churn=churn, allocator_cls=RecordingAllocator)
    assert {c for _, c in RecordingAllocator.last.calls} == {None}  # stack: the old allocator's calls


@pytest.mark.fast
def test_extent_is_refused_by_an_allocator_without_the_policy():
    class Old(PageAllocator):
        def alloc_ids(self, n: int) -> list[int]:  # type: ignore[override]
            return super().alloc_ids(n)

    assert not kt.has_extent_policy(Old) and kt.has_extent_policy(RecordingAllocator)
    with pytest.raises(ValueError, match="no `contiguous` policy"):
        kt.churn_slots(10, 1, seed=0, extent=True, allocator_cls=Old)
    assert [p.key for p in kt.patterns(40, [1, 16], 0, kt.Churn(steps=5), Old)] == \
        ["contiguous", "shuffle", "stack p1", "stack p16"]
    assert [p.key for p in kt.patterns(40, [1], 0, kt.Churn(steps=5), RecordingAllocator)] == \
        ["contiguous", "shuffle", "stack p1", "extent p1", "pd p1", "landed p1"]


@pytest.mark.fast
def test_a_prefill_servers_pool_is_never_grown_a_page_at_a_time():
    """Churn.decodes=False: background requests leave once their prompt is in, so every
    allocation is a prompt chunk asking for runs (no decode step's single pages)."""
    churn = kt.Churn(steps=40, chunk=64, decodes=False)
    kt.churn_slots(300, 1, seed=2, extent=True, churn=churn, allocator_cls=RecordingAllocator)
    calls = RecordingAllocator.last.calls
    assert calls[-5:] == [(64, True)] * 4 + [(44, True)]  # the measured request, in prompt chunks
    assert {c for _, c in calls} == {True} and len(calls) > 40  # the background's prompts, runs only
    _check_slots(kt.churn_slots(300, 16, seed=2, extent=True, churn=churn), 300, 16, churn)
    assert kt.prefill_server(kt.Churn(steps=7)) == kt.Churn(steps=7, decodes=False)
    with pytest.raises(ValueError, match="Churn.decodes must be True or False"):
        kt.Churn(decodes="no")  # type: ignore[arg-type]


@pytest.mark.fast
@pytest.mark.parametrize("seed", [0, 1])
def test_a_prefill_servers_pool_gives_long_runs_where_decode_churn_does_not(seed):
    """The role-true source: the same pool, prompts and allocator, churned without decode
    steps, places a 2048-token page-size-1 request in far fewer runs, so few that decode
    would not land it (the landing threshold), where the decode churn's would."""
    churn = kt.Churn()
    prefill = kt.churn_slots(2048, 1, seed=seed, extent=True, churn=kt.prefill_server(churn))
    decode = kt.churn_slots(2048, 1, seed=seed, extent=True, churn=churn)
    assert slot_runs(prefill) * 8 < slot_runs(decode)
    assert worth_landing(decode) and not worth_landing(prefill)


@pytest.mark.fast
def test_pd_and_landed_patterns_take_the_prefill_servers_source_and_extents_destination():
    churn = kt.Churn(steps=30)
    pats = {p.key: p for p in kt.patterns(300, [1, 16], 4, churn)}
    assert list(pats) == ["contiguous", "shuffle"] + kt.scatter_keys([1, 16])
    for ps in (1, 16):
        pd, landed, extent = pats[f"pd p{ps}"], pats[f"landed p{ps}"], pats[f"extent p{ps}"]
        assert pd.dst == extent.dst  # decode's reserve, as extent pN measures it
        assert list(pd.src) == kt.churn_slots(300, ps, seed=4, extent=True, churn=kt.prefill_server(churn))
        assert extent.src == tuple(kt.churn_slots(300, ps, seed=4, extent=True, churn=churn))  # unchanged
        assert (landed.src, landed.dst, landed.landed, pd.landed) == (pd.src, pd.dst, True, False)
        # landed: one entry per source run (the piece is consecutive); pd: runs on both sides
        assert landed.tokens_per_run == 300 / slot_runs(pd.src) >= pd.tokens_per_run == kt.run_length(pd.src, pd.dst)


@pytest.mark.fast
def test_run_length_counts_runs_consecutive_on_both_sides():
    src = [0, 1, 2, 5, 6, 9]
    dst = [10, 11, 12, 13, 14, 20]  # consecutive across src's first break, broken with src's second
    assert kt.joint_runs(src, dst) == 3 and kt.run_length(src, dst) == 2.0
    assert kt.joint_runs([0, 1, 2, 3], [4, 5, 9, 10]) == 2  # a break on one side is enough
    assert kt.joint_runs([7], [3]) == 1 and kt.run_length([], []) == 0.0
    assert kt.joint_runs([3, 2, 1], [1, 2, 3]) == 3  # descending slots are no run
    with pytest.raises(ValueError, match="3 source slots but 2"):
        kt.joint_runs([1, 2, 3], [1, 2])
    # What the statistic stands for: one write entry per run and buffer.
    churn = kt.Churn(steps=30)
    slots = kt.pool_slots(500, [1], churn)
    layout = KVLayout(1, tuple(BufferSpec(n, (i + 1) << 32, slots, 512) for i, n in
                               enumerate(("target.L0.K", "target.L0.V"))))
    s, d = (kt.churn_slots(500, 1, seed=seed, extent=False, churn=churn) for seed in (5, 6))
    assert kt.joint_runs(s, d) > 1
    plan = plan_transfer(layout, layout, ["target.L0.K", "target.L0.V"])
    assert len(plan.writes(s, d).src) == 2 * kt.joint_runs(s, d)
    assert len(plan.writes(src, dst).src) == 2 * 3


def _fake_result(with_extent: bool, unsplit: bool) -> kt.CaseResult:
    rates: dict[str, kt.Rate | None] = {
        "contiguous": kt.Rate(1.5, 8, 8, None, 64 if unsplit else None),
        "unsplit": kt.Rate(0.75, 8, 8) if unsplit else None,
        "shuffle": kt.Rate(0.015, 524288, 32768),
        "stack p1": kt.Rate(0.03, 100000, 32768, 1.6),
        "stack p16": kt.Rate(0.75, 4000, 4000, 131.0),
    }
    if with_extent:
        rates["extent p1"] = kt.Rate(0.3, 20000, 20000, 13.1)
        rates["extent p16"] = kt.Rate(1.2, 900, 900, 582.5)
        rates["pd p1"] = kt.Rate(0.6, 5000, 5000, 40.0)
        rates["landed p1"] = kt.Rate(0.9, 400, 400, 1310.7)
        rates["pd p16"] = kt.Rate(1.35, 300, 300, 1747.6)
        rates["landed p16"] = kt.Rate(1.2, 100, 100, 5242.9)
    return kt.CaseResult("mooncake", "demo", 65536, 256 * 2**20, 3.0, rates)


@pytest.mark.fast
def test_table_rows_line_up_with_the_header_and_mark_what_was_not_measured():
    header, rule = kt.table_header([1, 16])
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:5] == ["engine", "model", "tokens", "MiB", "raw TCP GB/s"]
    assert rule.count("---") == len(cols)
    row = kt.format_row(_fake_result(with_extent=True, unsplit=True), [1, 16])
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(cols)
    got = dict(zip(cols, cells))
    assert got["engine"] == "Mooncake" and got["model"].startswith("demo") and got["MiB"] == "256"
    assert got["contiguous GB/s (entries)"] == "1.50 (8 -> 64 on the wire)"
    assert got["contiguous / raw"] == "0.50x" and got["unsplit GB/s (entries)"] == "0.75 (8)"
    assert got["full shuffle p1 GB/s (/ contiguous; entries)"] == "0.015 (0.01x; 524288*)"
    assert got["stack p1 GB/s (/ contiguous; entries; tokens/run)"] == "0.030 (0.02x; 100000*; 1.6)"
    assert got["extent p16 GB/s (/ contiguous; entries; tokens/run)"] == "1.200 (0.80x; 900; 582.5)"
    assert cols[9:17] == [kt.scatter_title(k) for k in ("stack p1", "extent p1", "pd p1", "landed p1",
                                                       "stack p16", "extent p16", "pd p16", "landed p16")]
    assert got["pd p1 GB/s (/ contiguous; entries; tokens/run)"] == "0.600 (0.40x; 5000; 40.0)"
    assert got["landed p16 GB/s, write + unpack (/ contiguous; entries; source tokens/run)"] == \
        "1.200 (0.80x; 100; 5242.9)"
    old = dict(zip(cols, [c.strip() for c in kt.format_row(_fake_result(False, False), [1, 16]).strip("|").split("|")]))
    assert old["unsplit GB/s (entries)"] == "n/a" and old["contiguous GB/s (entries)"] == "1.50 (8)"
    assert old["extent p1 GB/s (/ contiguous; entries; tokens/run)"] == "n/a"
    assert old["pd p16 GB/s (/ contiguous; entries; tokens/run)"] == "n/a"
    assert old["landed p1 GB/s, write + unpack (/ contiguous; entries; source tokens/run)"] == "n/a"
    small = kt.CaseResult("nixl", "wide", 2, 2 * kt.SHAPES["wide"].token_bytes, 1.0, _fake_result(False, False).rates)
    assert kt.format_row(small, [1, 16]).startswith("| NIXL | wide (16 layers, 8x128 KV) | 2 | 0.25 | 1.00 |")


@pytest.mark.fast
def test_sizes_follow_the_shape_and_the_byte_cap():
    demo, wide = kt.SHAPES["demo"], kt.SHAPES["wide"]
    assert demo.token_bytes == 4096 and wide.token_bytes == 131072
    assert kt.sizes_of(demo, [1, 16, 64, 256], [], 2.5e9) == [256, 4096, 16384, 65536]
    assert kt.sizes_of(wide, [1, 256], [100], 2.5e9) == [8, 100, 2048]
    assert kt.sizes_of(wide, [1, 256], [], 2**27) == [8]  # 256 MiB is over a 128 MiB cap
    assert wide.tokens_for(0.01) == 1


@pytest.mark.fast
def test_flags():
    args = kt.parse_args([])
    assert args.engines == ["mooncake", "nixl"] and args.sizes_mib == [1, 16, 64, 256] and args.page_sizes == [1, 16, 64]
    assert args.ttft_engine == "mooncake"
    assert kt.parse_args(["--tokens", "4096"]).sizes_mib == []  # --tokens alone: those lengths only
    assert kt.parse_args(["--tokens", "4096", "--sizes-mib", "1"]).sizes_mib == [1.0]
    for bad, flag in ((["--pool-factor", "1.2"], "--pool-factor"), (["--sizes-mib", "0"], "--sizes-mib"),
                      (["--page-sizes", "x"], "--page-sizes"), (["--engines", "tcp"], "--engines"),
                      (["--sizes-mib", "--ttft-tokens"], "nothing to measure")):
        with pytest.raises(SystemExit):
            kt.parse_args(bad)


@pytest.mark.fast
def test_flag_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        kt.parse_args(["--pool-factor", "1.2"])
    assert "--pool-factor must be at least 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kt.parse_args(["--repeats", "0"])
    assert "--repeats takes numbers >= 1" in capsys.readouterr().err


@pytest.mark.fast
def test_best_time_repeats_within_its_budgets():
    calls = []
    assert kt.best_time(lambda: calls.append(1), 3, 10.0, min_s=0.0) >= 0 and len(calls) == 3
    calls.clear()
    kt.best_time(lambda: calls.append(1), 3, 0.0)  # the budget spent after the first run
    assert len(calls) == 1
    calls.clear()
    kt.best_time(lambda: calls.append(1), 2, 10.0, min_s=10.0, max_runs=7)  # fast: repeated, up to max_runs
    assert len(calls) == 7


@pytest.mark.fast
def test_wire_entries_split_at_the_engine_cap():
    from pdserve.disagg.transfer import WriteBatch

    batch = WriteBatch((0, 1, 2), (0, 1, 2), (2**20, 100, 2**19))
    assert kt.wire_entries(batch, 2**19) == 2 + 1 + 1
    assert kt.wire_entries(batch, None) == 3


# ---- end to end (two processes per engine) ---------------------------------------------------

NUMBER = re.compile(r"^-?\d+(\.\d+)?")


def test_a_tiny_run_on_both_engines_prints_every_row_with_positive_numbers():
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda) is not installed")
    pytest.importorskip("nixl_cu12", reason="the nixl extra (pip install -e '.[nixl]') is not installed")
    cmd = [sys.executable, "-m", "pdserve.bench.kv_transfer", "--engines", "mooncake", "nixl", "--shapes", "demo",
           "wide", "--sizes-mib", "0.25", "--page-sizes", "1", "16", "--repeats", "1", "--pattern-seconds", "0.2",
           "--max-entries", "100", "--churn-steps", "30", "--ttft-tokens", "64", "--ttft-engine", "nixl"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| engine |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in lines if line.startswith("| Mooncake |") or line.startswith("| NIXL |")]
    assert [r.split("|")[1:3] for r in rows] == [
        [f" {e} ", f" {kt.SHAPES[s].name} "] for e in ("Mooncake", "NIXL") for s in ("demo", "wide")]
    extent = kt.has_extent_policy()
    for row in rows:
        cells = dict(zip(cols, [c.strip() for c in row.strip("|").split("|")]))
        assert len(cells) == len(cols)
        for col, cell in cells.items():
            if col in ("engine", "model"):
                continue
            if cell == "n/a":  # only what this installation cannot measure
                assert col.startswith("unsplit") or (col.split()[0] in ("extent", "pd", "landed") and not extent), \
                    (col, row)
                continue
            m = NUMBER.match(cell)
            assert m and float(m.group()) > 0, (col, cell, row)
        # 0.25 MiB: 64 tokens of demo (8 buffers), 2 of wide (32 buffers); the shuffle is capped at 100
        assert cells["tokens"] in ("64", "2") and cells["MiB"] == "0.25"
        if cells["tokens"] == "64":
            assert cells["full shuffle p1 GB/s (/ contiguous; entries)"].endswith("*)")
    assert "TTFT split, NIXL" in proc.stdout
    ttft = [line for line in lines if line.startswith("| 64 |")]
    assert len(ttft) == 1 and all(float(c) > 0 for c in ttft[0].strip("|").replace("x", "").split("|")[:4])


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_the_receiver_check_sees_written_and_unwritten_slots(engine):
    """What each measured pattern is checked with: a planned write lands in the receiver's
    slots (every buffer), and slots nothing wrote are reported, naming the buffers."""
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[engine])
    from pdserve.disagg.engines import make_transfer_engine

    receiver = kt.Receiver(engine)
    sender = None
    try:
        session, metadata, layout, landing = receiver.setup("demo", 64)
        assert landing is None  # none asked for
        sender = make_transfer_engine(engine, host=kt.HOST)
        bufs = kt.SHAPES["demo"].buffers(64)
        for t in bufs.values():
            sender.register(t.data_ptr(), t.numel() * t.element_size())
        sender.add_peer(session, metadata)
        plan = plan_transfer(kt.layout_of(bufs), layout, list(bufs))
        sender.write(session, plan.writes([1, 2, 3, 9], [40, 41, 7, 8]))
        receiver.check([40, 41, 7, 8])
        with pytest.raises(RuntimeError, match=r"do not hold the sender's values in target\.L0\.K, .* 4 more"):
            receiver.check([40, 42])
        receiver.clear([7])
        with pytest.raises(RuntimeError, match="do not hold"):
            receiver.check([7])
    finally:
        if sender is not None:
            sender.close()
        receiver.close_case()
        receiver.stop()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_landed_write_reaches_the_slots_only_through_the_unpack(engine):
    """The landed pattern's path: the receiver's registered landing area, the sender's
    ``plan.landed`` writes (one entry per source run and buffer), the receiver's unpack
    into scattered slots; the check fails when the unpack or the write is left out."""
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[engine])
    from pdserve.disagg.engines import make_transfer_engine

    src, dst = [3, 4, 5, 6, 20, 21], [50, 7, 30, 31, 9, 12]
    receiver = kt.Receiver(engine)
    sender = None
    try:
        session, metadata, layout, landing = receiver.setup("demo", 64, landing_positions=len(dst))
        assert landing is not None and landing.name == "landing"
        sender = make_transfer_engine(engine, host=kt.HOST)
        shape = kt.SHAPES["demo"]
        bufs = shape.buffers(64)
        for t in bufs.values():
            sender.register(t.data_ptr(), t.numel() * t.element_size())
        sender.add_peer(session, metadata)
        plan = plan_transfer(kt.layout_of(bufs), layout, list(bufs))
        regions, size = landing_regions(layout, shape.names, len(dst))
        assert size <= landing.num_slots * landing.slot_bytes

        def landed_batch():
            base = landing.ptr + receiver.land(dst)  # a fresh, blanked piece
            return plan.landed(base, regions, len(dst)).writes(src, range(len(dst)))

        batch = landed_batch()
        assert len(batch.src) == len(shape.names) * slot_runs(src)  # 2 runs per buffer, not joint_runs' 5
        sender.write(session, batch)
        with pytest.raises(RuntimeError, match="do not hold the sender's values"):
            receiver.check(dst)  # written, not unpacked: the slots are still blank
        receiver.unpack()
        receiver.check(dst)
        receiver.clear(dst)
        landed_batch()  # the piece blanked again, nothing written into it
        receiver.unpack()
        with pytest.raises(RuntimeError, match="do not hold the sender's values"):
            receiver.check(dst)  # an unpack of a piece no write reached
    finally:
        if sender is not None:
            sender.close()
        receiver.close_case()
        receiver.stop()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_the_landed_pattern_is_measured_and_checked(engine, monkeypatch):
    """A tiny case of measure_case with a landed pattern: it is timed with its unpack and
    passes the byte check; with the unpack skipped the same case fails that check."""
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[engine])
    churn = kt.Churn(steps=5)
    tokens = 64
    contiguous = tuple(range(tokens))
    src = tuple(range(100, 100 + tokens))
    dst = tuple(range(tokens + 200, 200, -1))[:tokens]  # descending: one slot per run
    pats = [kt.Pattern("contiguous", contiguous, contiguous), kt.Pattern("landed p1", src, dst, landed=True)]
    receiver = kt.Receiver(engine)
    try:
        res = kt.measure_case(engine, receiver, "demo", tokens, pats, [1], churn, 1, 10**6, 0.2)
        landed = res.rates["landed p1"]
        assert landed is not None and landed.gbps > 0
        names = len(kt.SHAPES["demo"].names)
        assert landed.entries == landed.timed_entries == names  # one source run per buffer
        assert landed.tokens_per_run == tokens
        monkeypatch.setattr(receiver, "unpack", lambda: None)
        with pytest.raises(RuntimeError, match="do not hold the sender's values"):
            kt.measure_case(engine, receiver, "demo", tokens, pats, [1], churn, 1, 10**6, 0.2)
    finally:
        receiver.stop()


# ---- --decode-tp: a TP1 prefill rank's writes to one decode rank's share of the heads ----------

@pytest.mark.fast
def test_head_codes_tell_buffer_head_and_slot_apart():
    shape = kt.SHAPES["wide"]
    bufs = kt.coded_buffers(shape, 5)
    codes = {n: t.view(torch.int32) for n, t in bufs.items()}
    k0 = codes["target.L0.K"]
    assert (k0 == k0[:, :, :1]).all()  # one code per (slot, head): the head's elements alike
    assert len({int(c) for t in codes.values() for c in t[:, :, 0].flatten()}) == 32 * 5 * 8  # all distinct
    assert (k0 >= 0).all() and torch.tensor([kt.BLANK]).view(torch.int32) < 0  # never BLANK's bits
    # The receiver's expectation for decode rank 1 of TP 2 (heads 4..7) is the sender's heads 4..7.
    heads = shape.decode_heads(2)
    assert heads == HeadRange(0, 4, 8) and shape.decode_heads(4) == HeadRange(0, 2, 8)
    upper = HeadRange(4, 4, 8)
    want = kt.head_codes("target.L3.V", upper, torch.tensor([1, 4])).expand(-1, -1, shape.head_dim)
    assert torch.equal(codes["target.L3.V"][[1, 4], 4:], want)
    assert not torch.equal(codes["target.L3.V"][[1, 4], :4], want)  # the other heads differ
    assert not torch.equal(codes["target.L3.V"][[0, 4], 4:], want)  # so do other slots
    with pytest.raises(ValueError, match="at most 16 KV heads, not 32"):
        kt.head_codes("target.L0.K", HeadRange(0, 32, 32), torch.arange(2))


@pytest.mark.fast
def test_a_decode_ranks_plan_has_an_entry_per_position_and_buffer_and_its_landing_piece_one_region_each():
    """What "tp direct" times and why: decode rank 0 at TP 2 holds half of each slot, so
    even contiguous slots on both sides are one entry per position and buffer; its landing
    piece, cut for one TP1 prefill rank, is one region per buffer of the half rows."""
    shape = kt.SHAPES["demo"]
    src = kt.coded_buffers(shape, 16)
    dst_bufs = shape.buffers(16, blank=True, heads=2)
    heads = shape.decode_heads(2)
    dst = kt.layout_of(dst_bufs, heads)
    assert {b.heads for b in dst.buffers} == {heads} and {b.slot_bytes for b in dst.buffers} == {2 * 32 * 4}
    plan = plan_transfer(kt.layout_of(src, shape.all_heads), dst, shape.names, prefill_rank=0,
                         prefill_head_ranges=[shape.all_heads])
    assert {(p.src_offset, p.dst_offset, p.length) for p in plan.pairs} == {(0, 0, 256)}
    assert len(plan.writes(range(16), range(16)).src) == 16 * len(shape.names)
    regions, size = landing_regions(dst, shape.names, 16, {n: [shape.all_heads] for n in shape.names})
    assert [(r.row_bytes, r.skip) for r in regions] == [(256, 0)] * len(shape.names) and size == 16 * 256 * 8


def _tp_result(direct_entries: int, timed: int) -> kt.TpResult:
    return kt.TpResult("nixl", "wide", 2048, 2, 128 * 2**20, 2.0, kt.Rate(0.05, direct_entries, timed),
                       kt.Rate(1.0, 128, 128), 0.01)


@pytest.mark.fast
def test_the_tp_table_rows_line_up_with_its_header():
    header, rule = kt.tp_table_header()
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols == list(kt.TP_COLUMNS) and rule.count("---") == len(cols)
    cells = dict(zip(cols, [c.strip() for c in kt.format_tp_row(_tp_result(65536, 32768)).strip("|").split("|")]))
    assert len(cells) == len(cols)
    assert cells == {"engine": "NIXL", "model": "wide (16 layers, 8x128 KV)", "tokens": "2048", "MiB moved": "128",
                     "raw TCP GB/s": "2.00", "tp direct GB/s (/ raw; entries)": "0.050 (0.025x; 65536*)",
                     "tp gathered GB/s, gather + write + unpack (/ raw; entries)": "1.000 (0.5x; 128)",
                     "gathered / direct": "20.0x"}
    assert "(0.025x; 512)" in kt.format_tp_row(_tp_result(512, 512))  # all timed: no star


@pytest.mark.fast
def test_decode_tp_flag(capsys):
    assert kt.parse_args([]).decode_tp == 1
    assert kt.parse_args(["--decode-tp", "2"]).decode_tp == 2
    assert kt.parse_args(["--decode-tp", "8", "--shapes", "demo"]).decode_tp == 8  # 4 heads: replicated
    with pytest.raises(SystemExit):
        kt.parse_args(["--decode-tp", "0"])
    assert "--decode-tp takes numbers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kt.parse_args(["--decode-tp", "3"])
    assert "--decode-tp 3 does not shard the 4 KV heads of shape 'demo'" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_the_decode_rank_check_sees_wrong_heads_and_wrong_slots(engine):
    """What the --decode-tp patterns are checked with: decode rank 0's slots must hold the
    sender's first half of the heads of the same position; the other half, or the right
    heads of the next position, fail, naming the buffers."""
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[engine])
    from pdserve.disagg.engines import make_transfer_engine
    from pdserve.disagg.layout import BufferPair, TransferPlan

    shape = kt.SHAPES["demo"]
    receiver = kt.Receiver(engine)
    sender = None
    try:
        session, metadata, layout, _ = receiver.setup("demo", 8, decode_tp=2)
        assert {b.heads for b in layout.buffers} == {HeadRange(0, 2, 4)}
        sender = make_transfer_engine(engine, host=kt.HOST)
        bufs = kt.coded_buffers(shape, 8)
        for t in bufs.values():
            sender.register(t.data_ptr(), t.numel() * t.element_size())
        sender.add_peer(session, metadata)
        src = kt.layout_of(bufs, shape.all_heads)
        plan = plan_transfer(src, layout, shape.names, prefill_rank=0, prefill_head_ranges=[shape.all_heads])
        sender.write(session, plan.writes(range(8), range(8)))
        receiver.check_heads(range(8), range(8))
        with pytest.raises(RuntimeError, match=r"do not hold this decode rank's heads .* in target\.L0\.K, .* 4 more"):
            receiver.check_heads(range(1, 8), range(7))  # the right heads, of the previous position
        upper = TransferPlan(tuple(BufferPair(p.src, p.dst, p.length, 0, p.length) for p in plan.pairs))
        sender.write(session, upper.writes([3], [3]))  # heads 2..3 of slot 3
        with pytest.raises(RuntimeError, match="do not hold this decode rank's heads"):
            receiver.check_heads([3], [3])
        receiver.check_heads([2, 4], [2, 4])
    finally:
        if sender is not None:
            sender.close()
        receiver.close_case()
        receiver.stop()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_decode_tp_case_is_measured_and_checked(engine, monkeypatch):
    """A small real --decode-tp 2 case: both patterns pass the receiver's byte check; the
    direct one is one entry per position per buffer, the gathered one one per buffer per
    piece of the gather buffer (here 3: 64 positions of 8 half rows, 24 positions a
    piece); with the receiver's unpack skipped the gathered pattern fails its check."""
    pytest.importorskip({"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}[engine])
    shape = kt.SHAPES["demo"]
    names = len(shape.names)
    tokens, per_position = 64, len(shape.names) * 2 * 32 * 4
    receiver = kt.Receiver(engine)
    try:
        res = kt.measure_tp_case(engine, receiver, "demo", tokens, 2, 1, 10**6, 0.2, gather_bytes=24 * per_position)
        assert res.nbytes == tokens * shape.token_bytes // 2 and res.raw > 0
        assert res.direct.entries == res.direct.timed_entries == tokens * names
        assert res.gathered.entries == res.gathered.timed_entries == 3 * names
        assert res.direct.gbps > 0 and res.gathered.gbps > 0 and res.split_s > 0
        # A prefix timed: still written whole (untimed) and checked.
        res = kt.measure_tp_case(engine, receiver, "demo", tokens, 2, 1, 100, 0.2)
        assert (res.direct.entries, res.direct.timed_entries, res.gathered.entries) == (tokens * names, 100, names)
        monkeypatch.setattr(receiver, "unpack", lambda: None)
        with pytest.raises(RuntimeError, match="do not hold this decode rank's heads"):
            kt.measure_tp_case(engine, receiver, "demo", tokens, 2, 1, 10**6, 0.2)
    finally:
        receiver.stop()
