"""Continuous batching over one model runner: the step skeleton every mode shares.

A step has fixed, named phases, in this order:

    poll_external  what happened outside the model since the last step (transfers:
                   decode commits arrived KV, prefill learns where KV goes)
    plan_batch     admit waiting requests into a prefill batch (chunked when long);
                   otherwise, when this mode decodes, the decode strategy plans one
                   step for every running request (plain: one token; EAGLE: a tree)
    forward        one target forward (storing draft features when something reads them)
    process        draw tokens and settle each request that drew one (finish or run on)
    commit         what the mode does with the step's results (prefill: send the new
                   KV and hand off first tokens)

Admission (``plan_batch``'s prefill batch and drawing first tokens) lives in the
``Admission`` mixin (``admission.py``). Colocated, prefill and decode schedulers fill hooks (``poll_external``,
``may_decode``, ``settle``, ``commit``); none overrides ``step``. KV is owned by
the ``KVManager``: pages are allocated just before a forward and released when a
request finishes (its KV goes into the prefix cache), is aborted, or is retracted
under memory pressure (it then re-queues and recomputes its KV; output unchanged).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ForwardInput, ModelRunner
from pdserve.scheduler.batch import Sampler, ScheduledBatch, StepOutput
from pdserve.scheduler.decoding import PlainDecoding
from pdserve.scheduler.admission import Admission, AdmissionTuning, too_big
from pdserve.scheduler.faults import FaultIsolation
from pdserve.scheduler.grammar import COMPILING, GrammarBackend
from pdserve.scheduler.kv_manager import KVManager, size_kv_pages
from pdserve.scheduler.req import FinishKind, FinishReason, Req, stop_reason
from pdserve.speculative.decoding import EagleDecoding
from pdserve.speculative.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)

__all__ = ["AdmissionTuning", "Scheduler", "StepOutput", "too_big"]


class Scheduler(FaultIsolation, Admission):
    decodes = True  # a prefill server never decodes: no decode steps, no draft state, no growth to reserve

    def __init__(self, args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                 tp: TPGroup = TPGroup(), tuning: AdmissionTuning = AdmissionTuning()) -> None:
        self.args = args
        self.runner = runner
        self.tp = tp
        self.tuning = tuning
        self.decode_text = decode_text
        self.device = runner.device
        self.page_size = args.page_size
        self.context_len = runner.context_len
        self.eos_ids = runner.config.eos_token_ids
        self.vocab_size = runner.config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.eos_ids, self.device, tp)
        num_pages = size_kv_pages(args, runner, tp, EagleWorker.bytes_per_slot(args, runner)
                                  if args.speculative_algorithm is not None else 0)
        self.spec: EagleWorker | None = None
        self.decoding: PlainDecoding | EagleDecoding
        if args.speculative_algorithm is not None:
            self.spec = EagleWorker(args, runner, num_pages * self.page_size)
        self.kv = KVManager(args, runner, num_pages, self.spec.room if self.spec is not None else 1)
        if self.spec is not None:
            self.spec.bind(self.kv.req_table.table)
            if args.use_cuda_graph():
                self.spec.enable_graphs(self.kv.req_table.padding_row, args.cuda_graph_max_bs, capture=True)
            self.kv.followers.append(self.spec)  # the draft features move with the target KV
            self.decoding = EagleDecoding(self, self.spec)
        else:
            self.decoding = PlainDecoding(self)
        # (layers, pool): where every target forward stores each new token's draft
        # feature by KV slot; a plain prefill server sets it when a speculative decode
        # peer asks for features.
        self.feature_sink: tuple[tuple[int, ...], torch.Tensor] | None = (
            (self.spec.capture_layers, self.spec.features) if self.spec is not None else None)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.ending: list[Req] = []  # ended on arrival (nothing to compute): reported by the next step
        self.new_token_ratio = tuning.init_new_token_ratio
        self.num_retractions = 0
        self.num_forward_steps = 0
        self.prompt_tokens_seen = 0   # prompt tokens of admitted requests
        self.cached_tokens_seen = 0   # of which served from the prefix cache
        # Tokens prefill forwards computed (not served from the cache): the prompts, once
        # per request however many samples it has, and retracted requests' recomputed KV.
        self.prefill_tokens_computed = 0
        # Compiles the grammars of constrained requests; set by the builder, which
        # holds the tokenizer (None: constrained requests are refused).
        # Its deadline and cache bound are this server's --grammar-* flags.
        self.grammars: GrammarBackend | None = None

    # ---- requests ---------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.constrain(req)
        self.waiting.append(req)

    def constrain(self, req: Req) -> None:
        """Start compiling the grammar of a constrained request; each sample gets its own
        matcher. A request waits for its compile in the queue (``admit`` passes it by)."""
        constraint = req.params.constraint
        if constraint is None:
            return
        if self.grammars is None:
            raise ValueError(f"{constraint[0]}: this scheduler was built without a tokenizer, "
                             "so it cannot constrain outputs")
        for sample in [req] + req.pending_forks:
            sample.grammar = self.grammars.state(sample.params)

    def settle_grammars(self, reqs: list[Req]) -> None:
        """Fix which of ``reqs``' grammars are done (compiled, failed, or past
        --grammar-compile-timeout) before admission acts on it. Every TP rank compiles on
        its own and finishes at its own moment, so the ranks agree (one collective, only
        while some grammar is still compiling) and all admit or refuse the same requests."""
        states = [r.grammar for r in reqs if r.grammar is not None and r.grammar.agreed in (None, COMPILING)]
        if not states:
            return
        codes = [s.local_code() for s in states]
        if self.tp.enabled:
            codes = self.tp.all_reduce_min(torch.tensor(codes, dtype=torch.int64)).tolist()
        for state, code in zip(states, codes):
            state.settle(int(code))

    def abort(self, rid: str, message: str = "aborted by the client") -> list[Req]:
        """Abort every sample of `rid`; returns the requests that were finished."""
        out: list[Req] = []
        reason = FinishReason(FinishKind.ABORT, message=message)
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            out += self.finish(req, reason)
        for req in [r for r in self.running if r.rid == rid]:
            self.running.remove(req)
            out += self.finish(req, reason)
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            out += self.finish(req, reason)
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.ending)

    # ---- the step ---------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput(finished=self.ending)
        self.ending = []
        self.poll_external(out)
        batch = self.plan_batch(out)
        if batch is not None:
            self.num_forward_steps += 1
            with self.guarded(lambda: batch.reqs + batch.sampling_reqs, out, f"{batch.mode} step"):
                logits = self.forward(batch.forward)
                self.process(batch, logits, out)
        self.commit(batch, out)
        return out

    def poll_external(self, out: StepOutput) -> None:
        """Hook: take in what changed outside the model (nothing, colocated)."""

    def may_decode(self) -> bool:
        """Hook: whether this step may run the decode strategy (decode servers hold it
        for one step to publish first tokens)."""
        return True

    def commit(self, batch: ScheduledBatch | None, out: StepOutput) -> None:
        """Hook: act on the step's results (nothing more, colocated)."""

    def plan_batch(self, out: StepOutput) -> ScheduledBatch | None:
        batch = self.admit(out)
        if batch is None and self.running and self.decodes and self.may_decode():
            batch = self.decoding.plan(out)
        return batch

    def forward(self, fwd: ForwardInput) -> torch.Tensor:
        """Run the target; store the new tokens' features when something reads them."""
        if self.feature_sink is None:
            return self.runner.forward(fwd)
        layers, pool = self.feature_sink
        logits, feats, slots = self.runner.forward_features(fwd, layers)
        assert feats is not None
        pool[slots] = feats.to(pool.dtype)
        return logits

    def process(self, batch: ScheduledBatch, logits: torch.Tensor, out: StepOutput) -> None:
        if batch.mode == "prefill":
            self._process_prefill(batch, logits, out)
        else:
            self.decoding.process(batch, logits, out)
            self.new_token_ratio = max(self.tuning.min_new_token_ratio,
                                       self.new_token_ratio - self.tuning.ratio_decay)

    def settle(self, req: Req, out: StepOutput, joining: bool) -> None:
        """Hook: ``req`` drew a token (``joining``: its first since a prefill). It
        finishes, or runs on in the running batch."""
        out.advanced.append(req)
        reason = self.stop_reason(req)
        if reason is not None:
            if not joining:
                self.running.remove(req)
            out.finished += self.finish(req, reason)
        elif joining:
            self.running.append(req)

    # ---- stopping, retracting, releasing ----------------------------------------------------
    def stop_reason(self, req: Req) -> FinishReason | None:
        reason = stop_reason(req, self.eos_ids, self.context_len, self.decode_text)
        grammar = req.grammar
        if grammar is None or reason is not None and reason.kind is not FinishKind.LENGTH:
            return reason
        ended = grammar.advance(req.output_ids)
        if grammar.rejected is not None:
            return FinishReason(FinishKind.ABORT, server_error=True,
                                message=f"internal error: token {grammar.rejected} left the output's grammar")
        # A grammar that ended on its stop token ends the output even with ignore_eos.
        return FinishReason(FinishKind.STOP, matched=req.output_ids[-1]) if ended and reason is None else reason

    def make_decode_room(self, out: StepOutput) -> None:
        """Retract requests until every running request can grow by the decode
        strategy's room (one token; a speculative round: its whole tree)."""
        room = self.decoding.room
        while self.running:
            need = sum(self.kv.growth_pages(r, room) for r in self.running)
            if need <= self.kv.available_pages:
                return
            if len(self.running) == 1:
                req = self.running.pop()
                out.finished += self.finish(req, FinishReason(
                    FinishKind.ABORT, message="the KV pool cannot hold this request's length "
                    "(raise --max-total-tokens)"))
                return
            # SGLang's choice: the request with the fewest output tokens (least work
            # lost), the longest prompt among equals.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self.running.remove(victim)
            self.kv.release(victim, cache_kv=True)
            victim.retractions += 1
            self.num_retractions += 1
            self.waiting.insert(0, victim)
            self.new_token_ratio = self.tuning.init_new_token_ratio
            logger.info("retracted request %s (%d output tokens) to free KV", victim.rid,
                        len(victim.output_ids))

    def finish(self, req: Req, reason: FinishReason) -> list[Req]:
        """End ``req`` (and its never-forked samples) and give back what it holds."""
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

    # ---- inspection ---------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache and the compiled grammars; only allowed when idle (like
        SGLang's /flush_cache)."""
        if self.has_work:
            return False
        self.kv.flush()
        if self.grammars is not None:
            self.grammars.flush()
        return True

    def state(self) -> dict[str, object]:
        mem = self.memory_state()
        used = mem["kv_pages_total"] - mem["kv_pages_free"] - mem["kv_pages_evictable"]
        return {
            "memory": mem,
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_waiting_reqs": len(self.waiting),
            "num_retractions": self.num_retractions,
            "num_forward_steps": self.num_forward_steps,
            "token_usage": used / max(1, mem["kv_pages_total"]),
            "num_used_tokens": used * self.page_size,
            "cache_hit_rate": self.cached_tokens_seen / max(1, self.prompt_tokens_seen),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "context_len": self.context_len,
            "avg_spec_accept_length": self.spec.avg_accept_length if self.spec is not None else None,
            "grammar": self.grammars.stats() if self.grammars is not None else None,
        }

    def memory_state(self) -> dict[str, int]:
        return self.kv.memory_state()

    # ---- teardown ------------------------------------------------------------------------
    def release(self) -> None:
        """Break the reference cycles through this scheduler (the decode strategy points
        back at it, graph runners at their runner and worker) and stop the grammar
        compiler, so that once its owner drops it, reference counting alone frees the
        weights, KV pools and CUDA graphs: a garbage collection may come much later, and
        until then another engine in this process finds the device memory taken. The
        scheduler is unusable afterwards."""
        del self.decoding
        self.runner.decode_graphs = None
        if self.spec is not None:
            self.spec.graphs = None
        if self.grammars is not None:
            self.grammars.close()
            self.grammars = None
