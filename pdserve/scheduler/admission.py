"""Admission: which waiting requests (and the chunked one) go into the next prefill
batch, what that batch runs, and drawing the first token of every prompt it completes.

A mixin of ``Scheduler`` (the ``plan_batch`` and ``process`` phases of a step call
it): a request is admitted while the prefill token budget lasts and the pool keeps
room for the running requests' decode growth; a prompt longer than the budget is
chunked; a cached prefix is attached; the samples of a request are forked from it
once its prompt is in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from pdserve.model.device_io import upload
from pdserve.model.runner import ForwardInput
from pdserve.scheduler import prompt_logprobs
from pdserve.scheduler.batch import ScheduledBatch, StepOutput
from pdserve.scheduler.kv_manager import pages_for
from pdserve.scheduler.radix_cache import PrefixMatch
from pdserve.scheduler.req import FinishKind, FinishReason, Req


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


class Admission:
    """The prefill side of a scheduler's step (see the module docstring)."""

    def _ordered_waiting(self) -> list[Req]:
        if self.args.schedule_policy == "lpm" and len(self.waiting) <= 128:
            lens = {id(r): self.kv.matched_len(r.fill_ids[:-1]) for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -lens[id(r)])  # stable: ties stay FCFS
        return list(self.waiting)

    def growth_reserve(self, reqs: list[Req]) -> int:
        """Pages kept for the decode growth of ``reqs``."""
        if not self.decodes:
            return 0
        tokens = sum(min(r.remaining_new_tokens, self.tuning.reserve_clip) for r in reqs)
        # A speculative round briefly holds its tree past each request's length.
        transient = len(reqs) * pages_for(self.decoding.room, self.page_size) if self.spec is not None else 0
        return pages_for(int(tokens * self.new_token_ratio), self.page_size) + transient

    def admit(self, out: StepOutput) -> ScheduledBatch | None:
        """Admit waiting requests (and the chunked one) into a prefill batch within the
        token budget, keeping room for the running requests' growth."""
        if not self.waiting and self.chunked is None:
            return None
        self.settle_grammars(self.waiting)  # (the same on every TP rank: admission acts on it)
        ps = self.page_size
        chunking = self.args.chunked_prefill_size != -1
        budget = self.args.max_prefill_tokens
        if chunking:
            budget = min(budget, self.args.chunked_prefill_size)
        reserve = self.growth_reserve(self.running)
        admitted: list[tuple[Req, int]] = []
        candidates = ([self.chunked] if self.chunked is not None else []) + self._ordered_waiting()
        for req in candidates:
            if budget <= 0:
                break
            fresh = req is not self.chunked
            forks = len(req.pending_forks)
            match: PrefixMatch | None = None
            if fresh:
                refusal = self._refusal(req)
                if refusal is not None:
                    self.waiting.remove(req)
                    out.finished += self.finish(req, refusal)
                    continue
                if req.grammar is not None and not req.grammar.ready:
                    continue  # still compiling (never waited for here): the requests behind it go first
                if self.kv.free_rows < 1 + forks:
                    break
                prompt_logprobs.begin(req)
                # Positions whose prompt logprobs are still wanted must be computed.
                bound = prompt_logprobs.cache_bound(req)
                match = self.kv.match(req.fill_ids[:-1] if bound is None else req.fill_ids[:bound])
                start = match.slots.numel()
            else:
                start = req.kv_len
            remaining = req.fill_len - start
            extend = remaining
            if extend > budget:
                if not chunking and admitted or chunking and self.chunked is not None and fresh:
                    self._unlock(match)
                    break
                if chunking:
                    extend = budget
            completes = extend == remaining
            need = pages_for(start + extend, ps) - pages_for(start, ps)
            growth = 0
            if completes:
                need += forks * (1 if req.fill_len % ps else 0)
                growth = self.growth_reserve([req] + req.pending_forks)
            # Alone (nothing else holds or will take pages), a request that fits goes even
            # if its growth estimate does not: waiting could not make room, and a request
            # that really outgrows the pool is ended by the decode-room check.
            alone = not admitted and not self.running and self.chunked in (None, req)
            if need + growth > self.kv.available_pages - reserve and not (alone and need <= self.kv.available_pages):
                self._unlock(match)
                break
            if fresh:
                assert match is not None
                self.waiting.remove(req)
                self._attach(req, match)
            self.kv.assign(req, start, start + extend)
            reserve += growth
            budget -= extend
            admitted.append((req, extend))
            if not completes:
                self.chunked = req
                break
            if req is self.chunked:
                self.chunked = None
        return self._prefill_batch(admitted) if admitted else None

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
                                  sample_index + logprob_index, self.device)
        for req, extend in admitted:
            req.kv_len += extend  # KV is written by this forward
        self.prefill_tokens_computed += len(ids)
        return ScheduledBatch("prefill", reqs, fwd)

    def _process_prefill(self, batch: ScheduledBatch, logits: torch.Tensor, out: StepOutput) -> None:
        """Draw the first token of every request whose prompt is now complete (its
        other samples forked from it first); chunks of longer prompts draw nothing."""
        self._record_prompt_logprobs(batch, logits)
        row = 0
        for req in batch.reqs:
            if req.kv_len < req.fill_len:
                continue
            if req.params.max_new_tokens == 0 and not req.output_ids:
                for child in req.pending_forks:  # scored prompts (echo, max_tokens 0): every sample reports them
                    child.input_logprobs, child.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
                out.finished += self.finish(req, FinishReason(FinishKind.LENGTH))
                row += 1
                continue
            # The prompt goes into the prefix cache now, locked for every sample
            # (a later request sharing it hits while this one still runs).
            children, req.pending_forks = req.pending_forks, []
            for child in children:  # one prompt, one set of prompt logprobs
                child.input_logprobs, child.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            batch.sampling_reqs += [req] + children  # (first: a failure below ends them too)
            batch.sampling_rows += [row] * (1 + len(children))
            self.kv.fork(req, children, own_last_position=self.spec is not None)
            row += 1
        reqs = batch.sampling_reqs
        if reqs:
            rows = upload(batch.sampling_rows, torch.int64, logits.device)
            draws = self.sampler.draw(logits[rows], reqs, reqs)
            for i, req in enumerate(reqs):
                draws.append_to(req, i)
                self.settle(req, out, joining=True)
        # Draft KV for what this prefill added (and, after a cache hit or a retraction,
        # for the whole prefix): the next token is known now.
        if self.decodes:
            held = {id(r): r for r in batch.reqs + reqs if r.row is not None}
            self.decoding.prefilled(list(held.values()))

    def _record_prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """The prompt logprobs this prefill's logits hold (rows after the sampling rows,
        laid out by ``_prefill_batch``)."""
        spans = [(r, *prompt_logprobs.span(r, r.kv_len)) for r in batch.reqs]
        spans = [(r, lo, hi) for r, lo, hi in spans if hi > lo]
        if spans:
            first = sum(1 for r in batch.reqs if r.kv_len >= r.fill_len)
            prompt_logprobs.record(spans, logits[first:])
