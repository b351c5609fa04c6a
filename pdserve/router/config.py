"""Router configuration: one frozen dataclass, parsed from flags named as in SGLang's router.

    python -m pdserve.router --pd-disaggregation \\
        --prefill http://p0:30001 8998 --prefill http://p1:30001 \\
        --decode http://d0:30002 --decode http://d1:30002 --host 0.0.0.0 --port 8000

or, in front of colocated servers (plain load balancing, no bootstrap fields):

    python -m pdserve.router --worker-urls http://s0:30000 http://s1:30000

or with the workers found on Kubernetes (pods matching label selectors, watched):

    python -m pdserve.router --pd-disaggregation --service-discovery \\
        --prefill-selector app=pdserve component=prefill --decode-selector app=pdserve component=decode

Every mistake is a `ConfigError` whose message starts with the flag it is about.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

from pdserve.flags import FlagParser
from pdserve.router.policies import POLICY_NAMES
from pdserve.router.urls import UrlError, canonical_url, is_own_address

DEFAULT_BOOTSTRAP_PORT = 8998  # the servers' --disaggregation-bootstrap-port default
POLICIES = POLICY_NAMES  # the --policy choices: the registry's names (policies.POLICY_CLASSES)
ROLES = ("prefill", "decode", "plain")
# The pod annotation a prefill pod names its bootstrap port in (absent: DEFAULT_BOOTSTRAP_PORT).
DEFAULT_BOOTSTRAP_PORT_ANNOTATION = "pdserve/bootstrap-port"
DEFAULT_DISCOVERY_PORT = 30000  # the servers' --port default
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # the servers' --log-level choices


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerSpec:
    url: str                   # normalised: scheme://host:port, no trailing slash
    role: str                  # "prefill", "decode" or "plain" (a colocated server)
    bootstrap_port: int | None = None  # prefill only; None: let the servers use their default

    @property
    def host(self) -> str:
        """What decode is told to bootstrap from: the prefill URL's host."""
        return urlsplit(self.url).hostname or ""


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    workers: tuple[WorkerSpec, ...] = ()   # plain mode
    pd_disaggregation: bool = True
    host: str = "127.0.0.1"
    port: int = 30000
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    policy: str = "round_robin"             # plain mode
    health_check_interval: float = 1.0
    health_check_timeout: float = 1.0
    retries: int = 1
    request_timeout: float = 1800.0
    connect_timeout: float = 2.0
    api_key: str | None = None
    # When set, the admin routes (/abort_request, /flush_cache, /workers) need it instead of
    # api_key (and the router sends it to the workers on their admin routes); when not, they
    # answer only loopback clients.
    admin_api_key: str | None = None
    # Checked before any per-request work (the servers' defaults): a body above
    # max_request_bytes is a 413, n above max_n or more than max_request_samples samples
    # (prompts x n) in one request a 400.
    max_n: int = 16
    max_request_bytes: int = 8 << 20
    max_request_samples: int = 65536
    # A client must deliver a request's headers and body within this many seconds.
    request_read_timeout: float = 10.0
    # A client whose connection has taken nothing for this many seconds while the router's
    # buffers for it are full is dropped (its request's worker legs aborted), as nginx's
    # send_timeout: a stream nobody reads does not hold the router's memory forever.
    send_timeout: float = 60.0
    # cache_aware (prefill, decode or plain; one prefix tree per role's policy): route to the
    # worker whose cached prefix covers more than this share of the request, unless it has
    # more than balance_abs_threshold requests in flight above the least loaded worker.
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    max_tree_size: int = 1 << 22             # elements (chars or token ids) kept per tree
    log_level: str = "info"
    # Kubernetes pod discovery (discovery.py): pods matching a selector (label -> value, all
    # must match) are added when ready and drained when not ready or deleted.
    service_discovery: bool = False
    prefill_selector: tuple[tuple[str, str], ...] = ()
    decode_selector: tuple[tuple[str, str], ...] = ()
    selector: tuple[tuple[str, str], ...] = ()   # plain mode (colocated servers)
    service_discovery_namespace: str | None = None  # None: the router pod's own namespace
    service_discovery_port: int = DEFAULT_DISCOVERY_PORT
    bootstrap_port_annotation: str = DEFAULT_BOOTSTRAP_PORT_ANNOTATION

    def __post_init__(self) -> None:
        # With discovery the worker lists may start empty: pods join at run time.
        sd = self.service_discovery
        if self.pd_disaggregation:
            if not self.prefill and not sd:
                raise ConfigError("--prefill: PD mode needs at least one prefill server")
            if not self.decode and not sd:
                raise ConfigError("--decode: PD mode needs at least one decode server")
            if self.workers:
                raise ConfigError("--worker-urls: plain workers cannot be mixed with --pd-disaggregation")
            if sd and not (self.prefill_selector and self.decode_selector):
                raise ConfigError("--prefill-selector/--decode-selector: --service-discovery in PD mode needs "
                                  "both (key=value labels of the prefill and of the decode pods)")
            if self.selector:
                raise ConfigError("--selector: selects colocated workers; in PD mode use --prefill-selector and "
                                  "--decode-selector")
        else:
            if self.prefill or self.decode:
                raise ConfigError("--pd-disaggregation: --prefill/--decode need --pd-disaggregation")
            if not self.workers and not sd:
                raise ConfigError("--worker-urls: give the servers to route to (or --pd-disaggregation "
                                  "with --prefill/--decode)")
            if sd and not self.selector:
                raise ConfigError("--selector: --service-discovery without --pd-disaggregation needs the "
                                  "key=value labels of the worker pods")
            if self.prefill_selector or self.decode_selector:
                raise ConfigError("--prefill-selector/--decode-selector: need --pd-disaggregation")
        if not sd and (self.prefill_selector or self.decode_selector or self.selector):
            raise ConfigError("--service-discovery: the selectors only apply with --service-discovery")
        if not 0 < self.service_discovery_port <= 65535:
            raise ConfigError(f"--service-discovery-port: must be in [1, 65535], got {self.service_discovery_port}")
        if not self.bootstrap_port_annotation:
            raise ConfigError("--bootstrap-port-annotation: must not be empty")
        urls = [w.url for w in self.all_workers]
        dup = next((u for u in urls if urls.count(u) > 1), None)
        if dup is not None:
            raise ConfigError(f"--prefill/--decode: {dup} is listed twice")
        own = next((u for u in urls if is_own_address(u, self.host, self.port)), None)
        if own is not None:  # it would send every request back to itself
            raise ConfigError(f"--prefill/--decode/--worker-urls: {own} is this router's own address "
                              f"(--host {self.host} --port {self.port})")
        for name in ("prefill_policy", "decode_policy", "policy"):
            if getattr(self, name) not in POLICIES:
                raise ConfigError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} is not one of "
                                  f"{', '.join(POLICIES)}")
        positive = ("health_check_interval", "health_check_timeout", "request_timeout", "connect_timeout",
                    "request_read_timeout", "send_timeout")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(self, name)}")
        if self.send_timeout == float("inf"):
            raise ConfigError("--send-timeout: must be finite")
        if self.retries < 0:
            raise ConfigError(f"--retries: must be >= 0, got {self.retries}")
        if not 0 < self.port <= 65535:
            raise ConfigError(f"--port: must be in [1, 65535], got {self.port}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"--balance-abs-threshold: must be >= 0, got {self.balance_abs_threshold}")
        if self.max_tree_size < 1:
            raise ConfigError(f"--max-tree-size: must be >= 1, got {self.max_tree_size}")
        for name, least in (("max_n", 1), ("max_request_bytes", 1024), ("max_request_samples", 1)):
            if getattr(self, name) < least:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= {least}, got {getattr(self, name)}")

    @property
    def all_workers(self) -> tuple[WorkerSpec, ...]:
        return self.prefill + self.decode + self.workers


def normalise_url(url: str, flag: str) -> str:
    """One canonical spelling per server (urls.py: scheme://host:port, numeric and loopback
    spellings folded, no userinfo, at most 2048 characters); ConfigError naming `flag`."""
    try:
        return canonical_url(url)
    except UrlError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def parse_bootstrap_port(value: object, what: str) -> int | None:
    """A prefill worker's bootstrap port as the flag, the API and the pod annotation give
    it: an integer in [1, 65535], or 'none' (SGLang's spelling for "the servers' own
    default"). `what` starts the error message."""
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return None
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"{what}: bootstrap port {value!r} is not an integer") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{what}: bootstrap port {value!r} is not an integer")
    if not 0 < value <= 65535:
        raise ConfigError(f"{what}: bootstrap port {value} is not in [1, 65535]")
    return value


def _prefill_spec(values: Sequence[str]) -> WorkerSpec:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill: expected URL [BOOTSTRAP_PORT], got {' '.join(values)!r}")
    url = normalise_url(values[0], "--prefill")
    port: int | None = DEFAULT_BOOTSTRAP_PORT
    if len(values) == 2:
        port = parse_bootstrap_port(values[1], f"--prefill: {url}")
    return WorkerSpec(url, "prefill", port)


def _selector(values: Sequence[str] | None, flag: str) -> tuple[tuple[str, str], ...]:
    """`key=value ...` (SGLang's spelling; one value may also hold several, comma-separated)."""
    out: list[tuple[str, str]] = []
    for value in values or ():
        for part in value.split(","):
            key, eq, val = part.strip().partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"{flag}: {part!r} is not key=value")
            out.append((key.strip(), val.strip()))
    return tuple(out)


def build_parser() -> FlagParser:
    """The router's flags: unique prefixes accepted (as SGLang's router), every bad flag
    and value reported together as one ConfigError (pdserve/flags.py)."""
    ap = FlagParser(prog="python -m pdserve.router", description=__doc__, error_class=ConfigError,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pd-disaggregation", action="store_true",
                    help="route each request to a prefill and a decode server")
    ap.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                    help=f"a prefill server and its bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}; "
                         "'none': the servers' default); repeat for more")
    ap.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode server; repeat for more")
    ap.add_argument("--worker-urls", "--worker", nargs="+", action="extend", default=[], dest="worker_urls",
                    metavar="URL", help="plain mode: colocated servers to balance over")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--policy", default=None, choices=POLICIES,
                    help="load balancing policy (round_robin); in PD mode the policy of both prefill and decode "
                         "unless --prefill-policy / --decode-policy override it")
    ap.add_argument("--prefill-policy", default=None, choices=POLICIES,
                    help="PD mode: the policy for prefill servers (default: --policy)")
    ap.add_argument("--decode-policy", default=None, choices=POLICIES,
                    help="PD mode: the policy for decode servers (default: --policy); cache_aware sends a "
                         "conversation back to the decode server whose prefix cache holds its earlier turns")
    ap.add_argument("--health-check-interval", type=float, default=1.0, metavar="S")
    ap.add_argument("--health-check-timeout", type=float, default=1.0, metavar="S")
    ap.add_argument("--retries", type=int, default=1,
                    help="times a request that failed before any token reached the client is retried on "
                         "another pair")
    ap.add_argument("--request-timeout", type=float, default=1800.0, metavar="S")
    ap.add_argument("--connect-timeout", type=float, default=2.0, metavar="S")
    ap.add_argument("--api-key", default=None,
                    help="clients must send 'Authorization: Bearer KEY'; also sent to the workers")
    ap.add_argument("--admin-api-key", default=None,
                    help="the admin routes (/abort_request, /flush_cache, /workers) need 'Authorization: Bearer "
                         "KEY' (not --api-key); also sent to the workers on their admin routes. Without it the "
                         "admin routes answer only loopback clients")
    ap.add_argument("--admin-api-key-file", default=None, metavar="PATH",
                    help="--admin-api-key read from a file (a mounted secret), kept off the command line")
    ap.add_argument("--max-n", type=int, default=16, help="upper bound on n per request (the servers' --max-n)")
    ap.add_argument("--max-request-bytes", type=int, default=8 << 20, metavar="BYTES",
                    help="larger bodies are refused (413) before they are read")
    ap.add_argument("--max-request-samples", type=int, default=65536, metavar="N",
                    help="upper bound on prompts x n in one request (one bootstrap room each)")
    ap.add_argument("--request-read-timeout", type=float, default=10.0, metavar="S",
                    help="a client must send a request's headers and body within this (else 408, closed)")
    ap.add_argument("--send-timeout", type=float, default=60.0, metavar="S",
                    help="drop a client that takes nothing for this long while its response waits (as the servers)")
    ap.add_argument("--cache-threshold", type=float, default=0.5)
    ap.add_argument("--balance-abs-threshold", type=int, default=32)
    ap.add_argument("--max-tree-size", type=int, default=1 << 22)
    ap.add_argument("--service-discovery", action="store_true",
                    help="add and drain workers as Kubernetes pods matching the selectors become ready or go "
                         "(needs the kubernetes package: pip install 'pdserve[k8s]')")
    ap.add_argument("--prefill-selector", nargs="+", action="extend", metavar="KEY=VALUE",
                    help="labels of the prefill pods (PD mode)")
    ap.add_argument("--decode-selector", nargs="+", action="extend", metavar="KEY=VALUE",
                    help="labels of the decode pods (PD mode)")
    ap.add_argument("--selector", nargs="+", action="extend", metavar="KEY=VALUE",
                    help="labels of colocated worker pods (plain mode)")
    ap.add_argument("--service-discovery-namespace", default=None, metavar="NS",
                    help="namespace to watch (default: the router pod's own, else 'default')")
    ap.add_argument("--service-discovery-port", type=int, default=DEFAULT_DISCOVERY_PORT, metavar="PORT",
                    help=f"the servers' HTTP port in the pods ({DEFAULT_DISCOVERY_PORT})")
    ap.add_argument("--bootstrap-port-annotation", default=DEFAULT_BOOTSTRAP_PORT_ANNOTATION, metavar="NAME",
                    help=f"prefill pod annotation holding its bootstrap port (absent: {DEFAULT_BOOTSTRAP_PORT})")
    ap.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="info: a ready line, worker changes and failures; debug adds uvicorn's and httpx's lines")
    return ap


def from_cli(argv: Sequence[str] | None = None) -> RouterConfig:
    ns = build_parser().parse_or_raise(sys.argv[1:] if argv is None else argv)
    if not ns.pd_disaggregation and (ns.prefill or ns.decode) and not ns.worker_urls:
        # SGLang requires the flag; say so rather than silently treating them as plain workers.
        raise ConfigError("--pd-disaggregation: --prefill/--decode need --pd-disaggregation")
    policy = ns.policy or "round_robin"
    return RouterConfig(
        prefill=tuple(_prefill_spec(v) for v in ns.prefill),
        decode=tuple(WorkerSpec(normalise_url(u, "--decode"), "decode") for u in ns.decode),
        workers=tuple(WorkerSpec(normalise_url(u, "--worker-urls"), "plain") for u in ns.worker_urls),
        pd_disaggregation=ns.pd_disaggregation, host=ns.host, port=ns.port,
        # As SGLang's router: --policy is both roles' policy unless a role's own flag overrides it.
        prefill_policy=ns.prefill_policy or policy, decode_policy=ns.decode_policy or policy, policy=policy,
        health_check_interval=ns.health_check_interval, health_check_timeout=ns.health_check_timeout,
        retries=ns.retries, request_timeout=ns.request_timeout, connect_timeout=ns.connect_timeout,
        api_key=ns.api_key, admin_api_key=_admin_key(ns.admin_api_key, ns.admin_api_key_file), max_n=ns.max_n,
        max_request_bytes=ns.max_request_bytes, max_request_samples=ns.max_request_samples,
        request_read_timeout=ns.request_read_timeout, send_timeout=ns.send_timeout,
        cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
        max_tree_size=ns.max_tree_size, log_level=ns.log_level,
        service_discovery=ns.service_discovery,
        prefill_selector=_selector(ns.prefill_selector, "--prefill-selector"),
        decode_selector=_selector(ns.decode_selector, "--decode-selector"),
        selector=_selector(ns.selector, "--selector"),
        service_discovery_namespace=ns.service_discovery_namespace,
        service_discovery_port=ns.service_discovery_port, bootstrap_port_annotation=ns.bootstrap_port_annotation)


def _admin_key(key: str | None, path: str | None) -> str | None:
    """--admin-api-key, or the content of --admin-api-key-file (whitespace around it
    stripped: a mounted secret's trailing newline)."""
    if path is None:
        return key
    if key is not None:
        raise ConfigError("--admin-api-key: give it or --admin-api-key-file, not both")
    try:
        with open(path, encoding="utf-8") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"--admin-api-key-file: cannot read {path!r}: {exc.strerror or exc}") from None
    if not key:
        raise ConfigError(f"--admin-api-key-file: {path!r} is empty")
    return key
