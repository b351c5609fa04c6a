"""What the HTTP process holds of one request while it runs, and the updates waiting for
its consumer: the per-sample results (`SampleResult`, `RequestState`), the bounded queue
an HTTP request's updates arrive on (`Updates`, merging what a slow reader has not
taken) and the prompts of one HTTP request (`Job`).

Split from tokenizer_manager.py, which submits requests and routes the scheduler's and
detokenizer's messages to these: this is the data the routes and results read, with no
sockets or processes behind it (tests build it directly).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.sampling_params import SamplingParams
from pdserve.server.messages import TextUpdate


@dataclass
class SampleResult:
    """What one sample has produced so far."""
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[float, int], ...]] = field(default_factory=list)
    # Prompt logprobs as the scheduler computed them (None: not asked, or computed by the
    # prefill server of a PD pair)
    input_logprobs: tuple[float | None, ...] | None = None
    input_top_logprobs: tuple[tuple[tuple[float, int], ...] | None, ...] | None = None
    finish: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0


@dataclass
class RequestState:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[SampleResult]
    queue: Updates  # shared by every prompt of one HTTP request
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish is not None for s in self.samples)


class _Merged:
    """The updates of one sample its consumer has not taken yet, as one: the deltas
    (text, tokens, logprobs) concatenated, the counters and finish of the latest, the
    once-only fields (sampling params, prompt logprobs) of the first that had them."""

    def __init__(self, state: RequestState, update: TextUpdate) -> None:
        self.state = state
        self.first = self.last = update
        # Filled at the second update (most samples never get one: a reading client
        # takes each update before the next arrives).
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[tuple[float, int], ...]] = []

    def add(self, update: TextUpdate) -> None:
        if self.last is self.first:
            self._extend(self.first)
        self._extend(update)
        self.last = update

    def _extend(self, update: TextUpdate) -> None:
        self.texts.append(update.text_delta)
        self.ids.extend(update.token.new_ids)
        self.logprobs.extend(update.token.new_logprobs)
        self.tops.extend(update.token.new_top_logprobs)

    def update(self) -> TextUpdate:
        if self.last is self.first:
            return self.first
        first, last = self.first.token, self.last.token
        with_input = first if first.input_logprobs is not None else last
        token = replace(last, new_ids=tuple(self.ids), new_logprobs=tuple(self.logprobs),
                        new_top_logprobs=tuple(self.tops), params=first.params or last.params,
                        finish=last.finish if last.finish is not None else first.finish,
                        input_logprobs=with_input.input_logprobs, input_top_logprobs=with_input.input_top_logprobs)
        return TextUpdate(token, "".join(self.texts))


class Updates:
    """What one job's consumer has not taken yet: at most one pending update per sample.

    A stream is read as fast as its client takes it; a client that reads slowly or not at
    all must not make the server queue one update per step (with logprobs, kilobytes each)
    without bound. An update for a sample whose previous one is still pending is merged
    into it (`_Merged`): the consumer gets the same text and tokens in fewer, larger
    deltas, as SGLang's tokenizer manager hands a slow stream the latest state. Pending
    memory is then bounded by what the samples produce (which the request's state holds
    anyway), not by how many steps produced it. A failure (str) comes after what is pending.
    Duck-types the part of asyncio.Queue the manager uses (put_nowait, get)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], _Merged] = {}  # (id(state), sample) -> merged, oldest first
        self._failure: str | None = None
        self._ready = asyncio.Event()

    def put_nowait(self, item: tuple[RequestState, TextUpdate] | str) -> None:
        if isinstance(item, str):
            if self._failure is None:
                self._failure = item
        else:
            state, update = item
            key = (id(state), update.token.index)
            merged = self._pending.get(key)
            if merged is None:
                self._pending[key] = _Merged(state, update)
            else:
                merged.add(update)
        self._ready.set()

    async def get(self) -> tuple[RequestState, TextUpdate] | str:
        while not self._pending and self._failure is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending:
            merged = self._pending.pop(next(iter(self._pending)))
            return merged.state, merged.update()
        assert self._failure is not None
        return self._failure

    def qsize(self) -> int:
        """Items a get() would return without waiting (one per sample with updates pending)."""
        return len(self._pending) + (self._failure is not None)


@dataclass
class Job:
    """The prompts of one HTTP request and the queue their updates arrive on."""
    states: list[RequestState]
    queue: Updates
    # rid -> position of the prompt's first sample in the flat list of samples
    _first: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = itertools.accumulate((len(st.samples) for st in self.states[:-1]), initial=0)
        self._first = {st.rid: start for st, start in zip(self.states, starts)}

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def flat_index(self, state: RequestState, sample: int) -> int:
        """Where sample `sample` of `state` is among all the job's samples, prompt by
        prompt (the order of a batch's results; SGLang's and OpenAI's `index`)."""
        return self._first[state.rid] + sample
