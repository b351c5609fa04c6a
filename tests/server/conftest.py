"""Fixtures for the HTTP server's end-to-end tests: start `python -m pdserve.launch_server`
on a free port, wait for it, talk to it, stop it and check that no child survives."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import httpx
import pytest

from tests import process_logs
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90.0
TERM_GRACE_S = 15.0
MAX_TOTAL_TOKENS = 8192  # the KV pool of the module's `server` and `engine` below


_HANDED_OUT: set[int] = set()  # every port free_port returned in this test process


def free_port() -> int:
    """A port free now that this process never handed out before: a port chosen but not
    bound yet (a bootstrap port for a server still starting) is free to the OS, and was
    once handed out again for another server's HTTP port (a 501 from the bootstrap
    registry where the decode server should have answered)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# ---- /proc helpers (psutil is not installed) --------------------------------------
def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # state is the first field after the ")" that closes the command name
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """Every live process below `root`, from /proc's parent links."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parents[int(entry)] = int(fields[1])
    out: set[int] = set()
    frontier = [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in out]
        out.update(kids)
        frontier.extend(kids)
    return {p for p in out if pid_alive(p)}


# ---- SSE ---------------------------------------------------------------------------
def parse_sse_lines(lines: Iterable[str]) -> tuple[list[Any], bool]:
    """The JSON payloads of `data:` lines, and whether `data: [DONE]` ended the stream."""
    events: list[Any] = []
    done = False
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            done = True
            continue
        assert not done, f"event after [DONE]: {payload!r}"
        events.append(json.loads(payload))
    return events, done


def read_data_events(lines: Iterator[str], n: int) -> int:
    """Consume `lines` up to and including the `n`-th `data:` line (the rest of the stream
    stays unread); returns how many data lines came (fewer than `n` if the stream ended)."""
    got = 0
    for line in lines:
        if line.startswith("data:"):
            got += 1
            if got == n:
                break
    return got


# ---- the server process ------------------------------------------------------------
def kill_tree(proc: subprocess.Popen, known_pids: set[int]) -> None:
    """SIGKILL ``proc``, its descendants and ``known_pids`` (children seen earlier)."""
    pids = set(known_pids)
    if proc.poll() is None:
        pids |= descendants(proc.pid)
        proc.kill()
        proc.wait(10)
    for p in pids:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ServerProcess:
    def __init__(self, model_dir: Path, *extra: str, api_key: str | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-server-", suffix=".log", delete=False)
        self.argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(self.port), *extra]
        if api_key is not None:
            self.argv += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=str(REPO_ROOT), env=env, start_new_session=True)
        process_logs.register(self.log.name, f"server :{self.port} ({' '.join(extra) or 'defaults'})")
        self.known_pids: set[int] = set()
        self.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0)
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return "<no output>"

    def _wait_ready(self) -> None:
        try:
            wait_until_healthy(self.proc, self.url, STARTUP_TIMEOUT_S, lambda: self.output()[-8000:],
                               what=f"server ($ {' '.join(self.argv)})")
        except AssertionError as exc:
            self.kill_all()
            raise RuntimeError(f"{exc}\n{self.output()[-8000:]}") from None
        self.remember_pids()

    # ---- inspection -------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        r = self.client.get("/get_server_info", timeout=10.0)
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    def remember_pids(self) -> set[int]:
        """Record every child pid (from /proc and from /get_server_info)."""
        self.known_pids |= descendants(self.proc.pid)
        try:
            info = self.info()
            self.known_pids |= {int(p) for p in info.get("pids", [])}
            sp = scheduler_pid(info)
            if sp is not None:
                self.known_pids.add(int(sp))
        except Exception:
            pass
        self.known_pids.discard(self.proc.pid)
        return set(self.known_pids)

    def state(self) -> dict[str, Any]:
        return self.info()["internal_state"]

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """The state once no request runs or waits."""
        def idle() -> dict[str, Any] | None:
            st = self.state()
            return st if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0 else None
        return wait_until(idle, timeout, step=0.1, what=lambda: f"server idle (state: {self.state()})")

    def assert_pools_full(self, timeout: float = 15.0) -> None:
        """Idle, cache flushed, every KV page and request slot free."""
        self.wait_idle(timeout)

        def full() -> bool:
            r = self.client.post("/flush_cache", timeout=10.0)
            assert r.status_code == 200, (r.status_code, r.text)
            mem = self.state()["memory"]
            return mem["kv_pages_free"] == mem["kv_pages_total"] and mem["req_slots_free"] == mem["req_slots_total"]
        wait_until(full, timeout, step=0.2,
                   what=lambda: f"pools full after flush_cache (memory: {self.state()['memory']})")

    def finished(self, finish: str | None = None) -> float:
        """Requests this server has finished (with `finish`: only those that ended so, e.g. "abort")."""
        labels = {"finish": finish} if finish else {}
        return metric_value(self.client.get("/metrics").text, "pdserve:requests_total", **labels)

    # ---- stopping -----------------------------------------------------------------
    def terminate(self) -> tuple[bool, set[int]]:
        """SIGTERM, SIGKILL after the grace period. Returns (exited on SIGTERM, surviving children)."""
        if self.proc.poll() is None:
            self.remember_pids()
        children = set(self.known_pids)
        graceful = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                graceful = False
                self.proc.kill()
                self.proc.wait(10)
        # Children get a moment to notice their parent is gone.
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not any(pid_alive(p) for p in children), 5.0, step=0.1)
        return graceful, {p for p in children if pid_alive(p)}

    def kill_all(self) -> None:
        """Last resort: SIGKILL the server and the children we saw it start."""
        kill_tree(self.proc, self.known_pids)

    def close(self) -> None:
        try:
            graceful, alive = self.terminate()
            if not graceful or alive:
                sys.stderr.write(f"[tests/server] server {self.argv} graceful={graceful} "
                                 f"surviving children={sorted(alive)}\n")
        finally:
            self.kill_all()
            self.client.close()
            self.log.close()
            process_logs.unregister(self.log.name)
            with contextlib.suppress(OSError):
                os.unlink(self.log.name)


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, output: Callable[[], str],
                       what: str) -> None:
    """Until GET `url`/health answers 200: AssertionError after `timeout`, RuntimeError with
    `output()` (the process's log) as soon as `proc` exits."""
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{output()}")
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    wait_until(healthy, timeout, step=0.2, ignore=(httpx.HTTPError,), what=f"{what} healthy at {url}")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def scheduler_pid(info: dict[str, Any]) -> int | None:
    pid = info.get("scheduler_pid")
    if pid is None:
        pid = info.get("internal_state", {}).get("scheduler_pid")
    return pid


@pytest.fixture(scope="session")
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """Start a server; every server started is stopped at the end of the session at the
    latest (module fixtures stop theirs earlier with .close())."""
    servers: list[ServerProcess] = []

    def start(model_dir: Path, *extra: str, api_key: str | None = None) -> ServerProcess:
        s = ServerProcess(model_dir, *extra, api_key=api_key)
        servers.append(s)
        return s
    yield start
    for s in servers:
        if s.proc.poll() is None:
            s.close()


@pytest.fixture(scope="module")
def server_flags() -> tuple[str, ...]:
    """The command-line flags of the module's `server`; a test module overrides this
    fixture to start its server otherwise."""
    return ("--max-total-tokens", str(MAX_TOTAL_TOKENS))


@pytest.fixture(scope="module")
def server_api_key() -> str | None:
    """The --api-key of the module's `server` (overridable like `server_flags`)."""
    return None


@pytest.fixture(scope="module")
def server(start_server, llama_dir, server_flags, server_api_key) -> Iterator[ServerProcess]:
    """One server on the tiny llama for the whole test module."""
    s = start_server(llama_dir, *server_flags, api_key=server_api_key)
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine(llama_dir) -> Iterator[Any]:
    """The offline Engine on the model and pool size of `server`: the reference."""
    from pdserve import Engine

    e = Engine(model_path=str(llama_dir), max_total_tokens=MAX_TOTAL_TOKENS)
    yield e
    e.shutdown()


def assert_openai_error(r: httpx.Response, status: int = 400, fields: tuple[str, ...] = ()) -> dict:
    """An OpenAI-style error response; when `fields` are given, one of them is named
    (as `param` or in the message)."""
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:500]}"
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"error body is not JSON: {r.text[:500]!r}")
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    if status == 400:
        assert err.get("type") == "invalid_request_error", err
        assert err.get("code") in (400, "400"), err
    if fields:
        named = err.get("param") in fields or any(f in err["message"] for f in fields)
        assert named, f"error names none of {fields}: {err}"
    return err


def start_servers(model_dir: Path, specs: dict[str, tuple[str, ...]], *common: str) -> dict[str, "ServerProcess"]:
    """Start several servers at once (startup is mostly imports and loads), each with its
    own flags then ``common``; all or none: if one fails, the others are closed and the
    error names which."""
    started: dict[str, ServerProcess] = {}
    errors: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futs = {name: pool.submit(ServerProcess, model_dir, *flags, *common) for name, flags in specs.items()}
        for name, fut in futs.items():
            try:
                started[name] = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported below, after cleanup
                errors.append(f"{name}: {exc}")
    if errors:
        for server in started.values():
            with contextlib.suppress(Exception):
                server.close()
        raise RuntimeError("\n".join(errors))
    return started
