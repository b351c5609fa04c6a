"""Plain decoding: the decode strategy of a scheduler without a draft model.

A decode strategy is chosen once, when the scheduler is built (EAGLE's lives in
``pdserve.speculative.decoding``). It plans one decode step for the running batch
and processes its logits; the scheduler's skeleton calls it and owns everything
else (admission, stop checks, releasing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.model.runner import ForwardInput
from pdserve.scheduler.batch import ScheduledBatch, StepOutput
from pdserve.scheduler.req import Req

if TYPE_CHECKING:
    from pdserve.scheduler.scheduler import Scheduler


class PlainDecoding:
    room = 1  # positions one step adds past a request's KV

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched

    def plan(self, out: StepOutput) -> ScheduledBatch | None:
        """One token for every running request (retracting some first if the pool
        cannot hold that)."""
        sched = self.sched
        sched.make_decode_room(out)
        reqs = list(sched.running)
        if not reqs:
            return None
        fwd = ForwardInput.upload([r.output_ids[-1] for r in reqs], [r.row for r in reqs], [r.kv_len for r in reqs],
                                  [1] * len(reqs), None, sched.device,
                                  decode_keys=[sched.kv.req_table.key(r.row) for r in reqs])
        sched.kv.grow_by_one(reqs, fwd.layout)
        for r in reqs:
            r.kv_len += 1
        return ScheduledBatch("decode", reqs, fwd, sampling_reqs=reqs, sampling_rows=list(range(len(reqs))))

    def process(self, batch: ScheduledBatch, logits: torch.Tensor, out: StepOutput) -> None:
        sched = self.sched
        reqs = batch.sampling_reqs
        draws = sched.sampler.draw(logits, reqs, reqs)
        for i, req in enumerate(reqs):
            draws.append_to(req, i)
            sched.settle(req, out, joining=False)

    def prefilled(self, reqs: list[Req]) -> None:
        """Requests whose prompt (or recomputed prefix) was just prefilled."""
