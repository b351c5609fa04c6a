"""`pdserve up`: one command starts prefill + decode + router on the demo model, answers a
chat request through the OpenAI client, and Ctrl-C in its terminal (SIGINT to the whole
process group) stops every process it started, the router first: a stream open then ends
cleanly, nothing logs a failure, and the console reads as one (every line labelled with
the process that wrote it)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.router.test_pd_names_and_logs import GLOG_LINE
from tests.server.conftest import free_port, parse_sse_lines
from tests.waiting import wait_until


@pytest.mark.fast
def test_up_reports_every_bad_flag_once():
    """`up`'s own flags and the server flags it forwards, checked in the up process: every
    problem at once (unique prefixes expanded over both, the multi-node flags caught by any
    prefix), then the servers' values as ServerArgs checks them."""
    from pdserve.config import ConfigError
    from pdserve.up import parse_args

    with pytest.raises(ConfigError) as exc:
        parse_args(["--prefill", "0", "--page-sise", "3", "--nn", "2", "--dtype", "x", "--port", "0",
                    "--disaggregation-bootstrap-p", "9", "--speculative-prefill", "--max-n", "many"])
    assert sorted(str(exc.value).splitlines()) == sorted([
        "--page-sise: unknown flag (did you mean --page-size?)",
        "--dtype: invalid choice 'x' (choose from auto, float32, float16, bfloat16)",
        "--max-n: invalid int value: 'many'",
        "--prefill: must be >= 1, got 0",
        "--port: must be in [1, 65535], got 0",
        "--speculative-prefill: needs --speculative-algorithm",
        "--nnodes: pdserve up starts one machine's deployment; start an instance spanning nodes with "
        "`pdserve serve ... --nnodes N --node-rank R --dist-init-addr HOST:PORT` on each node",
        "--disaggregation-bootstrap-port: set by pdserve up itself (use its own flags)",
    ])
    # A value only a server refuses is reported by `up`, once.
    with pytest.raises(ConfigError, match="^--page-size: must be >= 1, got 0$"):
        parse_args(["--page", "0"])
    with pytest.raises(ConfigError, match="^ambiguous option: --dis could match --disaggregation-mode, --dist-init-addr, .* and \\d+ more$"):
        parse_args(["--dis", "null"])


@pytest.mark.fast
def test_up_takes_prefixes_and_the_servers_draft_rule(tmp_path):
    from pdserve.config import ConfigError, ServerArgs
    from pdserve.testing import build_random_model
    from pdserve.up import parse_args

    args = parse_args(["--speculative-algo", "EAGLE3", "--pref", "2", "--page", "16", "--max-n", "4",
                       "--log-level=debug", "--disaggregation-mode", "pd"])
    assert (args.speculative_algorithm, args.num_prefill, args.mode) == ("EAGLE3", 2, "pd")
    forwarded = ("--page-size", "16", "--max-n", "4", "--log-level=debug")  # then, on a GPU, its share
    assert args.server_args[:len(forwarded)] == forwarded
    assert args.router_args == ("--max-n", "4", "--log-level", "debug")
    # The demo model's own head, as `pdserve serve` picks it (one rule, in ServerArgs).
    assert args.speculative_draft_model_path == \
        ServerArgs.from_cli(["--speculative-algorithm", "EAGLE3"]).speculative_draft_model_path
    plain = build_random_model(tmp_path / "plain", "llama")
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: is required with --speculative-"
                                          "algorithm EAGLE: .* ships no draft head"):
        parse_args(["--model-path", str(plain), "--speculative-algorithm", "EAGLE"])
    mtp = build_random_model(tmp_path / "mtp", "llama", num_nextn_predict_layers=2)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 2"):
        parse_args(["--model-path", str(mtp), "--speculative-algorithm", "EAGLE"])
    # GLM-4.5's own MTP layer drafts: the model path is the draft path.
    glm = build_random_model(tmp_path / "glm", "glm4_moe")
    assert parse_args(["--model-path", str(glm), "--speculative-algorithm", "EAGLE"]
                      ).speculative_draft_model_path == str(glm)


@pytest.mark.fast
def test_base_port_pins_every_port_and_refuses_a_busy_one():
    from pdserve.config import ConfigError
    from pdserve.up import parse_args, port_plan, preflight

    plan = port_plan(parse_args(["--base-port", "40000", "--prefill", "2", "--decode", "2"]))
    assert plan.named() == [("the router", 40000), ("prefill-0's HTTP port", 40001),
                            ("prefill-0's bootstrap port", 40002), ("prefill-1's HTTP port", 40003),
                            ("prefill-1's bootstrap port", 40004), ("decode-0's HTTP port", 40005),
                            ("decode-1's HTTP port", 40006)]
    assert port_plan(parse_args(["--base-port", "40000", "--disaggregation-mode", "null"])).named() == \
        [("the server", 40000)]
    assert port_plan(parse_args(["--port", "8000"])).named() == [("the router", 8000)]  # the servers: free ports
    with pytest.raises(ConfigError, match=r"^--base-port: the deployment's ports 65534\.\.65537 must lie in"):
        parse_args(["--base-port", "65534"])
    with pytest.raises(ConfigError, match="^--base-port: .* give it or --port, not both"):
        parse_args(["--base-port", "40000", "--port", "8000"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, flag in ((["--base-port", str(port)], "--base-port"), (["--port", str(port)], "--port")):
            with pytest.raises(ConfigError, match=f"^{flag} {port}: port {port} \\(the server\\) is in use on "
                                                  f"127.0.0.1; choose another {flag}$"):
                preflight(parse_args([*argv, "--disaggregation-mode", "null"]), {})


def test_up_without_mooncake_fails_fast_with_the_fix(tmp_path):
    """Mooncake not importable (a shim package raising ImportError, on the servers' path
    too): `up` says so in one line, naming the `pd` extra, before it starts anything."""
    shim = tmp_path / "shim" / "mooncake"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('mooncake hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "up", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - started
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("pdserve up: error: the prefill and decode servers move KV with Mooncake, which "
                               "does not load here (ImportError: mooncake hidden by the test): pip install -e "
                               "'.[pd]'"), r.stderr
    assert elapsed < 30, elapsed  # no model loaded: the import of torch is most of it (76 s before)


def test_pinned_port_in_use_is_refused_before_anything_starts():
    """PD: a busy bootstrap port of the plan is named (after the Mooncake check passes)."""
    from pdserve.config import ConfigError
    from pdserve.up import parse_args, preflight, server_env

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = parse_args(["--base-port", str(port - 2)])
        with pytest.raises(ConfigError, match=f"^--base-port {port - 2}: port {port} \\(prefill-0's bootstrap "
                                              "port\\) is in use"):
            preflight(args, server_env(args))


def _wait_all_gone(children: list[psutil.Process], seconds: float) -> None:
    def alive() -> list[psutil.Process]:
        out = []
        for c in children:
            try:
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                    out.append(c)
            except psutil.NoSuchProcess:
                pass
        return out

    def cmdlines() -> str:
        lines = []
        for c in alive():
            try:
                lines.append(" ".join(c.cmdline()))
            except psutil.Error:
                pass
        return f"all children of pdserve up gone; alive: {lines}"
    wait_until(lambda: not alive(), seconds, step=0.2, what=cmdlines)


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on loopback."""
    from pdserve.up import port_in_use

    def run() -> int | None:
        first = free_port()
        return first if first + count <= 65536 and not any(port_in_use("127.0.0.1", first + i)
                                                            for i in range(count)) else None
    return wait_until(run, 10.0, step=0.0, what=f"{count} consecutive free ports")


# Every line of the console: `[date time LABEL] ...` (up's example request follows its ready line).
CONSOLE_LINE = re.compile(r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (up|router|prefill|decode|prefill TP0|decode TP0)\] |  )")


def test_up_serves_chat_and_ctrl_c_stops_everything(tmp_path):
    """With --base-port every port is pinned: router N, prefill N+1 (bootstrap N+2), decode N+3."""
    port = _free_port_run(4)
    with (tmp_path / "stderr").open("w") as stderr:  # what `up` and its servers said, for a failure's message
        # Its own session, as a terminal starts it: a Ctrl-C there reaches the whole group.
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.launch_server", "up", "--base-port", str(port)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "ready at" in line:
                ready.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300), "".join(lines)
        assert f"http://127.0.0.1:{port}" in "".join(lines) and "curl" in "".join(lines)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len([c for c in children if "pdserve" in " ".join(c.cmdline())]) >= 3  # 2 servers + router
        # The two servers split the machine's cores (unless the user set OMP_NUM_THREADS).
        want = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
        servers = [c for c in children if "pdserve.launch_server" in " ".join(c.cmdline())]
        assert len(servers) == 2 and all(c.environ().get("OMP_NUM_THREADS") == want for c in servers)
        pinned = {" ".join(c.cmdline()).split("--disaggregation-mode ")[1].split()[0]: c.cmdline() for c in servers}
        assert pinned["prefill"][pinned["prefill"].index("--port") + 1] == str(port + 1)
        assert pinned["prefill"][pinned["prefill"].index("--disaggregation-bootstrap-port") + 1] == str(port + 2)
        assert pinned["decode"][pinned["decode"].index("--port") + 1] == str(port + 3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        out = client.chat.completions.create(model="pdserve-demo", max_tokens=16, temperature=0,
                                             messages=[{"role": "user", "content": "Repeat: abcdefgh"}])
        assert out.choices[0].message.content == "abcdefgh"
        # SGLang's documented model name works through the router too.
        out = client.chat.completions.create(model="default", max_tokens=16, temperature=0,
                                             messages=[{"role": "user", "content": "Repeat: xyz"}])
        assert out.choices[0].message.content == "xyz" and out.model == "pdserve-demo"
        # Named processes: ps shows which is which.
        titles = {" ".join(c.cmdline()).strip() for c in children}
        assert {"pdserve::router", "pdserve::scheduler TP0 (prefill)", "pdserve::scheduler TP0 (decode)",
                "pdserve::detokenizer (prefill)", "pdserve::detokenizer (decode)"} <= titles, titles
        body = {"prompt": "Repeat: abcdefgh", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60.0) as r:
            assert r.status_code == 200
            stream = r.iter_lines()
            head = []
            for line in stream:  # up to the first event: the stream is open
                head.append(line)
                if line.startswith("data:"):
                    break
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal delivers
            events, done = parse_sse_lines(head + list(stream))
        # The router stopped first and the servers drained: the stream finished.
        assert done and not [e for e in events if "error" in e], events
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert proc.wait(90) == 0
        _wait_all_gone(children, 20)
        # A normal run at the default log level reads as one: no Mooncake glog lines (its
        # start prints an `E` line), no warning or error, one ready line per process, each
        # line labelled with who wrote it (the servers' access logs too).
        said = "".join(lines) + (tmp_path / "stderr").read_text()
        assert "stopping" in "".join(lines), said
        assert not GLOG_LINE.search(said), said
        for bad in ("WARNING", "Traceback", "Error", "ERROR"):
            assert bad not in said, said
        assert all(CONSOLE_LINE.match(x) for x in said.splitlines() if x.strip()), said
        ready = [x for x in said.splitlines() if "ready on http://" in x]
        assert len(ready) == 3, said  # 2 servers + router, each saying what it is
        assert any("] pdserve prefill server ready on" in x for x in ready), ready
        assert any("] pdserve decode server ready on" in x for x in ready), ready
        access = [x for x in said.splitlines() if '"POST /v1/completions HTTP/1.1" 200' in x]
        assert {x.split("]")[0].rsplit(" ", 1)[1] for x in access} == {"prefill", "decode"}, access
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail("pdserve up did not stop; its stderr ends:\n" + (tmp_path / "stderr").read_text()[-3000:])


def test_up_ctrl_c_while_starting_stops_everything():
    """Ctrl-C before the servers are healthy stops the startup and every process already started."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.launch_server", "up", "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def servers() -> list[psutil.Process] | None:
            assert proc.poll() is None, "pdserve up exited while starting"
            kids = [c for c in psutil.Process(proc.pid).children()
                    if "pdserve.launch_server" in " ".join(c.cmdline())]
            return kids if len(kids) >= 2 else None
        # Both servers spawned, neither healthy yet (loading takes seconds).
        children = wait_until(servers, 60.0, ignore=(psutil.NoSuchProcess,), what="both servers spawned")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "] stopping" in out and "ready at" not in out, out
        _wait_all_gone(children, 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail("pdserve up did not stop while starting")


def test_servers_sharing_a_gpu_split_its_share():
    """On a GPU the servers of `pdserve up` share one device: each takes an equal part of
    the default --mem-fraction-static, unless the flag is given or they run on the CPU."""
    from pdserve.up import device_share

    assert device_share([], 2, cuda=True) == ["--mem-fraction-static", "0.425"]
    assert device_share(["--page-size", "16"], 3, cuda=True) == ["--mem-fraction-static", "0.283"]
    assert device_share([], 1, cuda=True) == []
    assert device_share([], 2, cuda=False) == []
    assert device_share(["--device", "cpu"], 2, cuda=True) == []
    assert device_share(["--mem-fraction-static", "0.3"], 2, cuda=True) == []
    assert device_share(["--mem-fraction-static=0.3"], 2, cuda=True) == []
