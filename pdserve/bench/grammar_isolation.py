"""Issue 39: does a grammar compile stall the other streams of its server?

    python -m pdserve.bench.grammar_isolation [--mode colocated|pd|both] [--enum-size 20000]
        [--pythonpath DIR] [--flags "..."]

Starts real servers (the demo model; ``--pythonpath DIR`` runs them from another checkout,
e.g. a ``git worktree`` of the code before a change) and measures a plain greedy stream's
gaps between tokens, first alone, then while a request whose JSON schema is a cold enum of
``--enum-size`` strings (20,000: 220 KB) arrives on the same server. Prints, per mode, the
p99 and max gap of each run, their ratio, and what the constrained request got.

- colocated: one server; stream and constrained request on it.
- pd: a prefill and a decode server, each request sent to both with bootstrap fields (as
  the router does). The schema is made warm on prefill first (a request constrained on the
  prefill leg only), so the constrained request's KV reaches decode at once while decode
  compiles it cold: the issue's freeze of every decode stream.

The constrained request is fired once the stream has produced ``WARM_TOKENS`` tokens; the
"with" numbers are the gaps between its start and its end (the stream restarts when it
ends; the gap between two streams is not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

WARM_TOKENS = 20
STREAM_TOKENS = 1500      # one plain stream (the demo model's context is 2048)
BASELINE_GAPS = 300       # gaps measured without the constrained request


def enum_schema(size: int, seed: int) -> str:
    """A JSON schema whose only value is one of ``size`` distinct strings (20,000: 220 KB);
    ``seed`` makes it cold (a text no server has seen)."""
    prefix = "".join(chr(97 + (seed >> (5 * k)) % 26) for k in range(2))
    return json.dumps({"enum": [f"{prefix}{i:05d}" for i in range(size)]})


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m pdserve.launch_server`` process (from ``pythonpath`` when given)."""

    def __init__(self, *flags: str, pythonpath: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-g39-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
        self.argv = [sys.executable, "-m", "pdserve.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
                     "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=tempfile.gettempdir(), start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout} s: {self.output()[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        import signal
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@dataclass
class Target:
    """Where requests go: one colocated server, or a prefill + decode pair (each request
    sent to both, with the bootstrap fields a PD router adds)."""
    url: str                          # the server that streams (colocated, or decode)
    prefill: str | None = None
    bootstrap_port: int | None = None

    def legs(self, body: dict[str, Any], prefill_body: dict[str, Any] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        if self.prefill is None:
            return body, None
        pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
              "bootstrap_room": random.getrandbits(62)}
        return dict(body, **pd), dict(prefill_body or body, **pd, stream=False)

    def generate(self, body: dict[str, Any], prefill_body: dict[str, Any] | None = None,
                 timeout: float = 600) -> dict[str, Any]:
        """A non-streamed request (both legs at once on a PD pair); the answer of the
        server that produced the output."""
        main, pre = self.legs(body, prefill_body)
        out: dict[str, Any] = {}
        if pre is not None:
            t = threading.Thread(target=lambda: out.update(pre=httpx.post(self.prefill + "/generate", json=pre,
                                                                           timeout=timeout)))
            t.start()
        r = httpx.post(self.url + "/generate", json=main, timeout=timeout)
        if pre is not None:
            t.join()
        return {"status": r.status_code, **(r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else {"body": r.text})}

    def stream(self, body: dict[str, Any], timeout: float = 600) -> Iterator[float]:
        """A streamed request: yields the arrival time of each event that carried tokens."""
        main, pre = self.legs(dict(body, stream=True))
        if pre is not None:
            threading.Thread(target=lambda: httpx.post(self.prefill + "/generate", json=pre, timeout=timeout),
                             daemon=True).start()
        with httpx.stream("POST", self.url + "/generate", json=main, timeout=timeout) as r:
            r.raise_for_status()
            seen = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                n = len(event.get("output_ids", []))
                if n > seen:
                    seen = n
                    yield time.perf_counter()


@dataclass
class Streamer:
    """Plain greedy streams back to back, until stopped; token arrival times per stream."""
    target: Target
    streams: list[list[float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        body = {"text": "The plain stream:", "sampling_params": {"max_new_tokens": STREAM_TOKENS, "temperature": 0,
                                                                "ignore_eos": True}}
        try:
            while not self.stop.is_set():
                times: list[float] = []
                self.streams.append(times)
                for t in self.target.stream(body):
                    times.append(t)
                    if self.stop.is_set():
                        break
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc

    def tokens(self) -> int:
        return sum(len(s) for s in self.streams)

    def gaps(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        """Gaps between consecutive tokens of one stream, ending in [since, until]."""
        return [b - a for s in self.streams for a, b in zip(s, s[1:]) if since <= b <= until]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@dataclass
class Measurement:
    base: list[float]
    during: list[float]
    constrained: dict[str, Any]
    constrained_s: float

    @property
    def ratio(self) -> float:
        return max(self.during) / max(self.base)

    def lines(self, label: str) -> list[str]:
        fin = self.constrained.get("meta_info", {}).get("finish_reason") or self.constrained.get("body")
        return [f"{label}: alone      p99 {pct(self.base, 0.99) * 1e3:8.1f} ms  max {max(self.base) * 1e3:8.1f} ms"
                f"  ({len(self.base)} gaps)",
                f"{label}: compiling  p99 {pct(self.during, 0.99) * 1e3:8.1f} ms  max {max(self.during) * 1e3:8.1f} ms"
                f"  ({len(self.during)} gaps)  max ratio {self.ratio:.1f}x",
                f"{label}: constrained request: {self.constrained_s:.1f} s, HTTP {self.constrained.get('status')}, "
                f"text {str(self.constrained.get('text'))[:40]!r}, finish {fin}"]


def measure(target: Target, schema: str, max_new_tokens: int = 16) -> Measurement:
    """A plain stream's gaps alone (``BASELINE_GAPS``), then while a request constrained by
    ``schema`` (cold on ``target``) is in flight."""
    streamer = Streamer(target)
    thread = threading.Thread(target=streamer.run, daemon=True)
    thread.start()
    try:
        while streamer.tokens() < WARM_TOKENS + BASELINE_GAPS + 1 and streamer.error is None:
            time.sleep(0.01)
        if streamer.error is not None:
            raise streamer.error
        base = streamer.gaps()[WARM_TOKENS:]
        t0 = time.perf_counter()
        answer = target.generate({"text": "Pick one:", "sampling_params": {
            "json_schema": schema, "max_new_tokens": max_new_tokens, "temperature": 0}})
        t1 = time.perf_counter()
        time.sleep(0.5)  # (a stall ending just after the answer still counts)
    finally:
        streamer.stop.set()
        thread.join(60)
    if streamer.error is not None:
        raise streamer.error
    during = streamer.gaps(t0, t1 + 0.5)
    if not during:
        raise RuntimeError("the plain stream produced no token while the constrained request ran")
    return Measurement(base, during, answer, t1 - t0)


def warm_up(target: Target, prefill_schema: str | None = None) -> None:
    """First requests (a constrained one starts the vocabulary scan and, after issue 39, the
    compile process); on a PD pair ``prefill_schema`` is made warm on prefill only."""
    plain = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    assert target.generate(plain)["status"] == 200
    small = {"text": "Hello", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}}
    assert target.generate(small)["status"] == 200
    if prefill_schema is not None:
        pre = {"text": "Pick one:", "sampling_params": {"json_schema": prefill_schema, "max_new_tokens": 16,
                                                        "temperature": 0}}
        out = target.generate({"text": "Pick one:", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
                              prefill_body=pre)
        assert out["status"] == 200, out
    # Since issue 39 a scheduler starts a compile process at its first constrained request
    # (seconds of imports): measure once it is up (servers before it report no "grammar").
    for url in filter(None, (target.url, target.prefill)):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            grammar = httpx.get(url + "/get_server_info", timeout=10).json()["internal_state"].get("grammar")
            if not grammar or grammar.get("worker_pid"):
                break
            time.sleep(0.2)


def run(mode: str, enum_size: int, pythonpath: str | None, flags: list[str]) -> list[str]:
    seed = random.getrandbits(40)
    schema = enum_schema(enum_size, seed)
    if mode == "colocated":
        server = Server(*flags, pythonpath=pythonpath)
        try:
            server.wait_ready()
            target = Target(server.url)
            warm_up(target)
            m = measure(target, schema)
        finally:
            server.close()
        return m.lines(f"colocated, {len(schema) / 1e3:.0f} KB enum")
    boot = free_port()
    prefill = Server("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *flags,
                     pythonpath=pythonpath)
    decode = Server("--disaggregation-mode", "decode", *flags, pythonpath=pythonpath)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        target = Target(decode.url, prefill.url, boot)
        warm_up(target, prefill_schema=schema)
        m = measure(target, schema)
    finally:
        prefill.close()
        decode.close()
    return m.lines(f"decode (1P1D), {len(schema) / 1e3:.0f} KB enum warm on prefill, cold on decode")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["colocated", "pd", "both"], default="both")
    ap.add_argument("--enum-size", type=int, default=20000)
    ap.add_argument("--pythonpath", default=None, help="run the servers from this checkout")
    ap.add_argument("--flags", default="", help="extra server flags")
    args = ap.parse_args(argv)
    modes = ["colocated", "pd"] if args.mode == "both" else [args.mode]
    where = args.pythonpath or str(Path(__file__).resolve().parents[2])
    print(f"servers from {where}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    for mode in modes:
        for line in run(mode, args.enum_size, args.pythonpath, shlex.split(args.flags)):
            print(line, flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
