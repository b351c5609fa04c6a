"""What the PD router costs: latency it adds per request, and the request rate it sustains.

    python -m pdserve.bench.router_overhead [--num-requests 50] [--output-len 16]
        [--load-requests 2000] [--concurrency 32] [--skip-servers]

1. Latency (real servers, demo model by default, sequential requests, interleaved so both
   paths see the same machine state):
   - a colocated server directly vs the same server behind the router in plain mode
     (`--worker-urls`: same body forwarded plus a rid, one hop more);
   - a prefill/decode pair driven by a client that fans each request out to both servers
     itself (what tests/disagg does) vs the same pair behind the router in PD mode.
2. Throughput (fake workers that answer at once, served from threads of this process;
   the router is a real `python -m pdserve.router` process): requests/s through the
   router in PD mode (two legs per request), non-streaming and streaming, plus the same
   load sent straight to one fake as the load generator's own ceiling, and the router
   process's CPU time per request (from /proc: the rate one core can sustain, whatever
   else shares the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

_TICK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Proc:
    def __init__(self, argv: list[str], url: str, log: Path) -> None:
        self.url = url
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float = 180.0) -> "_Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _server(model: Path, tmp: Path, name: str, *flags: str) -> _Proc:
    port = _free_port()
    return _Proc([sys.executable, "-m", "pdserve.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                  "--port", str(port), "--max-total-tokens", "16384", "--log-level", "warning", *flags],
                 f"http://127.0.0.1:{port}", tmp / f"{name}.log")


def _router(tmp: Path, name: str, *flags: str) -> _Proc:
    port = _free_port()
    return _Proc([sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port),
                  "--log-level", "error", *flags], f"http://127.0.0.1:{port}", tmp / f"{name}.log")


# ---- 1. latency ------------------------------------------------------------------------
def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def latency(args: argparse.Namespace, tmp: Path) -> list[tuple[str, list[float], list[float] | None]]:
    from pdserve.assets import path as asset_path

    model = Path(args.model_path) if args.model_path else asset_path("demo")
    boot = _free_port()
    coloc = _server(model, tmp, "colocated", "--disaggregation-mode", "null")
    pre = _server(model, tmp, "prefill", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                  str(boot))
    dec = _server(model, tmp, "decode", "--disaggregation-mode", "decode")
    procs = [coloc, pre, dec]
    try:
        for p in procs:
            p.wait_healthy()
        plain = _router(tmp, "router-plain", "--worker-urls", coloc.url)
        pd = _router(tmp, "router-pd", "--pd-disaggregation", "--prefill", pre.url, str(boot), "--decode", dec.url)
        procs += [plain, pd]
        plain.wait_healthy()
        pd.wait_healthy()
        rng = random.Random(0)
        prompts = ["".join(rng.choice("abcdefghij0123456789") for _ in range(args.prompt_len))
                   for _ in range(args.num_requests)]
        body = {"max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        rows: dict[str, list[float]] = {k: [] for k in ("direct", "plain", "pair", "pd")}
        with httpx.Client(timeout=120) as c:
            def post(url: str, prompt: str, **extra: Any) -> None:
                r = c.post(url + "/v1/completions", json=dict(body, prompt=prompt, **extra))
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")

            async def fan_out(prompt: str) -> None:
                # Both legs at once with one room, as a client without a router must.
                extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
                         "bootstrap_room": random.getrandbits(63)}
                rp, rd = await asyncio.gather(ac.post(pre.url + "/v1/completions", json=dict(body, prompt=prompt, **extra)),
                                              ac.post(dec.url + "/v1/completions", json=dict(body, prompt=prompt, **extra)))
                for r in (rp, rd):
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.url}: {r.status_code} {r.text[:500]}")

            loop = asyncio.new_event_loop()
            ac = httpx.AsyncClient(timeout=120)
            try:
                for warm in prompts[:3]:  # connections, first-request paths, the PD handshake
                    post(coloc.url, warm), post(plain.url, warm), post(pd.url, warm)
                    loop.run_until_complete(fan_out(warm))
                for i, p in enumerate(prompts):
                    runs = [("direct", lambda: post(coloc.url, p)), ("plain", lambda: post(plain.url, p)),
                            ("pair", lambda: loop.run_until_complete(fan_out(p))), ("pd", lambda: post(pd.url, p))]
                    # Each pair (direct, routed) back to back, in alternating order: no path
                    # always goes first after the other server's work.
                    for pair in (runs[:2], runs[2:]):
                        for name, fn in (pair if i % 2 else pair[::-1]):
                            rows[name].append(_timed(fn))
            finally:
                loop.run_until_complete(ac.aclose())
                loop.close()
        return [("colocated, direct", rows["direct"], None),
                ("colocated, via router (plain)", rows["plain"], rows["direct"]),
                ("PD pair, client fans out itself", rows["pair"], None),
                ("PD pair, via router (PD mode)", rows["pd"], rows["pair"])]
    finally:
        for p in reversed(procs):
            p.stop()


# ---- 2. throughput with fake workers ---------------------------------------------------------
async def _load(url: str, n: int, concurrency: int, stream: bool) -> float:
    body = {"prompt": "hello", "max_tokens": 4, "stream": stream}
    sem = asyncio.Semaphore(concurrency)
    failures = 0
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one() -> None:
            nonlocal failures
            async with sem:
                if stream:
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        text = (await r.aread()).decode()
                        ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
                else:
                    r = await c.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                failures += not ok
        await asyncio.gather(*(one() for _ in range(min(n, 50))))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        took = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"{failures} requests failed")
    return took


def throughput(args: argparse.Namespace, tmp: Path) -> tuple[list[tuple[str, float, float | None]],
                                                              list[tuple[str, list[float], list[float] | None]]]:
    from pdserve.router.fake_worker import FakeWorker, ThreadedServer

    prefill, decode = FakeWorker("prefill", tokens=4), FakeWorker("decode", tokens=4)
    plain = FakeWorker("plain", tokens=4)
    with ThreadedServer(prefill.app()) as ps, ThreadedServer(decode.app()) as ds, ThreadedServer(plain.app()) as cs:
        router = _router(tmp, "router-fakes", "--pd-disaggregation", "--prefill", ps.url, "--decode", ds.url)
        plain_router = _router(tmp, "router-fakes-plain", "--worker-urls", cs.url)
        try:
            router.wait_healthy()
            plain_router.wait_healthy()
            lat: dict[str, list[float]] = {"direct": [], "plain": [], "pd": []}
            with httpx.Client(timeout=60) as c:
                def post(url: str) -> None:
                    c.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}).raise_for_status()
                for _ in range(5):
                    post(cs.url), post(plain_router.url), post(router.url)
                for _ in range(args.num_requests * 4):
                    lat["direct"].append(_timed(lambda: post(cs.url)))
                    lat["plain"].append(_timed(lambda: post(plain_router.url)))
                    lat["pd"].append(_timed(lambda: post(router.url)))
            lat_rows = [("fake worker, direct", lat["direct"], None),
                        ("via router (plain), 1 leg", lat["plain"], lat["direct"]),
                        ("via router (PD), 2 legs in parallel", lat["pd"], lat["direct"])]
            out: list[tuple[str, float, float | None]] = []
            took = asyncio.run(_load(cs.url, args.load_requests, args.concurrency, False))
            out.append(("fake worker direct (load ceiling)", args.load_requests / took, None))
            for stream in (False, True):
                cpu0 = _cpu_seconds(router.proc.pid)
                took = asyncio.run(_load(router.url, args.load_requests, args.concurrency, stream))
                cpu = _cpu_seconds(router.proc.pid) - cpu0
                n = args.load_requests + min(args.load_requests, 50)
                out.append((f"router PD -> fakes, {'streaming' if stream else 'non-streaming'}",
                            args.load_requests / took, cpu / n * 1000))
            return out, lat_rows
        finally:
            plain_router.stop()
            router.stop()


def _print_latency(title: str, rows: list[tuple[str, list[float], list[float] | None]]) -> None:
    """Each routed row against the direct row before it: the router's added latency as
    the median of per-request differences (each pair ran back to back, so load from
    anything else on the machine mostly cancels out)."""
    print(f"\n{title} (ms)")
    print(f"{'path':36s} {'mean':>8s} {'p50':>8s} {'p99':>8s}   added by the router (median of paired diffs)")
    for name, xs, base in rows:
        line = f"{name:36s} {statistics.mean(xs) * 1e3:8.2f} {_pct(xs, .5) * 1e3:8.2f} {_pct(xs, .99) * 1e3:8.2f}"
        if base is not None:
            diffs = [a - b for a, b in zip(xs, base)]
            line += f"   {statistics.median(diffs) * 1e3:+.2f}"
        print(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded demo model")
    ap.add_argument("--num-requests", type=int, default=100, help="sequential requests per path (latency)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--load-requests", type=int, default=2000, help="requests per throughput run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--skip-servers", action="store_true", help="only the fake-worker throughput part")
    args = ap.parse_args(argv)

    print(f"{os.cpu_count()} cores; router = python -m pdserve.router (uvicorn, one process)")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.skip_servers:
            _print_latency(f"Latency, {args.num_requests} sequential /v1/completions per path, {args.prompt_len}-char "
                           f"prompts, {args.output_len} output tokens, demo model", latency(args, tmp))
        rows2, fake_lat = throughput(args, tmp)
        _print_latency(f"Latency, {args.num_requests * 4} sequential /v1/completions per path to fake workers "
                       "(instant answers)", fake_lat)
        print(f"\nThroughput, fake workers (instant answers, 4 tokens), {args.load_requests} requests at "
              f"concurrency {args.concurrency}")
        print(f"{'path':36s} {'req/s':>8s} {'router CPU ms/req':>18s}")
        for name, rate, cpu in rows2:
            print(f"{name:36s} {rate:8.0f} {'' if cpu is None else f'{cpu:18.2f}'}")

if __name__ == "__main__":
    main()
