"""When a request's output ends: its stop conditions and, for a constrained one, its
grammar (which also ends an output on the grammar's own stop token, even with
``ignore_eos``). The decode strategies ask it after every token they emit, since a
speculative round may stop in the middle of an accepted path."""

from __future__ import annotations

from typing import Callable

from pdserve.scheduler.req import FinishKind, FinishReason, Req, stop_reason


class StopCheck:
    def __init__(self, eos_ids: tuple[int, ...], context_len: int, decode_text: Callable[[list[int]], str]) -> None:
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.decode_text = decode_text

    def __call__(self, req: Req) -> FinishReason | None:
        """Why ``req`` stops after its last output token (None: it goes on)."""
        reason = stop_reason(req, self.eos_ids, self.context_len, self.decode_text)
        grammar = req.grammar
        if grammar is None or reason is not None and reason.kind is not FinishKind.LENGTH:
            return reason
        ended = grammar.advance(req.output_ids)
        if grammar.rejected is not None:
            return FinishReason(FinishKind.ABORT, server_error=True,
                                message=f"internal error: token {grammar.rejected} left the output's grammar")
        return FinishReason(FinishKind.STOP, matched=req.output_ids[-1]) if ended and reason is None else reason
