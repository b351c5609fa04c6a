"""Detokenizer process: token updates in, text deltas out.

Text is only released once it is stable: an incomplete UTF-8 character at the
end, or an ending that could be the start of a stop string, is held back until
the next tokens decide it. So the streamed deltas always concatenate to the
final (stop-trimmed) text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

from pdserve.sampling_params import SamplingParams
from pdserve.server import ipc
from pdserve.server.messages import TextBatch, TextUpdate, TokenBatch, TokenUpdate
from pdserve.tokenizer import load_tokenizer, trim_at_stop


@dataclass
class _Sample:
    params: SamplingParams
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters already sent


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` must wait: a partial character, or
    the longest ending that is a proper prefix of some stop string."""
    hold = 0
    if text.endswith("\ufffd"):
        hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


class Detokenizer:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.samples: dict[tuple[str, int], _Sample] = {}

    def process(self, update: TokenUpdate) -> TextUpdate:
        key = (update.rid, update.index)
        sample = self.samples.get(key)
        if sample is None:
            sample = _Sample(update.params or SamplingParams())
            self.samples[key] = sample
        sample.ids.extend(update.new_ids)
        p = sample.params
        text = self.tokenizer.decode(sample.ids, skip_special_tokens=p.skip_special_tokens)  # type: ignore[attr-defined]
        if update.finish is not None:
            matched = update.finish.get("matched")
            final = trim_at_stop(text, matched if isinstance(matched, str) else None, p.no_stop_trim)
            delta = final[sample.emitted:]
            del self.samples[key]
        else:
            stable = len(text) - held_back(text, p.stop)
            delta = text[sample.emitted:stable] if stable > sample.emitted else ""
            sample.emitted = max(sample.emitted, stable)
        return TextUpdate(update, delta)


def run_detokenizer_process(tokenizer_dir: Path, paths: ipc.IpcPaths, ready: Connection) -> None:
    from pdserve.server.scheduler_process import die_with_parent

    die_with_parent()
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
