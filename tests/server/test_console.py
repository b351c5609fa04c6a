"""A new user's first minutes with `pdserve serve`, end to end (one server, the demo model
with its EAGLE head and no shape flags, started in its own process group as a terminal
starts it):

- its processes are named (`pdserve::scheduler TP0`, `pdserve::detokenizer`: their
  /proc/PID/cmdline);
- it says what it chose: one startup summary line, and /get_server_info reports the
  resolved values (the speculative shape it picked, not None);
- every line it writes has one labelled format, and `--decode-log-interval` lines come
  from the scheduler (with the accept length);
- Ctrl-C in the terminal (SIGINT to the whole group) with a stream open: the stream ends
  cleanly, the process exits 0, and nothing it wrote is a traceback or an error.

The in-process side (the numbers, the formats) is tests/server/test_console_units.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx

from pdserve import assets
from tests.server.conftest import ServerProcess, descendants, parse_sse_lines

LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (server|server TP0)\] ")


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_serve_names_its_processes_says_what_it_chose_and_stops_cleanly_on_ctrl_c():
    s = ServerProcess(assets.path("demo"), "--max-total-tokens", "8192", "--decode-log-interval", "4",
                      "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                      str(assets.path("demo-eagle")))
    try:
        titles = sorted(cmdline(p) for p in descendants(s.proc.pid))
        assert "pdserve::scheduler TP0" in titles and "pdserve::detokenizer" in titles, titles

        args = s.info()["server_args"]
        assert (args["speculative_num_steps"], args["speculative_eagle_topk"],
                args["speculative_num_draft_tokens"]) == (3, 1, 4)  # picked, and said
        assert (args["device"], args["dtype"], args["attention_backend"], args["max_total_tokens"]) == \
            ("cpu", "float32", "torch_native", 8192)

        body = {"prompt": "Repeat: abcdefgh", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60.0) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            head = []
            for line in lines:  # up to the first event: the stream is open
                head.append(line)
                if line.startswith("data:"):
                    break
            os.killpg(s.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C delivers
            events, done = parse_sse_lines(head + list(lines))
        assert done, events
        # It finished (the drain let it) or, at the latest, ended with a clean error event.
        errors = [e for e in events if "error" in e]
        assert not errors or errors[-1]["error"]["code"] == 503, errors
        if not errors:
            assert sum(len(e["choices"][0]["text"]) for e in events) > 0
            assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert s.proc.wait(60) == 0
        out = s.output()
        for bad in ("Traceback", "Error", "ERROR"):
            assert bad not in out, out
        # One labelled format, every line (the ready line and uvicorn's access log too).
        assert all(LINE.match(x) for x in out.splitlines() if x.strip()), out
        summary = [x for x in out.splitlines() if "KV pool" in x]
        assert len(summary) == 1, out
        assert "speculative EAGLE num_steps 3, eagle_topk 1, num_draft_tokens 4 (default)" in summary[0], summary
        assert "KV pool 8,192 tokens" in summary[0] and "attention torch_native" in summary[0], summary
        decode_lines = [x for x in out.splitlines() if "] Decode batch." in x]
        assert decode_lines and all(x.split("]")[0].endswith("server TP0") and "accept len: " in x
                                    for x in decode_lines), out
        ready = [x for x in out.splitlines() if "ready on http://" in x]
        assert len(ready) == 1 and "pdserve colocated server ready on" in ready[0], out
    finally:
        s.close()

