"""Sending one client request to a (prefill, decode) pair and answering the client.

Per attempt: pick a pair, give the body a rid per prompt and (PD mode) a fresh room
per sample, send it to both workers at once, and answer with decode's response
(streamed through for streaming requests) once prefill has answered too.

Failure rules:
- Before anything reached the client, a leg that fails at the connection level, with a
  5xx, or with a server-side abort (a failed KV transfer) fails the attempt: the other
  leg is aborted (`POST /abort_request` with the rid, and its connection closed) and
  the request is retried on another pair, `--retries` times. A connection-level
  failure also takes the worker out of rotation.
- Load shedding: a 503 with `Retry-After` (a server whose queue is full) or a 503 saying
  the server is draining, before anything reached the client, is retried on a pair
  without that worker, whatever `--retries` says, until no candidate of the role is
  left (each worker sheds a request at most once): only when every candidate shed it
  does the client get the 503, with `Retry-After`. The other leg is aborted as for any
  failed attempt (its room freed), and the retry draws fresh rooms and rids. A draining
  worker also leaves rotation (not counted as a failure).
- A 4xx from either leg is the answer (the other leg is aborted): the workers validate,
  the router passes their verdict and body through.
- Once a streamed event has reached the client nothing is retried: a decode failure
  ends the stream with an OpenAI-shaped SSE error event and `data: [DONE]`.
- A client that goes away (or aborts by rid) aborts both legs.
Every accepted request ends in exactly one of: decode's answer, a worker's error passed
through, or one router error.

In plain mode (colocated workers) there is no prefill leg and no bootstrap fields.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from pdserve.router.errors import SSE_DONE, error_body, error_bytes, sse_event
from pdserve.router.logprobs import merge_prompt_logprobs, results_by_index, wants_prompt_logprobs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Policy
from pdserve.router.rooms import Shape, draw_rooms, leg_body, leg_rids, rid_list, routing_key, shape_of
from pdserve.router.workers import Worker, WorkerRegistry, says_draining

logger = logging.getLogger(__name__)

# An abort can overtake the leg it is meant for (the leg's POST may still be on its way):
# the router asks again until the worker has seen the rid, for up to ABORT_TRIES tries.
ABORT_TRIES = 10
ABORT_RETRY_S = 0.1
# After decode has finished, how long the router keeps waiting for a prefill leg that has
# not answered yet before aborting it (decode only finishes after prefill's transfer, so
# this is normally immediate).
PREFILL_GRACE_S = 30.0
# Causes of a 503 that means "not now, ask someone else" rather than "broken".
SHED_CAUSES = ("shed", "draining")
DEFAULT_RETRY_AFTER = "1"  # seconds, when no shedding worker named one


@dataclass
class Reply:
    """A complete (non-streaming) answer."""
    status: int
    content: bytes
    media_type: str = "application/json"
    headers: dict[str, str] | None = None


@dataclass
class Failure:
    """Why an attempt failed, and what the client gets if it is the final outcome."""
    cause: str
    message: str
    retryable: bool
    status: int
    worker: Worker | None = None
    content: bytes | None = None  # the worker's own body, passed through when final
    retry_after: str | None = None  # a shedding worker's Retry-After

    def reply(self) -> Reply:
        headers = {"retry-after": self.retry_after} if self.retry_after is not None else None
        if self.content is not None:
            return Reply(self.status, self.content, headers=headers)
        return Reply(self.status, error_bytes(self.message, self.status), headers=headers)


@dataclass
class _Leg:
    worker: Worker
    status: int | None = None
    content: bytes = b""
    error: BaseException | None = None
    retry_after: str | None = None


@dataclass
class _Attempt:
    route: str
    prefill: Worker | None
    decode: Worker
    rids: list[str]
    client_aborted: bool = False
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # role -> leg task


class Proxy:
    def __init__(self, registry: WorkerRegistry, metrics: RouterMetrics, *,
                 pd: bool, prefill_policy: Policy | None, decode_policy: Policy, retries: int,
                 headers: dict[str, str] | None = None, admin_headers: dict[str, str] | None = None,
                 randbits: Callable[[int], int] = secrets.randbits) -> None:
        self.registry = registry
        self.metrics = metrics
        self.pd = pd
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.retries = retries
        self.headers = {"content-type": "application/json", **(headers or {})}
        # /abort_request on the workers: their admin key when the router has one
        self.admin_headers = {**self.headers, **(admin_headers or {})}
        self.randbits = randbits
        self.decode_role = "decode" if pd else "plain"
        # rid (as the client knows it) -> the attempt now serving it, for /abort_request
        self.active: dict[str, _Attempt] = {}
        self._background: set[asyncio.Task] = set()

    # ---- choosing a pair -------------------------------------------------------------
    def _pick(self, route: str, body: dict[str, Any], exclude: set[Worker],
              shed: set[Worker] = frozenset()) -> tuple[Worker | None, Worker] | Failure | None:  # type: ignore[assignment]
        """A pair, a Failure when a role has no healthy worker, or None when every healthy
        worker of a role has shed this request already."""
        prefills = self.registry.healthy("prefill") if self.pd else []
        decodes = self.registry.healthy(self.decode_role)
        missing = (["prefill"] if self.pd and not prefills else []) + ([self.decode_role] if not decodes else [])
        if missing:
            self.metrics.errors.labels("no_healthy_worker").inc()
            return Failure("no_healthy_worker", f"no healthy {' and no healthy '.join(missing)} worker "
                           "(the router has nobody to send the request to)", False, 503)
        if shed:  # a worker that shed this request is not asked again
            prefills = [w for w in prefills if w not in shed]
            decodes = [w for w in decodes if w not in shed]
            if (self.pd and not prefills) or not decodes:
                return None
        # "Another pair": leave out the worker that just failed when there is a choice.
        prefills = [w for w in prefills if w not in exclude] or prefills
        decodes = [w for w in decodes if w not in exclude] or decodes
        key = None
        if self.prefill_policy is not None and self.prefill_policy.name == "cache_aware" \
                or self.decode_policy.name == "cache_aware":
            key = routing_key(route, body)
        prefill = self.prefill_policy.pick(prefills, key) if self.pd and self.prefill_policy else None
        decode = self.decode_policy.pick(decodes, key)
        return prefill, decode  # type: ignore[return-value]

    def _prepare(self, route: str, body: dict[str, Any], shape: Shape, pair: tuple[Worker | None, Worker],
                 attempt: int) -> tuple[_Attempt, bytes]:
        prefill, decode = pair
        rids = leg_rids(route, shape, body.get("rid"), attempt)
        if prefill is not None:
            lb = leg_body(body, rid=rids, host=prefill.spec.host, port=prefill.spec.bootstrap_port,
                          rooms=draw_rooms(shape, self.randbits))
        else:
            lb = leg_body(body, rid=rids)
        att = _Attempt(route, prefill, decode, rid_list(rids))
        for key in self._client_keys(body, att):
            self.active[key] = att
        return att, json.dumps(lb, separators=(",", ":")).encode()

    def _client_keys(self, body: dict[str, Any], att: _Attempt) -> list[str]:
        """The rids a client may abort this request by: its own, else the router's."""
        own = rid_list(body.get("rid"))
        return own or att.rids

    def _forget(self, body: dict[str, Any], att: _Attempt) -> None:
        for key in self._client_keys(body, att):
            if self.active.get(key) is att:
                del self.active[key]

    def _legs(self, att: _Attempt) -> list[Worker]:
        return [w for w in (att.prefill, att.decode) if w is not None]

    # ---- classifying a leg's outcome ---------------------------------------------------
    def _transport_failure(self, worker: Worker, exc: BaseException) -> Failure:
        what = f"{worker.role} worker {worker.url}"
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            self.metrics.errors.labels("timeout").inc()
            return Failure("timeout", f"{what} timed out ({type(exc).__name__})", False, 504, worker)
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.registry.mark_down(worker, f"request failed: {reason}")
        self.metrics.errors.labels("connect_error").inc()
        return Failure("connect_error", f"{what} failed: {reason}", True, 502, worker)

    def _status_failure(self, worker: Worker, status: int, content: bytes,
                        retry_after: str | None = None) -> Failure:
        what = f"{worker.role} worker {worker.url}"
        message = _error_message(content) or f"HTTP {status}"
        if status == 503 and (says_draining(content) or "draining" in message.lower()):
            # Shutting down gracefully: out of rotation (not a failure), ask another worker.
            self.registry.mark_draining(worker)
            return Failure("draining", f"{what} is draining", True, status, worker, content, retry_after)
        if status == 503 and retry_after is not None:
            # Its queue is full (--max-queued-requests): another worker may have room.
            self.metrics.errors.labels("shed").inc()
            return Failure("shed", f"{what} shed the request: {message}", True, status, worker, content,
                           retry_after)
        if status >= 500:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{what}: {message}", True, status, worker, content)
        self.metrics.errors.labels("worker_4xx").inc()
        return Failure("worker_4xx", f"{what}: {message}", False, status, worker, content)

    def _payload_failure(self, worker: Worker, route: str, payload: Any, content: bytes) -> Failure | None:
        """A 200 that still reports a server-side failure: an error object (an SSE error
        event) or a sample that ended with an abort (e.g. a failed KV transfer)."""
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            err = payload["error"]
            code = err.get("code")
            status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else 500
            if status < 400:
                status = 500
            return self._status_failure(worker, status, json.dumps(payload).encode())
        reason = _abort_reason(route, payload)
        if reason is not None:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{worker.role} worker {worker.url}: {reason}", True, 200, worker, content)
        return None

    def _check_unary(self, leg: _Leg, route: str) -> tuple[Failure | None, Any]:
        if leg.error is not None:
            return self._transport_failure(leg.worker, leg.error), None
        assert leg.status is not None
        if leg.status >= 400:
            return self._status_failure(leg.worker, leg.status, leg.content, leg.retry_after), None
        try:
            payload = json.loads(leg.content)
        except ValueError:
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{leg.worker.role} worker {leg.worker.url}: answer is not JSON",
                           True, 502, leg.worker), None
        return self._payload_failure(leg.worker, route, payload, leg.content), payload

    # ---- legs --------------------------------------------------------------------------
    async def _post(self, worker: Worker, route: str, content: bytes) -> _Leg:
        worker.in_flight += 1
        self.metrics.worker_requests.labels(worker.role, worker.url).inc()
        leg = _Leg(worker)
        try:
            r = await worker.client.post(worker.url + route, content=content, headers=self.headers)
            leg.status, leg.content = r.status_code, r.content
            leg.retry_after = r.headers.get("retry-after")
        except httpx.HTTPError as exc:
            leg.error = exc
        except RuntimeError as exc:  # its client closed: the worker was removed meanwhile
            leg.error = httpx.TransportError(f"worker removed: {exc}")
        finally:
            worker.in_flight -= 1
        return leg

    def abort_legs(self, att: _Attempt, workers: list[Worker]) -> None:
        """Abort the attempt's rids on `workers`, in the background (an abort must never
        hold up the answer, nor be lost when the request's own task is cancelled)."""
        for w in workers:
            for rid in att.rids:
                self.metrics.aborts.labels(w.role).inc()
                # Counted from now (not from when the task runs) to when it is over, even
                # cancelled before it ran: a worker being removed keeps its client until then.
                w.pending_aborts += 1
                self.spawn(self._abort(w, rid)).add_done_callback(
                    lambda _t, w=w: setattr(w, "pending_aborts", w.pending_aborts - 1))

    async def _abort(self, worker: Worker, rid: str) -> None:
        for _ in range(ABORT_TRIES):
            try:
                r = await worker.client.post(worker.url + "/abort_request", json={"rid": rid},
                                             headers=self.admin_headers, timeout=5.0)
                if r.status_code != 200 or r.json().get("aborted"):
                    return
            except ValueError:
                return  # not a pdserve answer: asking again will not change it
            except RuntimeError:
                return  # its client is closed: the worker is gone
            except httpx.HTTPError as exc:
                # Tried again: the leg just cancelled on this worker can leave a pooled
                # connection that fails once (seen as an abort lost under load); a worker
                # that is really gone fails every try and holds nothing to free.
                logger.debug("abort of %s on %s failed: %r", rid, worker.url, exc)
            await asyncio.sleep(ABORT_RETRY_S)

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self, grace_s: float = 2.0) -> None:
        """Give pending aborts a moment to reach the workers, then cancel what is left."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=grace_s)
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def abort_by_rid(self, rid: str) -> bool:
        """The client's POST /abort_request through the router: abort both legs."""
        att = self.active.get(rid)
        if att is None:
            return False
        att.client_aborted = True
        self.abort_legs(att, self._legs(att))
        return True

    # ---- non-streaming -------------------------------------------------------------------
    async def unary(self, route: str, body: dict[str, Any]) -> Reply:
        result = await self._with_retries(route, body, lambda att, content: self._unary_attempt(att, content, body),
                                          keeps_attempt=False)
        assert isinstance(result, Reply)
        return result

    async def _with_retries(self, route: str, body: dict[str, Any],
                            run: Callable[[_Attempt, bytes], Awaitable[Any]], keeps_attempt: bool) -> Any:
        """Run attempts on fresh pairs until one succeeds, a failure is not retryable, the
        client aborted, or the retries are spent (then the last failure's reply).
        ``keeps_attempt``: a successful attempt stays registered (a stream forgets it
        when it closes)."""
        busy = next((rid for rid in rid_list(body.get("rid")) if rid in self.active), None)
        if busy is not None:  # (checked and registered with no await in between)
            return Reply(400, error_bytes(f"rid: {busy!r} is already in flight", 400, "rid"))
        shape = shape_of(route, body)
        exclude: set[Worker] = set()   # failed: avoided when there is a choice
        shed: set[Worker] = set()      # shed the request: never asked again for it
        retry_afters: list[str] = []
        failure: Failure | None = None
        failed = 0
        attempt = -1
        while True:
            attempt += 1
            pair = self._pick(route, body, exclude, shed)
            if pair is None:  # every candidate of a role shed it: the 503, with Retry-After
                assert failure is not None
                return self._shed_reply(failure, retry_afters)
            if isinstance(pair, Failure):
                return pair.reply() if failure is None else failure.reply()
            if attempt:
                self.metrics.retries.inc()
                logger.warning("retrying %s on %s + %s after: %s", route, pair[0] and pair[0].url, pair[1].url,
                               failure.message if failure else "")
            att, content = self._prepare(route, body, shape, pair, attempt)
            try:
                result = await run(att, content)
            except BaseException:
                self._forget(body, att)
                raise
            if not isinstance(result, Failure):
                if not keeps_attempt:
                    self._forget(body, att)
                return result
            self._forget(body, att)
            failure = result
            if not failure.retryable or att.client_aborted:
                break
            if failure.cause in SHED_CAUSES and failure.worker is not None:
                # Not a fault: bounded by the workers (each sheds it once), not by --retries.
                shed.add(failure.worker)
                if failure.retry_after is not None:
                    retry_afters.append(failure.retry_after)
                continue
            failed += 1
            if failed > self.retries:
                break
            if failure.worker is not None:
                exclude.add(failure.worker)
        assert failure is not None
        return failure.reply()

    def _shed_reply(self, last: Failure, retry_afters: list[str]) -> Reply:
        """Every candidate shed the request: the last worker's 503 with the soonest
        Retry-After any of them gave (a number of seconds; else the last one's text)."""
        seconds = [int(v) for v in retry_afters if v.strip().isdigit()]
        value = str(min(seconds)) if seconds else (retry_afters[-1] if retry_afters else DEFAULT_RETRY_AFTER)
        reply = last.reply()
        reply.headers = {**(reply.headers or {}), "retry-after": value}
        return reply

    async def _unary_attempt(self, att: _Attempt, content: bytes, body: dict[str, Any]) -> Reply | Failure:
        route = att.route
        for w in self._legs(att):
            att.tasks[w.role] = asyncio.get_running_loop().create_task(self._post(w, route, content))
        by_task = {t: role for role, t in att.tasks.items()}
        pending = set(att.tasks.values())
        decode_role = att.decode.role
        answers: dict[str, Any] = {}
        decode_reply: Reply | None = None
        try:
            while pending:
                # Once decode has answered, prefill (which answers when its transfer is done,
                # so normally already has) gets a bounded wait, not the request timeout.
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                                   timeout=None if decode_reply is None else PREFILL_GRACE_S)
                if not done:
                    self.metrics.errors.labels("prefill_late_error").inc()
                    logger.warning("prefill leg still running %.0f s after decode answered: aborted",
                                   PREFILL_GRACE_S)
                    self._cancel_pending(att, pending)
                    break
                for t in done:
                    role = by_task[t]
                    leg: _Leg = t.result()
                    fail, payload = self._check_unary(leg, route)
                    if fail is None:
                        answers[role] = payload
                        if role == decode_role:
                            decode_reply = Reply(leg.status or 200, leg.content)
                        continue
                    if role == "prefill" and decode_reply is not None:
                        # Decode's answer is complete and stands; the prefill failure is logged.
                        self.metrics.errors.labels("prefill_late_error").inc()
                        logger.warning("prefill leg failed after decode answered: %s", fail.message)
                        continue
                    self._cancel_pending(att, pending)
                    return fail
            assert decode_reply is not None
            if "prefill" in answers and wants_prompt_logprobs(route, body):
                payload = answers[decode_role]
                merge_prompt_logprobs(route, payload, results_by_index(route, answers["prefill"]))
                decode_reply = Reply(decode_reply.status, json.dumps(payload).encode())
            return decode_reply
        except BaseException:  # cancelled: the client went away
            self._cancel_pending(att, {t for t in att.tasks.values() if not t.done()})
            raise

    def _cancel_pending(self, att: _Attempt, pending: set[asyncio.Task]) -> None:
        roles = {role for role, t in att.tasks.items() if t in pending}
        for t in pending:
            t.cancel()
        self.abort_legs(att, [w for w in self._legs(att) if w.role in roles])

    # ---- streaming -----------------------------------------------------------------------
    async def open_stream(self, route: str, body: dict[str, Any], arrived: float) -> "StreamSession | Reply":
        """Everything up to decode's first event, retried like a unary request; then a
        session that streams the rest (nothing after this point is retried)."""
        return await self._with_retries(
            route, body, lambda att, content: self._stream_attempt(att, content, body, arrived), keeps_attempt=True)

    async def _stream_attempt(self, att: _Attempt, content: bytes, body: dict[str, Any],
                              arrived: float) -> "StreamSession | Failure":
        loop = asyncio.get_running_loop()
        route = att.route
        if att.prefill is not None:
            att.tasks["prefill"] = loop.create_task(self._post(att.prefill, route, content))
        opened: _OpenStream | None = None
        att.tasks["decode"] = d_task = loop.create_task(self._open_stream(att.decode, route, content))
        need_prefill = wants_prompt_logprobs(route, body)
        prefill_payload: Any = None
        try:
            pending = set(att.tasks.values())
            while d_task in pending or (need_prefill and att.tasks.get("prefill") in pending):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if d_task in done:
                    res = d_task.result()
                    if isinstance(res, Failure):
                        self._cancel_pending(att, pending)
                        return res
                    opened = res
                p_task = att.tasks.get("prefill")
                if p_task is not None and p_task in done:
                    fail, prefill_payload = self._check_prefill_stream(p_task.result(), route)
                    if fail is not None:
                        if opened is not None:
                            opened.close(self)
                        self._cancel_pending(att, pending)
                        return fail
            assert opened is not None
            merge = None
            if need_prefill and prefill_payload is not None:
                merge = results_by_index(route, prefill_payload)
            return StreamSession(self, att, body, opened, arrived, merge)
        except BaseException:
            if opened is not None:
                opened.close(self)
            self._cancel_pending(att, {t for t in att.tasks.values() if not t.done()})
            raise

    def _check_prefill_stream(self, leg: _Leg, route: str) -> tuple[Failure | None, Any]:
        """Prefill's whole streamed answer (it answers once its transfer has succeeded)."""
        if leg.error is not None:
            return self._transport_failure(leg.worker, leg.error), None
        assert leg.status is not None
        if leg.status >= 400:
            return self._status_failure(leg.worker, leg.status, leg.content, leg.retry_after), None
        last: Any = None
        merged: dict[int, Any] = {}
        for line in leg.content.decode(errors="replace").splitlines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            try:
                payload = json.loads(line[5:])
            except ValueError:
                continue
            fail = self._payload_failure(leg.worker, route, payload, line[5:].strip().encode())
            if fail is not None:
                if fail.status == 200:  # an abort event: as an error for a stream's status line
                    fail.status, fail.content = 503, error_bytes(fail.message, 503)
                return fail, None
            last = payload
            merged.update(results_by_index(route, payload))
        if route == "/generate":
            return None, [merged[i] for i in sorted(merged)] if merged else last
        return None, {"choices": [merged[i] for i in sorted(merged)]} if merged else last

    async def _open_stream(self, worker: Worker, route: str, content: bytes) -> "_OpenStream | Failure":
        """Send the decode leg and read up to its first event. The open stream (and the
        worker's in-flight count) belongs to the session from then on."""
        worker.in_flight += 1
        self.metrics.worker_requests.labels(worker.role, worker.url).inc()
        resp: httpx.Response | None = None
        handed_over = False
        try:
            req = worker.client.build_request("POST", worker.url + route, content=content, headers=self.headers)
            resp = await worker.client.send(req, stream=True)
            if resp.status_code != 200:
                body = await resp.aread()
                return self._status_failure(worker, resp.status_code, body, resp.headers.get("retry-after"))
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
                    self.metrics.errors.labels("worker_5xx").inc()
                    return Failure("worker_5xx", f"{worker.role} worker {worker.url}: malformed event {data[:200]!r}",
                                   True, 502, worker)
                fail = self._payload_failure(worker, route, payload, data.encode())
                if fail is not None:
                    if fail.status == 200:  # a stream that only says "aborted": an error status
                        fail.status, fail.content = 503, error_bytes(fail.message, 503)
                    return fail
                handed_over = True
                return _OpenStream(worker, resp, lines, payload, data)
            self.metrics.errors.labels("worker_5xx").inc()
            return Failure("worker_5xx", f"{worker.role} worker {worker.url}: stream ended before any event",
                           True, 502, worker)
        except httpx.HTTPError as exc:
            return self._transport_failure(worker, exc)
        except RuntimeError as exc:  # its client closed: the worker was removed meanwhile
            return self._transport_failure(worker, httpx.TransportError(f"worker removed: {exc}"))
        finally:
            if not handed_over:
                worker.in_flight -= 1
                if resp is not None:
                    self.spawn(resp.aclose())


@dataclass
class _OpenStream:
    worker: Worker
    resp: httpx.Response
    lines: AsyncIterator[str]
    first: Any        # the first event's payload
    first_data: str   # and its text
    closed: bool = False

    def close(self, proxy: Proxy) -> None:
        if not self.closed:
            self.closed = True
            self.worker.in_flight -= 1
            proxy.spawn(self.resp.aclose())


class _BrokenStream(Exception):
    pass


class StreamSession:
    """Decode's stream from its first event on, forwarded event by event. `close()` is
    synchronous (it only schedules work) so that it can run from any cancellation path:
    a client that disconnects cancels the response task wherever it is."""

    def __init__(self, proxy: Proxy, att: _Attempt, body: dict[str, Any], opened: _OpenStream, arrived: float,
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
                raise _BrokenStream("the stream ended without [DONE]")
        except (httpx.HTTPError, _BrokenStream) as exc:
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
        proxy._forget(self.body, att)
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
        fail, _ = self.proxy._check_prefill_stream(p_task.result(), self.att.route)
        if fail is not None:
            self.proxy.metrics.errors.labels("prefill_late_error").inc()
            logger.warning("prefill leg failed after decode's stream: %s", fail.message)


def _error_message(content: bytes) -> str | None:
    try:
        err = json.loads(content).get("error")
        return str(err.get("message")) if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return None


def _abort_reason(route: str, payload: Any) -> str | None:
    """The message of a sample that ended with a server-side abort, if any."""
    if route == "/generate":
        for item in payload if isinstance(payload, list) else [payload]:
            fin = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
            if isinstance(fin, dict) and fin.get("type") == "abort":
                return str(fin.get("message") or "aborted")
        return None
    if isinstance(payload, dict):
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return "a sample was aborted by the server"
    return None
