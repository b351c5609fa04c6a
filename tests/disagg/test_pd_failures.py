"""Failures across a real prefill/decode pair: each reaches the client with a reason, in
seconds not minutes, and leaves both pools full (a peer killed mid-transfer and an aborted
room on each transfer engine, Mooncake and NIXL)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve.testing import build_random_model
from tests.server.conftest import ServerProcess, free_port
from tests.waiting import wait_until

PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("pdfail") / "t", "llama", num_layers=2)


def start_pair(target, boot: int, prefill_extra: tuple[str, ...] = (), backend: str = "mooncake"):
    fast = ["--disaggregation-heartbeat-interval", "0.2", "--disaggregation-heartbeat-misses", "3",
            "--disaggregation-bootstrap-timeout", "3", "--disaggregation-waiting-timeout", "20",
            "--disaggregation-transfer-backend", backend]
    p = ServerProcess(target, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *fast,
                      *prefill_extra)
    d = ServerProcess(target, "--disaggregation-mode", "decode", *fast)
    return p, d


def body(room: int, boot: int) -> dict:
    return {"input_ids": [5, 6, 7, 8, 9], "sampling_params": PARAMS, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot, "bootstrap_room": room}


def post_async(url: str, payload: dict, box: dict) -> threading.Thread:
    def run():
        t0 = time.monotonic()
        try:
            box["response"] = httpx.post(url, json=payload, timeout=120)
        except httpx.HTTPError as exc:
            box["error"] = exc
        box["seconds"] = time.monotonic() - t0
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def disagg_state(s: ServerProcess) -> dict:
    return s.state()["disaggregation"]


def abort_message(r: httpx.Response) -> str:
    data = r.json()
    if "error" in data:
        return data["error"]["message"]
    assert data["meta_info"]["finish_reason"]["type"] == "abort", data
    return data["meta_info"]["finish_reason"]["message"]


def test_prefill_death_fails_waiting_decode_rooms_within_heartbeats(target):
    boot = free_port()
    p, d = start_pair(target, boot)
    try:
        # Warm the pair up (handshake), then a request only decode knows about waits for prefill.
        ok = {}
        t1, t2 = post_async(p.url + "/generate", body(1, boot), {}), post_async(d.url + "/generate", body(1, boot), ok)
        t1.join(60), t2.join(60)
        assert ok["response"].status_code == 200
        box: dict = {}
        t = post_async(d.url + "/generate", body(2, boot), box)
        wait_until(lambda: disagg_state(d)["transferring"] == 1, 20.0)
        killed = time.monotonic()
        p.kill_all()
        t.join(30)
        assert time.monotonic() - killed < 5.0, "decode noticed the dead prefill too late"
        assert "stopped answering heartbeats" in abort_message(box["response"])
        d.assert_pools_full()
        assert disagg_state(d)["failures"].get("peer_dead") == 1
        assert disagg_state(d)["peers_lost"] == 1  # the dead prefill rank, counted once
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_decode_death_mid_transfer_fails_prefill_rooms_within_heartbeats(target, backend):
    """Decode dies while prefill is still computing and sending a long prompt in small
    chunks: prefill fails the room within the heartbeat deadline, its client gets the
    reason, its pages all come back, and the server keeps serving."""
    boot = free_port()
    p, d = start_pair(target, boot, ("--chunked-prefill-size", "4"), backend)
    try:
        long_prompt = dict(body(3, boot), input_ids=[5 + i % 80 for i in range(1000)])
        box: dict = {}
        t = post_async(p.url + "/generate", long_prompt, box)
        post_async(d.url + "/generate", long_prompt, {})
        wait_until(lambda: disagg_state(p)["rooms"]["transferring"] == 1, 20.0)
        killed = time.monotonic()
        d.kill_all()
        t.join(30)
        assert time.monotonic() - killed < 5.0, "prefill noticed the dead decode too late"
        # Whichever comes first names the cause: the next write fails, or heartbeats stop.
        message = abort_message(box["response"])
        assert "stopped answering heartbeats" in message or "KV transfer failed" in message, message
        failures = disagg_state(p)["failures"]
        assert failures.get("peer_dead", 0) + failures.get("transfer_error", 0) == 1, failures
        # Whichever failed the room, the dead decode rank stops answering heartbeats: counted once.
        wait_until(lambda: disagg_state(p)["peers_lost"] == 1, 10.0, what="prefill counted the lost decode peer")
        p.assert_pools_full()
        # A new decode server pairs with the same prefill server.
        d2 = ServerProcess(target, "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend)
        try:
            ok: dict = {}
            ts = [post_async(p.url + "/generate", body(4, boot), {}), post_async(d2.url + "/generate", body(4, boot), ok)]
            for th in ts:
                th.join(60)
            assert ok["response"].status_code == 200 and len(ok["response"].json()["output_ids"]) == 8
            d2.assert_pools_full()
        finally:
            d2.close()
        p.assert_pools_full()
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_room_aborted_mid_transfer_fails_on_both_sides_and_frees_both_pools(target, backend):
    """The prefill leg of a long prompt is aborted (/abort_request) while its KV is being
    sent in small chunks: decode's client hears that prefill failed the request, both
    pools come back whole (decode's pages once prefill acknowledged its last write), and
    the pair serves the next request."""
    boot = free_port()
    p, d = start_pair(target, boot, ("--chunked-prefill-size", "4"), backend)
    try:
        long_prompt = dict(body(5, boot), input_ids=[5 + i % 80 for i in range(1000)], rid="abort-me")
        boxes: tuple[dict, dict] = ({}, {})
        threads = [post_async(p.url + "/generate", long_prompt, boxes[0]),
                   post_async(d.url + "/generate", dict(long_prompt, rid="decode-leg"), boxes[1])]
        wait_until(lambda: disagg_state(p)["rooms"]["transferring"] == 1, 20.0)
        assert p.client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
        for t in threads:
            t.join(30)
        assert boxes[1]["seconds"] < 30
        assert "prefill failed the request" in abort_message(boxes[1]["response"]), boxes[1]["response"].text
        p.assert_pools_full()
        d.assert_pools_full()
        ok: dict = {}
        ts = [post_async(p.url + "/generate", body(6, boot), {}), post_async(d.url + "/generate", body(6, boot), ok)]
        for th in ts:
            th.join(60)
        assert ok["response"].status_code == 200 and len(ok["response"].json()["output_ids"]) == 8
    finally:
        d.close()
        p.close()


def test_bootstrap_never_completed_and_duplicate_room(target):
    boot = free_port()
    p, d = start_pair(target, boot)
    try:
        # Prefill gets a request decode never asks for: it fails at the bootstrap deadline.
        box: dict = {}
        t = post_async(p.url + "/generate", body(7, boot), box)
        dup: dict = {}
        wait_until(lambda: disagg_state(p)["rooms"]["bootstrapping"] == 1, 20.0)  # room 7 is live
        t_dup = post_async(p.url + "/generate", body(7, boot), dup)  # same live room: refused
        t_dup.join(30)
        assert "already in use" in abort_message(dup["response"])
        t.join(30)
        assert "bootstrapping exceeded its 3 s deadline" in abort_message(box["response"])
        assert box["seconds"] < 10
        # On the OpenAI routes such a server-side failure is a 503 with the reason (not a 400).
        r = httpx.post(p.url + "/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                             "bootstrap_port": boot, "bootstrap_room": 8})
        assert r.status_code == 503 and "bootstrapping exceeded" in r.json()["error"]["message"], r.text
        p.assert_pools_full()
        # An unreachable prefill server is a clear error from decode, not a hang.
        bad = dict(body(8, boot), bootstrap_port=free_port())
        r = httpx.post(d.url + "/generate", json=bad, timeout=60)
        assert "did not list the prefill ranks" in abort_message(r)
        d.assert_pools_full()
    finally:
        d.close()
        p.close()
