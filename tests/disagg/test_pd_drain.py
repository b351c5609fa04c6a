"""Draining a PD prefill server (SIGTERM) lets its in-flight transfer finish: the request's
prefill leg is in flight (waiting for its decode side) when the drain begins; /health is
503 draining, a new request is refused, and once the decode leg arrives the KV moves, the
decode server answers what the colocated engine answers, and the prefill server exits 0.
Ordered on what is observed (the prefill server's count in flight), never on a sleep."""

from __future__ import annotations

import signal
import threading

import httpx

from pdserve.testing import build_random_model
from tests.server.conftest import ServerProcess, assert_openai_error, free_port, pid_alive
from tests.waiting import wait_until

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_draining_prefill_finishes_its_transfer(tmp_path, make_engine):
    target = build_random_model(tmp_path / "t", "llama", num_layers=2, num_heads=4, num_kv_heads=2)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    expected = make_engine(target).generate(input_ids=prompt, sampling_params=PARAMS)["output_ids"]
    boot = free_port()
    p = ServerProcess(target, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                      "--graceful-shutdown-timeout", "300")
    try:
        d = ServerProcess(target, "--disaggregation-mode", "decode")
        try:
            children = p.remember_pids()
            body = {"input_ids": prompt, "sampling_params": PARAMS, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": boot, "bootstrap_room": 4242}
            result: dict[str, httpx.Response] = {}

            def prefill_leg() -> None:
                result["prefill"] = httpx.post(p.url + "/generate", json=body, timeout=300.0)
            t = threading.Thread(target=prefill_leg, daemon=True)
            t.start()
            # The prefill leg waits for its decode side, which has not been asked yet.
            wait_until(lambda: p.info()["in_flight_requests"] == 1, 30.0, what="the prefill leg in flight")
            p.proc.send_signal(signal.SIGTERM)

            def draining() -> dict | None:
                r = httpx.get(p.url + "/health", timeout=5.0)
                return r.json() if r.status_code == 503 else None
            health = wait_until(draining, 10.0, what="prefill /health 503 draining")
            assert health["status"] == "draining" and health["in_flight_requests"] == 1, health
            refused = httpx.post(p.url + "/generate", timeout=10.0,
                                 json=dict(body, bootstrap_room=4343))
            assert_openai_error(refused, 503)
            assert "retry-after" in refused.headers
            # Now the decode leg: the transfer from the draining prefill server completes.
            rd = httpx.post(d.url + "/generate", json=body, timeout=300.0)
            assert rd.status_code == 200, rd.text
            assert rd.json()["output_ids"] == expected
            t.join(300.0)
            assert result["prefill"].status_code == 200, result["prefill"].text
            code = p.proc.wait(120.0)
            assert code == 0, p.output()[-3000:]
            wait_until(lambda: not any(pid_alive(x) for x in children), 15.0, step=0.1, what="prefill children gone")
            d.assert_pools_full()
        finally:
            d.close()
    finally:
        p.close()
