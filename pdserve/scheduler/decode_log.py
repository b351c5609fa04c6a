"""The scheduler's periodic decode line (SGLang's ``--decode-log-interval``):

    Decode batch. #running-req: 8, #queue-req: 0, #token: 4,210 / 111,400 (3.78%),
    gen throughput (token/s): 812.4, accept len: 3.21

every ``--decode-log-interval`` decode steps, from TP rank 0 only. The numbers are the
scheduler's ``state()``, the dict ``/metrics`` sets its gauges from
(``pdserve:num_running_reqs``, ``pdserve:num_queue_reqs``, ``pdserve:token_usage``,
``pdserve:avg_spec_accept_length``), so the line and the metrics never disagree; the
throughput is the tokens decode steps gained since the previous line over the time since
it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

logger = logging.getLogger("pdserve.scheduler")


class DecodeLog:
    """Counts decode steps and their tokens; every ``interval`` steps, one line."""

    def __init__(self, interval: int, page_size: int, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] | None = None) -> None:
        if interval < 1:
            raise ValueError(f"--decode-log-interval: must be >= 1, got {interval}")
        self.interval = interval
        self.page_size = page_size
        self.clock = clock
        self.emit = emit if emit is not None else logger.info
        self.steps = 0               # decode steps since the last line
        self.tokens = 0              # tokens those steps gained
        self.since: float | None = None  # when the first of them ran (or the last line was written)

    def step(self, tokens: int, state: Callable[[], dict[str, Any]]) -> None:
        """One decode step (a plain step or a speculative round) that gained ``tokens``;
        ``state`` gives the scheduler's numbers when a line is due (passed per call, not
        kept: a scheduler holding a log that holds the scheduler would outlive its
        shutdown until the cycle collector ran)."""
        now = self.clock()
        if self.since is None:
            self.since = now
        self.steps += 1
        self.tokens += tokens
        if self.steps >= self.interval:
            self.emit(self.line(state(), self.tokens / max(now - self.since, 1e-9)))
            self.steps, self.tokens, self.since = 0, 0, now

    def line(self, st: dict[str, Any], throughput: float) -> str:
        mem = st["memory"]
        total = mem["kv_pages_total"] * self.page_size
        text = (f"Decode batch. #running-req: {st['num_running_reqs']}, #queue-req: {st['num_waiting_reqs']}, "
                f"#token: {st['num_used_tokens']:,} / {total:,} ({100 * st['token_usage']:.2f}%), "
                f"gen throughput (token/s): {throughput:.1f}")
        accept = st.get("avg_spec_accept_length")
        if accept is not None:
            text += f", accept len: {accept:.2f}"
        return text
