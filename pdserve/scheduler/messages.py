"""Wire messages into the scheduler.

Whoever drives a scheduler (the offline Engine over a pipe, the HTTP process over
ZMQ) sends a `Command`; new requests travel in it as frozen `NewRequest`s, never as
the scheduler's own mutable `Req`. Each rank builds its `Req`s from the message
(`pdserve.scheduler.req.samples_from_message`), so what crosses a process boundary is
plain immutable data and the scheduler's state stays the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Bootstrap:
    """Where the other half of one disaggregated sample lives: the prefill server's
    bootstrap registry and the room (SGLang's 63-bit `bootstrap_room`) both sides share."""
    host: str
    port: int
    room: int


@dataclass(frozen=True)
class NewRequest:
    """One prompt's request group: its `params.n` samples are prefilled once and forked."""
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seeds: tuple[int, ...]                      # one per sample, sample 0 first
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs (SGLang's logprob_start_len): -1 none, else from this prompt position
    # on (checked against the prompt by the sender).
    logprob_start_len: int = -1
    # One per sample on a prefill or decode server (every sample crosses in its own
    # room); None when colocated.
    bootstrap: tuple[Bootstrap, ...] | None = None

    def __post_init__(self) -> None:
        # A malformed message is a bug in the sender: refuse it before any rank acts on it.
        if len(self.seeds) != self.params.n:
            raise ValueError(f"NewRequest {self.rid}: {len(self.seeds)} seeds for n={self.params.n}")
        if self.bootstrap is not None and len(self.bootstrap) != self.params.n:
            raise ValueError(f"NewRequest {self.rid}: {len(self.bootstrap)} bootstrap addresses "
                             f"for n={self.params.n}")


@dataclass(frozen=True)
class Command:
    """What rank 0 receives and broadcasts to every rank."""
    add: tuple[NewRequest, ...] = ()
    abort: tuple[str, ...] = ()
    flush_cache: bool = False
    get_state: bool = False
    shutdown: bool = False

    @staticmethod
    def merge(cmds: list["Command"]) -> "Command":
        return Command(
            add=tuple(r for c in cmds for r in c.add),
            abort=tuple(a for c in cmds for a in c.abort),
            flush_cache=any(c.flush_cache for c in cmds),
            get_state=any(c.get_state for c in cmds),
            shutdown=any(c.shutdown for c in cmds),
        )
