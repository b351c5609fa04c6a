"""`pdserve up`: one command starts prefill + decode + router on the demo model, answers a
chat request through the OpenAI client, and Ctrl-C in its terminal (SIGINT to the whole
process group) stops every process it started, the router first: a stream open then ends
cleanly, nothing logs a failure, and the console reads as one (every line labelled with
the process that wrote it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import psutil
import pytest

from tests.router.test_pd_names_and_logs import GLOG_LINE
from tests.server.conftest import free_port, parse_sse_lines
from tests.waiting import wait_until


def test_up_bad_flags_name_the_flag():
    for argv, flag in ((["--prefill", "0"], "--prefill"), (["--port", "0"], "--port"),
                       (["--disaggregation-bootstrap-port", "9"], "--disaggregation-bootstrap-port"),
                       (["--speculative-prefill"], "--speculative-prefill")):
        r = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "up", *argv],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and flag in r.stderr, (argv, r.stderr)


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


# Every line of the console: `[date time LABEL] ...` (up's example request follows its ready line).
CONSOLE_LINE = re.compile(r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (up|router|prefill|decode|prefill TP0|decode TP0)\] |  )")


def test_up_serves_chat_and_ctrl_c_stops_everything(tmp_path):
    port = free_port()
    with (tmp_path / "stderr").open("w") as stderr:  # what `up` and its servers said, for a failure's message
        # Its own session, as a terminal starts it: a Ctrl-C there reaches the whole group.
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.launch_server", "up", "--port", str(port)],
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
