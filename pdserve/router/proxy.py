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

This module pairs the workers (the policies pick), sends the legs and runs the retry
loop; what a leg's answer means (the failure rules above) is legs.py's, and a stream
from decode's first event on is streaming.py's (it has a life of its own once the client
has something: forwarded, merged, closed from any path, never retried).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from pdserve.router.errors import error_bytes
from pdserve.router.legs import PREFILL_GRACE_S, Failure, Leg, LegJudge, Reply
from pdserve.router.logprobs import merge_prompt_logprobs, results_by_index, wants_prompt_logprobs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Policy
from pdserve.router.rooms import Shape, draw_rooms, leg_body, leg_rids, rid_list, routing_key, shape_of
from pdserve.router.streaming import StreamSession, open_session
from pdserve.router.workers import Worker, WorkerRegistry

__all__ = ["Failure", "Proxy", "Reply", "StreamSession"]

logger = logging.getLogger(__name__)

# An abort can overtake the leg it is meant for (the leg's POST may still be on its way):
# the router asks again until the worker has seen the rid, for up to ABORT_TRIES tries.
ABORT_TRIES = 10
ABORT_RETRY_S = 0.1
# Causes of a 503 that means "not now, ask someone else" rather than "broken".
SHED_CAUSES = ("shed", "draining")
DEFAULT_RETRY_AFTER = "1"  # seconds, when no shedding worker named one


@dataclass
class Attempt:
    """One try of a request on one pair: its rids and its legs' tasks."""
    route: str
    prefill: Worker | None
    decode: Worker
    rids: list[str]
    client_aborted: bool = False
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # role -> leg task


class Proxy:
    """Pairs workers for each request, sends its legs and retries failed attempts (the
    rules of the module doc); legs.py judges each leg, streaming.py carries a stream on
    from decode's first event."""

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
        self.judge = LegJudge(registry, metrics)
        self.decode_role = "decode" if pd else "plain"
        # rid (as the client knows it) -> the attempt now serving it, for /abort_request
        self.active: dict[str, Attempt] = {}
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
        if self.prefill_policy is not None and self.prefill_policy.needs_key \
                or self.decode_policy.needs_key:  # a policy that routes on the request's text
            key = routing_key(route, body)
        prefill = self.prefill_policy.pick(prefills, key) if self.pd and self.prefill_policy else None
        decode = self.decode_policy.pick(decodes, key)
        return prefill, decode  # type: ignore[return-value]

    def _prepare(self, route: str, body: dict[str, Any], shape: Shape, pair: tuple[Worker | None, Worker],
                 attempt: int) -> tuple[Attempt, bytes]:
        prefill, decode = pair
        rids = leg_rids(route, shape, body.get("rid"), attempt)
        if prefill is not None:
            lb = leg_body(body, rid=rids, host=prefill.spec.host, port=prefill.spec.bootstrap_port,
                          rooms=draw_rooms(shape, self.randbits))
        else:
            lb = leg_body(body, rid=rids)
        att = Attempt(route, prefill, decode, rid_list(rids))
        for key in self._client_keys(body, att):
            self.active[key] = att
        return att, json.dumps(lb, separators=(",", ":")).encode()

    def _client_keys(self, body: dict[str, Any], att: Attempt) -> list[str]:
        """The rids a client may abort this request by: its own, else the router's."""
        own = rid_list(body.get("rid"))
        return own or att.rids

    def forget(self, body: dict[str, Any], att: Attempt) -> None:
        for key in self._client_keys(body, att):
            if self.active.get(key) is att:
                del self.active[key]

    def _legs(self, att: Attempt) -> list[Worker]:
        return [w for w in (att.prefill, att.decode) if w is not None]

    # ---- legs --------------------------------------------------------------------------
    async def post_leg(self, worker: Worker, route: str, content: bytes) -> Leg:
        worker.in_flight += 1
        self.metrics.worker_requests.labels(worker.role, worker.url).inc()
        leg = Leg(worker)
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

    def abort_legs(self, att: Attempt, workers: list[Worker]) -> None:
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
                            run: Callable[[Attempt, bytes], Awaitable[Any]], keeps_attempt: bool) -> Any:
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
                self.forget(body, att)
                raise
            if not isinstance(result, Failure):
                if not keeps_attempt:
                    self.forget(body, att)
                return result
            self.forget(body, att)
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

    async def _unary_attempt(self, att: Attempt, content: bytes, body: dict[str, Any]) -> Reply | Failure:
        route = att.route
        for w in self._legs(att):
            att.tasks[w.role] = asyncio.get_running_loop().create_task(self.post_leg(w, route, content))
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
                    self.cancel_pending(att, pending)
                    break
                for t in done:
                    role = by_task[t]
                    leg: Leg = t.result()
                    fail, payload = self.judge.check_unary(leg, route)
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
                    self.cancel_pending(att, pending)
                    return fail
            assert decode_reply is not None
            if "prefill" in answers and wants_prompt_logprobs(route, body):
                payload = answers[decode_role]
                merge_prompt_logprobs(route, payload, results_by_index(route, answers["prefill"]))
                decode_reply = Reply(decode_reply.status, json.dumps(payload).encode())
            return decode_reply
        except BaseException:  # cancelled: the client went away
            self.cancel_pending(att, {t for t in att.tasks.values() if not t.done()})
            raise

    def cancel_pending(self, att: Attempt, pending: set[asyncio.Task]) -> None:
        roles = {role for role, t in att.tasks.items() if t in pending}
        for t in pending:
            t.cancel()
        self.abort_legs(att, [w for w in self._legs(att) if w.role in roles])

    # ---- streaming -----------------------------------------------------------------------
    async def open_stream(self, route: str, body: dict[str, Any], arrived: float) -> "StreamSession | Reply":
        """Everything up to decode's first event, retried like a unary request; then a
        session that streams the rest (nothing after this point is retried)."""
        return await self._with_retries(
            route, body, lambda att, content: open_session(self, att, content, body, arrived), keeps_attempt=True)
