"""Plain decoding: the decode strategy of a scheduler without a draft model.

A decode strategy is chosen once, when the scheduler is built (EAGLE's lives in
``pdserve.speculative.decoding``). It gets its dependencies explicitly and never
touches the scheduler: ``plan`` returns one decode step for the requests it is given
(the scheduler retracted others first if the pool could not hold their step), ``process`` returns what each request gained
(its tokens appended, whether it stops); the scheduler settles them.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from pdserve.model.runner import ForwardInput
from pdserve.scheduler.batch import Gain, Sampler, ScheduledBatch
from pdserve.scheduler.kv_manager import KVManager
from pdserve.scheduler.req import FinishReason, Req


class DecodeStrategy(Protocol):
    lookahead: int  # positions past a request's KV one step may use

    def plan(self, reqs: list[Req]) -> ScheduledBatch: ...

    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Gain]: ...

    def prefilled(self, reqs: list[Req]) -> None:
        """Requests whose prompt (or recomputed prefix) was just prefilled, or whose
        transferred KV just arrived."""


class PlainDecoding:
    lookahead = 1  # positions one step adds past a request's KV

    def __init__(self, kv: KVManager, sampler: Sampler, stop: Callable[[Req], FinishReason | None]) -> None:
        self.kv = kv
        self.sampler = sampler
        self.stop = stop

    def plan(self, reqs: list[Req]) -> ScheduledBatch:
        """One token for every request."""
        kv = self.kv
        fwd = ForwardInput.upload([r.output_ids[-1] for r in reqs], [r.row for r in reqs], [r.kv_len for r in reqs],
                                  [1] * len(reqs), None, kv.device,
                                  decode_keys=[kv.req_table.key(r.row) for r in reqs])
        kv.grow_by_one(reqs, fwd.layout)
        for r in reqs:
            r.kv_len += 1
        return ScheduledBatch("decode", reqs, fwd, sampling_reqs=reqs, sampling_rows=list(range(len(reqs))))

    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Gain]:
        reqs = batch.sampling_reqs
        draws = self.sampler.draw(logits, reqs, reqs)
        gains = []
        for i, req in enumerate(reqs):
            draws.append_to(req, i)
            gains.append(Gain(req, self.stop(req)))
        return gains

    def prefilled(self, reqs: list[Req]) -> None:
        """Nothing to build: plain decoding keeps no state beside the target KV."""
