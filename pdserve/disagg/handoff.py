"""What the prefill and decode sides share: one record per PD request, the table of
them, the TP ranks' agreement on their rooms, and the KV layout this rank publishes
for transfers.

A disaggregated request (one sample: every sample has its own bootstrap room) is a
``Handoff`` while its side of the protocol still has work with it: its room, its
phase, and what the phase needs (the prefill server's address, the positions already
queued for transfer, the pages held after a failure). On a prefill server that is
until its room ends (the transfer succeeded or failed). On a decode server it is
until the commit (from then on the request is decoded from the scheduler's queues
like any other), or, after a failure, until its quarantined pages are freed. The
phases are the side's own steps, named apart from the room's ``RoomState``.

On a prefill server the samples of one request (n > 1) share one prompt
computation: the first live sample carries the others as ``pending_forks`` (they
wait as AWAITING_PROMPT), and when its prompt is complete they are forked from it
(``KVManager.fork``: shared full pages, a copied partial page, their own first
tokens) and each is sent to its own room (FORKED until decode has said where).
"""

from __future__ import annotations

import base64
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from pdserve.disagg import protocol as P
from pdserve.disagg.layout import (PROTOCOL_VERSION, BufferSpec, CompatRecord, HeadRange, KVLayout, feature_slice,
                                   kv_head_range)
from pdserve.disagg.staging import HostStaging, choose_staging
from pdserve.disagg.transfer import TransferEngine
from pdserve.model.parallel import TPGroup
from pdserve.scheduler.req import FinishKind, FinishReason, Req
from pdserve.speculative.eagle_worker import CarriedState

if TYPE_CHECKING:
    from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    # prefill server
    AWAITING_DESTINATION = "awaiting_destination"  # waiting for decode to say where the KV goes
    COMPUTING = "computing"          # being prefilled (waiting or chunked); KV sent as it is written
    INFLIGHT = "inflight"            # first token drawn, record queued behind the last write
    AWAITING_PROMPT = "awaiting_prompt"  # n > 1: another sample of the request computes the prompt
    FORKED = "forked"                # n > 1: forked with its first token; waits for decode's room
    # decode server
    QUEUED = "queued"                # connecting to its prefill server / waiting for KV room
    RECEIVING = "receiving"          # KV reserved and asked for; waiting for the record
    QUARANTINED = "quarantined"      # failed; its pages wait until no write can still land


class Readiness(enum.IntEnum):
    """A handoff's condition as one TP rank sees it. The ranks act on the minimum over
    ranks, so a request moves on only when every rank is ready and fails when any rank
    failed (the ranks' schedulers must stay identical: they share no other state)."""
    FAILED = 0
    WAITING = 1
    DONE = 2


@dataclass(eq=False)
class Handoff:
    req: Req
    room: int
    phase: Phase
    peer_url: str = ""                    # decode: the prefill server's bootstrap address
    sent: int = 0                         # prefill: prompt positions queued for transfer
    bootstrapped: bool = False            # prefill: every rank agreed decode said where the KV goes
    first_position: int = 0               # decode: prompt positions served from its own prefix cache
    draft_state: bool = False             # decode: starts from prefill's draft state (no draft prefill here)
    landing_offset: int = -1              # decode: its piece of the landing area (-1: written into its slots)
    landing_regions: tuple = ()           # decode: that piece's regions (landing.LandingRegion)
    held_pages: torch.Tensor | None = None  # decode, quarantined: pages kept out of use
    release_at: float = 0.0               # decode, quarantined: freed then at the latest


class HandoffTable:
    """The live handoffs of one scheduler by room, in arrival order (the same order on
    every TP rank: they receive the same commands)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._by_room: dict[int, Handoff] = {}

    def add(self, h: Handoff) -> None:
        assert h.room not in self._by_room
        self._by_room[h.room] = h

    def remove(self, h: Handoff) -> None:
        del self._by_room[h.room]

    def get(self, room: int | None) -> Handoff | None:
        return self._by_room.get(room) if room is not None else None

    def __contains__(self, room: int) -> bool:
        return room in self._by_room

    def __iter__(self) -> Iterator[Handoff]:
        return iter(list(self._by_room.values()))

    def __len__(self) -> int:
        return len(self._by_room)

    def count(self, phase: Phase) -> int:
        return sum(1 for h in self._by_room.values() if h.phase is phase)

    def agree(self, readiness: Callable[[Handoff], Readiness]) -> list[tuple[Handoff, Readiness]]:
        """Every handoff with its readiness agreed by all TP ranks (one collective)."""
        items = list(self._by_room.values())
        codes = [int(self._safely(readiness, h)) for h in items]
        if self.tp.enabled and codes:
            codes = self.tp.all_reduce_min(torch.tensor(codes, dtype=torch.int64)).tolist()
        return [(h, Readiness(c)) for h, c in zip(items, codes)]


    @staticmethod
    def _safely(readiness: Callable[[Handoff], Readiness], h: Handoff) -> Readiness:
        """A handoff whose state cannot be read is failed (its phase's failure path ends
        it), never the step."""
        try:
            return readiness(h)
        except Exception:
            logger.exception("room %d: reading its transfer state failed", h.room)
            return Readiness.FAILED


def add_pd_state(st: dict[str, object], mode: str, waiting: int, running: int, manager: Any,
                 **extra: object) -> dict[str, object]:
    """A PD scheduler's state(): its handoffs counted as waiting or running requests, and
    the transfer manager's rooms and refused control messages."""
    st["num_waiting_reqs"] += waiting  # type: ignore[operator]
    st["num_running_reqs"] += running  # type: ignore[operator]
    st["disaggregation"] = {"mode": mode, **extra, "rooms": manager.rooms.counts(),
                            "failures": dict(manager.rooms.failures), "peers_lost": manager.peers_lost,
                            "refused_messages": manager.refused_messages,
                            "control_addr": manager.control_addr}
    return st


def split_samples(sched: "Scheduler", req: Req) -> list[Req]:
    """A request's n samples, each in its own room. Decode runs each on its own;
    prefill computes the prompt once (sample 0 keeps the others as pending forks),
    draws each one's first token from the same logits as a colocated fork (sampling
    noise depends on the sample's seed and position only) and sends each room the
    whole prompt KV.

    With max_new_tokens 0 there is nothing to hand over: each side ends the request on
    arrival with `length` and no token, as a colocated server does (no room is opened),
    and this returns []."""
    samples = [req] + req.pending_forks
    if req.params.max_new_tokens != 0:
        return samples
    req.pending_forks = []
    for s in samples:
        s.finish = FinishReason(FinishKind.LENGTH)
    sched.queues.ending.extend(samples)
    return []


def compat_record(sched: "Scheduler") -> CompatRecord:
    cfg, runner = sched.runner.config, sched.runner
    spec = sched.spec
    return CompatRecord(
        protocol_version=PROTOCOL_VERSION, architecture=cfg.architecture, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype=str(runner.kv_dtype).replace("torch.", ""),
        page_size=sched.page_size, vocab_size=cfg.vocab_size, kv_scales=runner.kv_scales.digest(),
        speculative_algorithm=spec.algorithm if spec is not None else None,
        feature_width=spec.config.feature_width if spec is not None else 0, tp_size=sched.tp.size,
        draft_identity=spec.identity if spec is not None else "", eagle_topk=spec.topk if spec is not None else 0)


def draft_state_message(state: CarriedState) -> P.DraftState:
    """A request's carried draft state as the handoff record carries it."""
    hidden = state.hidden.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return P.DraftState(tuple(state.topk_p.tolist()), tuple(int(i) for i in state.topk_index.tolist()),
                        base64.b64encode(hidden).decode())


def carried_state(msg: P.DraftState) -> CarriedState:
    """The inverse of ``draft_state_message`` (float32 on the host; the worker checks the
    shapes against its draft and moves it to its device and dtype)."""
    hidden = torch.frombuffer(bytearray(base64.b64decode(msg.hidden, validate=True)), dtype=torch.float32)
    return CarriedState(torch.tensor(msg.topk_p, dtype=torch.float32), torch.tensor(msg.topk_index, dtype=torch.int64),
                        hidden)


def transfer_staging(sched: "Scheduler", engine: TransferEngine) -> HostStaging | None:
    """Host twins of the transfer buffers when ``engine`` cannot reach the device's
    memory (``--disaggregation-kv-staging``); None: the buffers are registered as they are."""
    mode = choose_staging(sched.args.disaggregation_kv_staging, sched.device, engine.reaches_device_memory)
    logger.info("KV transfer: %s", "device buffers registered directly" if mode == "direct" else
                "staged through host copies of the KV buffers")
    return HostStaging() if mode == "host" else None


def buffer_spec(name: str, t: torch.Tensor, staging: HostStaging | None, heads: HeadRange | None = None,
                receives: HeadRange | None = None) -> BufferSpec:
    """A transfer buffer as the engine sees it: ``t`` itself, or its host twin."""
    if staging is not None:
        t = staging.twin(name, t)
    return BufferSpec(name, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size(), heads, receives)


def feature_elements(pool: torch.Tensor) -> HeadRange:
    """A feature pool's row as a "head" range of single elements (the unit a decode
    rank's slice is cut in: BufferSpec.receives)."""
    return HeadRange(0, pool.shape[1], pool.shape[1])


def transfer_buffers(sched: "Scheduler", with_features: bool) -> dict[str, torch.Tensor]:
    """This rank's device buffers a transfer moves, by name: the target KV and, with a
    draft, the draft KV (``draft.L{i}.K/V``) and (``with_features``) the target-feature pool."""
    out = dict(sched.kv.kv_pool.buffers())
    spec = sched.spec
    if spec is not None:
        out.update(spec.draft_pool.buffers())
        if with_features:
            out["features"] = spec.features
    return out


def kv_layout(sched: "Scheduler", staging: HostStaging | None, with_features: bool) -> KVLayout:
    """The named buffers of this rank (``transfer_buffers``): target KV (head-sharded) and,
    with a draft, the draft KV (head-sharded like the target's) and the target-feature
    pool (one full row per slot on every rank, of which this rank receives its slice:
    ``feature_slice``); their host twins when staged."""
    buffers = transfer_buffers(sched, with_features)
    if staging is not None:  # all twins at once: the host must hold them together
        staging.twins(buffers)
    spec = sched.spec
    target = kv_head_range(sched.runner.config.num_kv_heads, sched.tp.rank, sched.tp.size)
    draft = (kv_head_range(spec.config.layer.num_kv_heads, sched.tp.rank, sched.tp.size) if spec is not None
             else None)
    width = spec.config.feature_width if spec is not None else 0
    specs = []
    for name, t in buffers.items():
        if name == "features":
            specs.append(buffer_spec(name, t, staging, feature_elements(t),
                                     feature_slice(width, sched.tp.rank, sched.tp.size)))
        else:
            specs.append(buffer_spec(name, t, staging, draft if name.startswith("draft.") else target))
    return KVLayout(sched.page_size, tuple(specs))


def register_buffers(engine: object, layout: KVLayout) -> None:
    for b in layout.buffers:
        engine.register(b.ptr, b.num_slots * b.slot_bytes)  # type: ignore[attr-defined]
