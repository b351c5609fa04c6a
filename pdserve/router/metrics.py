"""The router's Prometheus metrics (one registry per app: no process-global state).

Latencies are what the client sees through the router: time to the first streamed
event, gaps between streamed events, and arrival to the last byte.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Causes of errors_total (documented so that dashboards can rely on them):
#   no_healthy_worker  no healthy prefill or decode worker: 503 at once
#   connect_error      a leg failed at the connection level (worker taken out of rotation)
#   timeout            a leg exceeded --request-timeout
#   worker_5xx         a worker answered 5xx (or ended a leg with a server-side abort)
#   worker_4xx         a worker refused the request (passed through to the client)
#   shed               a worker answered 503 + Retry-After (its queue is full): retried elsewhere
#   bad_request        the router refused the request itself (not a JSON object, router-owned fields)
#   stream_broken      the decode leg failed after tokens reached the client (SSE error event)
#   prefill_late_error the prefill leg failed after decode had already answered
#   client_disconnect  the client went away; both legs were aborted
# A worker that is draining (503 "draining") is not an error: it only leaves rotation.
ERROR_CAUSES = ("no_healthy_worker", "connect_error", "timeout", "worker_5xx", "worker_4xx", "shed", "bad_request",
                "stream_broken", "prefill_late_error", "client_disconnect")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve_router:time_to_first_token_seconds",
                              "Streaming requests: arrival at the router to the first event sent to the client",
                              ["route"], buckets=_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router:inter_token_latency_seconds",
                             "Streaming requests: time between events sent to the client", ["route"],
                             buckets=_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router:e2e_request_latency_seconds",
                             "Arrival at the router to the end of the response", ["route"],
                             buckets=_BUCKETS, registry=r)
        self.requests = Counter("pdserve_router:requests", "Requests by route and final outcome",
                                ["route", "outcome"], registry=r)
        self.worker_requests = Counter("pdserve_router:worker_requests", "Legs sent to each worker",
                                       ["role", "worker"], registry=r)
        self.errors = Counter("pdserve_router:errors", "Errors by cause", ["cause"], registry=r)
        self.retries = Counter("pdserve_router:retries", "Requests retried on another pair", registry=r)
        self.aborts = Counter("pdserve_router:leg_aborts", "Legs aborted on a worker (orphans, disconnects)",
                              ["role"], registry=r)
        self.worker_healthy = Gauge("pdserve_router:worker_healthy", "1 while a worker is in rotation",
                                    ["role", "worker"], registry=r)
        self.worker_in_flight = Gauge("pdserve_router:worker_in_flight", "Legs in flight per worker",
                                      ["role", "worker"], registry=r)
        self.health_check_failures = Counter(
            "pdserve_router:health_check_failures", "Failed health probes per worker (a draining answer is not one)",
            ["role", "worker"], registry=r)
        self.worker_draining = Gauge("pdserve_router:worker_draining",
                                     "1 while a worker is draining (its own drain) or being removed",
                                     ["role", "worker"], registry=r)
        for cause in ERROR_CAUSES:
            self.errors.labels(cause)  # present at 0 from the start

    def render(self, workers: Iterable[object]) -> bytes:
        for w in workers:
            self.worker_healthy.labels(w.role, w.url).set(1 if w.healthy else 0)  # type: ignore[attr-defined]
            self.worker_in_flight.labels(w.role, w.url).set(w.in_flight)  # type: ignore[attr-defined]
            self.worker_draining.labels(w.role, w.url).set(  # type: ignore[attr-defined]
                1 if w.server_draining or w.removing else 0)  # type: ignore[attr-defined]
        return generate_latest(self.registry)

    def forget_worker(self, role: str, url: str) -> None:
        """A removed worker's series go (a gauge left behind would read as a live worker)."""
        for metric in (self.worker_healthy, self.worker_in_flight, self.worker_draining,
                       self.health_check_failures, self.worker_requests):
            try:
                metric.remove(role, url)
            except KeyError:
                pass
