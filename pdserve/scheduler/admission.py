"""Prefill planning: which waiting requests (and the chunked one) go into the next
prefill batch, what that batch runs, and what drawing the first token of every prompt
it completes gave each request.

``PrefillPlanner.plan`` returns an ``Admission`` (the batch, and which requests moved or
ended) and ``process`` returns each request's ``Gain``: the scheduler applies both,
so the queues change in one place. A request is admitted while the prefill token
budget lasts and the pool keeps room for the running requests' decode growth; a
prompt longer than the budget is chunked; a cached prefix is attached; the samples
of a request are forked from it once its prompt is in the pool. An error admitting
one request is reported for that request alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.model.device_io import upload
from pdserve.model.runner import ForwardInput
from pdserve.scheduler import prompt_logprobs
from pdserve.scheduler.batch import Gain, Sampler, ScheduledBatch
from pdserve.scheduler.kv_manager import KVManager, pages_for
from pdserve.scheduler.radix_cache import PrefixMatch
from pdserve.scheduler.req import FinishKind, FinishReason, Req

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionTuning:
    """How much decode growth a prefill admission keeps in reserve (SGLang's scheme:
    an estimated fraction of each request's remaining tokens, decaying while no
    retraction happens, reset when one does)."""
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    ratio_decay: float = 0.001
    reserve_clip: int = 256


def too_big(need: int, capacity: int) -> FinishReason:
    return FinishReason(FinishKind.ABORT, message=f"request needs {need} KV pages but the pool has "
                        f"{capacity} (raise --max-total-tokens)")


class GrowthReserve:
    """The pages kept for running requests' decode growth (see ``AdmissionTuning``);
    a speculative round also briefly holds its tree past each request's length."""

    def __init__(self, tuning: AdmissionTuning, page_size: int, decodes: bool, round_room: int) -> None:
        self.tuning = tuning
        self.page_size = page_size
        self.decodes = decodes
        self.round_room = round_room  # positions a speculative round adds (0: none)
        self.ratio = tuning.init_new_token_ratio

    def pages(self, reqs: list[Req]) -> int:
        if not self.decodes:
            return 0  # a prefill server never decodes
        tokens = sum(min(r.remaining_new_tokens, self.tuning.reserve_clip) for r in reqs)
        transient = len(reqs) * pages_for(self.round_room, self.page_size) if self.round_room else 0
        return pages_for(int(tokens * self.ratio), self.page_size) + transient

    def decay(self) -> None:
        """A decode step went by without a retraction."""
        self.ratio = max(self.tuning.min_new_token_ratio, self.ratio - self.tuning.ratio_decay)

    def reset(self) -> None:
        """A retraction happened: the estimate was too low."""
        self.ratio = self.tuning.init_new_token_ratio


@dataclass
class Admission:
    """What ``PrefillPlanner.plan`` decided; the scheduler applies it to its queues."""
    batch: ScheduledBatch | None = None
    admitted: list[Req] = field(default_factory=list)  # fresh requests off the waiting queue
    chunked: Req | None = None                          # the chunked request from now on
    refused: list[tuple[Req, FinishReason]] = field(default_factory=list)  # can never be admitted
    failed: list[tuple[Req, Exception]] = field(default_factory=list)      # an error admitting it


class PrefillPlanner:
    """The prefill side of a scheduler's step (see the module docstring)."""

    def __init__(self, args: ServerArgs, kv: KVManager, sampler: Sampler, growth: GrowthReserve,
                 stop: Callable[[Req], FinishReason | None], fork_own_last_position: bool) -> None:
        self.args = args
        self.kv = kv
        self.sampler = sampler
        self.growth = growth
        self.stop = stop
        # A draft's KV at the last prompt position depends on each sample's first token.
        self.fork_own_last_position = fork_own_last_position
        self.page_size = args.page_size
        self.prompt_tokens_seen = 0   # prompt tokens of admitted requests
        self.cached_tokens_seen = 0   # of which served from the prefix cache
        # Tokens prefill forwards computed (not served from the cache): the prompts, once
        # per request however many samples it has, and retracted requests' recomputed KV.
        self.prefill_tokens_computed = 0

    def _ordered(self, waiting: list[Req]) -> list[Req]:
        if self.args.schedule_policy == "lpm" and len(waiting) <= 128:
            lens = {id(r): self.kv.matched_len(r.fill_ids[:-1]) for r in waiting}
            return sorted(waiting, key=lambda r: -lens[id(r)])  # stable: ties stay FCFS
        return list(waiting)

    def plan(self, waiting: list[Req], chunked: Req | None, running: list[Req]) -> Admission:
        """Admit waiting requests (and the chunked one) into a prefill batch within the
        token budget, keeping room for the running requests' growth."""
        result = Admission(chunked=chunked)
        if not waiting and chunked is None:
            return result
        chunking = self.args.chunked_prefill_size != -1
        budget = self.args.max_prefill_tokens
        if chunking:
            budget = min(budget, self.args.chunked_prefill_size)
        reserve = self.growth.pages(running)
        admitted: list[tuple[Req, int]] = []
        for req in ([chunked] if chunked is not None else []) + self._ordered(waiting):
            if budget <= 0:
                break
            try:
                step = self._admit_one(req, req is not chunked, result, admitted, budget, reserve, chunking, running)
            except Exception as exc:  # this request's bookkeeping broke: it alone fails
                logger.exception("admitting request %s failed", req.rid)
                result.failed.append((req, exc))
                continue
            if step is None:
                continue
            if step is False:
                break
            extend, growth, completes = step
            reserve += growth
            budget -= extend
            admitted.append((req, extend))
            if not completes:
                result.chunked = req
                break
            if req is result.chunked:
                result.chunked = None
        if admitted:
            try:
                result.batch = self._prefill_batch(admitted)
            except Exception as exc:
                logger.exception("building the prefill batch failed")
                result.failed += [(r, exc) for r, _ in admitted]
        return result

    def _admit_one(self, req: Req, fresh: bool, result: Admission, admitted: list[tuple[Req, int]], budget: int,
                   reserve: int, chunking: bool, running: list[Req]) -> tuple[int, int, bool] | bool | None:
        """Admit one candidate: (positions it computes now, growth pages it reserves,
        whether its prompt completes); None to pass it by; False to stop admitting."""
        ps = self.page_size
        forks = len(req.pending_forks)
        match: PrefixMatch | None = None
        if fresh:
            refusal = self._refusal(req)
            if refusal is not None:
                result.refused.append((req, refusal))
                return None
            if req.grammar is not None and not req.grammar.ready:
                return None  # still compiling (never waited for here): the requests behind it go first
            if self.kv.free_rows < 1 + forks:
                return False
            prompt_logprobs.begin(req)
            # Positions whose prompt logprobs are still wanted must be computed.
            bound = prompt_logprobs.cache_bound(req)
            match = self.kv.match(req.fill_ids[:-1] if bound is None else req.fill_ids[:bound])
            start = match.slots.numel()
        else:
            start = req.kv_len
        try:
            remaining = req.fill_len - start
            extend = remaining
            if extend > budget:
                if not chunking and admitted or chunking and result.chunked is not None and fresh:
                    self._unlock(match)
                    return False
                if chunking:
                    extend = budget
            completes = extend == remaining
            need = pages_for(start + extend, ps) - pages_for(start, ps)
            growth = 0
            if completes:
                need += forks * (1 if req.fill_len % ps else 0)
                growth = self.growth.pages([req] + req.pending_forks)
            # Alone (nothing else holds or will take pages), a request that fits goes even
            # if its growth estimate does not: waiting could not make room, and a request
            # that really outgrows the pool is ended by the decode-room check.
            alone = not admitted and not running and result.chunked in (None, req)
            available = self.kv.available_pages
            if need + growth > available - reserve and not (alone and need <= available):
                self._unlock(match)
                return False
        except Exception:
            self._unlock(match)
            raise
        if fresh:
            assert match is not None
            self._attach(req, match)  # (from here the request holds the match: releasing it unlocks)
            result.admitted.append(req)
        self.kv.assign(req, start, start + extend)
        return extend, growth, completes

    def _refusal(self, req: Req) -> FinishReason | None:
        """Why ``req`` can never be admitted, however long it waits (None: it can)."""
        samples = 1 + len(req.pending_forks)
        if samples > self.kv.req_table.num_rows:
            return FinishReason(FinishKind.ABORT, message=f"n: {samples} samples need as many request slots, "
                                f"the server has {self.kv.req_table.num_rows} (--max-running-requests)")
        ps = self.page_size
        need = pages_for(req.fill_len, ps) + (samples - 1) * (1 if req.fill_len % ps else 0)
        if need > self.kv.capacity:
            return too_big(need, self.kv.capacity)
        if req.grammar is not None and req.grammar.error is not None:
            # Invalid, or past --grammar-compile-timeout: this request alone ends.
            return FinishReason(FinishKind.ABORT, message=req.grammar.error)
        return None

    def _unlock(self, match: PrefixMatch | None) -> None:
        if match is not None:
            self.kv.unlock(match)

    def _attach(self, req: Req, match: PrefixMatch) -> None:
        n = self.kv.attach(req, match)
        if not req.output_ids and not req.retractions:
            req.cached_tokens = n
            self.prompt_tokens_seen += len(req.prompt_ids) * (1 + len(req.pending_forks))
            self.cached_tokens_seen += n * (1 + len(req.pending_forks))

    def _prefill_batch(self, admitted: list[tuple[Req, int]]) -> ScheduledBatch:
        ids: list[int] = []
        sample_index: list[int] = []
        logprob_index: list[int] = []  # prompt-logprob positions: their logits rows follow the sampling rows
        for req, extend in admitted:
            lo, hi = prompt_logprobs.span(req, req.kv_len + extend)
            assert lo >= req.kv_len or lo == hi, "prompt-logprob positions were skipped"
            logprob_index += range(len(ids) + lo - req.kv_len, len(ids) + hi - req.kv_len)
            ids += req.fill_ids[req.kv_len: req.kv_len + extend]
            if req.kv_len + extend == req.fill_len:
                sample_index.append(len(ids) - 1)
        reqs = [r for r, _ in admitted]
        fwd = ForwardInput.upload(ids, [r.row for r in reqs], [r.kv_len for r in reqs], [e for _, e in admitted],
                                  sample_index + logprob_index, self.kv.device)
        for req, extend in admitted:
            req.kv_len += extend  # KV is written by this forward
        self.prefill_tokens_computed += len(ids)
        return ScheduledBatch("prefill", reqs, fwd)

    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Gain]:
        """Draw the first token of every request whose prompt is now complete (its
        other samples forked from it first); chunks of longer prompts draw nothing. A
        scored prompt (max_new_tokens 0) ends without a token."""
        self._record_prompt_logprobs(batch, logits)
        gains: list[Gain] = []
        row = 0
        for req in batch.reqs:
            if req.kv_len < req.fill_len:
                continue
            if req.params.max_new_tokens == 0 and not req.output_ids:
                for child in req.pending_forks:  # scored prompts (echo, max_tokens 0): every sample reports them
                    child.input_logprobs, child.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
                gains.append(Gain(req, FinishReason(FinishKind.LENGTH), drew=False))
                row += 1
                continue
            # The prompt goes into the prefix cache now, locked for every sample
            # (a later request sharing it hits while this one still runs).
            children, req.pending_forks = req.pending_forks, []
            for child in children:  # one prompt, one set of prompt logprobs
                child.input_logprobs, child.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            batch.sampling_reqs += [req] + children  # (first: a failure below ends them too)
            batch.sampling_rows += [row] * (1 + len(children))
            self.kv.fork(req, children, own_last_position=self.fork_own_last_position)
            row += 1
        reqs = batch.sampling_reqs
        if reqs:
            rows = upload(batch.sampling_rows, torch.int64, logits.device)
            draws = self.sampler.draw(logits[rows], reqs, reqs)
            for i, req in enumerate(reqs):
                draws.append_to(req, i)
                gains.append(Gain(req, self.stop(req), joining=True))
        return gains

    def _record_prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """The prompt logprobs this prefill's logits hold (rows after the sampling rows,
        laid out by ``_prefill_batch``)."""
        spans = [(r, *prompt_logprobs.span(r, r.kv_len)) for r in batch.reqs]
        spans = [(r, lo, hi) for r, lo, hi in spans if hi > lo]
        if spans:
            first = sum(1 for r in batch.reqs if r.kv_len >= r.fill_len)
            prompt_logprobs.record(spans, logits[first:])
