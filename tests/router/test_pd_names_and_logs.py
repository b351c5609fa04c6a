"""A 1P1D pair behind the router, at the default log level, as a user starts it:

- model names: the router passes `model="default"` and every `--served-model-name` through
  (the servers answer them) and an unknown name comes back as the servers' OpenAI 404
  `model_not_found`;
- logs: no Mooncake glog line (its normal start prints a dozen, one of them an `E`), no
  WARNING from normal operation, uvicorn's lifecycle lines gone, one ready line per
  process, the router's normal events at INFO; `--log-level debug` brings Mooncake's
  lines (and uvicorn's) back.

The tests share the deployment and run in file order: the log test stops it."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from pdserve.testing import build_random_model
from tests.router.conftest import RouterProcess, stop_process
from tests.server.conftest import ServerProcess, free_port
from tests.waiting import wait_until

SERVED = ("tiny", "alias")
MESSAGES = [{"role": "user", "content": "count to three"}]
# A glog line: severity, date, time, thread id, file:line]
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\]", re.MULTILINE)
UVICORN_LIFECYCLE = ("Started server process", "Waiting for application startup", "Application startup complete",
                     "Uvicorn running on", "Shutting down", "Finished server process")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("names_logs") / "t", "llama", num_layers=2, num_heads=4,
                              num_kv_heads=2, hidden_size=64)


@pytest.fixture(scope="module")
def deployment(target):
    boot = free_port()
    procs: list = []
    try:
        p = ServerProcess(target, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                          "--served-model-name", *SERVED)
        procs.append(p)
        d = ServerProcess(target, "--disaggregation-mode", "decode", "--served-model-name", SERVED[0],
                          "--served-model-name", SERVED[1])  # the repeated-flag spelling
        procs.append(d)
        r = RouterProcess("--pd-disaggregation", "--prefill", p.url, str(boot), "--decode", d.url, log_level=None)
        procs.append(r)
        yield p, d, r
    finally:
        for proc in reversed(procs):
            proc.close()


# ---- model names through the router ---------------------------------------------------------------
def test_router_serves_default_and_every_served_name(deployment):
    _, _, router = deployment
    assert [m["id"] for m in router.client.get("/v1/models").json()["data"]] == list(SERVED)
    texts = set()
    for model in ("default", *SERVED, None):
        extra = {"model": model} if model is not None else {}
        r = router.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True, **extra})
        assert r.status_code == 200, (model, r.text)
        assert r.json()["model"] == SERVED[0]
        texts.add(r.json()["choices"][0]["text"])
        r = router.client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                             "temperature": 0, **extra})
        assert r.status_code == 200, (model, r.text)
    assert len(texts) == 1
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=60, max_retries=0)
    try:
        chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finally:
        client.close()


def test_router_unknown_name_is_openai_404(deployment):
    _, _, router = deployment
    for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True})):
        r = router.client.post(path, json=dict(body, model="gpt-4"))
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found"), err
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=60, max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as exc:
            client.completions.create(model="llama-70b", prompt="hi", max_tokens=2)
        assert exc.value.code == "model_not_found"
    finally:
        client.close()
    # The router's own answer stays right after 404s: nothing was taken out of rotation.
    assert router.worker_health() and all(router.worker_health().values())


# ---- logs ---------------------------------------------------------------------------------------------
def assert_quiet(label: str, out: str, ready: str) -> None:
    assert not GLOG_LINE.search(out), f"{label}: Mooncake's glog lines at the default level:\n{out}"
    assert "InitGoogleLogging" not in out, f"{label}:\n{out}"
    for bad in ("WARNING", "ERROR", "Traceback"):
        assert bad not in out, f"{label}: {bad} in normal operation:\n{out}"
    for line in UVICORN_LIFECYCLE:
        assert line not in out, f"{label}: uvicorn's {line!r} below debug:\n{out}"
    ready_lines = [x for x in out.splitlines() if "ready on http://" in x]
    assert len(ready_lines) == 1 and ready in ready_lines[0], f"{label}: ready lines {ready_lines}:\n{out}"


def test_tokenize_and_detokenize_through_the_pd_router(deployment):
    """Either worker holds the tokenizer: the router's answer is theirs."""
    p, d, r = deployment
    for body in ({"prompt": "count to three"}, {"messages": MESSAGES}):
        via = r.client.post("/tokenize", json=body)
        assert via.status_code == 200, via.text
        assert via.json() == d.client.post("/tokenize", json=body).json() == p.client.post("/tokenize", json=body).json()
        back = r.client.post("/detokenize", json={"tokens": via.json()["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json() == d.client.post("/detokenize", json={"tokens": via.json()["tokens"]}).json()
    assert r.client.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_default_log_level_is_quiet(deployment):
    """Run after the requests above (a KV transfer each); stops the deployment so that the
    shutdown is covered too."""
    p, d, router = deployment
    stop_process(router.proc)
    for s in (p, d):
        graceful, alive = s.terminate()
        assert graceful and not alive
    router_out = Path(router.log.name).read_text(errors="replace")  # all of it (output() is the tail)
    assert_quiet("prefill", p.output(), "prefill] pdserve prefill server ready on")
    assert_quiet("decode", d.output(), "decode] pdserve decode server ready on")
    assert_quiet("router", router_out, "router] pdserve router (PD mode) ready on")
    # The servers' access log (INFO) still shows the requests; the router's normal events are INFO.
    assert '"POST /v1/completions HTTP/1.1" 200' in d.output() and "404" in d.output()
    assert re.search(r"\d\d router\] decode worker \S+ is in rotation", router_out), router_out
    assert "httpx" not in router_out  # no line per health probe


def test_debug_log_level_shows_mooncake(target):
    """`--log-level debug` shows what the default hides: Mooncake's own lines (its startup
    ERROR included) and uvicorn's lifecycle."""
    boot = free_port()
    s = ServerProcess(target, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                      "--log-level", "debug")
    try:
        out = wait_until(lambda: "Application startup complete" in s.output() and s.output(), 10.0)
    finally:
        s.close()
    glog = GLOG_LINE.findall(out)
    assert len(glog) >= 3, out
    assert "transfer_engine" in out and "Local segment descriptor not found" in out, out
    assert "Application startup complete" in out, out
