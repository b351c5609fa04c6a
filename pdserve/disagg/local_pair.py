"""A prefill and a decode scheduler in one process, wired through their transfer
managers over ``LocalTransfer`` (real ZMQ control sockets, in-process copies of the
KV): what the PD tests and the GPU check drive, without servers or Mooncake."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Callable

from pdserve.config import ServerArgs
from pdserve.disagg.transfer import LocalTransfer
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import Req, samples_from_message
from pdserve.tokenizer import load_tokenizer


def build_side(cls: type, model_dir: str | Path, args: dict[str, Any], tokenizer_dir: str | Path | None = None,
               **kw: Any) -> Any:
    """A prefill_scheduler or decode_scheduler (``cls``) on ``model_dir`` with ServerArgs
    ``args`` and its own LocalTransfer; ``kw`` goes to the scheduler (a decode side's
    ``fetch_ranks``)."""
    server_args = ServerArgs(model_path=str(model_dir), **args)
    runner = ModelRunner(server_args, Path(model_dir), TPGroup())
    tok = load_tokenizer(tokenizer_dir or model_dir)
    return cls(server_args, runner, lambda ids: tok.decode(ids, skip_special_tokens=False), LocalTransfer(), **kw)


def give_rooms(prefill_samples: list[Req], decode_samples: list[Req], salt: int = 0) -> None:
    """One bootstrap room per sample, the same on both sides."""
    for rp, rd in zip(prefill_samples, decode_samples):
        room = random.getrandbits(62) + salt
        for r in (rp, rd):
            r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, room


def run_pair(p: Any, d: Any, prompts: list[list[int]], sampling: dict[str, Any], timeout: float = 60.0,
             logprob_start_len: int = -1, between: Callable[[], None] | None = None,
             prefill_done: dict[tuple[str, int], Req] | None = None) -> list[Req]:
    """Send every prompt through the pair, each sample in its own room; the decode
    side's samples once all ended (each exactly once) and prefill holds nothing more.
    ``between`` runs after each prefill step; ``prefill_done`` collects the samples
    prefill ended, by (rid, sample index)."""
    builder = RequestBuilder(None, 1 << 20, 1 << 30, 64, 0)
    params = SamplingParams.from_dict(sampling)
    logprobs = logprob_start_len >= 0
    done: dict[tuple[str, int], Req] = {}
    p_done = prefill_done if prefill_done is not None else {}
    dec_reqs: list[Req] = []
    for i, ids in enumerate(prompts):
        gp, gd = (samples_from_message(builder.group(ids, params, logprobs, 0, rid=f"r{i}",
                                                     logprob_start_len=logprob_start_len)) for _ in range(2))
        give_rooms(gp, gd, salt=i)
        p.add(gp[0])
        d.add(gd[0])
        dec_reqs += gd
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in p.step().finished:
            assert (r.rid, r.sample_index) not in p_done, "a prefill sample ended twice"
            p_done[(r.rid, r.sample_index)] = r
        if between is not None:
            between()
        for r in d.step().finished:
            assert (r.rid, r.sample_index) not in done, "a request ended twice"
            done[(r.rid, r.sample_index)] = r
        if len(done) == len(dec_reqs) and not p.has_work:
            break
        time.sleep(0.001)  # control messages travel on their own threads
    assert len(done) == len(dec_reqs), "requests did not finish"
    return [done[(r.rid, r.sample_index)] for r in dec_reqs]
