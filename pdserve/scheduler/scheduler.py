"""Continuous batching over one model runner (the colocated event loop's core).

Each `step()` runs one forward: a prefill batch when waiting requests fit
(chunked when long), otherwise one decode token for every running request.
KV is allocated just before a forward and released when a request finishes
(its KV goes into the prefix cache), is aborted, or is retracted under memory
pressure (it then re-queues and recomputes its KV later; output unchanged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ForwardInput, ModelRunner
from pdserve.model.sampler import sample
from pdserve.scheduler.batch import ScheduledBatch, build_sampling_info
from pdserve.scheduler.memory import PageAllocator, ReqToTokenPool, TokenToKVPool
from pdserve.scheduler.radix_cache import ChunkCache, PrefixMatch, RadixCache
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.speculative.eagle_worker import EagleWorker

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


@dataclass
class StepOutput:
    advanced: list[Req] = field(default_factory=list)  # drew a token this step
    finished: list[Req] = field(default_factory=list)  # finished this step (incl. aborts)


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """Tokens of a draft tree node's ancestors below the root, and its own, root first."""
    out: list[int] = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


class _DrawView:
    """A request as it would be after emitting a tree path: what the sampler reads.
    The extended output list is only built when penalties need it (not per node
    of every round)."""

    def __init__(self, req: Req, path: list[int]) -> None:
        self.params = req.params
        self.seed = req.seed
        self._req = req
        self._path = path
        self.num_output_tokens = len(req.output_ids) + len(path)

    @property
    def output_ids(self) -> list[int]:
        return self._req.output_ids + self._path

    @property
    def fill_ids(self) -> list[int]:
        return self._req.prompt_ids + self.output_ids


class Scheduler:
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
        num_pages = self._size_pages()
        self.allocator = PageAllocator(num_pages, self.page_size)
        cfg = runner.config
        self.kv_pool = TokenToKVPool("target", cfg.num_layers, num_pages * self.page_size,
                                     runner.num_local_kv_heads, cfg.head_dim, runner.kv_dtype, self.device)
        self.spec: EagleWorker | None = None
        room = 1
        if args.speculative_algorithm is not None:
            self.spec = EagleWorker(args, runner, num_pages * self.page_size)
            room = self.spec.room
        # A speculative round's tree may reach past the context end; those
        # positions are never committed (a request finishes at the context length).
        self.decode_room = room
        self.req_table = ReqToTokenPool(args.max_running_requests, self.context_len + room, self.device)
        runner.bind_memory(self.kv_pool, self.req_table.table, num_pages * self.page_size)
        if self.spec is not None:
            self.spec.bind(self.req_table.table)
        self.cache: RadixCache | ChunkCache = (
            ChunkCache(self.allocator) if args.disable_radix_cache else RadixCache(self.allocator))
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = tuning.init_new_token_ratio
        self.num_retractions = 0
        self.num_forward_steps = 0
        self.prompt_tokens_seen = 0   # prompt tokens of admitted requests
        self.cached_tokens_seen = 0   # of which served from the prefix cache

    # ---- sizing ---------------------------------------------------------------
    def _size_pages(self) -> int:
        cfg, runner, args = self.runner.config, self.runner, self.args
        per_token = TokenToKVPool.bytes_per_token(cfg.num_layers, runner.num_local_kv_heads,
                                                  cfg.head_dim, runner.kv_dtype)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = free * args.mem_fraction_static
            else:
                budget = args.cpu_kv_budget_gb * (1 << 30) * args.mem_fraction_static
            # No point holding more than every request slot filled to the context.
            tokens = min(int(budget // per_token), args.max_running_requests * self.context_len)
        pages = tokens // self.page_size
        if self.tp.enabled:  # ranks must agree on the pool size
            t = self.tp.broadcast(torch.tensor([pages]))
            pages = int(t.min())
        logger.info("KV pool: %d pages x %d tokens (%.1f MiB)", pages, self.page_size,
                    pages * self.page_size * per_token / 2**20)
        return pages + 1  # + the padding page

    # ---- requests ---------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> list[Req]:
        """Abort every sample of `rid`; returns the requests that were finished."""
        out: list[Req] = []
        reason = FinishReason(FinishKind.ABORT, message=message)
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            out += self._finish(req, reason)
        for req in [r for r in self.running if r.rid == rid]:
            self.running.remove(req)
            out += self._finish(req, reason)
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            out += self._finish(req, reason)
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + (1 if self.chunked else 0)

    # ---- the step ---------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput()
        batch = self._schedule_prefill(out)
        if batch is None and self.spec is not None:
            self._spec_round(out)
            return out
        if batch is None:
            batch = self._schedule_decode(out)
        if batch is None:
            return out
        self.num_forward_steps += 1
        logits = self._forward(batch.forward)
        self._process(batch, logits, out)
        if self.spec is not None:
            # Draft KV for what this prefill added (and, after a cache hit or a
            # retraction, for the whole prefix): the next token is known now.
            held = {id(r): r for r in batch.reqs + batch.sampling_reqs if r.row is not None}
            self.spec.catch_up(list(held.values()))
        if batch.mode == "decode":
            self._decay_token_ratio()
        return out

    def _decay_token_ratio(self) -> None:
        self.new_token_ratio = max(self.tuning.min_new_token_ratio, self.new_token_ratio - self.tuning.ratio_decay)

    def _feature_capture(self) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(layers, pool): where every target forward stores each new token's draft
        feature (by KV slot); None when nothing reads features."""
        return (self.spec.capture_layers, self.spec.features) if self.spec is not None else None

    def _forward(self, fwd: ForwardInput) -> torch.Tensor:
        """Run the target; store the new tokens' features when something reads them."""
        capture = self._feature_capture()
        if capture is None:
            return self.runner.forward(fwd)
        logits, feats, slots = self.runner.forward_features(fwd, capture[0])
        assert feats is not None
        capture[1][slots] = feats.to(capture[1].dtype)
        return logits

    # ---- prefill ------------------------------------------------------------------
    def _ordered_waiting(self) -> list[Req]:
        if self.args.schedule_policy == "lpm" and len(self.waiting) <= 128:
            lens = {id(r): self.cache.match_prefix(r.fill_ids[:-1]).slots.numel() for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -lens[id(r)])  # stable: ties stay FCFS
        return list(self.waiting)

    def _growth_reserve(self, reqs: list[Req]) -> int:
        tokens = sum(min(r.remaining_new_tokens, self.tuning.reserve_clip) for r in reqs)
        # A speculative round briefly holds its tree past each request's length.
        transient = len(reqs) * _pages_for(self.decode_room, self.page_size) if self.spec is not None else 0
        return _pages_for(int(tokens * self.new_token_ratio), self.page_size) + transient

    def _schedule_prefill(self, out: StepOutput) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        ps = self.page_size
        chunking = self.args.chunked_prefill_size != -1
        budget = self.args.max_prefill_tokens
        if chunking:
            budget = min(budget, self.args.chunked_prefill_size)
        reserve = self._growth_reserve(self.running)
        admitted: list[tuple[Req, int]] = []
        candidates = ([self.chunked] if self.chunked is not None else []) + self._ordered_waiting()
        for req in candidates:
            if budget <= 0:
                break
            fresh = req is not self.chunked
            forks = len(req.pending_forks)
            match: PrefixMatch | None = None
            if fresh:
                if self.req_table.num_free < 1 + forks:
                    break
                match = self.cache.match_prefix(req.fill_ids[:-1])
                self.cache.lock(match.node)
                start = match.slots.numel()
            else:
                start = req.kv_len
            remaining = req.fill_len - start
            extend = remaining
            if extend > budget:
                if not chunking:
                    if admitted:
                        self._unlock_if(fresh, match)
                        break
                elif self.chunked is not None and fresh:
                    self._unlock_if(fresh, match)
                    break
                else:
                    extend = budget
            completes = extend == remaining
            need = _pages_for(start + extend, ps) - _pages_for(start, ps)
            if completes:
                need += forks * (1 if req.fill_len % ps else 0)
                growth = self._growth_reserve([req] + req.pending_forks)
            else:
                growth = 0
            available = self.allocator.num_free + self.cache.evictable_pages - reserve
            if need + growth > available:
                self._unlock_if(fresh, match)
                if (fresh and not admitted and not self.running and self.chunked is None
                        and need > self.allocator.capacity):
                    self.waiting.remove(req)
                    out.finished += self._finish(req, FinishReason(
                        FinishKind.ABORT, message=f"request needs {need} KV pages but the pool has "
                        f"{self.allocator.capacity} (raise --max-total-tokens)"))
                    continue
                break
            if fresh:
                assert match is not None
                self.waiting.remove(req)
                self._attach(req, match)
            self._assign_slots(req, start, start + extend)
            reserve += growth
            budget -= extend
            admitted.append((req, extend))
            if not completes:
                self.chunked = req
                break
            if req is self.chunked:
                self.chunked = None
        if not admitted:
            return None
        return self._prefill_batch(admitted)

    def _unlock_if(self, fresh: bool, match: PrefixMatch | None) -> None:
        if fresh and match is not None:
            self.cache.unlock(match.node)

    def _attach(self, req: Req, match: PrefixMatch) -> None:
        """Give a waiting request its table row(s) and the matched cached prefix."""
        req.row = self.req_table.alloc()
        for child in req.pending_forks:
            child.row = self.req_table.alloc()
        n = match.slots.numel()
        if n:
            self.req_table.table[req.row, :n] = match.slots.to(self.device)
            self.allocator.retain(match.slots[::self.page_size] // self.page_size)
        req.lock_node = match.node
        req.kv_len = n
        req.draft_len = 0  # the draft KV of a cached prefix is recomputed from its stored features
        if not req.output_ids and not req.retractions:
            req.cached_tokens = n
            self.prompt_tokens_seen += len(req.prompt_ids) * (1 + len(req.pending_forks))
            self.cached_tokens_seen += n * (1 + len(req.pending_forks))

    def _alloc_pages(self, n: int) -> torch.Tensor:
        while self.allocator.num_free < n:
            if self.cache.evict(n - self.allocator.num_free) == 0:
                # Admission and decode-room checks make this unreachable; if it is
                # reached, the accounting is wrong and must not be papered over.
                raise RuntimeError(f"KV accounting error: need {n} pages, {self.allocator.num_free} free, "
                                   f"{self.cache.evictable_pages} reported evictable")
        return self.allocator.alloc(n)

    def _assign_slots(self, req: Req, start: int, end: int) -> None:
        """Give positions [start, end) of `req` KV slots (continuing its last page)."""
        ps = self.page_size
        assert req.row is not None
        old_pages = _pages_for(start, ps)
        new_pages = self._alloc_pages(_pages_for(end, ps) - old_pages).to(self.device)
        pos = torch.arange(start, end, device=self.device)
        page_idx = pos // ps
        if old_pages:
            last = self.req_table.table[req.row, (old_pages - 1) * ps] // ps
            padded = torch.cat([last.view(1), new_pages])
            page = padded[page_idx - (old_pages - 1)]
        else:
            page = new_pages[page_idx]
        self.req_table.table[req.row, start:end] = page * ps + pos % ps

    def _prefill_batch(self, admitted: list[tuple[Req, int]]) -> ScheduledBatch:
        ids: list[int] = []
        sample_index: list[int] = []
        for req, extend in admitted:
            ids += req.fill_ids[req.kv_len: req.kv_len + extend]
            if req.kv_len + extend == req.fill_len:
                sample_index.append(len(ids) - 1)
        dev = self.device
        reqs = [r for r, _ in admitted]
        fwd = ForwardInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            rows=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            prefix_lens=torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=dev),
            extend_lens=torch.tensor([e for _, e in admitted], dtype=torch.int64, device=dev),
            sample_index=torch.tensor(sample_index, dtype=torch.int64, device=dev),
        )
        for req, extend in admitted:
            req.kv_len += extend  # KV is written by this forward
        return ScheduledBatch("prefill", reqs, fwd)

    # ---- decode -------------------------------------------------------------------
    def _schedule_decode(self, out: StepOutput) -> ScheduledBatch | None:
        if not self.running:
            return None
        self._make_decode_room(out)
        reqs = self.running
        if not reqs:
            return None
        ps, dev = self.page_size, self.device
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev)
        pos = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=dev)
        needs_page = [r.kv_len % ps == 0 for r in reqs]
        pages = self._alloc_pages(sum(needs_page)).to(dev)
        if ps == 1:
            slots = pages
        else:
            slots = self.req_table.table[rows, (pos - 1).clamp(min=0)] + 1
            slots[torch.tensor(needs_page, device=dev)] = pages * ps
        self.req_table.table[rows, pos] = slots
        fwd = ForwardInput(
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev),
            rows=rows, prefix_lens=pos, extend_lens=torch.ones_like(pos),
            sample_index=torch.arange(len(reqs), device=dev),
            decode_keys=[self.req_table.key(r.row) for r in reqs],
        )
        for r in reqs:
            r.kv_len += 1
        batch = ScheduledBatch("decode", list(reqs), fwd)
        batch.sampling_reqs = list(reqs)
        batch.sampling_rows = list(range(len(reqs)))
        return batch

    def _make_decode_room(self, out: StepOutput) -> None:
        """Retract requests until every running request can grow by one token (a
        speculative round: by its whole tree)."""
        ps, room = self.page_size, self.decode_room
        while self.running:
            need = sum(_pages_for(r.kv_len + room, ps) - _pages_for(r.kv_len, ps) for r in self.running)
            if need <= self.allocator.num_free + self.cache.evictable_pages:
                return
            if len(self.running) == 1:
                req = self.running.pop()
                out.finished += self._finish(req, FinishReason(
                    FinishKind.ABORT, message="the KV pool cannot hold this request's length "
                    "(raise --max-total-tokens)"))
                return
            # SGLang's choice: the request with the fewest output tokens (least work
            # lost), the longest prompt among equals.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self.running.remove(victim)
            self._release(victim, cache_kv=True)
            victim.retractions += 1
            self.num_retractions += 1
            self.waiting.insert(0, victim)
            self.new_token_ratio = self.tuning.init_new_token_ratio
            logger.info("retracted request %s (%d output tokens) to free KV", victim.rid,
                        len(victim.output_ids))

    # ---- speculative decoding ---------------------------------------------------------
    def _spec_round(self, out: StepOutput) -> None:
        """One EAGLE round for every running request: draft a tree, verify it with
        one target forward, emit the accepted tokens and the bonus, compact KV."""
        spec = self.spec
        assert spec is not None
        self._make_decode_room(out)
        reqs = list(self.running)
        if not reqs:
            return
        self.num_forward_steps += 1
        for r in reqs:
            self._assign_slots(r, r.kv_len, r.kv_len + spec.room)
        tree = spec.propose(reqs)
        fwd = spec.verify_input(reqs, tree)
        logits = self._forward(fwd)
        nodes = spec.num_draft_tokens
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        # Every node draws the token plain decoding would draw at its output
        # position (same penalties, same seeded noise), so the walk below emits
        # exactly the non-speculative output.
        views = [_DrawView(r, _path_tokens(tokens[b], parents[b], j)) for b, r in enumerate(reqs)
                 for j in range(nodes)]
        info = build_sampling_info(views, self.vocab_size, self.eos_ids, self.device)  # type: ignore[arg-type]
        want_lp = any(r.return_logprob for r in reqs)
        result = sample(logits, info, want_lp, max((r.top_logprobs_num for r in reqs), default=0))
        drawn = result.next_ids.tolist()
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        ps = self.page_size
        for b, req in enumerate(reqs):
            base, n = b * nodes, req.kv_len
            path = spec.accept_path(tokens[b], parents[b], drawn[base: base + nodes])
            reason = None
            emitted = 0
            for node in path:
                i = base + node
                self._append_token(req, drawn[i], lps[i] if lps else None,
                                   top_lp[i] if top_lp else None, top_ids[i] if top_ids else None)
                emitted += 1
                reason = self._check_finished(req)
                if reason is not None:
                    break
            # Position n + j now holds the input of the j-th emitted token: node path[j].
            moves = [(n + j, n + path[j]) for j in range(1, emitted) if path[j] != j]
            if moves:
                table = self.req_table.table[req.row]
                dst = table[torch.tensor([d for d, _ in moves], device=self.device)]
                src = table[torch.tensor([s for _, s in moves], device=self.device)]
                self.kv_pool.copy_slots(dst, src)
                spec.copy_slots(dst, src)
            req.kv_len = n + emitted
            keep, held = _pages_for(req.kv_len, ps), _pages_for(n + spec.room, ps)
            if held > keep:
                tail = self.req_table.table[req.row, keep * ps: held * ps: ps] // ps
                self.allocator.release(tail.cpu())
            req.spec_verify_ct += 1
            req.spec_accepted_drafts += min(emitted, len(path) - 1)
            spec.num_verify_rounds += 1
            spec.num_emitted_tokens += emitted
            out.advanced.append(req)
            if reason is not None:
                self.running.remove(req)
                out.finished += self._finish(req, reason)
        spec.catch_up([r for r in reqs if r.row is not None])
        self._decay_token_ratio()

    def _append_token(self, req: Req, token: int, logprob: float | None, top_lp: list[float] | None,
                      top_ids: list[int] | None) -> None:
        req.output_ids.append(token)
        if req.return_logprob and logprob is not None:
            req.output_logprobs.append(logprob)
            if req.top_logprobs_num and top_lp is not None and top_ids is not None:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(top_lp[:k], top_ids[:k])))

    # ---- after the forward --------------------------------------------------------
    def _process(self, batch: ScheduledBatch, logits: torch.Tensor, out: StepOutput) -> None:
        if batch.mode == "prefill":
            row = 0
            for req in batch.reqs:
                if req.kv_len < req.fill_len:
                    continue  # a chunk of a longer prompt: nothing to draw yet
                if req.params.max_new_tokens == 0 and not req.output_ids:
                    out.finished += self._finish(req, FinishReason(FinishKind.LENGTH))
                    row += 1
                    continue
                group = [req] + self._fork(req)
                batch.sampling_reqs += group
                batch.sampling_rows += [row] * len(group)
                row += 1
        reqs = batch.sampling_reqs
        if not reqs:
            return
        rows = torch.tensor(batch.sampling_rows, dtype=torch.int64, device=logits.device)
        picked = logits if batch.mode == "decode" else logits[rows]
        info = build_sampling_info(reqs, self.vocab_size, self.eos_ids, self.device)
        want_lp = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs), default=0)
        result = sample(picked, info, want_lp, top_k)
        next_ids = self.tp.broadcast(result.next_ids)
        ids = next_ids.tolist()
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        for i, req in enumerate(reqs):
            self._append_token(req, ids[i], lps[i] if lps else None, top_lp[i] if top_lp else None,
                               top_ids[i] if top_ids else None)
            out.advanced.append(req)
            reason = self._check_finished(req)
            if reason is not None:
                if req in self.running:
                    self.running.remove(req)
                out.finished += self._finish(req, reason)
            elif batch.mode == "prefill":
                self.running.append(req)

    def _fork(self, parent: Req) -> list[Req]:
        """Start the parent's other samples on its prompt KV: full pages are shared,
        a partial last page is copied (each sample writes its own continuation)."""
        children, parent.pending_forks = parent.pending_forks, []
        ps, n = self.page_size, parent.kv_len
        full = n // ps * ps
        if self.spec is not None:
            # The draft KV of the last prompt position depends on each sample's
            # first token: that position must live in a page of each sample's own.
            full = (n - 1) // ps * ps
        shared = self.req_table.table[parent.row, :full]
        # Cache the prompt now and lock it for every sample: whichever sample
        # finishes first must not leave shared pages counted as evictable.
        self.cache.insert(parent.fill_ids[:full], shared.cpu())
        prompt_node = self.cache.match_prefix(parent.fill_ids[:full]).node
        self.cache.lock(prompt_node)
        self.cache.unlock(parent.lock_node)
        parent.lock_node = prompt_node
        for child in children:
            assert child.row is not None
            self.req_table.table[child.row, :full] = shared
            self.allocator.retain(shared[::ps].cpu() // ps)
            if full < n:
                page = self._alloc_pages(1).to(self.device)
                dst = page * ps + torch.arange(n - full, device=self.device)
                self.kv_pool.copy_slots(dst, self.req_table.table[parent.row, full:n])
                if self.spec is not None:
                    self.spec.copy_slots(dst, self.req_table.table[parent.row, full:n])
                self.req_table.table[child.row, full:n] = dst
            child.kv_len = n
            child.draft_len = 0
            child.cached_tokens = parent.cached_tokens
            child.lock_node = prompt_node
            self.cache.lock(prompt_node)
        return children

    def _check_finished(self, req: Req) -> FinishReason | None:
        p = req.params
        token = req.output_ids[-1]
        n_out = len(req.output_ids)
        if n_out >= p.min_new_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return FinishReason(FinishKind.STOP, matched=token)
            if token in p.stop_token_ids:
                return FinishReason(FinishKind.STOP, matched=token)
            if p.stop:
                longest = max(len(s) for s in p.stop)
                tail = self.decode_text(req.output_ids[-(longest + 1):])
                for s in p.stop:
                    if s in tail:
                        return FinishReason(FinishKind.STOP, matched=s)
        if n_out >= p.max_new_tokens or req.fill_len >= self.context_len:
            return FinishReason(FinishKind.LENGTH)
        return None

    # ---- releasing ------------------------------------------------------------------
    def _finish(self, req: Req, reason: FinishReason) -> list[Req]:
        req.finish = reason
        self._release(req, cache_kv=reason.kind is not FinishKind.ABORT)
        done = [req]
        for child in req.pending_forks:  # samples that never got forked
            if child.row is not None:
                self.req_table.free(child.row)
                child.row = None
            child.finish = reason
            done.append(child)
        req.pending_forks = []
        return done

    def _release(self, req: Req, cache_kv: bool) -> None:
        if req.row is None:
            return
        if req.kv_len:
            slots = self.req_table.table[req.row, :req.kv_len].cpu()
            if cache_kv:
                self.cache.insert(req.fill_ids[:req.kv_len], slots)
            self.allocator.release(slots[::self.page_size] // self.page_size)
        self.cache.unlock(req.lock_node)
        req.lock_node = None
        self.req_table.free(req.row)
        req.row = None
        req.kv_len = 0

    # ---- inspection ---------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache; only allowed when idle (like SGLang's /flush_cache)."""
        if self.has_work:
            return False
        self.cache.reset()
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
            "context_len": self.context_len,
            "avg_spec_accept_length": self.spec.avg_accept_length if self.spec is not None else None,
        }

    def memory_state(self) -> dict[str, int]:
        return {
            "kv_pages_total": self.allocator.capacity,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_evictable": self.cache.evictable_pages,
            "req_slots_total": self.req_table.num_rows,
            "req_slots_free": self.req_table.num_free,
        }
