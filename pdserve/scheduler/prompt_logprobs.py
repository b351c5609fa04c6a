"""Prompt logprobs: SGLang's ``logprob_start_len`` and OpenAI completions' ``echo`` +
``logprobs``.

The logprob of prompt token t_i is log_softmax(logits at position i-1)[t_i], of the
raw model distribution (no temperature, no penalties), as SGLang and vLLM report it;
the top-k are of the same distribution. The first prompt token has no logprob (None).

They are computed by the prefill forward, and only for the requests that ask: such a
request's forward returns logits at positions max(start, 1) - 1 .. len(prompt) - 2 as
well as its sampling position, each chunk of a chunked prefill adding its part in
order. Those positions must be computed, not served from the prefix cache, so a
request that still needs them matches the cache only up to the first of them (SGLang
does the same).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdserve.scheduler.req import Req


def pending(req: Req) -> bool:
    """Whether ``req`` asked for prompt logprobs and they are not complete yet."""
    if req.logprob_start_len < 0:
        return False
    lps = req.input_logprobs
    return lps is None or len(lps) < len(req.prompt_ids) - req.logprob_start_len


def cache_bound(req: Req) -> int | None:
    """How many leading prompt positions may come from the prefix cache (None: no bound)."""
    return max(req.logprob_start_len, 1) - 1 if pending(req) else None


def begin(req: Req) -> None:
    """Set up the lists a fresh request fills (the first prompt token's entry is None)."""
    if req.logprob_start_len < 0 or req.input_logprobs is not None:
        return
    lead: list = [None] if req.logprob_start_len == 0 else []
    req.input_logprobs = list(lead)
    req.input_top_logprobs = list(lead) if req.top_logprobs_num else None


def span(req: Req, upto: int) -> tuple[int, int]:
    """Positions [lo, hi) whose logits a prefill chunk ending at KV position ``upto``
    must return for ``req`` (empty when none): the ones not recorded yet, below upto,
    never the last prompt position (its logits draw the first output token)."""
    if not pending(req):
        return 0, 0
    assert req.input_logprobs is not None, "begin() at admission"
    s = req.logprob_start_len
    lo = max(s, 1) - 1 + len(req.input_logprobs) - (1 if s == 0 else 0)
    hi = min(upto, len(req.prompt_ids) - 1)
    return lo, max(lo, hi)


def record(reqs: Sequence[tuple[Req, int, int]], logits: torch.Tensor) -> None:
    """Append prompt logprobs to each ``(req, lo, hi)``; ``logits`` holds their positions'
    rows back to back, in that order. One device-to-host transfer for the batch."""
    targets: list[int] = []
    for req, lo, hi in reqs:
        targets += req.prompt_ids[lo + 1: hi + 1]  # position j predicts prompt token j + 1
    if not targets:
        return
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    chosen = logp.gather(1, index[:, None])[:, 0]
    k = max(r.top_logprobs_num for r, _, _ in reqs)
    if k:
        top_vals, top_ids = logp.topk(k, dim=-1)
        host = torch.cat([chosen[:, None], top_vals, top_ids.to(logp.dtype)], dim=1).tolist()
    else:
        host = chosen[:, None].tolist()
    at = 0
    for req, lo, hi in reqs:
        assert req.input_logprobs is not None
        for row in host[at: at + hi - lo]:
            req.input_logprobs.append(row[0])
            if req.input_top_logprobs is not None:
                n = req.top_logprobs_num
                req.input_top_logprobs.append([(v, int(t)) for v, t in zip(row[1:1 + n], row[1 + k:1 + k + n])])
        at += hi - lo
