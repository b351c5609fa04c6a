"""EAGLE decoding: the decode strategy of a scheduler with a draft model.

One round for every running request: draft a tree (the draft model's forwards
happen while planning), verify it with one target forward, emit the accepted
tokens and the bonus token, and compact the KV of the accepted path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.model import device_io
from pdserve.scheduler.batch import ScheduledBatch, StepOutput
from pdserve.scheduler.req import FinishReason, Req
from pdserve.speculative.eagle_worker import EagleWorker

if TYPE_CHECKING:
    from pdserve.scheduler.scheduler import Scheduler


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """Tokens of a draft tree node's ancestors below the root, and its own, root first."""
    out: list[int] = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


class DrawView:
    """A request as it would be after emitting a tree path: what the sampler reads.
    The extended output list is only built when penalties need it (not per node
    of every round)."""

    def __init__(self, req: Req, path: list[int]) -> None:
        self.params = req.params
        self.seed = req.seed
        self._req = req
        self._path = path
        self.num_output_tokens = len(req.output_ids) + len(path)
        # The sampler's penalty state counts the request's committed output once and
        # adds the path's tokens on top for this draw only.
        self.base = req
        self.extra_ids = path

    @property
    def output_ids(self) -> list[int]:
        return self._req.output_ids + self._path

    @property
    def fill_ids(self) -> list[int]:
        return self._req.prompt_ids + self.output_ids


class EagleDecoding:
    def __init__(self, sched: "Scheduler", spec: EagleWorker) -> None:
        self.sched = sched
        self.spec = spec
        self.room = spec.room  # positions past kv_len one round uses: the tree and the draft scratch

    def plan(self, out: StepOutput) -> ScheduledBatch | None:
        sched, spec = self.sched, self.spec
        sched.make_decode_room(out)
        reqs = list(sched.running)
        if not reqs:
            return None
        round_pages = [sched.kv.assign(r, r.kv_len, r.kv_len + spec.room) for r in reqs]
        tree = spec.propose(reqs)
        return ScheduledBatch("verify", reqs, spec.verify_input(reqs, tree), tree=tree, round_pages=round_pages)

    def process(self, batch: ScheduledBatch, logits: torch.Tensor, out: StepOutput) -> None:
        sched, spec = self.sched, self.spec
        reqs, nodes = batch.reqs, spec.num_draft_tokens
        # The round's first read: the tree the draws are keyed to (the draws are the second).
        tokens, parents = device_io.fetch(torch.stack([batch.tree.tokens, batch.tree.parents]))
        # Every node draws the token plain decoding would draw at its output
        # position (same penalties, same seeded noise), so the walk below emits
        # exactly the non-speculative output.
        views = [DrawView(r, path_tokens(tokens[b], parents[b], j)) for b, r in enumerate(reqs)
                 for j in range(nodes)]
        draws = sched.sampler.draw(logits, views, reqs)
        moves: list[tuple[int, int, int]] = []
        ended: list[tuple[Req, FinishReason]] = []
        starts: list[int] = []  # each request's kv_len before the round
        for b, req in enumerate(reqs):
            base, n = b * nodes, req.kv_len
            starts.append(n)
            path = spec.accept_path(tokens[b], parents[b], draws.ids[base: base + nodes])
            reason = None
            emitted = 0
            for node in path:
                draws.append_to(req, base + node)
                emitted += 1
                reason = sched.stop_reason(req)
                if reason is not None:
                    break
            # Position n + j now holds the input of the j-th emitted token: node path[j].
            moves += [(req.row, n + j, n + path[j]) for j in range(1, emitted) if path[j] != j]
            req.kv_len = n + emitted
            req.spec_verify_ct += 1
            req.spec_accepted_drafts += min(emitted, len(path) - 1)
            spec.num_verify_rounds += 1
            spec.num_emitted_tokens += emitted
            out.advanced.append(req)
            if reason is not None:
                ended.append((req, reason))
        # One batched compaction, then the round's pages past each kept length go back
        # (page ids from the host: no device read), then finished requests release
        # (their compacted KV into the prefix cache).
        sched.kv.move_positions(moves)
        for b, req in enumerate(reqs):
            sched.kv.trim(req, starts[b], batch.round_pages[b])
        for req, reason in ended:
            sched.running.remove(req)
            out.finished += sched.finish(req, reason)
        spec.catch_up([r for r in reqs if r.row is not None])

    def prefilled(self, reqs: list[Req]) -> None:
        """Draft KV for what a prefill added; the next token is known now."""
        self.spec.catch_up(reqs)
