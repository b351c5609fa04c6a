"""`pdserve up`: a complete local deployment in one command.

    pdserve up                                   # 1 prefill + 1 decode + router, demo model
    pdserve up --prefill 2 --decode 2 --speculative-algorithm EAGLE
    pdserve up --disaggregation-mode null        # one colocated server
    pdserve up --model-path DIR --port 8000 --page-size 16   # server flags go to every server
    pdserve up --api-key KEY --admin-api-key ADMIN_KEY       # the router and every server
    pdserve up --base-port 30000                 # router 30000, prefill 30001 (+ bootstrap 30002), decode 30003

Flags (its own and the servers') may be unique prefixes, as SGLang's parser takes them.
Before anything starts, the whole command line is checked (every bad flag reported at
once, each server's command line as the server would check it), and so are Mooncake's
transfer engine and the pinned ports.

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
import dataclasses
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
from pdserve.flags import FlagParser, error_lines, is_bad, raise_problems


@dataclass(frozen=True)
class UpArgs:
    model_path: str | None
    mode: str                     # "pd" or "null"
    num_prefill: int
    num_decode: int
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None  # resolved by ServerArgs (the same rule as `pdserve serve`)
    speculative_prefill: bool
    host: str
    port: int
    startup_timeout: float
    server_args: tuple[str, ...]  # passed through to every server (flags written out in full)
    api_key: str | None = None        # the router's and every server's
    admin_api_key: str | None = None
    router_args: tuple[str, ...] = ()  # the server limits the router checks too (--max-n, ...)
    admin_api_key_generated: bool = False  # no --admin-api-key, and the router is no loopback client
    base_port: int | None = None  # --base-port: every port pinned (port_plan); None: servers' ports picked free

    @property
    def num_servers(self) -> int:
        return 1 if self.mode == "null" else self.num_prefill + self.num_decode


# Server flags `up` sets on each server itself (its own flags set them).
OWNED = ("--port", "--host", "--disaggregation-mode", "--disaggregation-bootstrap-port", "--model-path")
MULTINODE = ("--nnodes", "--node-rank", "--dist-init-addr")


def build_parser(config_error: type[Exception]) -> FlagParser:
    ap = FlagParser(prog="pdserve up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    error_class=config_error)
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
    ap.add_argument("--port", type=int, default=None,
                    help="the deployment's HTTP port (router, or the server; default 30000)")
    ap.add_argument("--base-port", type=int, default=None, metavar="N",
                    help="pin every port: the router (or the colocated server) on N, then each prefill server's "
                         "HTTP and bootstrap ports, then the decode servers' HTTP ports, from N+1 on "
                         "(default: free ports picked at run time for the servers)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")
    ap.add_argument("--api-key", default=None,
                    help="required from clients by the router and by every server (the router sends it on)")
    ap.add_argument("--admin-api-key", default=None,
                    help="required on the admin routes (/abort_request, /flush_cache, /drain, the router's "
                         "/workers) of the router and of every server; without it they answer loopback clients "
                         "only, and with a --host the router reaches the servers from beyond loopback, one is "
                         "generated")
    return ap


def parse_args(argv: Sequence[str]) -> UpArgs:
    """`up`'s flags and the server flags it forwards, all checked here, once: every bad flag
    in one ConfigError (unique prefixes expanded, as `pdserve serve` takes them), then each
    server's command line as ServerArgs validates it (so a bad value is reported by `up`,
    not by every server)."""
    from pdserve.config import ConfigError, ServerArgs

    server_parser = ServerArgs.cli_parser()
    ap = build_parser(ConfigError)
    ns, rest, problems = ap.parse_collecting([os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv],
                                             forward_to=server_parser)
    if ns is not None:
        problems += server_parser.parse_collecting(rest)[2]
        problems += _own_problems(ns, rest)
    raise_problems(problems, ConfigError)
    assert ns is not None
    mode = ns.disaggregation_mode
    servers = 1 if mode == "null" else ns.prefill + ns.decode
    rest += device_share(rest, servers, _cuda_available())
    admin_api_key, generated = ns.admin_api_key, False
    if admin_api_key is None and mode == "pd" and not router_is_loopback_client(ns.host):
        # The router aborts legs and flushes caches on the servers' admin routes; from
        # beyond loopback those need a key, which nobody else has to know.
        admin_api_key, generated = secrets.token_hex(16), True
    port = ns.base_port if ns.base_port is not None else (ns.port if ns.port is not None else 30000)
    args = UpArgs(ns.model_path, mode, ns.prefill, ns.decode, ns.speculative_algorithm,
                  ns.speculative_draft_model_path, ns.speculative_prefill, ns.host, port, ns.startup_timeout,
                  tuple(rest), ns.api_key, admin_api_key, _router_limits(rest), generated, ns.base_port)
    # Every server's command line, as it will run (ports aside), through ServerArgs: the
    # first value a server would refuse is reported now. The draft comes back resolved.
    draft = None
    for role in ("null",) if mode == "null" else ("prefill", "decode"):
        speculative = role != "prefill" or args.speculative_prefill
        server = ServerArgs.from_cli(server_argv(args, 0, role, _speculative_flags(args) if speculative else []))
        draft = draft or server.speculative_draft_model_path
    return dataclasses.replace(args, speculative_draft_model_path=draft)


def _own_problems(ns: argparse.Namespace, rest: Sequence[str]) -> list[str]:
    """What `up` refuses of its own flags, and server flags it sets itself (values the
    parser refused already are skipped: they are reported)."""
    ok = {k: v for k, v in vars(ns).items() if not is_bad(v)}
    problems = []
    prefill, decode, port, base = ok.get("prefill"), ok.get("decode"), ok.get("port"), ok.get("base_port")
    null = ok.get("disaggregation_mode") == "null"
    for name, value in (("prefill", prefill), ("decode", decode)):
        if value is not None and value < 1:
            problems.append(f"--{name}: must be >= 1, got {value}")
    if port is not None and not 0 < port <= 65535:
        problems.append(f"--port: must be in [1, 65535], got {port}")
    if base is not None:
        if ns.port is not None:
            problems.append("--base-port: puts the router (or the colocated server) on its own port; give it or "
                            "--port, not both")
        last = base if null else base + 2 * max(prefill or 1, 1) + max(decode or 1, 1)
        if not 0 < base or last > 65535:
            problems.append(f"--base-port: the deployment's ports {base}..{last} must lie in [1, 65535]")
    if ok.get("speculative_prefill") and not ns.speculative_algorithm:
        problems.append("--speculative-prefill: needs --speculative-algorithm")
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("--")]  # written out in full by the parser
    for name in dict.fromkeys(f for f in flags if f in MULTINODE):  # up's servers are all this machine's processes
        problems.append(f"{name}: pdserve up starts one machine's deployment; start an instance spanning nodes "
                        "with `pdserve serve ... --nnodes N --node-rank R --dist-init-addr HOST:PORT` on each node")
    for name in dict.fromkeys(f for f in flags if f in OWNED):
        problems.append(f"{name}: set by pdserve up itself (use its own flags)")
    return problems


def server_argv(args: UpArgs, port: int, mode: str, extra: Sequence[str]) -> list[str]:
    """A server's flags as `up` starts it (checked by parse_args with the same function)."""
    argv = ["--host", args.host, "--port", str(port), "--disaggregation-mode", mode]
    if args.model_path is not None:
        argv += ["--model-path", args.model_path]
    return argv + list(extra) + key_args(args) + list(args.server_args)


def _speculative_flags(args: UpArgs) -> list[str]:
    if args.speculative_algorithm is None:
        return []
    out = ["--speculative-algorithm", args.speculative_algorithm]
    if args.speculative_draft_model_path is not None:  # else ServerArgs picks the default (the demo's head)
        out += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    return out


@dataclass(frozen=True)
class PortPlan:
    """The ports `up` listens on: the deployment's (router, or the colocated server), each
    prefill server's HTTP and bootstrap ports, each decode server's HTTP port. None: picked
    free at run time."""
    deployment: int
    deployment_is: str  # "the router", or "the server" (--disaggregation-mode null)
    prefill: tuple[tuple[int, int], ...] | None
    decode: tuple[int, ...] | None

    def named(self) -> list[tuple[str, int]]:
        out = [(self.deployment_is, self.deployment)]
        for i, (http, boot) in enumerate(self.prefill or ()):
            out += [(f"prefill-{i}'s HTTP port", http), (f"prefill-{i}'s bootstrap port", boot)]
        out += [(f"decode-{i}'s HTTP port", http) for i, http in enumerate(self.decode or ())]
        return out


def port_plan(args: UpArgs) -> PortPlan:
    """--base-port N: the router (or the colocated server) on N, then prefill i on N+1+2i
    (bootstrap N+2+2i), then decode j on N+1+2P+j. Without it: --port, the rest free."""
    front = "the server" if args.mode == "null" else "the router"
    if args.base_port is None or args.mode == "null":
        return PortPlan(args.port, front, None, None)
    n, p = args.base_port, args.num_prefill
    return PortPlan(n, front, tuple((n + 1 + 2 * i, n + 2 + 2 * i) for i in range(p)),
                    tuple(n + 1 + 2 * p + j for j in range(args.num_decode)))


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on (is bound to) HOST:PORT: a bind as the servers do it
    (SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False  # an unresolvable --host is the servers' to refuse, naming it
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return True
    return False


def preflight(args: UpArgs, env: dict[str, str]) -> None:
    """What a deployment needs from this machine, checked before anything starts (a
    server finds out only after loading its model): the transfer engine loads, the RDMA
    devices exist, the pinned ports are free. ConfigError with the fix."""
    from pdserve.config import ConfigError

    if args.mode == "pd":
        why = transfer_engine_problem(args.server_args, env)
        if why is not None:
            raise ConfigError(why)
    flag = "--base-port" if args.base_port is not None else "--port"
    for what, port in port_plan(args).named():
        if port_in_use(args.host, port):
            raise ConfigError(f"{flag} {args.base_port if args.base_port is not None else args.port}: port {port} "
                              f"({what}) is in use on {args.host}; choose another {flag}")


def transfer_engine_problem(server_args: Sequence[str], env: dict[str, str]) -> str | None:
    """Why the PD servers' transfer engine cannot run here (None: it can). Mooncake (the
    default) is imported in a child with the servers' environment, as they will import it:
    the import fails without the package or without libibverbs1, which it links against
    even over TCP. With --disaggregation-ib-device (RDMA) the devices must exist."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--disaggregation-transfer-backend", default="mooncake")
    ap.add_argument("--disaggregation-ib-device", default=None)
    ns, _ = ap.parse_known_args(list(server_args))
    if ns.disaggregation_transfer_backend != "mooncake":
        return None  # refused by the servers' own checks (nixl) before they load anything
    try:
        probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True,
                               env={**env, "MC_LOG_LEVEL": "ERROR"}, timeout=60)
        lines = [x.strip() for x in probe.stderr.splitlines() if x.strip()]
        error = None if probe.returncode == 0 else lines[-1] if lines else f"exit status {probe.returncode}"
    except subprocess.TimeoutExpired:
        error = "its import did not finish in 60 s"
    if error is not None:
        fix = ("apt-get install libibverbs1 (Mooncake links against it, even over TCP)" if "ibverbs" in error
               else "pip install -e '.[pd]' (Mooncake's CPU build; mooncake-transfer-engine on a CUDA machine), "
                    "and apt-get install libibverbs1")
        return (f"the prefill and decode servers move KV with Mooncake, which does not load here ({error}): {fix}; "
                "or run one colocated server with --disaggregation-mode null")
    if ns.disaggregation_ib_device:
        missing = [d for d in ns.disaggregation_ib_device.split(",")
                   if not os.path.isdir(os.path.join("/sys/class/infiniband", d.strip()))]
        if missing:
            return (f"--disaggregation-ib-device: no RDMA device {', '.join(missing)} on this machine (see "
                    "/sys/class/infiniband, or `ibv_devices`); leave the flag out to transfer over TCP")
    return None


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


def server_env(args: UpArgs) -> dict[str, str]:
    """Servers on one machine split its cores: each torch (OpenMP) pool defaults to
    every core, and two servers' spinning pools on the same cores stall each other
    (measured on 2 cores, P and D both with EAGLE: mean TTFT 580 ms with 2 threads
    each, 57 ms with 1). An OMP_NUM_THREADS the user set wins."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.num_servers))
    return env


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
        """``server_env`` plus ``label``: what the server's lines are labelled with
        (pdserve/logs.py)."""
        return dict(server_env(self.args), **{logs.LABEL_ENV: label})

    def _start(self, name: str, cmd: list[str], url: str, env: dict[str, str] | None = None) -> Child:
        child = Child(name, url, subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=env))
        self.children.append(child)
        return child

    def _server_cmd(self, port: int, mode: str, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "pdserve.launch_server", *server_argv(self.args, port, mode, extra)]

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
        return _speculative_flags(self.args)

    def start(self) -> str:
        """Start everything, wait for health; returns the deployment's URL."""
        a = self.args
        if a.mode == "null":
            url = f"http://{a.host}:{a.port}"
            self._start("server", self._server_cmd(a.port, "null", self._speculative()), url,
                        self._server_env("server"))
            self._wait_healthy()
            return url
        plan = port_plan(a)
        prefill, decode = [], []
        for i in range(a.num_prefill):
            port, boot = plan.prefill[i] if plan.prefill is not None else (free_port(a.host), free_port(a.host))
            extra = ["--disaggregation-bootstrap-port", str(boot)] + (self._speculative() if a.speculative_prefill
                                                                       else [])
            name = f"prefill-{i}"
            child = self._start(name, self._server_cmd(port, "prefill", extra), f"http://{a.host}:{port}",
                                self._server_env(name if a.num_prefill > 1 else "prefill"))
            prefill.append((child.url, boot))
        for i in range(a.num_decode):
            port = plan.decode[i] if plan.decode is not None else free_port(a.host)
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
    from pdserve.config import ConfigError

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        preflight(args, server_env(args))
    except ConfigError as exc:  # one line per problem, no usage block, nothing started
        sys.stderr.write(error_lines("pdserve up", exc))
        return 2
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
