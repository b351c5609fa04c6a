"""Admission of new requests in the HTTP process: graceful drain and load shedding.

**Drain** (SIGTERM, or `POST /drain` with the admin key when one is set): from that
moment `/health` answers 503 `{"status": "draining", ...}` (so routers and Kubernetes
take the server out of rotation) and new generation requests get 503. The requests
already submitted keep running: a colocated or decode server finishes its running
requests, a PD prefill server its KV transfers (a prefill request ends only once its
transfer is acknowledged). After `--graceful-shutdown-timeout` seconds whatever is still
in flight is aborted: its client gets a 503 error (or, on a stream, an error event and
`[DONE]`) saying the server shut down. Then, if a client that was probing `/health` when
the drain began is still connected and has not probed since (a router: its probes keep a
connection alive), the server waits for that probe, still answering "draining", up to
LINGER_MAX_S (never past the drain's deadline): the router then sees the drain and takes
the server out of rotation, rather than finding it gone, which would count as a failure.
A router that removed the server first (DELETE /workers) has closed its connections and
is not waited for; nor are probes on connections of their own (kubelet, curl). Then
uvicorn stops and the process exits 0.

**Load shedding** (`--max-queued-requests N`): the queue is counted here, in the HTTP
process, at the moment a request is submitted, so a burst is refused as it arrives
rather than after the scheduler's next report. A sample occupies one of the
scheduler's `--max-running-requests` slots once it runs; what is in flight beyond those
slots is waiting:

    queued = max(0, in-flight samples - max_running_requests)

In flight: from submission until the response has taken the samples' last updates.
A stream whose client does not read holds its connection and its samples' output in
this process after the scheduler has finished it, so it counts until its client has
taken it or `--send-timeout` has dropped the client (`TokenizerManager.in_flight_samples`).

A request of `k` samples is refused (503 with `Retry-After`) when it would make
`queued` exceed N. When the scheduler runs fewer than `max_running_requests` at once
(KV memory is the limit) more wait than this counts; the bound is on what the server
has accepted, never unbounded. A request of more than `max_running_requests + N`
samples (prompts x n) could never fit: it is refused with a 400 naming both limits
(retrying cannot help it), and one idle server's worth is the most one request may
take, so a single request cannot hold every slot and queue place for its whole run
while every other client gets 503s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

logger = logging.getLogger("pdserve")

# Seconds a refused client is told to wait (Retry-After): a slot frees within one
# request's time, and a router retries another worker meanwhile.
RETRY_AFTER_S = 1
# How often the drain looks at what is still in flight.
DRAIN_POLL_S = 0.05
# After the drain: a /health probe this recent (before the drain began), on a connection
# still open, is a router watching; the server waits for its next probe this long at most.
PROBE_WATCH_S = 5.0
LINGER_MAX_S = 5.0
MAX_PROBE_PEERS = 256  # probes remembered (older ones are forgotten beyond this)

Peer = tuple[str, int]  # a client's (host, port), as uvicorn and Starlette give it


class TooManySamples(ValueError):
    """A request larger than the server can run plus queue: HTTP 400 (a ValueError, as
    the routes' other validation errors, its message starting with the field)."""


class Refused(Exception):
    """A request refused before it was submitted: HTTP 503 with Retry-After (app.py)."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        # "draining": the body says so as /health does, for a router to tell a drain
        # (out of rotation) from a full queue (try another worker).
        self.status = status


@dataclass(frozen=True)
class QueueLimit:
    """`--max-queued-requests` against the `--max-running-requests` slots."""
    max_queued: int | None
    max_running: int

    @property
    def max_samples(self) -> int | None:
        """The most samples one request may have: every running slot and queue place."""
        return None if self.max_queued is None else self.max_running + self.max_queued

    def check(self, in_flight: int, new: int) -> None:
        """Raise TooManySamples if a request of `new` samples could never be admitted,
        Refused if `new` more samples would queue past the limit now. (An idle server
        admits any request that passes the first check.)"""
        cap = self.max_samples
        if cap is None:
            return
        if new > cap:
            raise TooManySamples(
                f"n: the request has {new} samples (prompts x n), more than this server can run and "
                f"queue: {self.max_running} running (--max-running-requests) + {self.max_queued} queued "
                f"(--max-queued-requests) = {cap}; send fewer prompts or a smaller n")
        queued = max(0, in_flight + new - self.max_running)
        if queued > self.max_queued:
            raise Refused(f"server overloaded: {in_flight} samples in flight (running, waiting, or streams "
                          f"still being delivered) for {self.max_running} running slots and {self.max_queued} "
                          f"queue places (--max-queued-requests {self.max_queued}); retry later or on another "
                          "server")


class InFlight(Protocol):
    """What the drain needs of the TokenizerManager."""

    def in_flight_requests(self) -> int: ...

    async def abort_all(self, reason: str) -> int: ...


class Drain:
    """The drain of one server (see the module doc). `start` begins it (idempotent);
    `stop` is called once everything in flight has ended, to stop uvicorn."""

    def __init__(self, manager: InFlight, timeout: float) -> None:
        self.manager = manager
        self.timeout = timeout
        self.since: float | None = None        # time.time() when the drain began
        self.cause: str | None = None
        self.aborted = 0                       # requests cut off at the deadline
        self.done = False
        self.stop: Callable[[], None] = lambda: None
        # The peers of the connections open now (launch.py: uvicorn's connections).
        self.open_peers: Callable[[], set[Peer]] = set
        self._task: asyncio.Task | None = None
        self._cut_short: str | None = None      # why the drain stopped waiting early (cut_short)
        self._began = 0.0                       # time.monotonic() when the drain began
        self._probes: dict[Peer, float] = {}    # peer -> monotonic time of its last /health

    @property
    def draining(self) -> bool:
        return self.since is not None

    def check(self) -> None:
        """Raise Refused while draining (called before a request is submitted)."""
        if self.draining:
            raise Refused("server is draining (shutting down): it accepts no new requests; "
                          "send this one to another server", status="draining")

    def start(self, cause: str) -> bool:
        """Begin draining (on the event loop). False if a drain is already under way."""
        if self.draining:
            return False
        self.since, self.cause = time.time(), cause
        self._began = time.monotonic()
        logger.info("draining (%s): %d request(s) in flight, up to %g s (--graceful-shutdown-timeout)",
                    cause, self.manager.in_flight_requests(), self.timeout)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    def cut_short(self, why: str) -> None:
        """Stop waiting (on the event loop): what is still in flight is aborted now, each
        request with an error, and the server stops (a second Ctrl-C)."""
        if self.draining and not self.done and self._cut_short is None:
            self._cut_short = why
            logger.info("%s: aborting the %d request(s) still in flight", why, self.manager.in_flight_requests())

    async def _run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout
            while (self.manager.in_flight_requests() and time.monotonic() < deadline
                   and self._cut_short is None):
                await asyncio.sleep(DRAIN_POLL_S)
            if self.manager.in_flight_requests():
                if self._cut_short is not None:
                    why = f"server shut down ({self._cut_short}) before the request finished"
                else:
                    why = (f"server shut down: the request did not finish within the drain's {self.timeout:g} s "
                           "(--graceful-shutdown-timeout) and was aborted")
                self.aborted = await self.manager.abort_all(why)
                if self._cut_short is None:
                    logger.warning("drain deadline reached: aborted %d request(s)", self.aborted)
            else:
                logger.info("drained: every request in flight finished")
            if self._cut_short is None:
                await self._linger(deadline)
        except Exception:  # never leave the server half drained: stop it anyway
            logger.exception("drain failed; stopping the server")
        finally:
            self.done = True
            self.stop()

    def probed(self, peer: Peer | None) -> None:
        """A GET /health from `peer` (the route calls this before it answers)."""
        if peer is None:
            return
        now = time.monotonic()
        self._probes[tuple(peer)] = now  # type: ignore[index]
        if len(self._probes) > MAX_PROBE_PEERS:  # kubelets and curl: a new peer per probe
            self._probes = {p: t for p, t in self._probes.items() if now - t <= PROBE_WATCH_S}
            while len(self._probes) > MAX_PROBE_PEERS:
                del self._probes[next(iter(self._probes))]

    def watchers(self) -> set[str]:
        """Hosts still connected that probed /health shortly before the drain began and
        have not probed since (so have not seen it)."""
        seen = {p[0] for p, t in self._probes.items() if t >= self._began}
        open_peers = self.open_peers()
        return {p[0] for p, t in self._probes.items()
                if self._began - PROBE_WATCH_S <= t < self._began and p in open_peers and p[0] not in seen}

    async def _linger(self, deadline: float) -> None:
        until = min(deadline, time.monotonic() + LINGER_MAX_S)
        waited = False
        while self.watchers() and time.monotonic() < until:
            waited = True
            await asyncio.sleep(DRAIN_POLL_S)
        if waited:
            logger.info("drain: waited for the next /health probe of the router(s) watching")

    def status(self) -> dict[str, Any]:
        """What /health and /get_server_info show of it."""
        return {"draining": self.draining, "draining_since": self.since, "drain_cause": self.cause,
                "in_flight_requests": self.manager.in_flight_requests(),
                "graceful_shutdown_timeout": self.timeout}
