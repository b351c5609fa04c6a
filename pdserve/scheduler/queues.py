"""Where a scheduler's requests are, and the two ways one leaves the running batch.

A request is waiting (not admitted, or retracted), the chunked one (its prompt part
computed), running (decoding), or ending (ended on arrival with nothing to compute,
reported by the next step). ``finish`` ends one and gives back what it holds;
``retract`` sends a running one back to the queue under memory pressure (its KV goes
into the prefix cache; it recomputes what the cache lost, output unchanged).
"""

from __future__ import annotations

import logging

from pdserve.scheduler.kv_manager import KVManager
from pdserve.scheduler.req import FinishKind, FinishReason, Req

logger = logging.getLogger(__name__)


class RequestQueues:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.ending: list[Req] = []
        self.num_retractions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.ending)

    def live(self) -> list[Req]:
        """Every request held here that has not finished."""
        return self.waiting + self.running + ([self.chunked] if self.chunked is not None else [])

    def take_out(self, req: Req) -> None:
        """Remove ``req`` from whichever queue holds it (if any)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None

    def finish(self, req: Req, reason: FinishReason) -> list[Req]:
        """End ``req`` (and its never-forked samples) and give back what it holds: its
        KV (into the prefix cache unless aborted), an open speculative round's pages,
        its grammar's compile if only it waited for it. Returns the ended samples."""
        req.finish = reason
        self.kv.release(req, cache_kv=reason.kind is not FinishKind.ABORT)
        done = [req] + req.pending_forks
        for child in req.pending_forks:
            child.finish = reason
        for r in done:
            if r.grammar is not None:
                r.grammar.release()  # a compile only it waited for stops (the client left, or its deadline passed)
        req.pending_forks = []
        return done

    def abort(self, rid: str, reason: FinishReason) -> list[Req]:
        """End every sample of ``rid`` held here; returns them."""
        out: list[Req] = []
        for req in [r for r in self.live() if r.rid == rid]:
            self.take_out(req)
            out += self.finish(req, reason)
        return out

    def retract(self, victim: Req) -> None:
        """Send a running request back to the front of the queue, its KV into the cache."""
        self.running.remove(victim)
        self.kv.release(victim, cache_kv=True)
        victim.retractions += 1
        self.num_retractions += 1
        self.waiting.insert(0, victim)
        logger.info("retracted request %s (%d output tokens) to free KV", victim.rid, len(victim.output_ids))
