"""`pdserve up`: a complete local deployment in one command.

    pdserve up                                   # 1 prefill + 1 decode + router, demo model
    pdserve up --prefill 2 --decode 2 --speculative-algorithm EAGLE
    pdserve up --disaggregation-mode null        # one colocated server
    pdserve up --model-path DIR --port 8000 --page-size 16   # unknown flags go to every server
    pdserve up --api-key KEY --admin-api-key ADMIN_KEY       # the router and every server

It starts the servers (free ports picked at run time, bootstrap ports too), waits
until each answers `/health`, starts the router in front of them, prints the URL and
an example request, and on Ctrl-C (or SIGTERM) stops every process it started. If
any process dies, the whole deployment is stopped and the exit status is non-zero.

One console: every process writes pdserve's one line format (pdserve/logs.py), each
line labelled with who wrote it (`router`, `prefill`, `decode`, `server`, `up`; with
several servers of a kind, `prefill-0`, `prefill-1`, ...). A terminal's Ctrl-C reaches
every process of the group at once: the children ignore it (they start with SIGINT
ignored and keep it so) and `up` stops them in order, the router first (no new requests),
then the servers, which drain: what is in flight finishes, or ends with an error event
after --graceful-shutdown-timeout.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from pdserve import logs

DEMO_DRAFTS = {"EAGLE": "demo-eagle", "EAGLE3": "demo-eagle3"}


@dataclass(frozen=True)
class UpArgs:
    model_path: str | None
    mode: str                     # "pd" or "null"
    num_prefill: int
    num_decode: int
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_prefill: bool
    host: str
    port: int
    startup_timeout: float
    server_args: tuple[str, ...]  # passed through to every server
    api_key: str | None = None        # the router's and every server's
    admin_api_key: str | None = None
    router_args: tuple[str, ...] = ()  # the server limits the router checks too (--max-n, ...)
    admin_api_key_generated: bool = False  # no --admin-api-key, and the router is no loopback client


def parse_args(argv: Sequence[str]) -> UpArgs:
    ap = argparse.ArgumentParser(prog="pdserve up", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--model-path", default=None, help="model directory (default: the embedded demo model)")
    ap.add_argument("--disaggregation-mode", choices=("pd", "null"), default="pd",
                    help="pd: prefill + decode servers behind the router; null: one colocated server")
    ap.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill servers (pd mode)")
    ap.add_argument("--decode", type=int, default=1, metavar="M", help="decode servers (pd mode)")
    ap.add_argument("--speculative-algorithm", choices=("EAGLE", "EAGLE3"), default=None,
                    help="speculative decoding on the decode servers (and the colocated server)")
    ap.add_argument("--speculative-draft-model-path", default=None,
                    help="draft model (default with the demo model: its embedded EAGLE / EAGLE3 head)")
    ap.add_argument("--speculative-prefill", action="store_true",
                    help="run the draft on the prefill servers too")
    ap.add_argument("--host", default="127.0.0.1", help="address of the router (and of every server)")
    ap.add_argument("--port", type=int, default=30000, help="the deployment's HTTP port (router, or the server)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")
    ap.add_argument("--api-key", default=None,
                    help="required from clients by the router and by every server (the router sends it on)")
    ap.add_argument("--admin-api-key", default=None,
                    help="required on the admin routes (/abort_request, /flush_cache, /drain, the router's "
                         "/workers) of the router and of every server; without it they answer loopback clients "
                         "only, and with a --host the router reaches the servers from beyond loopback, one is "
                         "generated")
    ns, rest = ap.parse_known_args([os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv])
    if ns.prefill < 1:
        ap.error(f"--prefill: must be >= 1, got {ns.prefill}")
    if ns.decode < 1:
        ap.error(f"--decode: must be >= 1, got {ns.decode}")
    if not 0 < ns.port <= 65535:
        ap.error(f"--port: must be in [1, 65535], got {ns.port}")
    if ns.speculative_prefill and not ns.speculative_algorithm:
        ap.error("--speculative-prefill: needs --speculative-algorithm")
    draft = ns.speculative_draft_model_path
    if ns.speculative_algorithm and draft is None:
        if ns.model_path is not None:
            ap.error("--speculative-draft-model-path: required with --model-path and --speculative-algorithm")
        from pdserve import assets
        draft = str(assets.path(DEMO_DRAFTS[ns.speculative_algorithm]))
    owned = {"--port", "--host", "--disaggregation-mode", "--disaggregation-bootstrap-port", "--model-path"}
    clash = next((a for a in rest if a.split("=", 1)[0] in owned), None)
    multinode = next((a for a in rest if a.split("=", 1)[0] in ("--nnodes", "--node-rank", "--dist-init-addr")), None)
    if multinode is not None:  # up's servers are all this machine's processes
        ap.error(f"{multinode.split('=', 1)[0]}: pdserve up starts one machine's deployment; start an instance "
                 "spanning nodes with `pdserve serve ... --nnodes N --node-rank R --dist-init-addr HOST:PORT` "
                 "on each node")
    if clash is not None:
        ap.error(f"{clash.split('=', 1)[0]}: set by pdserve up itself (use its own flags)")
    servers = 1 if ns.disaggregation_mode == "null" else ns.prefill + ns.decode
    rest += device_share(rest, servers, _cuda_available())
    admin_api_key, generated = ns.admin_api_key, False
    if admin_api_key is None and ns.disaggregation_mode == "pd" and not router_is_loopback_client(ns.host):
        # The router aborts legs and flushes caches on the servers' admin routes; from
        # beyond loopback those need a key, which nobody else has to know.
        admin_api_key, generated = secrets.token_hex(16), True
    return UpArgs(ns.model_path, ns.disaggregation_mode, ns.prefill, ns.decode, ns.speculative_algorithm, draft,
                  ns.speculative_prefill, ns.host, ns.port, ns.startup_timeout, tuple(rest), ns.api_key,
                  admin_api_key, _router_limits(rest), generated)


def router_is_loopback_client(host: str) -> bool:
    """Whether the router, reaching the servers at http://HOST:PORT, connects from a
    loopback address: HOST is a loopback address, `localhost`, or 0.0.0.0 / :: (which
    connect to loopback). Servers without --admin-api-key answer their admin routes only
    to loopback clients."""
    from pdserve.router.urls import UrlError, canonical_host, is_loopback_host

    try:
        return is_loopback_host(canonical_host(host.strip("[]"), bracketed=":" in host))
    except UrlError:
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_share(server_args: Sequence[str], servers: int, cuda: bool) -> list[str]:
    """``--mem-fraction-static`` for servers that share one GPU: each server takes an
    equal part of the default share of the device (its weights and KV pools), unless
    the flag was given or the servers run on the CPU."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--mem-fraction-static")
    ap.add_argument("--device")
    ns, _ = ap.parse_known_args(list(server_args))
    if servers < 2 or not cuda or ns.mem_fraction_static is not None or ns.device == "cpu":
        return []
    from pdserve.config import ServerArgs

    return ["--mem-fraction-static", f"{ServerArgs.mem_fraction_static / servers:.3f}"]


# Server flags the router takes as well: the limits it checks too, and the log level (one
# --log-level sets every process's).
ROUTER_LIMITS = ("--max-n", "--max-request-bytes", "--log-level")


def _router_limits(server_args: Sequence[str]) -> tuple[str, ...]:
    """The servers' limits the router must apply too (else it refuses what they accept),
    and their log level."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ROUTER_LIMITS:
        ap.add_argument(name)
    ns, _ = ap.parse_known_args(list(server_args))
    out: list[str] = []
    for name in ROUTER_LIMITS:
        value = getattr(ns, name[2:].replace("-", "_"))
        if value is not None:
            out += [name, value]
    return tuple(out)


def graceful_timeout(server_args: Sequence[str]) -> float:
    """The servers' drain deadline (--graceful-shutdown-timeout, passed through to them):
    how long `up` lets them finish what is in flight when it stops them."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--graceful-shutdown-timeout", type=float, default=None)
    ns, _ = ap.parse_known_args(list(server_args))
    if ns.graceful_shutdown_timeout is not None:
        return float(ns.graceful_shutdown_timeout)
    from pdserve.config import ServerArgs

    return ServerArgs.graceful_shutdown_timeout


def say(message: str, level: int = logging.INFO) -> None:
    """One of `up`'s own lines, in the deployment's format (labelled `up`); warnings and
    errors on stderr."""
    print(logs.format_line("up", message, level=level), file=sys.stderr if level >= logging.WARNING else sys.stdout,
          flush=True)


def key_args(args: UpArgs) -> list[str]:
    """The keys, as the router and the servers spell them."""
    out: list[str] = []
    for name, value in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key)):
        if value is not None:
            out += [name, value]
    return out


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    url: str
    proc: subprocess.Popen


def _die_with_parent() -> None:
    """Children must not outlive `pdserve up`, even when it is SIGKILLed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; `up` decides


# How long the router alone gets to stop before the servers are told to drain: it exits
# at once when nothing is in flight; a stream in flight keeps it, and the servers' drain
# then bounds that stream.
ROUTER_HEAD_START_S = 2.0
# Past the servers' drain deadline (--graceful-shutdown-timeout), what is still running
# is killed after this long.
STOP_MARGIN_S = 15.0


class StopRequested(Exception):
    """Ctrl-C or SIGTERM asked the deployment to stop."""


class Deployment:
    def __init__(self, args: UpArgs, stop_requested: threading.Event) -> None:
        self.args = args
        self.stop_requested = stop_requested
        self.children: list[Child] = []

    def _server_env(self, label: str) -> dict[str, str]:
        """Servers on one machine split its cores: each torch (OpenMP) pool defaults to
        every core, and two servers' spinning pools on the same cores stall each other
        (measured on 2 cores, P and D both with EAGLE: mean TTFT 580 ms with 2 threads
        each, 57 ms with 1). An OMP_NUM_THREADS the user set wins. ``label``: what the
        server's lines are labelled with (pdserve/logs.py)."""
        env = dict(os.environ, **{logs.LABEL_ENV: label})
        if "OMP_NUM_THREADS" not in env:
            a = self.args
            servers = 1 if a.mode == "null" else a.num_prefill + a.num_decode
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // servers))
        return env

    def _start(self, name: str, cmd: list[str], url: str, env: dict[str, str] | None = None) -> Child:
        child = Child(name, url, subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=env))
        self.children.append(child)
        return child

    def _server_cmd(self, port: int, mode: str, extra: list[str]) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "pdserve.launch_server", "--host", a.host, "--port", str(port),
               "--disaggregation-mode", mode]
        if a.model_path is not None:
            cmd += ["--model-path", a.model_path]
        return cmd + extra + key_args(a) + list(a.server_args)

    def _router_cmd(self, prefill: list[tuple[str, int]], decode: list[str]) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "pdserve.router", "--pd-disaggregation", "--host", a.host,
               "--port", str(a.port), *key_args(a), *a.router_args]
        for url, boot in prefill:
            cmd += ["--prefill", url, str(boot)]
        for url in decode:
            cmd += ["--decode", url]
        return cmd

    def _speculative(self) -> list[str]:
        a = self.args
        if a.speculative_algorithm is None:
            return []
        return ["--speculative-algorithm", a.speculative_algorithm,
                "--speculative-draft-model-path", str(a.speculative_draft_model_path)]

    def start(self) -> str:
        """Start everything, wait for health; returns the deployment's URL."""
        a = self.args
        if a.mode == "null":
            url = f"http://{a.host}:{a.port}"
            self._start("server", self._server_cmd(a.port, "null", self._speculative()), url,
                        self._server_env("server"))
            self._wait_healthy()
            return url
        prefill, decode = [], []
        for i in range(a.num_prefill):
            port, boot = free_port(a.host), free_port(a.host)
            extra = ["--disaggregation-bootstrap-port", str(boot)] + (self._speculative() if a.speculative_prefill
                                                                       else [])
            name = f"prefill-{i}"
            child = self._start(name, self._server_cmd(port, "prefill", extra), f"http://{a.host}:{port}",
                                self._server_env(name if a.num_prefill > 1 else "prefill"))
            prefill.append((child.url, boot))
        for i in range(a.num_decode):
            port = free_port(a.host)
            name = f"decode-{i}"
            child = self._start(name, self._server_cmd(port, "decode", self._speculative()),
                                f"http://{a.host}:{port}", self._server_env(name if a.num_decode > 1 else "decode"))
            decode.append(child.url)
        self._wait_healthy()
        url = f"http://{a.host}:{a.port}"
        self._start("router", self._router_cmd(prefill, decode), url)
        self._wait_healthy()
        return url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        pending = [c for c in self.children]
        while pending:
            if self.stop_requested.is_set():
                raise StopRequested
            self.check_alive()
            for c in list(pending):
                try:
                    if httpx.get(c.url + "/health", timeout=2.0).status_code == 200:
                        pending.remove(c)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(c.name for c in pending)} not healthy after "
                                   f"{self.args.startup_timeout:g} s")
            time.sleep(0.3)

    def check_alive(self) -> None:
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{c.name} ({' '.join(c.proc.args)}) exited with status {rc}")  # type: ignore

    def stop(self) -> None:
        """The router first: SIGTERM, so it takes no new request; it exits once its
        streams in flight have ended. Then (once it is gone, or after ROUTER_HEAD_START_S
        when streams hold it) the servers: SIGTERM drains them, the requests in flight
        finish or, after --graceful-shutdown-timeout, end with an error event that the
        router passes on (a clean end, never a cut stream); the router, which stopped
        probing them loudly, leaves with its last stream. SIGKILL for whatever is still
        running STOP_MARGIN_S past the drain's deadline."""
        router = [c for c in self.children if c.name == "router"]
        servers = [c for c in self.children if c.name != "router"]
        for c in router:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        head_start = time.monotonic() + ROUTER_HEAD_START_S
        for c in router:
            try:
                c.proc.wait(max(0.0, head_start - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in servers:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + graceful_timeout(self.args.server_args) + STOP_MARGIN_S
        for c in servers + router:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{c.name} still running {STOP_MARGIN_S:g} s after the drain's deadline: killed",
                    logging.WARNING)
                c.proc.kill()
                c.proc.wait(5)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logs.set_process_title("up")
    # The handlers only set a flag that the loops below poll. Raising KeyboardInterrupt
    # from a handler is unreliable: when the signal lands while a finalizer (__del__,
    # a weakref callback) runs, Python reports the exception as "ignored" and goes on,
    # and Ctrl-C is lost (the likely cause of `pdserve up` once still running 60 s after
    # the test suite's SIGINT).
    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _signum, _frame: stop_requested.set())
    dep = Deployment(args, stop_requested)
    try:
        url = dep.start()
        where = ("router in front of " + f"{args.num_prefill} prefill + {args.num_decode} decode server(s)"
                 if args.mode == "pd" else "one colocated server")
        auth = " -H 'Authorization: Bearer <your --api-key>'" if args.api_key else ""
        if args.admin_api_key_generated:
            say(f"the router reaches the servers from beyond loopback ({args.host}), so their "
                "admin routes need a key: one was generated for the router and the servers (pass "
                "--admin-api-key to choose it and reach /drain, /abort_request, /flush_cache, /workers)")
        say(f"{where} ready at {url}\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is 12 + 7?\"}]}'\n"
            "  Ctrl-C stops everything.")
        while not stop_requested.is_set():
            dep.check_alive()
            time.sleep(0.2)  # a handler does not cut a sleep short (PEP 475): this bounds the delay
        raise StopRequested
    except StopRequested:
        say("stopping: the router first, then the servers (they drain)")
        return 0
    except RuntimeError as exc:
        say(str(exc), logging.ERROR)
        return 1
    finally:
        dep.stop()


if __name__ == "__main__":
    sys.exit(main())
