"""FP8 KV across the prefill/decode split: the seed's cell (prefill plain -> decode EAGLE)
and a plain pair (host-staged) with fp8 KV give the colocated fp8 engine's greedy outputs
on the demo model; the wire carries one byte per KV element; the handshake refuses a KV
dtype (or KV scales) mismatch by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve import assets
from pdserve.disagg.decode_side import decode_scheduler
from pdserve.disagg.layout import CompatRecord, HandshakeError, check_compatible
from pdserve.disagg.prefill_side import prefill_scheduler
from pdserve.disagg.staging import HostStaging
from tests.disagg.test_pd_schedulers import dirs, handshake_outcome, pools_full, run_pair, sched  # noqa: F401
from tests.disagg.test_seeds import PARAMS, accuracy, questions  # noqa: F401


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    return {"target": assets.path("demo"), "EAGLE": assets.path("demo-eagle")}


def pair(demo, d_algo: str | None, kv: str, extra: dict[str, Any] | None = None, p_algo: str | None = None):
    p = sched(prefill_scheduler, demo, p_algo, {"kv_cache_dtype": kv, "chunked_prefill_size": 64, **(extra or {})})
    d = sched(decode_scheduler, demo, d_algo, {"kv_cache_dtype": kv, **(extra or {})},
              fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    return p, d


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_seed_cell_plain_prefill_eagle_decode_with_fp8_kv(make_engine, demo, questions, kv):  # noqa: F811
    tok, convs, ids = questions
    colocated = make_engine(demo["target"], kv_cache_dtype=kv)
    assert colocated._scheduler.kv.kv_pool.k[0].element_size() == 1
    ref = [r["output_ids"] for r in colocated.generate(input_ids=ids, sampling_params=PARAMS)]
    default = [r["output_ids"] for r in make_engine(demo["target"]).generate(input_ids=ids, sampling_params=PARAMS)]
    # The demo model answers as well from fp8 KV as from its fp32 KV.
    assert accuracy(tok, convs, ref) >= accuracy(tok, convs, default) - 0.03
    p, d = pair(demo, "EAGLE", kv, {"page_size": 16})
    try:
        assert d.spec.draft_pool.k[0].element_size() == 1  # the draft's KV is fp8 too
        got = run_pair(p, d, ids, PARAMS)
        assert got == ref
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_eagle_pair_hands_over_fp8_draft_kv(make_engine, demo, questions):  # noqa: F811
    """Prefill running decode's draft sends the draft KV (fp8 too, one byte an element)
    with the target KV; decode starts from that draft state: colocated fp8 tokens."""
    _, _, ids = questions
    ids = ids[::2]
    ref = [r["output_ids"] for r in make_engine(demo["target"], kv_cache_dtype="fp8_e4m3").generate(
        input_ids=ids, sampling_params=PARAMS)]
    p, d = pair(demo, "EAGLE", "fp8_e4m3", {"page_size": 16}, p_algo="EAGLE")
    try:
        assert run_pair(p, d, ids, PARAMS) == ref
        sent = p.mode.manager.bytes_by_kind
        assert sent["draft_kv"] > 0 and sent["features"] == 0
        # Per position: the target's KV is 4 layers, the draft's 1, both fp8 of the same width.
        assert sent["target_kv"] == 4 * sent["draft_kv"]
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_plain_pair_host_staged_fp8_equals_colocated_and_sends_a_quarter_of_fp32(
        make_engine, demo, questions):  # noqa: F811
    """The demo model computes in fp32: its default KV is 4 bytes an element, fp8's 1, and
    a plain pair sends only KV, so the same requests move exactly a quarter of the bytes."""
    _, _, ids = questions
    ids = ids[::3]
    sent = {}
    for kv in ("auto", "fp8_e4m3"):
        ref = [r["output_ids"] for r in make_engine(demo["target"], kv_cache_dtype=kv).generate(
            input_ids=ids, sampling_params=PARAMS)]
        p, d = pair(demo, None, kv, {"disaggregation_kv_staging": "host"})
        try:
            assert run_pair(p, d, ids, PARAMS) == ref
            sent[kv] = p.mode.manager.bytes_by_kind["target_kv"]
            assert p.mode.manager.bytes_by_kind["features"] == 0
            pools_full(p)
            pools_full(d)
        finally:
            p.close()
            d.close()
    assert sent["auto"] > 0 and sent["fp8_e4m3"] * 4 == sent["auto"]


@pytest.mark.fast
def test_host_staging_moves_fp8_bytes():
    device_buf = (torch.arange(40, dtype=torch.float32).view(10, 4) / 8).to(torch.float8_e4m3fn)
    staging = HostStaging()
    twin = staging.twin("kv", device_buf)
    assert twin.dtype == torch.float8_e4m3fn and twin.element_size() == 1
    staging.stage_out([2, 7])
    assert torch.equal(twin[[2, 7]].view(torch.uint8), device_buf[[2, 7]].view(torch.uint8))
    twin[5] = torch.full((4,), -1.0).to(torch.float8_e4m3fn)
    staging.stage_in([5])
    assert (device_buf[5].float() == -1).all() and device_buf[4, 0].float() == 2.0


@pytest.mark.fast
def test_compat_record_names_kv_dtype_and_kv_scales_mismatches():
    base = CompatRecord(1, "LlamaForCausalLM", 4, 2, 16, "float8_e4m3fn", 16, 100)
    with pytest.raises(HandshakeError, match="kv_dtype: float8_e4m3fn vs bfloat16"):
        check_compatible(base, CompatRecord(**{**base.__dict__, "kv_dtype": "bfloat16"}))
    with pytest.raises(HandshakeError, match="kv_scales: 1.0 vs crc32:0000abcd"):
        check_compatible(base, CompatRecord(**{**base.__dict__, "kv_scales": "crc32:0000abcd"}))
    check_compatible(base, CompatRecord(**base.__dict__))


def test_kv_dtype_mismatch_refused_at_handshake_by_name(dirs):  # noqa: F811
    p = sched(prefill_scheduler, dirs, None, {"kv_cache_dtype": "fp8_e4m3"})
    sides = [sched(decode_scheduler, dirs, None, {"kv_cache_dtype": kv},
                   fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
             for kv in ("auto", "fp8_e5m2", "fp8_e4m3")]
    try:
        assert "kv_dtype: float8_e4m3fn vs float32" in handshake_outcome(sides[0])
        assert "kv_dtype: float8_e4m3fn vs float8_e5m2" in handshake_outcome(sides[1])
        assert handshake_outcome(sides[2]) is None
    finally:
        for s in (p, *sides):
            s.close()
