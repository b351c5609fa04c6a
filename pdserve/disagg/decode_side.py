"""The decode side of a disaggregated scheduler: reserves KV, receives it, decodes.

A request (each sample in its own room) is QUEUED while its prefill server is
connected in the background and until the pool can hold its prompt plus growth
(it queues, not fails, when the pool is full). It then reserves KV for its whole
prompt, asks the prefill server for it and is RECEIVING until the handoff
record arrives; it joins the running batch with the first token from the record
and decodes like any colocated request (retracted under memory pressure,
recomputed later). With speculative decoding the prefill server also sends the
target features of every position and decode builds the draft state itself,
exactly as a colocated prefill would; the sender's draft KV never travels, so a
plain prefill server can feed a speculative decode server.

A constrained request whose KV arrives before its grammar compiled is parked (holding
its KV) and joins the batch once the grammar is ready; it ends alone if the compile
fails or passes --grammar-compile-timeout. The scheduler thread never waits for a
compile, so every other stream keeps its pace.

A failed transfer ends its request at once, but its pages stay QUARANTINED until
every prefill rank said no write of its can still land there (or the transfer
deadline passed): a late write must never hit another request's KV.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.disagg import protocol as P
from pdserve.disagg.bootstrap import bootstrap_url
from pdserve.disagg.decode_manager import PrefillPeer
from pdserve.disagg.manager import DecodeTransferManager, LinkConfig
from pdserve.disagg.rooms import RoomState
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.admission import too_big
from pdserve.scheduler.batch import Draws, Gain, StepOutput
from pdserve.disagg.landing import (LandingArea, LandingRegion, landing_bytes, landing_names, landing_regions,
                                    strided_source, worth_landing)
from pdserve.disagg.layout import HeadRange, KVLayout, feature_slice
from pdserve.disagg.handoff import (Handoff, HandoffTable, Phase, Readiness, add_pd_state, carried_state,
                                    compat_record, kv_layout, register_buffers, split_samples, transfer_buffers,
                                    transfer_staging)
from pdserve.scheduler.kv_manager import pages_for
from pdserve.scheduler.mode import Mode
from pdserve.scheduler.radix_cache import PrefixMatch
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def peer_head_ranges(peers: list[PrefillPeer], names: tuple[str, ...]) -> dict[str, list[HeadRange]]:
    """Each head-sharded buffer of ``names`` with the heads every prefill rank of a
    connection holds of it, in rank order (as those ranks published their layouts)."""
    layouts = [p.info.layout.by_name() for p in sorted(peers, key=lambda p: p.info.tp_rank)]
    out = {}
    for name in names:
        specs = [by_name.get(name) for by_name in layouts]
        if specs and all(s is not None and s.heads is not None for s in specs):
            out[name] = [s.heads for s in specs]  # type: ignore[union-attr]
    return out


def decode_scheduler(args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                     engine: object, fetch_ranks: Callable[[str], list[P.RankInfo]], tp: TPGroup = TPGroup(),
                     host: str = "127.0.0.1", link: LinkConfig = LinkConfig()) -> Scheduler:
    """A scheduler with the decode side composed in (``.mode``)."""
    core = Scheduler(args, runner, decode_text, tp)
    core.mode = DecodeSide(core, engine, fetch_ranks, host, link)
    return core


class DecodeSide(Mode):
    """The decode server's hooks in its scheduler (``core``, which it was built for)."""

    def __init__(self, core: Scheduler, engine: object, fetch_ranks: Callable[[str], list[P.RankInfo]],
                 host: str, link: LinkConfig) -> None:
        super().__init__(core.queues)
        self.core = core
        tp = core.tp
        runner = core.runner
        self.staging = transfer_staging(core, engine)  # type: ignore[arg-type]
        layout = kv_layout(core, self.staging, with_features=True)
        register_buffers(engine, layout)
        self.layout = layout
        self._buffers = transfer_buffers(core, with_features=True)  # what a landed request is unpacked into
        # The landing area lives where the engine writes: with host staging, in host memory
        # (a landed request is then copied into the device buffers straight from it).
        nbytes = landing_bytes(core.args.disaggregation_kv_landing_mib,
                               sum(t.numel() * t.element_size() for t in self._buffers.values()))
        self.landing = (LandingArea(nbytes, "cpu" if self.staging is not None else core.device)
                        if nbytes else None)
        self.landing_min_run = core.args.disaggregation_kv_landing_min_run
        if self.landing is not None:
            register_buffers(engine, KVLayout(layout.page_size, (self.landing.spec,)))
        self.manager = DecodeTransferManager(engine, compat_record(core), layout, tp.rank, tp.size,  # type: ignore
                                             list(layout.names), host=host, cfg=link,
                                             feature_layers=self.core.spec.capture_layers if self.core.spec else (),
                                             landing=self.landing.spec if self.landing is not None else None)
        self.landed_requests = 0  # requests whose KV came through the landing area
        self.fetch_ranks = fetch_ranks
        self.handoffs = HandoffTable(tp)
        self._hold_decode = False  # this step committed first tokens: publish them before decoding
        # What one transferred prompt position brings to this rank: its KV (and draft feature).
        self.kv_bytes_per_position = self.core.kv.kv_pool.bytes_per_token(
            runner.config.num_layers, runner.num_local_kv_heads, runner.config.head_dim, runner.kv_dtype)
        self.feature_bytes_per_position = self.draft_kv_bytes_per_position = 0
        spec = self.core.spec
        # This rank's slice of each transferred feature row (None: the whole row); the
        # ranks all-gather the rest before the draft reads it (_gather_features).
        self.feature_slice = (feature_slice(spec.config.feature_width, tp.rank, tp.size) if spec is not None
                              else None)
        self._feature_slots: list[int] = []  # committed this step, still sliced
        if spec is not None:
            width = self.feature_slice.count if self.feature_slice is not None else spec.config.feature_width
            self.feature_bytes_per_position = width * spec.features.element_size()
            self.draft_kv_bytes_per_position = sum(t[0].numel() * t.element_size()
                                                   for t in spec.draft_pool.buffers().values())
        # Committed (KV and first token in) but their grammar still compiling: they join
        # the running batch once it is ready (poll_external), in arrival order.
        self.parked: list[Req] = []
        self._drafting: list[Req] = []  # joined this step; their draft runs over the prompts at once
        # Bytes this rank received in committed transfers, by kind (protocol.TRANSFER_KINDS).
        self.bytes_by_kind = dict.fromkeys(P.TRANSFER_KINDS, 0)
        self.prefix_hit_tokens = 0    # prompt tokens served from this server's own prefix cache
        # Prompt positions the draft ran over here at commit (prefill work on the decode side).
        self.draft_prefill_tokens = 0

    def bytes_per_position(self, draft_state: bool = False) -> int:
        """What one transferred prompt position brings to this rank: its target KV and, with
        a draft, its draft KV (``draft_state``: prefill ran this server's draft) or its
        target feature (decode drafts the prompt itself)."""
        return self.kv_bytes_per_position + (self.draft_kv_bytes_per_position if draft_state
                                             else self.feature_bytes_per_position)

    @property
    def payload_bytes(self) -> int:
        """Bytes of prompt positions received in committed transfers (not the metadata)."""
        return P.payload_bytes(self.bytes_by_kind)

    # ---- requests -------------------------------------------------------------------
    def add(self, req: Req) -> None:
        samples = split_samples(self.core, req)
        if not samples:
            return
        for s in samples:
            # Prompt logprobs are the prefill server's (the router merges them); a request
            # retracted here and recomputed must not compute them again.
            s.logprob_start_len = -1
        if any(s.bootstrap_room is None or s.bootstrap_host is None for s in samples):
            raise ValueError("bootstrap_room: a decode server needs bootstrap_host / bootstrap_port / "
                             "bootstrap_room for every sample")
        rooms = [s.bootstrap_room for s in samples]
        for room in rooms:
            if room in self.handoffs or rooms.count(room) > 1:
                raise ValueError(f"bootstrap_room: {room} is already in use by a live request")
        urls = [bootstrap_url(s.bootstrap_host, s.bootstrap_port, self.core.args.disaggregation_allowed_prefill)
                for s in samples]
        req.pending_forks = []  # (only now: if add() raises, the caller fails every sample)
        for sample, url in zip(samples, urls):
            self.manager.request_connect(url, functools.partial(self.fetch_ranks, url))
            self.handoffs.add(Handoff(sample, sample.bootstrap_room, Phase.QUEUED, peer_url=url))  # type: ignore

    def abort(self, rid: str, reason: FinishReason) -> list[Req]:
        message = reason.message or "aborted"
        out = []
        for h in self.handoffs:
            if h.req.rid != rid:
                continue
            if h.phase is Phase.QUEUED:
                self.handoffs.remove(h)
                out += self.core.finish(h.req, FinishReason(FinishKind.ABORT, message=message))
            elif h.phase is Phase.RECEIVING:
                self.manager.abort(h.room, message)
                out += self._quarantine(h, message, server_error=False)
        for req in [r for r in self.parked if r.rid == rid]:
            self.parked.remove(req)
            out += self.core.finish(req, FinishReason(FinishKind.ABORT, message=message))
        return out + self.queues.abort(rid, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.handoffs or self.parked)

    # ---- step hooks -------------------------------------------------------------------
    def poll_external(self, out: StepOutput) -> None:
        """Free quarantined pages that are safe, commit arrived transfers, then admit
        queued requests (in that order: each frees room for the next)."""
        self.manager.expire()
        agreed = self.handoffs.agree(self._readiness)
        for h, ready in agreed:
            if h.phase is Phase.QUARANTINED and ready is Readiness.DONE:
                self.handoffs.remove(h)
                try:
                    self._give_landing(h)  # (no write can land in it any more either)
                    self.core.kv.drop(h.held_pages)  # type: ignore[arg-type]
                    self.manager.release(h.room)
                except Exception:  # the request already ended; only its pages are at stake
                    logger.exception("room %d: releasing its quarantined pages failed", h.room)
        committed = self._unpark(out)
        for h, ready in agreed:
            if h.phase is not Phase.RECEIVING or ready is Readiness.WAITING:
                continue
            with self.core.guarded([h.req], out, "committing the transfer"):
                if ready is Readiness.DONE:
                    self._commit(h, out)
                    committed = True
                else:
                    state, _, reason = self.manager.poll(h.room)
                    if state is not RoomState.FAILED:  # another rank's transfer failed
                        reason = "KV transfer failed on another tensor-parallel rank"
                        self.manager.abort(h.room, reason)
                    out.finished += self._quarantine(h, reason or "transfer failed")
        self._draft_prompts(out)
        self._admit_transfers([(h, r) for h, r in agreed if h.phase is Phase.QUEUED], out)
        # Publish committed first tokens now (their TTFT); the running batch takes its
        # decode step on the very next step (never held twice in a row, so a stream of
        # arrivals cannot starve it).
        self._hold_decode = committed and not self._hold_decode

    def may_decode(self) -> bool:
        return not self._hold_decode

    def _readiness(self, h: Handoff) -> Readiness:
        if h.phase is Phase.QUEUED:
            state = self.manager.connection(h.peer_url)[0]
            return {"ok": Readiness.DONE, "failed": Readiness.FAILED}.get(state, Readiness.WAITING)
        if h.phase is Phase.RECEIVING:
            state = self.manager.poll(h.room)[0]
            return {RoomState.SUCCESS: Readiness.DONE, RoomState.FAILED: Readiness.FAILED}.get(
                state, Readiness.WAITING)
        safe = self.manager.safe_to_free(h.room) or time.monotonic() > h.release_at
        return Readiness.DONE if safe else Readiness.WAITING

    def _admit_transfers(self, queued: list[tuple[Handoff, Readiness]], out: StepOutput) -> None:
        """Reserve KV for queued requests (prompt + growth) and ask for their KV."""
        transferring = [h.req for h in self.handoffs if h.phase is Phase.RECEIVING]
        reserve = self.core.growth.pages(self.core.running + self.parked + transferring)
        for h, ready in queued:
            with self.core.guarded([h.req], out, "admitting the transfer"):
                reserved = self._admit_one(h, ready, reserve, transferring, out)
                if reserved is None:
                    break
                reserve += reserved

    def _admit_one(self, h: Handoff, ready: Readiness, reserve: int, transferring: list[Req],
                   out: StepOutput) -> int | None:
        """Admit one queued request if it can go (or end it if it never can): the growth
        pages its admission reserves (0 when not admitted); None when admission stops here."""
        req = h.req
        if ready is Readiness.FAILED:
            state, reason = self.manager.connection(h.peer_url)
            self.handoffs.remove(h)
            out.finished += self.core.finish(req, FinishReason(
                FinishKind.ABORT, message=str(reason) if state == "failed" else
                f"cannot reach the prefill server at {h.peer_url} (on another tensor-parallel rank)",
                server_error=True))
            return 0
        if ready is Readiness.WAITING:
            return 0  # still connecting; the requests behind it may go first
        n = len(req.prompt_ids)
        prefix = self._cached_prefix(req)
        held = prefix.slots.numel() if prefix is not None else 0
        need, growth = pages_for(n, self.core.page_size) - held // self.core.page_size, self.core.growth.pages([req])
        if self.core.kv.free_rows < 1 or need + growth > self.core.kv.available_pages - reserve:
            if prefix is not None:
                self.core.kv.unlock(prefix)
            if not self.core.running and not transferring and need > self.core.kv.capacity:
                self.handoffs.remove(h)
                out.finished += self.core.finish(req, too_big(need, self.core.kv.capacity))
                return 0
            return None  # queue, do not fail: pages come back as requests finish
        # The slots are the request's from now on (released on any outcome); their KV
        # becomes valid when the record arrives. The cached prefix stays locked by the
        # request (no eviction between this handshake and the commit).
        slots = self.core.kv.reserve(req, n, prefix)
        h.first_position = held
        peers = self.manager.connection(h.peer_url)[1]
        assert isinstance(peers, list)  # every rank reported the connection up
        h.phase = Phase.RECEIVING  # (before asking: a failure while asking quarantines the pages)
        transferring.append(req)
        spec = self.core.spec is not None
        h.draft_state = spec and self.manager.shares_draft(peers)
        want_features = spec and not h.draft_state
        h.landing_offset, h.landing_regions = self._take_landing(slots, want_features, h.draft_state, peers)
        self.manager.add_room(h.room, peers, slots, want_features=want_features, first_position=held,
                              want_draft_state=h.draft_state, landing_offset=h.landing_offset)
        return growth

    def _take_landing(self, slots: list[int], want_features: bool, draft_state: bool, peers: list[PrefillPeer]
                      ) -> tuple[int, tuple[LandingRegion, ...]]:
        """A landing piece for a request reserved ``slots``, when they are scattered (or a
        prefill rank of ``peers`` holds more heads than it sends here) and a piece is free:
        its offset and regions (cut by the prefill ranks that write it); (-1, ()): it is
        written into its slots."""
        if self.landing is None or len(slots) < 2:
            return -1, ()
        names = landing_names(self.layout.names, want_features, draft_state)
        senders = peer_head_ranges(peers, names)
        if not (worth_landing(slots, self.landing_min_run) or strided_source(self.layout, names, senders)):
            return -1, ()
        regions, size = landing_regions(self.layout, names, len(slots), senders)
        offset = self.landing.take(size)
        return (-1, ()) if offset is None else (offset, regions)

    def _give_landing(self, h: Handoff) -> None:
        if h.landing_offset >= 0:
            assert self.landing is not None
            self.landing.give(h.landing_offset)
            h.landing_offset, h.landing_regions = -1, ()

    def _cached_prefix(self, req: Req) -> PrefixMatch | None:
        """The longest prefix of ``req``'s prompt this server still caches (an earlier
        turn's prompt and answer), locked; None when nothing (or reuse is off)."""
        if self.core.args.disable_decode_prefix_reuse:
            return None
        match = self.core.kv.match(req.prompt_ids)
        if match.slots.numel() == 0:
            self.core.kv.unlock(match)
            return None
        return match

    def _commit(self, h: Handoff, out: StepOutput) -> None:
        """The record arrived: the request has its whole prompt KV and first token."""
        state, record, _ = self.manager.poll(h.room)
        assert record is not None
        self.handoffs.remove(h)
        self.manager.release(h.room)
        req = h.req
        received_slots = self.core.kv.slots(req, h.first_position, len(req.prompt_ids))
        if h.landing_offset >= 0:  # the transfer filled the request's landing piece: into its slots
            assert self.landing is not None
            try:
                self.landing.unpack(h.landing_offset, h.landing_regions, received_slots, self._buffers)
            finally:
                self._give_landing(h)
            self.landed_requests += 1
        elif self.staging is not None:  # the transfer filled the host twins: into the pool before any step
            self.staging.stage_in(received_slots)
        if not h.draft_state and self.feature_slice is not None:
            self._feature_slots += received_slots
        req.cached_tokens = record.cached_tokens
        self.prefix_hit_tokens += h.first_position
        received = len(req.prompt_ids) - h.first_position
        self.bytes_by_kind["target_kv"] += received * self.kv_bytes_per_position
        self.bytes_by_kind["draft_kv" if h.draft_state else "features"] += received * (
            self.bytes_per_position(h.draft_state) - self.kv_bytes_per_position)
        self.bytes_by_kind["metadata"] += len(P.encode(record))
        if h.draft_state:  # prefill ran this server's draft over the prompt: start from its state
            if record.draft_state is None:
                raise RuntimeError("prefill sent no draft state, which this request asked for")
            assert self.core.spec is not None
            self.core.spec.restore(req, carried_state(record.draft_state))
        tops = record.top_logprobs
        Draws([record.first_token], [record.logprob] if record.logprob is not None else None,
              [[lp for lp, _ in tops]] if tops else None, [[t for _, t in tops]] if tops else None).append_to(req, 0)
        if req.grammar is not None:
            self.core.settle_grammars([req])
            if not req.grammar.ready:  # the KV beat the compile: wait here, holding it, not in the batch
                self.parked.append(req)
                return
        self._join(req, out)

    def _join(self, req: Req, out: StepOutput) -> None:
        """A request with its prompt KV, first token and (if constrained) grammar joins the
        running batch, or ends (its first token may end it; a failed grammar does)."""
        if req.grammar is not None and req.grammar.error is not None:
            out.finished += self.core.finish(req, FinishReason(FinishKind.ABORT, message=req.grammar.error))
            return
        self.core.settle(Gain(req, self.core.stop_reason(req), joining=True), out)
        if req.finish is None and self.core.spec is not None and req.draft_len != req.kv_len:
            req.draft_len = 0  # (not started from prefill's draft state: drafted from the features)
            self._drafting.append(req)

    def _draft_prompts(self, out: StepOutput) -> None:
        """The draft state of the requests that joined this step from transferred
        features: one draft extend over all their prompts (before any decode step)."""
        self._gather_features()
        reqs, self._drafting = [r for r in self._drafting if r.finish is None], []
        if reqs:
            with self.core.guarded(reqs, out, "drafting the transferred prompts"):
                self.core.decoding.prefilled(reqs)
                self.draft_prefill_tokens += sum(r.kv_len for r in reqs)

    def _gather_features(self) -> None:
        """Complete the feature rows committed this step: each rank received its slice of
        them, one all-gather over the step's rows gives every rank the whole rows (the
        same collective on every rank: commits are agreed across ranks)."""
        if not self._feature_slots:
            return
        assert self.core.spec is not None and self.feature_slice is not None
        pool, part = self.core.spec.features, self.feature_slice
        slots = torch.tensor(self._feature_slots, dtype=torch.int64, device=pool.device)
        self._feature_slots = []
        pool[slots] = self.core.tp.all_gather_last_dim(pool[slots, part.start:part.end])

    def _unpark(self, out: StepOutput) -> bool:
        """Parked requests whose grammar is now ready (or failed, or past its deadline)
        join the batch (or end); True if any did."""
        if not self.parked:  # (every step: nothing to build then)
            return False
        self.parked = [r for r in self.parked if r.finish is None]
        self.core.settle_grammars(self.parked)  # (the same on every TP rank)
        done = [r for r in self.parked if r.grammar.ready]
        for req in done:
            self.parked.remove(req)
            with self.core.guarded([req], out, "joining the running batch"):
                self._join(req, out)
        return bool(done)

    def fail_request(self, req: Req, message: str) -> list[Req] | None:
        h = self.handoffs.get(req.bootstrap_room)
        if h is not None and h.req is req:
            if h.phase is Phase.RECEIVING:
                try:  # prefill may be writing into its pages: quarantine them as for any failure
                    self.manager.abort(h.room, f"internal error: {message}")
                    return self._quarantine(h, f"internal error: {message}")
                except Exception:
                    logger.exception("room %d: quarantining after an internal error failed", h.room)
            self.handoffs.remove(h)
        if req in self.parked:
            self.parked.remove(req)
        return None  # the scheduler ends it

    def live_requests(self) -> list[Req]:
        return [h.req for h in self.handoffs] + self.parked

    def _quarantine(self, h: Handoff, reason: str, server_error: bool = True) -> list[Req]:
        """End a request whose transfer failed; keep its pages out of use until no
        write of prefill's can still land there (or the transfer deadline passed)."""
        h.held_pages = self.core.kv.hold(h.req, h.first_position)
        h.release_at = time.monotonic() + self.core.args.disaggregation_transfer_timeout
        h.phase = Phase.QUARANTINED
        return self.core.finish(h.req, FinishReason(FinishKind.ABORT, message=reason, server_error=server_error))

    # ---- inspection -------------------------------------------------------------------
    def state(self, base: dict[str, object]) -> dict[str, object]:
        queued, transferring = self.handoffs.count(Phase.QUEUED), self.handoffs.count(Phase.RECEIVING)
        return add_pd_state(base, "decode", queued + len(self.parked), transferring, self.manager,
                            queued=queued, transferring=transferring, grammar_parked=len(self.parked),
                            quarantined=self.handoffs.count(Phase.QUARANTINED),
                            transfer_bytes=sum(self.bytes_by_kind.values()),
                            transfer_bytes_by_kind=dict(self.bytes_by_kind), prefix_hit_tokens=self.prefix_hit_tokens,
                            draft_prefill_tokens=self.draft_prefill_tokens, landing=self.landing_state())

    def landing_state(self) -> dict[str, int]:
        """The landing area: its size, what is free, the pieces out, the requests landed."""
        area = self.landing
        return {"capacity_bytes": area.capacity if area else 0, "free_bytes": area.free_bytes if area else 0,
                "pieces": area.pieces if area else 0, "landed_requests": self.landed_requests}

    def close(self) -> None:
        self.manager.close()
        if self.staging is not None:
            self.staging.close()
