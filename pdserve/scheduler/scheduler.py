"""Continuous batching over one model runner: the step skeleton every mode shares,
and the wiring of its parts.

A step has fixed, named phases, in this order:

    poll_external  what happened outside the model since the last step (transfers:
                   decode commits arrived KV, prefill learns where KV goes)
    plan_batch     the prefill planner admits waiting requests into a prefill batch
                   (chunked when long); otherwise, when this mode decodes, the decode
                   strategy plans one step for every running request (plain: one
                   token; EAGLE: a tree, its draft forwards run here)
    forward        one target forward (storing draft features when something reads them)
    process        the planner or the strategy draws tokens and returns what each
                   request gained; the scheduler settles each (finish or run on)
    commit         what the mode does with the step's results (prefill: send the new
                   KV and hand off first tokens)

The parts, each given its dependencies when built here: ``RequestQueues`` (where
requests are; finish, retract), ``PrefillPlanner`` (admission, first tokens),
``GrowthReserve``, a decode strategy (``PlainDecoding`` / ``EagleDecoding``), the
``StopCheck``, the ``Sampler`` and the ``KVManager`` (the only owner of KV
bookkeeping: pages are allocated just before a forward and released when a request
finishes, is aborted, or is retracted; a speculative round's pages are opened and
closed by it). Only this class moves requests between queues. Every phase that acts
on particular requests runs under the fault guard, so an error fails those requests,
never the others. Prefill and decode schedulers fill the hooks (``poll_external``,
``may_decode``, ``settle``, ``commit``); none overrides ``step``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ForwardInput, ModelRunner
from pdserve.scheduler.admission import AdmissionTuning, GrowthReserve, PrefillPlanner, too_big
from pdserve.scheduler.batch import Gain, Sampler, ScheduledBatch, StepOutput
from pdserve.scheduler.decode_log import DecodeLog
from pdserve.scheduler.decoding import DecodeStrategy, PlainDecoding
from pdserve.scheduler.faults import Guard, end_despite, internal_error
from pdserve.scheduler.grammar import COMPILING, GrammarBackend
from pdserve.scheduler.kv_manager import KVManager, PoolGeometry
from pdserve.scheduler.memory_budget import size_kv_pages
from pdserve.scheduler.mode import Mode
from pdserve.scheduler.queues import RequestQueues
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.scheduler.stopping import StopCheck
from pdserve.speculative.decoding import EagleDecoding
from pdserve.speculative.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)

__all__ = ["AdmissionTuning", "Scheduler", "StepOutput", "too_big"]


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                 tp: TPGroup = TPGroup(), tuning: AdmissionTuning = AdmissionTuning(), decodes: bool = True) -> None:
        self.args = args
        # A prefill server never decodes: no decode steps, no draft state, no growth to reserve.
        self.decodes = decodes
        self.runner = runner
        self.tp = tp
        self.device = runner.device
        self.page_size = args.page_size
        self.context_len = runner.context_len
        self.eos_ids = runner.config.eos_token_ids
        self.vocab_size = runner.config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.eos_ids, self.device, tp)
        self.stop_reason = StopCheck(self.eos_ids, self.context_len, decode_text)
        num_pages = size_kv_pages(args, runner, tp, EagleWorker.bytes_per_slot(args, runner)
                                  if args.speculative_algorithm is not None else 0)
        self.spec: EagleWorker | None = None
        self.decoding: DecodeStrategy
        if args.speculative_algorithm is not None:
            self.spec = EagleWorker(args, runner, num_pages * self.page_size)
        self.kv = KVManager(PoolGeometry.of(args, runner, num_pages, self.spec.lookahead if self.spec else 1))
        self.kv.bind(runner)  # the runner builds its attention backend over these pools
        if args.use_cuda_graph():  # then the decode graphs, over the bound pools
            runner.enable_decode_graphs(args.cuda_graph_max_bs, capture=True)
        if self.spec is not None:
            self.spec.bind(self.kv.req_table.table)
            if args.use_cuda_graph():
                self.spec.enable_graphs(self.kv.req_table.padding_row, args.cuda_graph_max_bs, capture=True)
            self.kv.followers.append(self.spec)  # the draft features move with the target KV
            self.decoding = EagleDecoding(self.kv, self.sampler, self.spec, self.stop_reason,
                                          agreement=tp if args.debug_tp_agreement and tp.enabled else None)
        else:
            self.decoding = PlainDecoding(self.kv, self.sampler, self.stop_reason)
        self.queues = RequestQueues(self.kv)
        # The serving mode's hooks (colocated: none); a PD builder composes its side in.
        self.mode: Mode = Mode(self.queues)
        self.growth = GrowthReserve(tuning, self.page_size, self.decodes,
                                    self.decoding.lookahead if self.spec is not None else 0)
        self.planner = PrefillPlanner(args, self.kv, self.sampler, self.growth, self.stop_reason,
                                      fork_own_last_position=self.spec is not None)
        # (layers, pool): where every target forward stores each new token's draft
        # feature by KV slot; a plain prefill server sets it when a speculative decode
        # peer asks for features.
        self.feature_sink: tuple[tuple[int, ...], torch.Tensor] | None = (
            (self.spec.capture_layers, self.spec.features) if self.spec is not None else None)
        self.num_forward_steps = 0
        self.num_decode_steps = 0  # decode steps and speculative rounds
        # Every --decode-log-interval decode steps one line (TP rank 0's: the ranks agree).
        self.decode_log = (DecodeLog(args.decode_log_interval, self.page_size)
                           if self.decodes and tp.rank == 0 else None)
        # Compiles the grammars of constrained requests; set by the builder, which
        # holds the tokenizer (None: constrained requests are refused).
        # Its deadline and cache bound are this server's --grammar-* flags.
        self.grammars: GrammarBackend | None = None

    # The queues, as the PD schedulers and inspection read them.
    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def chunked(self) -> Req | None:
        return self.queues.chunked

    @chunked.setter
    def chunked(self, req: Req | None) -> None:
        self.queues.chunked = req

    # ---- requests ---------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.constrain(req)
        self.mode.add(req)

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
        return self.mode.abort(rid, FinishReason(FinishKind.ABORT, message=message))

    def finish(self, req: Req, reason: FinishReason) -> list[Req]:
        """End ``req`` (and its never-forked samples) and give back what it holds."""
        return self.queues.finish(req, reason)

    @property
    def has_work(self) -> bool:
        return self.queues.has_work or self.mode.has_work

    # ---- the step ---------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput(finished=self.queues.ending)
        self.queues.ending = []
        self.mode.poll_external(out)
        batch = self.plan_batch(out)
        if batch is not None:
            self.num_forward_steps += 1
            decoding = batch.mode != "prefill"
            logged = decoding and self.decode_log is not None  # (only then count tokens: the decode hot path)
            before = sum(len(r.output_ids) for r in batch.reqs) if logged else 0
            with self.guarded(lambda: batch.reqs + batch.sampling_reqs, out, f"{batch.mode} step"):
                logits = self.forward(batch.forward)
                self.process(batch, logits, out)
            if decoding:
                self.num_decode_steps += 1
                if logged:
                    self.decode_log.step(sum(len(r.output_ids) for r in batch.reqs) - before, self.state)
        self.mode.commit(batch, out)
        return out

    def plan_batch(self, out: StepOutput) -> ScheduledBatch | None:
        batch = self.admit(out)
        if batch is None and self.running and self.decodes and self.mode.may_decode():
            self.make_lookahead_room(out)
            reqs = list(self.running)
            if reqs:
                with self.guarded(reqs, out, "planning the decode step"):
                    batch = self.decoding.plan(reqs)
        return batch

    def admit(self, out: StepOutput) -> ScheduledBatch | None:
        """Plan a prefill batch and apply what the planner decided to the queues."""
        queues = self.queues
        if not queues.waiting and queues.chunked is None:
            return None
        self.settle_grammars(queues.waiting)  # (the same on every TP rank: admission acts on it)
        admission = self.planner.plan(queues.waiting, queues.chunked, queues.running)
        for req in admission.admitted:
            queues.waiting.remove(req)
        queues.chunked = admission.chunked
        for req, reason in admission.refused:
            queues.waiting.remove(req)
            out.finished += self.finish(req, reason)
        for req, exc in admission.failed:
            out.finished += self.fail_request(req, f"admitting the request: {exc}")
        return admission.batch

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
            gains = self.planner.process(batch, logits)
        else:
            gains = self.decoding.process(batch, logits)
            self.growth.decay()
        for gain in gains:
            if gain.drew:
                self.settle(gain, out)
            else:
                out.finished += self.finish(gain.req, gain.stop or FinishReason(FinishKind.LENGTH))
        # Draft state for what a prefill added (and, after a cache hit or a retraction,
        # for the whole prefix): the next token is known now. A PD prefill server with a
        # draft runs it too: a decode server with the same draft starts from that state.
        if batch.mode == "prefill" and self.spec is not None:
            held = {id(r): r for r in batch.reqs + batch.sampling_reqs if r.row is not None}
            self.decoding.prefilled(list(held.values()))

    def settle(self, gain: Gain, out: StepOutput) -> None:
        """``gain.req`` drew a token (``gain.joining``: its first since a prefill). It
        finishes, or runs on in the running batch; on a prefill server the token is
        handed on instead (the mode's commit)."""
        if not self.mode.publishes_tokens:
            return
        req = gain.req
        out.advanced.append(req)
        if gain.stop is not None:
            if not gain.joining:
                self.running.remove(req)
            out.finished += self.finish(req, gain.stop)
        elif gain.joining:
            self.running.append(req)

    # ---- retracting ------------------------------------------------------------------------
    def make_lookahead_room(self, out: StepOutput) -> None:
        """Retract requests until every running request can grow by the decode
        strategy's lookahead (one token; a speculative round: its whole tree)."""
        lookahead = self.decoding.lookahead
        while self.running:
            need = sum(self.kv.growth_pages(r, lookahead) for r in self.running)
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
            self.queues.retract(min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids))))
            self.growth.reset()

    # ---- faults ---------------------------------------------------------------------------
    def guarded(self, reqs: list[Req] | Callable[[], list[Req]], out: StepOutput, what: str) -> Guard:
        """``with self.guarded(reqs, out, what):`` -- an exception inside fails ``reqs``
        (each with the error; a callable is read at that moment) instead of the step."""
        return Guard(self.fail_request, reqs if callable(reqs) else (lambda: reqs), out, what)  # type: ignore

    def fail_request(self, req: Req, message: str) -> list[Req]:
        """End one request after an internal error while handling it (wherever it is),
        giving back what it holds as far as that still works (an open speculative round's
        pages included): the step goes on for every other request."""
        if req.finish is not None:
            return []
        ended = self.mode.fail_request(req, message)
        if ended is not None:
            return ended
        self.queues.take_out(req)
        return end_despite(req, internal_error(message), self.finish)

    def live_requests(self) -> list[Req]:
        """Every request the scheduler (and its mode) holds that has not finished."""
        held = {id(r): r for r in self.queues.live()}
        held.update({id(r): r for r in self.mode.live_requests() if r.finish is None})
        return list(held.values())

    def fail_all(self, message: str) -> list[Req]:
        """The last resort after a step failed outside any request's guard: every live
        request ends with the error (each gets its one final outcome), the server goes on."""
        out: list[Req] = []
        for req in self.live_requests():
            out += self.fail_request(req, message)
        return out

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
        return self.mode.state({
            "memory": mem,
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_waiting_reqs": len(self.waiting),
            "num_retractions": self.queues.num_retractions,
            "num_forward_steps": self.num_forward_steps,
            "token_usage": used / max(1, mem["kv_pages_total"]),
            "num_used_tokens": used * self.page_size,
            "cache_hit_rate": self.planner.cached_tokens_seen / max(1, self.planner.prompt_tokens_seen),
            "prefill_tokens_computed": self.planner.prefill_tokens_computed,
            "context_len": self.context_len,
            "avg_spec_accept_length": self.spec.avg_accept_length if self.spec is not None else None,
            "grammar": self.grammars.stats() if self.grammars is not None else None,
        })

    def memory_state(self) -> dict[str, int]:
        return self.kv.memory_state()

    def settings(self) -> dict[str, Any]:
        """What this rank resolved at startup from the flags' "auto"s and defaults: the
        server's startup summary line and /get_server_info report these."""
        runner, args = self.runner, self.args
        pools = list(self.kv.kv_pool.buffers().values())
        if self.spec is not None:  # slot-indexed like the target KV: part of the same budget
            pools += [*self.spec.draft_pool.buffers().values(), self.spec.features]
        staging = None
        if args.disaggregation_mode != "null":
            staging = "host" if self.mode.staging is not None else "direct"
        return {
            "device": str(self.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "attention_backend": runner.attention_backend,
            "max_total_tokens": self.kv.allocator.capacity * self.page_size,
            "kv_pool_bytes": sum(t.numel() * t.element_size() for t in pools),
            "page_size": self.page_size,
            "context_length": self.context_len,
            "speculative_shape": ((self.spec.steps, self.spec.topk, self.spec.num_draft_tokens)
                                  if self.spec is not None else None),
            "disaggregation_kv_staging": staging,
            "tp_size": self.tp.size,
        }

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop what the mode runs (a PD side's threads, sockets and transfer engine)."""
        self.mode.close()

    def release(self) -> None:
        """Break the reference cycles through this scheduler (a PD side points back at
        it, graph runners at their runner and worker) and stop the grammar compiler, so
        that once its owner drops it, reference counting alone frees the weights, KV
        pools and CUDA graphs: a garbage collection may come much later, and until then
        another engine in this process finds the device memory taken. The scheduler is
        unusable afterwards."""
        self.mode = Mode(self.queues)
        self.runner.decode_graphs = None
        if self.spec is not None:
            self.spec.graphs = None
        if self.grammars is not None:
            self.grammars.close()
            self.grammars = None
