"""Fixtures for the HTTP server's end-to-end tests: start `python -m pdserve.launch_server`
on a free port, wait for it, talk to it, stop it and check that no child survives."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import httpx
import pytest

from tests import process_logs

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90.0
TERM_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# ---- the server process ------------------------------------------------------------
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
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready:\n"
                                   f"$ {' '.join(self.argv)}\n{self.output()[-8000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.remember_pids()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill_all()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.output()[-8000:]}")

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
        deadline = time.monotonic() + timeout
        st = self.state()
        while time.monotonic() < deadline:
            st = self.state()
            if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
                return st
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout}s: {st}")

    def assert_pools_full(self, timeout: float = 15.0) -> None:
        """Idle, cache flushed, every KV page and request slot free."""
        self.wait_idle(timeout)
        deadline = time.monotonic() + timeout
        mem: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = self.client.post("/flush_cache", timeout=10.0)
            assert r.status_code == 200, (r.status_code, r.text)
            mem = self.state()["memory"]
            if mem["kv_pages_free"] == mem["kv_pages_total"] and \
                    mem["req_slots_free"] == mem["req_slots_total"]:
                return
            time.sleep(0.2)
        raise AssertionError(f"pools not full after flush_cache: {mem}")

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
        deadline = time.monotonic() + 5.0
        alive = {p for p in children if pid_alive(p)}
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = {p for p in alive if pid_alive(p)}
        return graceful, alive

    def kill_all(self) -> None:
        """Last resort: SIGKILL the server and the children we saw it start."""
        pids = set(self.known_pids)
        if self.proc.poll() is None:
            pids |= descendants(self.proc.pid)
            self.proc.kill()
            self.proc.wait(10)
        for p in pids:
            if pid_alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass

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
