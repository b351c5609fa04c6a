"""A real prefill server and a real decode server (separate processes, Mooncake or NIXL over
TCP on loopback): requests sent to both with one bootstrap room come back from decode equal
to the colocated engine, for plain and speculative decode, on either transfer engine; bad PD
fields are refused."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any, Iterator

import httpx
import pytest

from pdserve.disagg import protocol as P
from pdserve.testing import build_random_draft, build_random_model
from tests.server.conftest import ServerProcess, assert_openai_error, free_port

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdsrv")
    t = build_random_model(root / "t", "llama", num_layers=4, num_heads=4, num_kv_heads=2)
    return t, build_random_draft(t, root / "e", "EAGLE")


async def pd_generate(p: ServerProcess, d: ServerProcess, boot_port: int, body: dict, room: int | list[int]) -> Any:
    body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=boot_port, bootstrap_room=room)
    async with httpx.AsyncClient(timeout=120) as c:
        rp, rd = await asyncio.gather(c.post(p.url + "/generate", json=body), c.post(d.url + "/generate", json=body))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    return rd.json()


def metric_values(text: str) -> dict[str, float]:
    """A /metrics page's samples by name and labels."""
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def prompts_and_reference(make_engine, target, seed: int, n: int, min_len: int, max_len: int,
                          params: dict) -> tuple[random.Random, list[list[int]], list[Any]]:
    """`n` random prompts (lengths in [min_len, max_len)), the colocated engine's answers,
    and the generator to draw rooms from."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 90) for _ in range(rng.randrange(min_len, max_len))] for _ in range(n)]
    return rng, prompts, make_engine(target).generate(input_ids=prompts, sampling_params=params)


def pd_generate_all(p: ServerProcess, d: ServerProcess, boot_port: int, prompts: list[list[int]],
                    params: dict, rooms: list[int]) -> list[Any]:
    """Every prompt at once, each in its own room: decode's answers."""
    async def run_all() -> list[Any]:
        return await asyncio.gather(*[pd_generate(p, d, boot_port, {"input_ids": ids, "sampling_params": params},
                                                  room) for ids, room in zip(prompts, rooms)])
    return asyncio.run(run_all())


@contextlib.contextmanager
def pd_pair(target, boot_port: int, prefill_flags: tuple[str, ...] = (),
            decode_flags: tuple[str, ...] = (), backend: str = "mooncake"
            ) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A prefill server (its bootstrap server on `boot_port`) and a decode server, both on
    transfer engine `backend`; both pools must be full at the end of a test that passed."""
    engine = ("--disaggregation-transfer-backend", backend)
    p = ServerProcess(target, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot_port),
                      *engine, *prefill_flags)
    try:
        d = ServerProcess(target, "--disaggregation-mode", "decode", *engine, *decode_flags)
        try:
            yield p, d
            p.assert_pools_full()
            d.assert_pools_full()
        finally:
            d.close()
    finally:
        p.close()


@pytest.mark.parametrize("backend,decode_spec", [("mooncake", False), ("mooncake", True), ("nixl", False),
                                                 ("nixl", True)],
                         ids=["plain", "decode-eagle", "nixl-plain", "nixl-decode-eagle"])
def test_pd_servers_equal_colocated(dirs, make_engine, backend, decode_spec):
    target, draft = dirs
    rng, prompts, ref = prompts_and_reference(make_engine, target, 3, 6, 5, 60, GREEDY)
    boot = free_port()
    extra = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft)) if decode_spec else ()
    with pd_pair(target, boot, ("--chunked-prefill-size", "16"), extra, backend) as (p, d):
        outs = pd_generate_all(p, d, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
        if decode_spec:
            assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in outs)
        # n > 1 and a batch: one room per sample (prompt-major), as SGLang's router sends them.
        sampled = {"n": 2, "temperature": 1.0, "seed": 5, "max_new_tokens": 8, "ignore_eos": True}
        want = make_engine(target).generate(input_ids=prompts[:2], sampling_params=sampled)
        rooms = [rng.getrandbits(63) for _ in range(4)]
        got = asyncio.run(pd_generate(p, d, boot, {"input_ids": prompts[:2], "sampling_params": sampled}, rooms))
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for bad_room in (rooms[:3], rooms[0], [rooms[0]] * 4):
            assert_openai_error(d.client.post("/generate", json={
                "input_ids": prompts[:2], "sampling_params": sampled, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": boot, "bootstrap_room": bad_room}), fields=("bootstrap_room",))
        # Without PD fields a prefill/decode server refuses the request with a 400.
        assert_openai_error(d.client.post("/generate", json={"input_ids": prompts[0], "sampling_params": GREEDY}),
                            fields=("bootstrap_room",))
        assert_openai_error(p.client.post("/v1/completions", json={"prompt": "hi", "bootstrap_host": "127.0.0.1",
                                                                   "bootstrap_room": 2**63}),
                            fields=("bootstrap_room",))
        # Bytes by kind on both sides: target KV and the handoff records always; per-position
        # target features only for a speculative decode, whose draft then runs over each
        # prompt here (decode_draft_prefill_tokens_total).
        sent, received = metric_values(p.client.get("/metrics").text), metric_values(d.client.get("/metrics").text)
        for side in (sent, received):
            kinds = {k: side[f'pdserve:kv_transfer_bytes_total{{kind="{k}"}}'] for k in P.TRANSFER_KINDS}
            assert kinds["target_kv"] > 0 and kinds["metadata"] > 0 and kinds["draft_kv"] == 0, kinds
            assert (kinds["features"] > 0) == decode_spec, kinds
        assert sent['pdserve:kv_transfer_bytes_total{kind="target_kv"}'] == \
            received['pdserve:kv_transfer_bytes_total{kind="target_kv"}']
        draft_prefill = received["pdserve:decode_draft_prefill_tokens_total"]
        assert draft_prefill == (sum(map(len, prompts)) + 2 * sum(map(len, prompts[:2])) if decode_spec else 0)
        assert 'pdserve:disagg_queue_reqs{state="transferring"}' in d.client.get("/metrics").text


def test_300_concurrent_requests_over_1p1d_lose_nothing(dirs, make_engine):
    """A burst through a small client that sends each request to both servers (the router
    issue brings the real router): every request completes, equal to colocated."""
    target, _ = dirs
    params = dict(GREEDY, max_new_tokens=4)
    _, prompts, ref = prompts_and_reference(make_engine, target, 11, 300, 3, 24, params)
    boot = free_port()
    with pd_pair(target, boot) as (p, d):
        base = random.Random(12).getrandbits(63)
        rooms = [(base + i) % 2**63 for i in range(len(prompts))]  # distinct 63-bit rooms
        outs = pd_generate_all(p, d, boot, prompts, params, rooms)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]


@pytest.mark.parametrize("backend,p_tp,d_tp", [("mooncake", 1, 1), ("nixl", 1, 1), ("mooncake", 1, 2),
                                               ("nixl", 2, 1)],
                         ids=["mooncake", "nixl", "mooncake-d-tp2", "nixl-p-tp2"])
def test_landed_transfers_over_real_engines(dirs, make_engine, backend, p_tp, d_tp):
    """Every decode reserve lands at page size 1: the engine writes into decode's registered
    landing area (with prefill at TP2, both prefill ranks into one decode rank's piece,
    each into its own region), decode copies each request into its slots at commit;
    outputs equal colocated and the area is whole again afterwards. The reserves of a
    fresh pool are one run: they land because --disaggregation-kv-landing-min-run is past
    any prompt, or, with decode at the higher TP, by default (the prefill rank sends each
    decode rank part of each slot's heads, which it gathers)."""
    target, _ = dirs
    rng, prompts, ref = prompts_and_reference(make_engine, target, 31, 6, 20, 70, GREEDY)
    boot = free_port()
    always = () if d_tp > p_tp else ("--disaggregation-kv-landing-min-run", "1000000000")
    with pd_pair(target, boot, ("--page-size", "1", "--chunked-prefill-size", "16", "--tp-size", str(p_tp)),
                 ("--page-size", "1", "--tp-size", str(d_tp), *always), backend) as (p, d):
        outs = pd_generate_all(p, d, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
        landing = d.wait_idle()["disaggregation"]["landing"]
        assert landing["landed_requests"] == len(prompts), landing
        # The default size: 1/32 of the rank's KV pool, at least 16 MiB (this model's pool is small).
        assert landing["free_bytes"] == landing["capacity_bytes"] == 16 << 20 and landing["pieces"] == 0, landing
        assert metric_values(d.client.get("/metrics").text)["pdserve:decode_landed_requests_total"] == len(prompts)
        # Decode at a higher TP holds part of each prefill slot's heads: prefill gathers
        # them (else one entry per position); otherwise its slots are runs and go as planned.
        gathered = p.wait_idle()["disaggregation"]["gathered_bytes"]
        assert (gathered > 0) == (d_tp > p_tp), gathered


@pytest.mark.parametrize("p_tp,d_tp,decode_spec", [(1, 2, False), (2, 1, False)], ids=["p-tp1-d-tp2", "p-tp2-d-tp1"])
def test_heterogeneous_tensor_parallel_pairs(dirs, make_engine, p_tp, d_tp, decode_spec):
    """Prefill and decode shard the KV heads differently: each prefill rank writes the
    heads it holds into the decode rank that holds them (GQA, 2 KV heads); page size 16
    and chunked prefill; outputs equal the colocated single-rank engine. With drafts on
    either side: tests/disagg/test_pd_tp_speculative.py."""
    target, draft = dirs
    rng, prompts, ref = prompts_and_reference(make_engine, target, 21, 5, 5, 70, GREEDY)
    boot = free_port()
    extra = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft)) if decode_spec else ()
    with pd_pair(target, boot, ("--tp-size", str(p_tp), "--page-size", "16", "--chunked-prefill-size", "32"),
                 ("--tp-size", str(d_tp), "--page-size", "16", *extra)) as (p, d):
        outs = pd_generate_all(p, d, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
