"""What one scheduler step runs and what it produced: the batch, the sampler's
batched inputs built from requests, the drawn tokens, the step's output."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from pdserve.model import device_io
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ForwardInput
from pdserve.model.sampler import (Penalties, PenaltyRows, SampleOutput, SamplingInfo, make_sampling_info,
                                   row_key, sample)
from pdserve.scheduler.grammar import new_bitmask
from pdserve.scheduler.req import FinishReason, Req


class Drawable(Protocol):
    """What the sampler reads of a request (a Req, or a view of one mid-round). A view
    that also has ``base`` (the Req) and ``extra_ids`` (its tokens past the Req's
    output) gets its penalties from the Req's device state instead of from scratch."""
    params: Any
    seed: int
    num_output_tokens: int

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def fill_ids(self) -> list[int]: ...


@dataclass
class StepOutput:
    advanced: list[Req] = field(default_factory=list)  # drew a token this step
    finished: list[Req] = field(default_factory=list)  # finished this step (incl. aborts)


@dataclass
class ScheduledBatch:
    """What the scheduler decided to run this step."""
    mode: str                   # prefill | decode | verify (a speculative round)
    reqs: list[Req]             # rows of the forward, in order
    forward: ForwardInput
    # Requests that draw a token this step, and which logits row each uses.
    sampling_reqs: list[Req] = field(default_factory=list)
    sampling_rows: list[int] = field(default_factory=list)
    tree: Any = None            # verify: the draft tree (speculative.eagle_worker.DraftTree)


@dataclass
class Gain:
    """What a step gave one request, as the phase that ran it reports it: its new tokens
    are appended to it already; only the scheduler acts on ``stop`` (finishing it, or
    keeping it in the running batch)."""
    req: Req
    stop: FinishReason | None
    joining: bool = False   # its first token since a prefill: it joins the running batch
    drew: bool = True       # False: it ended without a token (a scored prompt, max_new_tokens 0)


@dataclass(frozen=True)
class Draws:
    """Tokens drawn for a list of rows, with their logprobs when asked, as host lists."""
    ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None

    @staticmethod
    def pack(result: SampleOutput, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[R, C] float64 columns of ``result`` (only ``rows``, when given), for one
        device-to-host read: id, logprob when computed, top logprobs, top ids (ids
        < 2^31 are exact)."""
        cols = [result.next_ids.unsqueeze(1)]
        if result.logprobs is not None:
            cols.append(result.logprobs.unsqueeze(1))
        if result.top_logprobs is not None and result.top_ids is not None:
            cols += [result.top_logprobs, result.top_ids]
        packed = torch.cat([c.double() for c in cols], dim=1)
        return packed if rows is None else packed[rows]

    @classmethod
    def unpack(cls, rows: list[list[float]], result: SampleOutput) -> "Draws":
        """From the host rows of ``pack(result)``."""
        logprobs = result.logprobs is not None
        top_k = result.top_logprobs.shape[1] if result.top_logprobs is not None else 0
        first_top = 2 if logprobs else 1
        return cls([int(r[0]) for r in rows],
                   [r[1] for r in rows] if logprobs else None,
                   [r[first_top:first_top + top_k] for r in rows] if top_k else None,
                   [[int(t) for t in r[first_top + top_k:first_top + 2 * top_k]] for r in rows] if top_k else None)

    def append_to(self, req: Req, i: int) -> None:
        """Emit row ``i``'s token as ``req``'s next output token."""
        req.output_ids.append(self.ids[i])
        if req.return_logprob and self.logprobs is not None:
            req.output_logprobs.append(self.logprobs[i])
            if req.top_logprobs_num and self.top_logprobs is not None and self.top_ids is not None:
                k = req.top_logprobs_num
                req.output_top_logprobs.append(list(zip(self.top_logprobs[i][:k], self.top_ids[i][:k])))


class Sampler:
    """Draws a scheduler's tokens: its vocabulary, stop ids and TP group, and the device
    penalty state of the requests it draws for (made on first use, dropped once no
    request with penalties holds a slot)."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...], device: torch.device,
                 tp: TPGroup = TPGroup()) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.device = device
        self.tp = tp
        self.book: _PenaltyBook | None = None

    def draw(self, logits: torch.Tensor, rows: Sequence[Drawable], owners: Sequence[Req]) -> Draws:
        """Sample one token per logits row; ``rows`` say what each row's request looks like
        at that position, ``owners`` which requests ask for logprobs. Rank 0's draw is
        broadcast so every TP rank emits the same token. The one device-to-host read:
        ids, chosen logprobs and top logprobs packed into one float64 transfer (ids
        < 2^31 are exact)."""
        info = self.sampling_info(rows)
        want_lp = any(r.return_logprob for r in owners)
        top_k = max((r.top_logprobs_num for r in owners), default=0)
        result = sample(logits, info, want_lp, top_k)
        result.next_ids = self.tp.broadcast(result.next_ids)
        return Draws.unpack(device_io.fetch(Draws.pack(result)), result)

    def tree_drawable(self, reqs: Sequence[Req]) -> bool:
        """Whether ``draw_tree`` serves these requests: no grammar (its state along a
        path lives in a host matcher)."""
        return all(r.grammar is None for r in reqs)

    def draw_tree(self, logits: torch.Tensor, reqs: Sequence[Req], tree_tokens: torch.Tensor,
                  ancestors: torch.Tensor, depths: torch.Tensor) -> SampleOutput:
        """Draw every node of a speculative tree on the device: logits row ``b * N + j`` is
        request ``b``'s node ``j`` ([B, N] ``tree_tokens`` and ``depths``; ``ancestors``
        [B, N, N] marks each node's ancestors and itself), drawn exactly as plain
        decoding draws output position ``len(output) + depth`` after emitting the
        node's path: same parameters and seeded noise, penalties counting the path's
        tokens, min-token bans by position. Nothing is read back; rank 0's ids are
        broadcast. Only for requests ``tree_drawable`` accepts."""
        b, nodes = depths.shape
        ps = [r.params for r in reqs]

        def per_node(values: list) -> list:
            return [v for v in values for _ in range(nodes)]
        info = make_sampling_info(per_node([p.temperature for p in ps]), per_node([p.top_p for p in ps]),
                                  per_node([p.top_k for p in ps]), per_node([p.min_p for p in ps]),
                                  [0] * (b * nodes), self.vocab_size, self.device)
        seeds, starts, min_new = device_io.upload_rows(
            [[r.seed for r in reqs], [r.num_output_tokens for r in reqs], [p.min_new_tokens for p in ps]],
            torch.int64, self.device)
        positions = starts.unsqueeze(1) + depths  # [B, N] the output position each node draws
        info.keys = row_key(seeds.repeat_interleave(nodes), positions.reshape(-1))
        if any(p.needs_penalties for p in ps):
            info.penalties = self._tree_penalties(reqs, tree_tokens, ancestors)
        else:
            self._drop_idle_penalty_state()
        if any(r.num_output_tokens < p.min_new_tokens for r, p in zip(reqs, ps)):
            before_min = (positions < min_new.unsqueeze(1)).reshape(-1, 1)
            info.banned = self.stop_bans(reqs).repeat_interleave(nodes, dim=0) & before_min
        result = sample(logits, info, any(r.return_logprob for r in reqs),
                        max((r.top_logprobs_num for r in reqs), default=0))
        result.next_ids = self.tp.broadcast(result.next_ids)
        return result

    def _tree_penalties(self, reqs: Sequence[Req], tree_tokens: torch.Tensor, ancestors: torch.Tensor
                        ) -> Penalties:
        """Each request's penalty state (its committed output) repeated per node, plus
        the tokens of the node's path below the root (the root is the last committed
        token), counted on the device."""
        base = self.penalties(reqs)
        b, nodes = tree_tokens.shape
        v = self.vocab_size
        committed = base.output_counts.repeat_interleave(nodes, dim=0)
        counts = committed.clone()
        # Node j's path holds node a (a >= 1) where ancestors[b, j, a]: count tokens[b, a] in row b * N + j.
        row = torch.arange(b * nodes, device=counts.device).view(b, nodes, 1)
        flat = (row * v + tree_tokens.unsqueeze(1))[:, :, 1:].reshape(-1)
        on_path = ancestors[:, :, 1:].reshape(-1)
        counts.view(-1).index_add_(0, flat, on_path.to(counts.dtype))
        seen = base.seen.repeat_interleave(nodes, dim=0) | (counts > committed)
        return Penalties(repetition=base.repetition.repeat_interleave(nodes, dim=0),
                         frequency=base.frequency.repeat_interleave(nodes, dim=0),
                         presence=base.presence.repeat_interleave(nodes, dim=0), output_counts=counts, seen=seen)

    def _drop_idle_penalty_state(self) -> None:
        """A draw without penalties: finished requests' rows go back, and the device state
        with them once no request holds one."""
        if self.book is not None:
            self.book.release_finished()
            if not self.book.held:
                self.book = None

    def stop_bans(self, reqs: Sequence[Drawable]) -> torch.Tensor:
        """[R, V] bool: the stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``)
        of every row still short of its ``min_new_tokens``."""
        vocab_size, device = self.vocab_size, self.device
        banned = []
        for i, r in enumerate(reqs):
            p = r.params
            if r.num_output_tokens < p.min_new_tokens:
                # The request's set is built once (SamplingParams.stop_token_set), not per row and step.
                ids = p.stop_token_set if p.ignore_eos else p.stop_token_set.union(self.eos_ids)
                banned += [i * vocab_size + t for t in ids if t < vocab_size]
        flat = torch.zeros(len(reqs) * vocab_size, dtype=torch.bool, device=device)
        if banned:
            flat.index_fill_(0, device_io.upload(banned, torch.int64, device), True)
        return flat.view(len(reqs), vocab_size)

    def sampling_info(self, reqs: Sequence[Drawable]) -> SamplingInfo:
        """The sampler's inputs for ``reqs`` from their Python values: O(rows) scalar work
        plus the tokens each request produced since its last draw; uploads only, no
        device read."""
        vocab_size, device = self.vocab_size, self.device
        ps = [r.params for r in reqs]
        info = make_sampling_info([p.temperature for p in ps], [p.top_p for p in ps], [p.top_k for p in ps],
                                  [p.min_p for p in ps], [row_key(r.seed, r.num_output_tokens) for r in reqs],
                                  vocab_size, device)
        if any(p.needs_penalties for p in ps):
            info.penalties = self.penalties(reqs)
        else:
            self._drop_idle_penalty_state()
        if any(r.num_output_tokens < r.params.min_new_tokens for r in reqs):
            info.banned = self.stop_bans(reqs)
        info.allowed = self.grammar_masks(reqs)
        return info

    def grammar_masks(self, reqs: Sequence[Drawable]) -> torch.Tensor | None:
        """[R, ceil(V / 32)] int32 packed masks of the tokens each row's grammar allows
        (every bit set on unconstrained rows); None when no row is constrained."""
        bits: torch.Tensor | None = None
        for i, row in enumerate(reqs):
            base, path = _committed(row)
            if base is None or base.grammar is None:
                continue
            if bits is None:
                bits = new_bitmask(len(reqs), self.vocab_size)
            base.grammar.fill(bits, i, base.output_ids, path)
        return None if bits is None else device_io.upload_tensor(bits, self.device)

    def penalties(self, reqs: Sequence[Drawable]) -> Penalties:
        """Penalty inputs of ``reqs``: exactly what counting every row's output and marking
        its prompt and output gives, from state kept on the device (rows without
        penalties read the all-zero slot 0)."""
        if self.book is None:
            self.book = _PenaltyBook(self.vocab_size, self.device)
        return _penalties(self.book, reqs, self.device)


# ---- penalty state ----------------------------------------------------------------------------
# Each request with penalties keeps a row of a PenaltyRows on the device: its prompt
# marked once, its committed output counted as it grows (one batched scatter per
# step for the tokens drawn since). A row of the batch that is a view of a request
# in the middle of a speculative round names that request as ``base`` and its
# tokens past the request's output as ``extra_ids``: those are counted on top for
# this draw only. A row naming neither is counted from scratch in a slot lent for
# this draw. Draws of one process run on one thread.

@dataclass(eq=False)
class _Counted:
    """What a request's slot holds: ``prompt`` marked, ``output[:n]`` counted."""
    slot: int
    prompt: list[int]
    output: list[int]
    n: int = 0
    last: int = -1  # output[n - 1]

    def holds(self, req: Req) -> bool:
        """Still a prefix of ``req``'s output (a truncated or replaced one is not)."""
        out = req.output_ids
        return (self.prompt is req.prompt_ids and self.output is out and self.n <= len(out)
                and (self.n == 0 or out[self.n - 1] == self.last))


class _PenaltyBook:
    """Which slot of the device rows holds which request (a Sampler's)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.rows = PenaltyRows(vocab, device)
        self.held: weakref.WeakKeyDictionary[Req, _Counted] = weakref.WeakKeyDictionary()
        self.free: list[int] = list(range(self.rows.capacity - 1, 0, -1))
        self.lent: list[int] = []  # slots used from scratch by the current draw

    def release_finished(self) -> None:
        for req, counted in list(self.held.items()):
            if req.finished:
                del self.held[req]
                self.free.append(counted.slot)

    def take_slot(self) -> int:
        if not self.free:
            # Slots of requests collected without finishing come back first.
            used = {c.slot for c in self.held.values()}.union(self.lent)
            self.free = [s for s in range(self.rows.capacity - 1, 0, -1) if s not in used]
        if not self.free:
            old = self.rows.capacity
            self.rows.grow(2 * old)
            self.free = list(range(2 * old - 1, old - 1, -1))
        return self.free.pop()


def _committed(row: Drawable) -> tuple[Req | None, Sequence[int]]:
    """The request whose committed output ``row`` extends, and the tokens past it."""
    if isinstance(row, Req):
        return row, ()
    base, extra = getattr(row, "base", None), getattr(row, "extra_ids", None)
    return (base, extra) if isinstance(base, Req) and extra is not None else (None, ())


def _penalties(book: _PenaltyBook, reqs: Sequence[Drawable], device: torch.device) -> Penalties:
    v = book.rows.vocab
    book.release_finished()
    slots = [0] * len(reqs)
    reset: list[int] = []
    marks: list[int] = []    # slot * V + token: seen
    counted: list[int] = []  # slot * V + token: counted and seen
    extra: list[int] = []    # row * V + token: counted and seen in this draw only
    done: dict[int, int] = {}

    def fill(slot: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        reset.append(slot)
        marks.extend(slot * v + t for t in prompt if 0 <= t < v)
        counted.extend(slot * v + t for t in output if 0 <= t < v)

    for i, row in enumerate(reqs):
        if not row.params.needs_penalties:
            continue
        base, more = _committed(row)
        if base is None:
            slot = book.take_slot()
            book.lent.append(slot)
            out, whole = row.output_ids, row.fill_ids
            fill(slot, whole[:len(whole) - len(out)], out)
        elif id(base) in done:
            slot = done[id(base)]
        else:
            out = base.output_ids
            c = book.held.get(base)
            if c is None or not c.holds(base):
                c = book.held[base] = _Counted(c.slot if c is not None else book.take_slot(),
                                               base.prompt_ids, out)
                fill(c.slot, c.prompt, out)
            else:
                counted.extend(c.slot * v + t for t in out[c.n:] if 0 <= t < v)
            c.n, c.last = len(out), (out[-1] if out else -1)
            slot = done[id(base)] = c.slot
        extra.extend(i * v + t for t in more if 0 <= t < v)
        slots[i] = slot

    lists = (slots, reset, marks, counted, extra)
    ints = device_io.upload([t for part in lists for t in part], torch.int64, device)
    slot_t, reset_t, marks_t, counted_t, extra_t = (
        part_t if part else None for part, part_t in zip(lists, ints.split([len(x) for x in lists])))
    book.rows.update(reset_t, marks_t, counted_t)
    counts, seen = book.rows.gather(slot_t, extra_t)
    book.free += book.lent  # (their rows were copied out above; later writes come after on the stream)
    book.lent.clear()
    ps = [r.params for r in reqs]
    cols = device_io.upload([*(p.repetition_penalty for p in ps), *(p.frequency_penalty for p in ps),
                             *(p.presence_penalty for p in ps)], torch.float32, device)
    rep, freq, pres = cols.view(3, len(reqs), 1)
    return Penalties(repetition=rep, frequency=freq, presence=pres, output_counts=counts, seen=seen)
