"""pdserve's prefill and decode servers behind SGLang's own router (`sglang-router`, its
Rust wheel): chat (streamed and not, n = 2), completions and /generate answer, greedy
outputs equal to those through pdserve's router, and both pools come back full."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai

from pdserve import assets
from tests.router.conftest import RouterProcess, stop_process
from tests.server.conftest import ServerProcess, free_port, wait_until_healthy

import sglang_router  # noqa: F401  (the test extra installs it; a missing install must fail, not skip)

QUESTIONS = ["Repeat: abc123xyz", "What is 12 + 7?", "Remember: q=4xa, c=k0k. What is c?"]


class SGLangRouter:
    def __init__(self, prefill: ServerProcess, boot: int, decode: ServerProcess) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill.url, str(boot), "--decode", decode.url, "--host", "127.0.0.1",
             "--port", str(self.port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_healthy(self.proc, self.url, 60.0, self.output, what="sglang-router")
        except AssertionError as exc:  # it never answered: stop it, keep its log for the message
            output = self.output()
            self.close()
            raise AssertionError(f"{exc}\n{output}") from None

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        stop_process(self.proc)
        Path(self.log.name).unlink(missing_ok=True)


def answers(url: str, model: str) -> dict[str, object]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out: dict[str, object] = {}
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, n=2)
        out[f"chat n=2 {q}"] = [c.message.content for c in chat.choices]
        stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                                stream=True)
        out[f"chat stream {q}"] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    comp = client.completions.create(model=model, prompt=["Repeat: abc", "What is 3"], max_tokens=8, temperature=0)
    out["completions"] = [c.text for c in comp.choices]
    r = httpx.post(url + "/generate", timeout=60, json={"input_ids": [[5, 6, 7, 8], [9, 10, 11]],
                                                         "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    out["generate"] = [o["output_ids"] for o in r.json()]
    r = httpx.post(url + "/generate", timeout=60, json={"text": "Repeat: xyz", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    out["generate stream"] = events[-1]["output_ids"]
    return out


def test_pdserve_servers_behind_sglang_router_answer_like_pdserve_router():
    boot = free_port()
    demo = assets.path("demo")
    p = ServerProcess(demo, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot))
    d = ServerProcess(demo, "--disaggregation-mode", "decode")
    sgl = ours = None
    try:
        sgl = SGLangRouter(p, boot, d)
        ours = RouterProcess("--pd-disaggregation", "--prefill", p.url, str(boot), "--decode", d.url)
        model = d.client.get("/v1/models").json()["data"][0]["id"]
        # Its /v1/models names the servers' model as requests must name it, not by the
        # model's directory (0.3.2 asks a worker; newer gateways take /server_info's
        # served_model_name: tests/server/test_names_and_templates.py).
        listed = httpx.get(sgl.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in listed["data"]] == [model], listed
        via_sglang = answers(sgl.url, model)
        assert via_sglang == answers(ours.url, model)
        assert via_sglang["chat stream Repeat: abc123xyz"] == "abc123xyz"
        # Its power_of_two policy reads the servers' load in SGLang's shape.
        load = httpx.get(d.url + "/get_load", timeout=10).json()
        assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        p.assert_pools_full()
        d.assert_pools_full()
        # Its startup probe for gRPC (HTTP/2's preface) left no 404 line and no warning.
        for server in (p, d):
            assert "PRI * HTTP/2.0" not in server.output() and "Invalid HTTP request" not in server.output()
    finally:
        for r in (sgl, ours):
            if r is not None:
                r.close()
        d.close()
        p.close()
