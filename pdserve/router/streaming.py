"""A streaming request through the router: everything up to decode's first event (retried
by the proxy like a unary request), then a `StreamSession` that forwards decode's events
to the client as they come (nothing after the first event is retried).

Split from proxy.py, which picks the pair, sends the legs and retries attempts, because
from the first event on a request is a stream with its own life: forwarded event by
event, prompt logprobs from the prefill leg merged in, a mid-stream failure ended with an
SSE error event, and closed from whatever path the response ends on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

import httpx

from pdserve.router.errors import SSE_DONE, error_body, error_bytes, sse_event
from pdserve.router.legs import PREFILL_GRACE_S, Failure
from pdserve.router.logprobs import merge_prompt_logprobs, results_by_index, wants_prompt_logprobs
from pdserve.router.workers import Worker

if TYPE_CHECKING:
    from pdserve.router.proxy import Attempt, Proxy

logger = logging.getLogger(__name__)


async def open_session(proxy: "Proxy", att: "Attempt", content: bytes, body: dict[str, Any],
                       arrived: float) -> "StreamSession | Failure":
    loop = asyncio.get_running_loop()
    route = att.route
    if att.prefill is not None:
        att.tasks["prefill"] = loop.create_task(proxy.post_leg(att.prefill, route, content))
    opened: OpenStream | None = None
    att.tasks["decode"] = d_task = loop.create_task(open_decode_stream(proxy, att.decode, route, content))
    need_prefill = wants_prompt_logprobs(route, body)
    prefill_payload: Any = None
    try:
        pending = set(att.tasks.values())
        while d_task in pending or (need_prefill and att.tasks.get("prefill") in pending):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if d_task in done:
                res = d_task.result()
                if isinstance(res, Failure):
                    proxy.cancel_pending(att, pending)
                    return res
                opened = res
            p_task = att.tasks.get("prefill")
            if p_task is not None and p_task in done:
                fail, prefill_payload = proxy.judge.check_prefill_stream(p_task.result(), route)
                if fail is not None:
                    if opened is not None:
                        opened.close(proxy)
                    proxy.cancel_pending(att, pending)
                    return fail
        assert opened is not None
        merge = None
        if need_prefill and prefill_payload is not None:
            merge = results_by_index(route, prefill_payload)
        return StreamSession(proxy, att, body, opened, arrived, merge)
    except BaseException:
        if opened is not None:
            opened.close(proxy)
        proxy.cancel_pending(att, {t for t in att.tasks.values() if not t.done()})
        raise


async def open_decode_stream(proxy: "Proxy", worker: Worker, route: str, content: bytes) -> "OpenStream | Failure":
    """Send the decode leg and read up to its first event. The open stream (and the
    worker's in-flight count) belongs to the session from then on."""
    worker.in_flight += 1
    proxy.metrics.worker_requests.labels(worker.role, worker.url).inc()
    resp: httpx.Response | None = None
    handed_over = False
    try:
        req = worker.client.build_request("POST", worker.url + route, content=content, headers=proxy.headers)
        resp = await worker.client.send(req, stream=True)
        if resp.status_code != 200:
            body = await resp.aread()
            return proxy.judge.status_failure(worker, resp.status_code, body, resp.headers.get("retry-after"))
        lines = resp.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                payload = json.loads(data)
            except ValueError:
                proxy.metrics.errors.labels("worker_5xx").inc()
                return Failure("worker_5xx", f"{worker.role} worker {worker.url}: malformed event {data[:200]!r}",
                               True, 502, worker)
            fail = proxy.judge.payload_failure(worker, route, payload, data.encode())
            if fail is not None:
                if fail.status == 200:  # a stream that only says "aborted": an error status
                    fail.status, fail.content = 503, error_bytes(fail.message, 503)
                return fail
            handed_over = True
            return OpenStream(worker, resp, lines, payload, data)
        proxy.metrics.errors.labels("worker_5xx").inc()
        return Failure("worker_5xx", f"{worker.role} worker {worker.url}: stream ended before any event",
                       True, 502, worker)
    except httpx.HTTPError as exc:
        return proxy.judge.transport_failure(worker, exc)
    except RuntimeError as exc:  # its client closed: the worker was removed meanwhile
        return proxy.judge.transport_failure(worker, httpx.TransportError(f"worker removed: {exc}"))
    finally:
        if not handed_over:
            worker.in_flight -= 1
            if resp is not None:
                proxy.spawn(resp.aclose())


@dataclass
class OpenStream:
    """Decode's stream once its first event is in: it holds the worker's in-flight count."""
    worker: Worker
    resp: httpx.Response
    lines: AsyncIterator[str]
    first: Any        # the first event's payload
    first_data: str   # and its text
    closed: bool = False

    def close(self, proxy: "Proxy") -> None:
        if not self.closed:
            self.closed = True
            self.worker.in_flight -= 1
            proxy.spawn(self.resp.aclose())


class BrokenStream(Exception):
    """Decode's stream ended without [DONE]."""


class StreamSession:
    """Decode's stream from its first event on, forwarded event by event. `close()` is
    synchronous (it only schedules work) so that it can run from any cancellation path:
    a client that disconnects cancels the response task wherever it is."""

    def __init__(self, proxy: "Proxy", att: "Attempt", body: dict[str, Any], opened: OpenStream, arrived: float,
                 prefill_results: dict[int, Any] | None) -> None:
        self.proxy = proxy
        self.att = att
        self.body = body
        self.opened = opened
        self.arrived = arrived
        self.prefill_results = prefill_results
        self.pending_merge: set[int] | None = None
        self.finished = False   # the stream reached its end (decode's [DONE] or our error event)
        self.closed = False
        self.outcome = "success"

    def _merge(self, payload: Any, data: str) -> str:
        if self.prefill_results is None:
            return data
        if self.pending_merge is None:
            self.pending_merge = set(self.prefill_results)
        # /generate events are cumulative (each repeats the sample's whole meta_info, its
        # empty prompt logprobs too): every one is filled. A completions sample's prompt
        # logprobs are in its first chunk only.
        if not self.pending_merge and self.att.route != "/generate":
            return data
        if payload is None:
            try:
                payload = json.loads(data)
            except ValueError:
                return data
        self.pending_merge -= merge_prompt_logprobs(self.att.route, payload, self.prefill_results)
        return json.dumps(payload)

    async def events(self) -> AsyncIterator[bytes]:
        m = self.proxy.metrics
        route = self.att.route
        worker = self.opened.worker
        try:
            yield f"data: {self._merge(self.opened.first, self.opened.first_data)}\n\n".encode()
            last = time.perf_counter()
            m.ttft.labels(route).observe(last - self.arrived)
            done = False
            async for line in self.opened.lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                if data.startswith('{"error"'):  # the worker's own error event: passed through as is
                    m.errors.labels("worker_5xx").inc()
                    self.outcome = "server_error"
                yield f"data: {self._merge(None, data)}\n\n".encode()
                now = time.perf_counter()
                m.itl.labels(route).observe(now - last)
                last = now
            if not done:
                raise BrokenStream("the stream ended without [DONE]")
        except (httpx.HTTPError, BrokenStream) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException):
                self.proxy.registry.mark_down(worker, f"stream failed: {reason}")
            m.errors.labels("stream_broken").inc()
            self.outcome = "server_error"
            message = f"{worker.role} worker {worker.url} failed mid-stream: {reason}"
            logger.warning("%s", message)
            yield sse_event(error_body(message, "server_error", None, 502))
        self.finished = True
        yield SSE_DONE

    def close(self) -> None:
        """Idempotent. After a complete stream: wait (in the background) for the prefill
        leg. Otherwise (the client went away, or the server shuts down): abort both legs."""
        if self.closed:
            return
        self.closed = True
        proxy, att, m = self.proxy, self.att, self.proxy.metrics
        self.opened.close(proxy)
        proxy.forget(self.body, att)
        m.e2e.labels(att.route).observe(time.perf_counter() - self.arrived)
        p_task = att.tasks.get("prefill")
        if not self.finished:
            m.errors.labels("client_disconnect").inc()
            m.requests.labels(att.route, "client_disconnect").inc()
            legs = [att.decode]
            if p_task is not None and not p_task.done():
                p_task.cancel()
                legs.append(att.prefill)  # type: ignore[arg-type]
            proxy.abort_legs(att, legs)
            return
        m.requests.labels(att.route, self.outcome).inc()
        if p_task is not None:
            proxy.spawn(self._settle_prefill(p_task))

    async def _settle_prefill(self, p_task: asyncio.Task) -> None:
        done, _ = await asyncio.wait({p_task}, timeout=PREFILL_GRACE_S)
        if not done:
            p_task.cancel()
            self.proxy.abort_legs(self.att, [w for w in (self.att.prefill,) if w is not None])
            self.proxy.metrics.errors.labels("prefill_late_error").inc()
            return
        fail, _ = self.proxy.judge.check_prefill_stream(p_task.result(), self.att.route)
        if fail is not None:
            self.proxy.metrics.errors.labels("prefill_late_error").inc()
            logger.warning("prefill leg failed after decode's stream: %s", fail.message)
