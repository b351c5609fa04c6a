"""The prefill side of a disaggregated scheduler: prefills, sends the KV, hands off, never decodes.

A request (each sample in its own room) waits as AWAITING_DESTINATION until decode has
said where its KV goes; it is then prefilled like any other (radix cache on,
chunked) as COMPUTING, and after every forward the KV of the positions it now
holds is queued for transfer (a cached prefix is sent too: decode needs all of
it). Once its first token is drawn the handoff record follows the last write and
it waits as INFLIGHT until the transfer succeeded or failed; only then are its
pages released. A failed room (decode died, a write failed, a deadline) ends its
request at whatever phase it is in; a long prompt stops being computed at once.

The samples of a request (n > 1) share one prompt computation, as colocated: sample 0
carries the others as pending forks (they wait as AWAITING_PROMPT, each room
bootstrapping on its own). When its prompt is complete they are forked from it
(shared full pages, a copied partial page, the prompt logprobs) and each draws its own
first token from the same logits with its own seed; each one's whole prompt KV then
goes to its own room, at once when decode has said where, else once it has (FORKED).
A room that fails ends only its sample; when the carrier's fails while the prompt is
still being computed, the next live sample takes the computation over (it recomputes
what the prefix cache lacks).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.disagg import protocol as P
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.disagg.layout import kv_head_range
from pdserve.disagg.manager import LinkConfig, PrefillTransferManager
from pdserve.disagg.rooms import RoomError, RoomState
from pdserve.disagg.gather import SourceGather, SourceRows
from pdserve.disagg.prefill_features import FeatureProvider
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.batch import ScheduledBatch, StepOutput
from pdserve.disagg.handoff import (Handoff, HandoffTable, Phase, Readiness, add_pd_state, compat_record,
                                    draft_state_message, kv_layout, register_buffers, split_samples,
                                    transfer_buffers, transfer_staging)
from pdserve.scheduler.mode import Mode
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def prefill_scheduler(args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                      engine: object, tp: TPGroup = TPGroup(), host: str = "127.0.0.1",
                      link: LinkConfig = LinkConfig()) -> Scheduler:
    """A scheduler that never decodes (decode decides when a request ends; prefill only
    hands it off), with the prefill side composed in (``.mode``)."""
    core = Scheduler(args, runner, decode_text, tp, decodes=False)
    core.mode = PrefillSide(core, engine, host, link)
    return core


class PrefillSide(Mode):
    """The prefill server's hooks in its scheduler (``core``, which it was built for)."""
    publishes_tokens = False  # the first token is handed off, not published

    def __init__(self, core: Scheduler, engine: object, host: str, link: LinkConfig) -> None:
        super().__init__(core.queues)
        self.core = core
        tp = core.tp
        runner = core.runner
        self.bootstrap: BootstrapServer | None = None  # rank 0 of a prefill server runs the registry
        # Features are published per decode peer (provide_features), not up front:
        # which layers they hold is the decode draft's choice.
        self.staging = transfer_staging(core, engine)  # type: ignore[arg-type]
        layout = kv_layout(core, self.staging, with_features=False)
        register_buffers(engine, layout)
        self.engine = engine
        # What is sent from host memory, by address: the gather buffer copies from it.
        sources = SourceRows()
        published = transfer_buffers(core, with_features=False)
        for t in (self.staging.twins(published) if self.staging is not None else published).values():
            sources.add(t)
        features = FeatureProvider(core, engine, self.staging, sources)
        ranges = [kv_head_range(runner.config.num_kv_heads, r, tp.size) for r in range(tp.size)]
        draft_ranges = None if core.spec is None else [
            kv_head_range(core.spec.config.layer.num_kv_heads, r, tp.size) for r in range(tp.size)]
        self.manager = PrefillTransferManager(engine, compat_record(core), layout, tp.rank, ranges,  # type: ignore
                                              host=host, cfg=link, provide_features=features.provide,
                                              draft_head_ranges=draft_ranges, gather=SourceGather(engine, sources))
        self.handoffs = HandoffTable(tp)

    # ---- requests -------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.params.max_new_tokens == 0 and req.logprob_start_len >= 0:
            # Scoring a prompt (echo + logprobs, max_tokens 0): nothing crosses to decode
            # (it ends the request on arrival), but this server runs prompts, so it computes
            # their logprobs as a colocated server does; the router merges them into
            # decode's answer. No room is opened.
            self.core.waiting.append(req)
            return
        samples = split_samples(self.core, req)
        if not samples:
            return
        rooms = [s.bootstrap_room for s in samples]
        if any(r is None for r in rooms):
            raise ValueError("bootstrap_room: a prefill server needs a bootstrap_room for every sample")
        for room in rooms:
            if room in self.handoffs:
                raise ValueError(f"bootstrap_room: {room} is already in use by a live request")
        opened: list[int] = []
        try:
            for room in rooms:
                self.manager.open(room)  # type: ignore[arg-type]
                opened.append(room)  # type: ignore[arg-type]
        except RoomError as exc:
            for room in opened:
                self.manager.abort(room, "another sample's room was refused")
                self.manager.release(room)
            raise ValueError(f"bootstrap_room: {exc}") from None
        # Sample 0 computes the prompt for all (its pending forks wait for it).
        for sample in samples:
            phase = Phase.AWAITING_DESTINATION if sample is req else Phase.AWAITING_PROMPT
            self.handoffs.add(Handoff(sample, sample.bootstrap_room, phase))  # type: ignore[arg-type]

    def abort(self, rid: str, reason: FinishReason) -> list[Req]:
        message = reason.message or "aborted"
        out = []
        for h in self.handoffs:
            if h.req.rid == rid:
                self._separate(h.req)  # every sample ends on its own below, none takes over
        for h in self.handoffs:
            if h.req.rid == rid and h.phase is not Phase.COMPUTING:
                self.manager.abort(h.room, message)
                out += self._end(h, FinishReason(FinishKind.ABORT, message=message))
        for req in self.queues.abort(rid, reason):  # the computing ones
            h = self.handoffs.get(req.bootstrap_room)
            if h is not None:
                self.manager.abort(h.room, message)
                self._forget(h)
            out.append(req)
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.handoffs)

    # ---- step hooks -------------------------------------------------------------------
    def poll_external(self, out: StepOutput) -> None:
        self.manager.expire()
        for room in self.manager.rooms.ended():
            if room not in self.handoffs:  # opened by decode's request alone, then aborted or expired
                self.manager.release(room)
        for h, ready in self.handoffs.agree(self._readiness):
            with self.core.guarded([h.req], out, "handoff"):
                self._advance(h, ready, out)

    def _advance(self, h: Handoff, ready: Readiness, out: StepOutput) -> None:
        if ready is Readiness.FAILED:
            if h.phase is Phase.COMPUTING:
                if h.req is self.core.chunked:
                    self.core.chunked = None
                else:
                    self.core.waiting.remove(h.req)
            elif h.phase is Phase.AWAITING_PROMPT:
                self._detach(h.req)
            self._fail(h, out)
        elif ready is Readiness.DONE and h.phase is Phase.AWAITING_DESTINATION:
            h.bootstrapped = True
            h.phase = Phase.COMPUTING
            self.core.waiting.append(h.req)
        elif ready is Readiness.DONE and h.phase is Phase.AWAITING_PROMPT:
            h.bootstrapped = True  # its KV is sent as soon as it is forked
        elif ready is Readiness.DONE and h.phase is Phase.FORKED:
            self._ship(h)
        elif ready is Readiness.DONE and h.phase is Phase.INFLIGHT:
            out.finished += self._end(h, FinishReason(FinishKind.LENGTH))
            out.advanced.append(h.req)

    def commit(self, batch: ScheduledBatch | None, out: StepOutput) -> None:
        for req in out.finished:  # ended before any handoff (refused at admission, max_new_tokens 0)
            h = self.handoffs.get(req.bootstrap_room)
            if h is not None and h.req is req:
                self.manager.abort(h.room, req.finish.message if req.finish and req.finish.message else
                                   "the request ended at prefill without a token to hand off")
                self._forget(h)
        if batch is None:
            return
        for req in batch.reqs:  # the KV this forward wrote, before any record
            h = self.handoffs.get(req.bootstrap_room)
            if h is None or req.finish is not None:
                continue  # ended above
            with self.core.guarded([req], out, "sending KV"):
                self._send_new_kv(h)
        for req in batch.sampling_reqs:
            if req.finish is None:
                with self.core.guarded([req], out, "handing off"):
                    h = self.handoffs.get(req.bootstrap_room)
                    assert h is not None
                    if h.phase is Phase.AWAITING_PROMPT:  # forked from its carrier by this step
                        h.phase = Phase.FORKED
                        if h.bootstrapped:
                            self._ship(h)
                    else:
                        self._hand_off(req)

    def _ship(self, h: Handoff) -> None:
        """Send a forked sample's whole prompt KV (from its own row: the shared pages and
        its copy of a partial last page) and its handoff record."""
        self._send_new_kv(h)
        self._hand_off(h.req)

    def _send_new_kv(self, h: Handoff) -> None:
        """Queue the write of the positions ``h``'s request computed since the last send.
        Staged: copied to the host twins first. Direct on a GPU: the write waits for an
        event recorded after the forward that filled them."""
        if h.req.kv_len > h.sent:
            self._send_kv(h, h.sent)
            h.sent = h.req.kv_len

    def _send_kv(self, h: Handoff, first: int, draft: bool = False) -> None:
        """Queue the write of positions [first, kv_len) of ``h``'s request: their target KV,
        or (``draft``) their draft KV."""
        req = h.req
        slots = self.core.kv.slots(req, first, req.kv_len)
        ready = None
        if self.staging is not None:
            self.staging.stage_out(slots)
        elif self.core.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.manager.send(h.room, slots, first, ready, draft=draft)

    def _hand_off(self, req: Req) -> None:
        h = self.handoffs.get(req.bootstrap_room)
        assert h is not None
        draft_state = None
        if self.core.spec is not None and self.manager.wants_draft_state(h.room):
            # Decode runs the same draft: its prompt's draft KV and the first round's input
            # (this server drafted the prompt in the step that drew the first token).
            self._send_kv(h, 0, draft=True)
            draft_state = draft_state_message(self.core.spec.carried(req))
        record = P.HandoffRecord(
            h.room, "", first_token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else None,
            top_logprobs=tuple(tuple(x) for x in req.output_top_logprobs[0]) if req.output_top_logprobs else (),
            cached_tokens=req.cached_tokens, draft_state=draft_state)
        self.manager.finish(h.room, record)
        h.phase = Phase.INFLIGHT

    def _readiness(self, h: Handoff) -> Readiness:
        state = self.manager.status(h.room)[0]
        if state is RoomState.FAILED:
            return Readiness.FAILED
        if h.phase in (Phase.AWAITING_DESTINATION, Phase.AWAITING_PROMPT, Phase.FORKED):
            return Readiness.DONE if self.manager.ready(h.room) else Readiness.WAITING
        return Readiness.DONE if state is RoomState.SUCCESS else Readiness.WAITING

    def _fail(self, h: Handoff, out: StepOutput) -> None:
        """End a handoff whose room failed (on this rank, or when another TP rank's
        transfer failed: then it is failed here too, so decode hears of it)."""
        state, reason = self.manager.status(h.room)
        if state is not RoomState.FAILED:
            reason = "KV transfer failed on another tensor-parallel rank"
            self.manager.abort(h.room, reason)
        out.finished += self._end(h, FinishReason(FinishKind.ABORT, message=reason or "transfer failed",
                                                  server_error=True))

    def fail_request(self, req: Req, message: str) -> list[Req] | None:
        h = self.handoffs.get(req.bootstrap_room)
        if h is not None and h.req is req:
            if h.phase is Phase.AWAITING_PROMPT:
                self._detach(req)
            self._promote(req)
            self.handoffs.remove(h)
            try:  # decode hears of it; the room ends
                self.manager.abort(h.room, f"internal error: {message}")
                self.manager.release(h.room)
            except Exception:
                logger.exception("room %d: ending it after an internal error failed", h.room)
        return None  # the scheduler ends it

    def live_requests(self) -> list[Req]:
        return [h.req for h in self.handoffs]

    def _end(self, h: Handoff, reason: FinishReason) -> list[Req]:
        self._promote(h.req)  # its samples still waiting for the prompt live on
        done = self.core.finish(h.req, reason)
        self._forget(h)
        return done

    # ---- the samples of one request (n > 1) ----------------------------------------------
    def _separate(self, carrier: Req) -> list[Req]:
        """Take the samples waiting for ``carrier``'s prompt off it (the table rows its
        admission gave them go back); returns them."""
        children, carrier.pending_forks = carrier.pending_forks, []
        for child in children:
            self.core.kv.release(child, cache_kv=False)
        return children

    def _promote(self, carrier: Req) -> None:
        """``carrier`` ends before its prompt is complete: the first sample waiting for
        it computes the prompt instead, for itself and the others."""
        children = self._separate(carrier)
        if not children:
            return
        heir, heir.pending_forks = children[0], children[1:]
        h = self.handoffs.get(heir.bootstrap_room)
        assert h is not None and h.phase is Phase.AWAITING_PROMPT
        if h.bootstrapped:
            h.phase = Phase.COMPUTING
            self.core.waiting.insert(0, heir)  # its request arrived before the ones queued behind
        else:
            h.phase = Phase.AWAITING_DESTINATION

    def _detach(self, child: Req) -> None:
        """A sample waiting for another's prompt ends on its own: off its carrier."""
        for h in self.handoffs:
            if child in h.req.pending_forks:
                h.req.pending_forks.remove(child)
                self.core.kv.release(child, cache_kv=False)
                return

    def _forget(self, h: Handoff) -> None:
        self.handoffs.remove(h)
        self.manager.release(h.room)

    # ---- inspection -------------------------------------------------------------------
    def state(self, base: dict[str, object]) -> dict[str, object]:
        booting = self.handoffs.count(Phase.AWAITING_DESTINATION) + self.handoffs.count(Phase.FORKED)
        awaiting, inflight = self.handoffs.count(Phase.AWAITING_PROMPT), self.handoffs.count(Phase.INFLIGHT)
        return add_pd_state(base, "prefill", booting + awaiting, inflight, self.manager,
                            bootstrapping=booting, awaiting_prompt=awaiting, inflight=inflight,
                            transfer_bytes=self.manager.bytes_sent,
                            transfer_bytes_by_kind=dict(self.manager.bytes_by_kind),
                            transfer_seconds=self.manager.transfer_seconds,
                            gathered_bytes=self.manager.gather.gathered_bytes if self.manager.gather else 0)

    def close(self) -> None:
        self.manager.close()
        if self.staging is not None:
            self.staging.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
