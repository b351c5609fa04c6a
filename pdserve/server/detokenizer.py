"""Detokenizer process: token updates in, text deltas out.

Text is only released once it is stable: an incomplete UTF-8 character at the
end, or an ending that could be the start of a stop string, is held back until
the next tokens decide it. So the streamed deltas always concatenate to the
final (stop-trimmed) text.

The cost of an update does not grow with the output (issue 39: re-decoding the whole
output on every update cost 50 ms per token at 32k tokens):
- `IncrementalDecoder` decodes a bounded window of tokens, as SGLang and vLLM do: a few
  tokens before the read offset (the context, starting at a character boundary: decoded
  with and without the new tokens, so a tokenizer that strips a leading space or merges
  bytes treats them alike in both) and the new ones; the new text is the difference. A
  window whose text ends in U+FFFD (an incomplete UTF-8 character) waits for more
  tokens; one that keeps waiting moves on to its last complete point, and bytes that
  never form characters are split where the split provably changes nothing.
- `StopScan` keeps, per stop string, the state of a Knuth-Morris-Pratt automaton over the
  text so far: the longest ending of the text that starts the stop string (what must be
  held back) in time linear in the new text, and where each stop string first occurs
  (where the text is cut), across update boundaries, without keeping the text.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import zmq

from pdserve.sampling_params import SamplingParams
from pdserve.server import ipc
from pdserve.server.messages import TextBatch, TextUpdate, TokenBatch, TokenUpdate
from pdserve.tokenizer import load_tokenizer

REPLACEMENT = "\ufffd"
# Tokens of context decoded before the new ones (vLLM: 5): enough for a decoder to treat
# the first new token as it does inside the whole output (a leading space kept, ...).
CONTEXT_TOKENS = 5
# Tokens a window may hold past its read offset while its text ends in U+FFFD before it
# looks for a point to move on to (a UTF-8 character is at most 4 bytes: updates that
# each end inside one get there, a single character does not), how many points are tried
# (then as many more tokens wait before the next try), and past how many held tokens the
# window is cut even without a proven point (only a stream that keeps an incomplete byte
# sequence open across dozens of byte-less tokens gets there).
MAX_HELD_TOKENS = 16
SPLIT_CANDIDATES = 8
FORCE_SPLIT_TOKENS = 64


class IncrementalDecoder:
    """One sample's token stream decoded a bounded window at a time. The concatenated
    outputs of `feed` equal `tokenizer.decode(all ids)` for tokenizers whose text of a
    token sequence is the text of its bytes (character, byte-level BPE and SentencePiece
    tokenizers: `decoders.ByteLevel`, `Fuse`, `Metaspace`, `ByteFallback` on valid text)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []  # the window: ids[:read] the prefix, ids[read:] not released yet
        self.read = 0
        self.prefix_text = ""     # decode(ids[:read])
        self.released = 0         # characters of the window's text past prefix_text already released
        self.held_limit = MAX_HELD_TOKENS  # held tokens past which the window looks for a cut

    def feed(self, new_ids: Sequence[int], final: bool = False) -> tuple[str, str]:
        """The text `new_ids` complete, and the unsettled ending after it: a run of U+FFFD
        that later tokens may still turn into characters. `final`: the stream ended, all
        of its text is released (nothing unsettled)."""
        self.ids.extend(new_ids)
        n = len(self.ids)
        if self.read == n:
            return "", ""
        text = self._decode(self.ids)
        if final or not text.endswith(REPLACEMENT):
            return self._move(n, text), ""
        # Everything before the run of U+FFFD ending the text is settled: later bytes can
        # only change how an incomplete sequence at the very end decodes.
        start = len(self.prefix_text) + self.released
        settled = len(text.rstrip(REPLACEMENT))
        out = text[start:settled] if settled > start else ""
        self.released += len(out)
        if n - self.read > self.held_limit:
            # Updates that keep ending inside a character (or bytes that never form one)
            # would grow the window: it moves on to a later point.
            more = self._cut_held(text)
            if more is not None:
                rest, unsettled = self.feed(())
                return out + more + rest, unsettled
            self.held_limit = n - self.read + SPLIT_CANDIDATES  # next time, other candidates
        return out, text[start + len(out):]

    def _cut_held(self, text: str) -> str | None:
        """Moves a window that has held its last tokens for long to the last token whose
        text so far is complete (does not end in U+FFFD); bytes that never form characters
        are split where decoding the parts apart gives the window's text (for UTF-8 with
        replacement: where no character spans the cut), or in the end anywhere. Returns
        the text released, None when the window stays."""
        n = len(self.ids)
        candidates = range(n - 1, max(self.read, n - 1 - SPLIT_CANDIDATES), -1)
        for cut in candidates:
            head = self._decode(self.ids[:cut])
            if not head.endswith(REPLACEMENT):
                return self._move(cut, head)
        if n - self.read <= FORCE_SPLIT_TOKENS:
            return None
        for cut in candidates:
            head = self._decode(self.ids[:cut])
            if head + self._decode(self.ids[cut:]) == text:
                break
        else:
            cut = n - 4  # unproven: keep the last tokens, which could still be one character
            head = self._decode(self.ids[:cut])
        return self._move(cut, head, context=False)

    def _move(self, read: int, head: str, context: bool = True) -> str:
        """Releases the window's text up to token `read` (`head`: its decode) and starts
        the next window there. Its context, the tokens decoded before the new ones, is a
        few tokens starting at a character boundary (their text does not start with U+FFFD
        and ends `head`), else the tokens since the previous read offset (where the text
        released before ended). Without `context` the window starts bare at `read`."""
        start = len(self.prefix_text) + self.released
        cut = read
        prefix_text = ""
        if context:
            for cut in range(max(0, read - CONTEXT_TOKENS), read):
                prefix_text = self._decode(self.ids[cut:read])
                if not prefix_text.startswith(REPLACEMENT) and head.endswith(prefix_text):
                    break
            else:
                cut = self.read
                prefix_text = self._decode(self.ids[cut:read])
        del self.ids[:cut]
        self.read = read - cut
        self.prefix_text = prefix_text
        self.released = max(0, start - len(head))  # the next window's text released already
        self.held_limit = MAX_HELD_TOKENS
        return head[start:]


@functools.lru_cache(maxsize=256)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP prefix function: [i] is the length of the longest proper prefix of stop[:i+1]
    that is also its suffix."""
    pi = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = pi[k - 1]
        if stop[i] == stop[k]:
            k += 1
        pi[i] = k
    return tuple(pi)


def _advance(stop: str, pi: tuple[int, ...], state: int, text: str) -> int:
    """The automaton's state after `text`: the length of the longest ending of everything
    read that is a prefix of `stop` (len(stop): it ends with the whole stop string)."""
    m = len(stop)
    for c in text:
        if state == m:
            state = pi[m - 1]
        while state and stop[state] != c:
            state = pi[state - 1]
        if stop[state] == c:
            state += 1
    return state


def _proper(stop: str, pi: tuple[int, ...], state: int) -> int:
    """The longest ending that is a proper prefix of `stop` (a whole stop string is the
    scheduler's business, not a reason to wait)."""
    return pi[-1] if state == len(stop) else state


class StopScan:
    """Where a growing text stands against its stop strings, updated in time linear in
    the new text (per stop string)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.tables = [_borders(s) for s in self.stops]
        self.states = [0] * len(self.stops)
        self.first_end: list[int | None] = [None] * len(self.stops)  # end of each one's first occurrence
        self.length = 0   # characters read
        self.tail = ""    # the last characters read (enough to see a stop string span two pieces)
        self.keep = max(len(s) for s in self.stops)

    def feed(self, text: str) -> None:
        if not text:
            return
        joined = self.tail + text
        base = self.length - len(self.tail)  # position of joined[0] in the whole text
        for i, (stop, pi) in enumerate(zip(self.stops, self.tables)):
            m = len(stop)
            if self.first_end[i] is None:  # an occurrence ending in the new piece, searched at C speed
                at = joined.find(stop, max(0, len(self.tail) - m + 1))
                if at >= 0:
                    self.first_end[i] = base + at + m
            # The state depends on the last m characters only: a long piece restarts from
            # them, a short one steps on from the state so far.
            self.states[i] = (_advance(stop, pi, 0, joined[-m:]) if len(text) >= m
                              else _advance(stop, pi, self.states[i], text))
        self.length += len(text)
        self.tail = joined[-self.keep:]

    def hold(self) -> int:
        """How many trailing characters of the text read could begin a stop string."""
        return max(_proper(s, pi, q) for s, pi, q in zip(self.stops, self.tables, self.states))

    def first(self, stop: str) -> int | None:
        """Where `stop` first occurs in the text read (None: nowhere, or not a stop string here)."""
        for s, end in zip(self.stops, self.first_end):
            if s == stop:
                return None if end is None else end - len(s)
        return None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` must wait: a partial character, or
    the longest ending that is a proper prefix of some stop string."""
    hold = len(text) - len(text.rstrip(REPLACEMENT))
    if stops:
        scan = StopScan(stops)
        scan.feed(text)
        hold = max(hold, scan.hold())
    return hold


@dataclass
class _Sample:
    params: SamplingParams
    decoder: IncrementalDecoder
    scan: StopScan | None
    emitted: int = 0   # characters already sent
    pending: str = ""  # settled text not sent yet (a possible stop string's start)


class Detokenizer:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.samples: dict[tuple[str, int], _Sample] = {}

    def process(self, update: TokenUpdate) -> TextUpdate:
        key = (update.rid, update.index)
        sample = self.samples.get(key)
        if sample is None:
            p = update.params or SamplingParams()
            sample = _Sample(p, IncrementalDecoder(self.tokenizer, p.skip_special_tokens),
                             StopScan(p.stop) if p.stop else None)
            self.samples[key] = sample
        p = sample.params
        finish = update.finish
        settled, unsettled = sample.decoder.feed(update.new_ids, final=finish is not None)
        if sample.scan is not None:
            sample.scan.feed(settled)
        rest = sample.pending + settled
        if finish is not None:
            del self.samples[key]
            matched = finish.get("matched")
            if isinstance(matched, str) and not p.no_stop_trim:
                # Cut where the stop string first occurs (nothing more when that was sent already).
                at = sample.scan.first(matched) if sample.scan is not None else None
                if at is None:
                    found = rest.find(matched)
                    at = None if found < 0 else sample.emitted + found
                if at is not None:
                    rest = rest[:max(0, at - sample.emitted)]
            return TextUpdate(update, rest)
        # Unsettled characters may still become anything, the end of a stop string included:
        # what could start one before them waits with them.
        hold = len(unsettled) + (sample.scan.hold() if sample.scan is not None else 0)
        stable = len(rest) + len(unsettled) - hold
        delta, sample.pending = (rest[:stable], rest[stable:]) if stable > 0 else ("", rest)
        sample.emitted += len(delta)
        return TextUpdate(update, delta)


def run_detokenizer_process(tokenizer_dir: Path, paths: ipc.IpcPaths, ready: Connection,
                            log_level: str = "info", label: str = "server") -> None:
    from pdserve import logs
    from pdserve.server.scheduler_process import die_with_parent

    die_with_parent()
    logs.set_process_title("detokenizer", label)
    logs.configure(log_level, label)
    try:
        detok = Detokenizer(load_tokenizer(tokenizer_dir))
        ctx = zmq.Context()
        inbox = ipc.socket(ctx, zmq.PULL, paths.detokenizer, bind=True)
        to_http = ipc.socket(ctx, zmq.PUSH, paths.http, bind=False)
    except Exception as exc:
        ready.send(("error", repr(exc)))
        raise
    ready.send(("ready", {"pid": os.getpid()}))
    while True:
        batch: TokenBatch = ipc.loads(inbox.recv())
        out = TextBatch(tuple(detok.process(u) for u in batch.updates))
        to_http.send(ipc.dumps(out))
