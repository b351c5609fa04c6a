"""The prefill and decode event loops of a disaggregated pair.

PrefillScheduler: a request waits (``bootstrapping``) until decode has said
where its KV goes; it is then prefilled like any other (radix cache on,
chunked), and after every forward the KV of the positions it now holds is
queued for transfer (a cached prefix is sent too: decode needs all of it).
Once the first token is drawn, the handoff record follows the last write and
the request waits (``inflight``) until the transfer succeeded or failed; only
then are its pages released.  A prefill server never decodes.

DecodeScheduler: a request reserves KV for its whole prompt plus growth (it
queues, not fails, when the pool is full), asks the prefill server for the
KV, and joins the running batch when the record arrives, with the first token
from the record.  With speculative decoding the prefill server also sends the
target features of every position and decode builds the draft state itself,
exactly as a colocated prefill would.

Speculative state across the split never travels as the sender's draft KV:
decode always rebuilds it from features, so a plain prefill server can feed a
speculative decode server (the first seed's configuration) and both layouts
never need to agree on draft layers.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.disagg import protocol as P
from pdserve.disagg.layout import (PROTOCOL_VERSION, BufferSpec, CompatRecord, HandshakeError, KVLayout,
                                   kv_head_range)
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.disagg.manager import DecodeTransferManager, LinkConfig, PrefillTransferManager
from pdserve.disagg.rooms import RoomError, RoomState
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler, StepOutput, _pages_for

logger = logging.getLogger(__name__)


def compat_record(sched: Scheduler) -> CompatRecord:
    cfg, runner = sched.runner.config, sched.runner
    spec = sched.spec
    return CompatRecord(
        protocol_version=PROTOCOL_VERSION, architecture=cfg.architecture, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype=str(runner.kv_dtype).replace("torch.", ""),
        page_size=sched.page_size, vocab_size=cfg.vocab_size,
        speculative_algorithm=spec.algorithm if spec is not None else None,
        feature_width=spec.config.feature_width if spec is not None else 0, tp_size=sched.tp.size)


def kv_layout(sched: Scheduler, with_features: bool) -> KVLayout:
    """The named buffers of this rank: target KV (head-sharded) and, with a draft,
    the target-feature pool (one row per slot)."""
    heads = kv_head_range(sched.runner.config.num_kv_heads, sched.tp.rank, sched.tp.size)
    specs = []
    for name, t in sched.kv_pool.buffers().items():
        specs.append(BufferSpec(name, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size(), heads))
    if with_features and sched.spec is not None:
        f = sched.spec.features
        specs.append(BufferSpec("features", f.data_ptr(), f.shape[0], f[0].numel() * f.element_size()))
    return KVLayout(sched.page_size, tuple(specs))


def register_buffers(engine: object, layout: KVLayout) -> None:
    for b in layout.buffers:
        engine.register(b.ptr, b.num_slots * b.slot_bytes)  # type: ignore[attr-defined]


# A room's condition as each TP rank sees it; ranks act on the minimum over ranks, so
# a request moves on only when every rank is ready and fails when any rank failed
# (the ranks' schedulers must stay identical: they share no other state).
FAILED, WAITING, DONE = 0, 1, 2


def agree(tp: TPGroup, codes: list[int]) -> list[int]:
    if not tp.enabled or not codes:
        return codes
    return tp.all_reduce_min(torch.tensor(codes, dtype=torch.int64)).tolist()


def split_samples(req: Req) -> list[Req]:
    """A request's n samples as independent requests. Across the split every sample
    has its own room: prefill computes each one's first token (its draw is the one
    a colocated fork would make: sampling noise depends on the sample's seed and
    position only) and sends it the whole prompt KV; decode runs each on its own."""
    return [req] + req.pending_forks


class PrefillScheduler(Scheduler):
    def __init__(self, args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                 engine: object, tp: TPGroup = TPGroup(), host: str = "127.0.0.1",
                 link: LinkConfig = LinkConfig()) -> None:
        super().__init__(args, runner, decode_text, tp)
        self.bootstrap: BootstrapServer | None = None  # rank 0 of a prefill server runs the registry
        # Features are published per decode peer (provide_features), not up front:
        # which layers they hold is the decode draft's choice.
        layout = kv_layout(self, with_features=False)
        register_buffers(engine, layout)
        self.engine = engine
        self._capture: tuple[tuple[int, ...], torch.Tensor] | None = None  # a plain prefill's feature pool
        self._capture_lock = threading.Lock()
        ranges = [kv_head_range(runner.config.num_kv_heads, r, tp.size) for r in range(tp.size)]
        self.manager = PrefillTransferManager(engine, compat_record(self), layout, tp.rank, ranges,  # type: ignore
                                              host=host, cfg=link, provide_features=self._provide_features)
        self.bootstrapping: list[Req] = []
        self.inflight: list[Req] = []
        self._sent: dict[int, int] = {}   # live room -> prompt positions queued for transfer

    def _provide_features(self, layers: tuple[int, ...], slot_bytes: int) -> BufferSpec:
        """The feature pool a decode peer's draft reads (called at its handshake, on the
        transfer manager's thread). A speculative prefill offers its own when the layers
        match; a plain prefill allocates one on first demand and then captures it in
        every forward."""
        cfg = self.runner.config
        with self._capture_lock:
            if self.spec is not None:
                mine = self.spec.capture_layers
                if tuple(layers) != tuple(mine):
                    raise HandshakeError(f"decode's draft reads target features {list(layers) or 'final'}, this "
                                         f"prefill server's draft captures {list(mine) or 'final'}")
                pool = self.spec.features
                if self._capture is None:  # register once: Mooncake writes only from registered memory
                    self.engine.register(pool.data_ptr(), pool.numel() * pool.element_size())  # type: ignore
                    self._capture = (tuple(mine), pool)
            elif self._capture is not None:
                if tuple(layers) != self._capture[0]:
                    raise HandshakeError(f"this prefill server already captures target features "
                                         f"{list(self._capture[0]) or 'final'} for another decode server; "
                                         f"{list(layers) or 'final'} asked")
                pool = self._capture[1]
            else:
                if any(not 1 <= i < cfg.num_layers for i in layers):
                    raise HandshakeError(f"decode asks for target layers {list(layers)} of a "
                                         f"{cfg.num_layers}-layer model")
                width = cfg.hidden_size * max(1, len(layers))
                pool = torch.zeros(self.kv_pool.num_slots, width, dtype=self.runner.dtype, device=self.device)
                self.engine.register(pool.data_ptr(), pool.numel() * pool.element_size())  # type: ignore
                self._capture = (tuple(layers), pool)
            row = pool[0].numel() * pool.element_size()
            if row != slot_bytes:
                raise HandshakeError(f"features: prefill rows are {row} bytes, decode's {slot_bytes}")
            return BufferSpec("features", pool.data_ptr(), pool.shape[0], row)

    def add(self, req: Req) -> None:
        samples = split_samples(req)
        rooms = [s.bootstrap_room for s in samples]
        if any(r is None for r in rooms):
            raise ValueError("bootstrap_room: a prefill server needs a bootstrap_room for every sample")
        for room in rooms:
            if room in self._sent:
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
        req.pending_forks = []  # (only now: if add() raises, the caller fails every sample)
        for sample in samples:
            self._sent[sample.bootstrap_room] = 0  # type: ignore[index]
            self.bootstrapping.append(sample)

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrapping or self.inflight) or super().has_work

    def step(self) -> StepOutput:
        out = StepOutput()
        self.manager.expire()
        for room in self.manager.rooms.ended():
            if room not in self._sent:  # opened by decode's request alone, then aborted or expired
                self.manager.release(room)
        booting, inflight = list(self.bootstrapping), list(self.inflight)
        # Requests still being prefilled stop as soon as their room failed (decode died,
        # a write failed): no point computing the rest of a long prompt.
        computing = self.waiting + ([self.chunked] if self.chunked is not None else [])
        codes = agree(self.tp, [self._ready_code(r) for r in booting] + [self._room_code(r) for r in inflight] +
                      [self._room_code(r) for r in computing])
        nb, ni = len(booting), len(inflight)
        for req, code in zip(booting, codes):
            if code == FAILED:
                self.bootstrapping.remove(req)
                self._fail(req, self._reason(req), out)
            elif code == DONE:
                self.bootstrapping.remove(req)
                self.waiting.append(req)
        self._check_inflight(inflight, codes[nb: nb + ni], out)
        for req, code in zip(computing, codes[nb + ni:]):
            if code == FAILED:
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.waiting.remove(req)
                self._fail(req, self._reason(req), out)
        batch = self._schedule_prefill(out)
        if batch is None:
            return out
        self.num_forward_steps += 1
        logits = self._forward(batch.forward)
        for req in batch.reqs:
            self._send_new_kv(req)
        self._process(batch, logits, out)
        for req in out.advanced:
            if req.finish is None and req in self.running:
                self.running.remove(req)
                self._handoff(req)
        # The first token is the prefill server's whole output; the request stays
        # out of the client's view until decode has everything.
        out.advanced = [r for r in out.advanced if r.finish is not None]
        return out

    def _feature_capture(self) -> tuple[tuple[int, ...], torch.Tensor] | None:
        # A plain prefill captures what a speculative decode peer asked for.
        return super()._feature_capture() or self._capture

    def _check_finished(self, req: Req) -> FinishReason | None:
        return None  # decode decides when a request ends; prefill only hands it off

    def _send_new_kv(self, req: Req) -> None:
        room = req.bootstrap_room
        assert room is not None
        start = self._sent.get(room, 0)
        if req.kv_len > start:
            slots = self.req_table.table[req.row, start: req.kv_len].tolist()
            self.manager.send(room, slots, start)
            self._sent[room] = req.kv_len

    def _handoff(self, req: Req) -> None:
        room = req.bootstrap_room
        assert room is not None
        record = P.HandoffRecord(
            room, "", first_token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else None,
            top_logprobs=tuple(tuple(x) for x in req.output_top_logprobs[0]) if req.output_top_logprobs else (),
            cached_tokens=req.cached_tokens)
        self.manager.finish(room, record)
        self.inflight.append(req)

    def _ready_code(self, req: Req) -> int:
        room = req.bootstrap_room
        assert room is not None
        if self.manager.status(room)[0] is RoomState.FAILED:
            return FAILED
        return DONE if self.manager.ready(room) else WAITING

    def _room_code(self, req: Req) -> int:
        state = self.manager.status(req.bootstrap_room)[0]  # type: ignore[arg-type]
        return {RoomState.SUCCESS: DONE, RoomState.FAILED: FAILED}.get(state, WAITING)

    def _reason(self, req: Req) -> str:
        """Why a room failed: this rank's reason, or (when another TP rank's transfer
        failed) a generic one; the room is failed here too so decode hears of it."""
        room = req.bootstrap_room
        assert room is not None
        state, reason = self.manager.status(room)
        if state is not RoomState.FAILED:
            reason = "KV transfer failed on another tensor-parallel rank"
            self.manager.abort(room, reason)
        return reason or "transfer failed"

    def _check_inflight(self, inflight: list[Req], codes: list[int], out: StepOutput) -> None:
        for req, code in zip(inflight, codes):
            if code == DONE:
                self.inflight.remove(req)
                out.finished += self._finish(req, FinishReason(FinishKind.LENGTH))
                out.advanced.append(req)
                self._forget(req)
            elif code == FAILED:
                self.inflight.remove(req)
                self._fail(req, self._reason(req), out)

    def _fail(self, req: Req, reason: str, out: StepOutput) -> None:
        out.finished += self._finish(req, FinishReason(FinishKind.ABORT, message=reason,
                                                       server_error=True))
        self._forget(req)

    def _forget(self, req: Req) -> None:
        self._sent.pop(req.bootstrap_room, None)  # type: ignore[arg-type]
        self.manager.release(req.bootstrap_room)  # type: ignore[arg-type]

    def abort(self, rid: str, message: str = "aborted by the client") -> list[Req]:
        out = []
        for req in [r for r in self.bootstrapping + self.inflight if r.rid == rid]:
            self.manager.abort(req.bootstrap_room, message)  # type: ignore[arg-type]
            (self.bootstrapping if req in self.bootstrapping else self.inflight).remove(req)
            out += self._finish(req, FinishReason(FinishKind.ABORT, message=message))
            self._forget(req)
        for req in super().abort(rid, message):
            if req.bootstrap_room is not None:
                self.manager.abort(req.bootstrap_room, message)
                self._forget(req)
            out.append(req)
        return out

    def state(self) -> dict[str, object]:
        st = super().state()
        st["num_waiting_reqs"] += len(self.bootstrapping)  # type: ignore[operator]
        st["num_running_reqs"] += len(self.inflight)  # type: ignore[operator]
        st["disaggregation"] = {
            "mode": "prefill", "bootstrapping": len(self.bootstrapping), "inflight": len(self.inflight),
            "rooms": self.manager.rooms.counts(), "failures": dict(self.manager.rooms.failures),
            "transfer_bytes": self.manager.bytes_sent, "transfer_seconds": self.manager.transfer_seconds,
        }
        return st

    def close(self) -> None:
        self.manager.close()
        if self.bootstrap is not None:
            self.bootstrap.close()


@dataclass
class _Pending:
    req: Req
    url: str   # its prefill server's bootstrap address (connected in the background)


class DecodeScheduler(Scheduler):
    def __init__(self, args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                 engine: object, fetch_ranks: Callable[[str], list[P.RankInfo]], tp: TPGroup = TPGroup(),
                 host: str = "127.0.0.1", link: LinkConfig = LinkConfig()) -> None:
        super().__init__(args, runner, decode_text, tp)
        layout = kv_layout(self, with_features=True)
        register_buffers(engine, layout)
        wanted = [n for n in layout.names]  # target KV, and features when drafting
        self.manager = DecodeTransferManager(engine, compat_record(self), layout, tp.rank, tp.size,  # type: ignore
                                             wanted, host=host, cfg=link,
                                             feature_layers=self.spec.capture_layers if self.spec else ())
        self.fetch_ranks = fetch_ranks
        self.queued: list[_Pending] = []      # waiting for KV slots
        self.transferring: list[Req] = []
        # (room, pages, deadline) of failed transfers whose pages a late write might hit
        self.quarantine: list[tuple[int, torch.Tensor, float]] = []
        self._deferred_decode = False

    def add(self, req: Req) -> None:
        samples = split_samples(req)
        if any(s.bootstrap_room is None or s.bootstrap_host is None for s in samples):
            raise ValueError("bootstrap_room: a decode server needs bootstrap_host / bootstrap_port / "
                             "bootstrap_room for every sample")
        req.pending_forks = []
        for sample in samples:
            url = f"http://{sample.bootstrap_host}:{sample.bootstrap_port}"
            self.manager.request_connect(url, functools.partial(self.fetch_ranks, url))
            self.queued.append(_Pending(sample, url))

    @property
    def has_work(self) -> bool:
        return bool(self.queued or self.transferring or self.quarantine) or super().has_work

    def step(self) -> StepOutput:
        out = StepOutput()
        self.manager.expire()
        queued, transferring, quarantine = list(self.queued), list(self.transferring), list(self.quarantine)
        codes = agree(self.tp, [self._connect_code(p) for p in queued] +
                      [self._transfer_code(r) for r in transferring] + [self._quarantine_code(q) for q in quarantine])
        nq, nt = len(queued), len(transferring)
        self._release_quarantine(quarantine, codes[nq + nt:])
        self._check_transfers(transferring, codes[nq: nq + nt], out)
        self._admit_transfers(queued, codes[:nq], out)
        if out.advanced and not self._deferred_decode:
            # Publish committed first tokens now (their TTFT); the running batch
            # takes its decode step on the very next loop iteration (never deferred
            # twice in a row, so a stream of arrivals cannot starve it).
            self._deferred_decode = True
            return out
        self._deferred_decode = False
        if self.running:
            inner = super().step()
            out.advanced += inner.advanced
            out.finished += inner.finished
        return out

    def _connect_code(self, pending: _Pending) -> int:
        state = self.manager.connection(pending.url)[0]
        return {"ok": DONE, "failed": FAILED}.get(state, WAITING)

    def _transfer_code(self, req: Req) -> int:
        state = self.manager.poll(req.bootstrap_room)[0]  # type: ignore[arg-type]
        return {RoomState.SUCCESS: DONE, RoomState.FAILED: FAILED}.get(state, WAITING)

    def _quarantine_code(self, item: tuple[int, torch.Tensor, float]) -> int:
        room, _, deadline = item
        return DONE if self.manager.safe_to_free(room) or time.monotonic() > deadline else WAITING

    def _admit_transfers(self, queued: list[_Pending], codes: list[int], out: StepOutput) -> None:
        """Reserve KV for queued requests (prompt + growth) and ask for their KV."""
        ps = self.page_size
        reserve = self._growth_reserve(self.running + self.transferring)
        for pending, code in zip(queued, codes):
            req = pending.req
            if code == FAILED:
                state, reason = self.manager.connection(pending.url)
                self.queued.remove(pending)
                out.finished += self._finish(req, FinishReason(
                    FinishKind.ABORT, message=str(reason) if state == "failed" else
                    f"cannot reach the prefill server at {pending.url} (on another tensor-parallel rank)",
                    server_error=True))
                continue
            if code == WAITING:
                continue  # still connecting; the requests behind it may go first
            n = len(req.prompt_ids)
            need = _pages_for(n, ps)
            growth = self._growth_reserve([req])
            if self.req_table.num_free < 1 or need + growth > self.allocator.num_free + \
                    self.cache.evictable_pages - reserve:
                if not self.running and not self.transferring and need > self.allocator.capacity:
                    self.queued.remove(pending)
                    out.finished += self._finish(req, FinishReason(
                        FinishKind.ABORT, message=f"request needs {need} KV pages but the pool has "
                        f"{self.allocator.capacity} (raise --max-total-tokens)"))
                    continue
                break  # queue, do not fail: pages come back as requests finish
            self.queued.remove(pending)
            req.row = self.req_table.alloc()
            self._assign_slots(req, 0, n)
            # The slots are the request's from now on (released on any outcome);
            # their KV becomes valid when the record arrives.
            req.kv_len = n
            reserve += growth
            slots = self.req_table.table[req.row, :n].tolist()
            peers = self.manager.connection(pending.url)[1]
            assert isinstance(peers, list)  # every rank reported the connection up
            self.manager.add_room(req.bootstrap_room, peers, slots,  # type: ignore[arg-type]
                                  want_features=self.spec is not None)
            self.transferring.append(req)

    def _check_transfers(self, transferring: list[Req], codes: list[int], out: StepOutput) -> None:
        for req, code in zip(transferring, codes):
            if code == WAITING:
                continue
            room = req.bootstrap_room
            assert room is not None
            state, record, reason = self.manager.poll(room)
            if code == DONE:
                assert record is not None
                self.transferring.remove(req)
                self.manager.release(room)
                self._commit(req, record, out)
            elif code == FAILED:
                if state is not RoomState.FAILED:  # another rank's transfer failed
                    reason = "KV transfer failed on another tensor-parallel rank"
                    self.manager.abort(room, reason)
                self.transferring.remove(req)
                out.finished += self._retire(req, reason or "transfer failed")

    def _retire(self, req: Req, reason: str, server_error: bool = True) -> list[Req]:
        """Finish a request whose transfer failed. Its pages stay out of use (quarantined)
        until prefill confirms no write to them is left in flight (on every rank), or the
        transfer deadline passes: a late write must never land in another request's KV."""
        room = req.bootstrap_room
        assert room is not None and req.row is not None
        ps = self.page_size
        pages = self.req_table.table[req.row, : req.kv_len: ps].cpu() // ps
        self.allocator.retain(pages)
        self.quarantine.append((room, pages, time.monotonic() + self.args.disaggregation_transfer_timeout))
        return self._finish(req, FinishReason(FinishKind.ABORT, message=reason, server_error=server_error))

    def _release_quarantine(self, quarantine: list[tuple[int, torch.Tensor, float]], codes: list[int]) -> None:
        for item, code in zip(quarantine, codes):
            if code == DONE:
                self.quarantine.remove(item)
                self.allocator.release(item[1])
                self.manager.release(item[0])

    def _commit(self, req: Req, record: P.HandoffRecord, out: StepOutput) -> None:
        req.cached_tokens = record.cached_tokens
        self._append_token(req, record.first_token, record.logprob,
                           [lp for lp, _ in record.top_logprobs] or None, [t for _, t in record.top_logprobs] or None)
        out.advanced.append(req)
        reason = self._check_finished(req)
        if reason is not None:
            out.finished += self._finish(req, reason)
            return
        if self.spec is not None:
            req.draft_len = 0
            self.spec.catch_up([req])
        self.running.append(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> list[Req]:
        out = []
        for pending in [p for p in self.queued if p.req.rid == rid]:
            self.queued.remove(pending)
            out += self._finish(pending.req, FinishReason(FinishKind.ABORT, message=message))
        for req in [r for r in self.transferring if r.rid == rid]:
            self.manager.abort(req.bootstrap_room, message)  # type: ignore[arg-type]
            self.transferring.remove(req)
            out += self._retire(req, message, server_error=False)
        return out + super().abort(rid, message)

    def state(self) -> dict[str, object]:
        st = super().state()
        st["num_waiting_reqs"] += len(self.queued)  # type: ignore[operator]
        st["num_running_reqs"] += len(self.transferring)  # type: ignore[operator]
        st["disaggregation"] = {
            "mode": "decode", "queued": len(self.queued), "transferring": len(self.transferring),
            "quarantined": len(self.quarantine),
            "rooms": self.manager.rooms.counts(), "failures": dict(self.manager.rooms.failures),
        }
        return st

    def close(self) -> None:
        self.manager.close()


__all__ = ["PrefillScheduler", "DecodeScheduler", "compat_record", "kv_layout"]
