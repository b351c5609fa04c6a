"""Response bodies built from what a request produced, apart from any HTTP concern.

`native_result` is SGLang's /generate result (text, output_ids, meta_info); the
HTTP server and the offline `Engine` both build theirs with it, from a
`SampleOutput` taken from whichever record they hold (the HTTP process's
`SampleResult`, the Engine's finished `Req`). The OpenAI pieces (finish reason,
usage, logprobs) are here too so the route modules only assemble them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from pdserve.scheduler.req import Req
    from pdserve.server.request_state import RequestState, SampleResult

TopLogprobs = Sequence[Sequence[tuple[float, int]]]  # per output token: (logprob, token id) best first
# Per prompt token from logprob_start_len on; the first prompt token's entries are None.
PromptLogprobs = Sequence["float | None"]
PromptTopLogprobs = Sequence["Sequence[tuple[float, int]] | None"]


@dataclass(frozen=True)
class SampleOutput:
    """One sample's output so far (complete once `finish` is set)."""
    rid: str
    prompt_tokens: int
    text: str
    output_ids: Sequence[int]
    finish: Mapping[str, Any] | None           # FinishReason.to_dict()
    cached_tokens: int
    retractions: int
    spec_verify_ct: int                        # 0 without speculative decoding
    spec_accepted_drafts: int
    logprobs: Sequence[float] | None           # None: not asked for
    top_logprobs: TopLogprobs | None           # None: not asked for
    # Prompt logprobs: `logprob_start_len` -1 when not asked for; the values None when
    # asked but computed elsewhere (a decode server: its prefill peer has them).
    prompt_ids: Sequence[int] = ()
    logprob_start_len: int = -1
    input_logprobs: PromptLogprobs | None = None
    input_top_logprobs: PromptTopLogprobs | None = None

    @classmethod
    def of_req(cls, req: "Req", text: str) -> "SampleOutput":
        """From a finished scheduler request (the Engine decodes `text` itself)."""
        return cls(rid=req.rid, prompt_tokens=len(req.prompt_ids), text=text, output_ids=req.output_ids,
                   finish=req.finish.to_dict() if req.finish is not None else None,
                   cached_tokens=req.cached_tokens, retractions=req.retractions,
                   spec_verify_ct=req.spec_verify_ct, spec_accepted_drafts=req.spec_accepted_drafts,
                   logprobs=req.output_logprobs if req.return_logprob else None,
                   top_logprobs=req.output_top_logprobs if req.top_logprobs_num else None,
                   prompt_ids=req.prompt_ids, logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                   input_logprobs=req.input_logprobs, input_top_logprobs=req.input_top_logprobs)

    @classmethod
    def of_sample(cls, state: "RequestState", s: "SampleResult") -> "SampleOutput":
        """From what the HTTP process has received for sample `s` of `state`."""
        return cls(rid=state.rid, prompt_tokens=len(state.prompt_ids), text=s.text, output_ids=s.output_ids,
                   finish=s.finish, cached_tokens=s.cached_tokens, retractions=s.retractions,
                   spec_verify_ct=s.spec_verify_ct, spec_accepted_drafts=s.spec_accepted_drafts,
                   logprobs=s.logprobs if state.return_logprob else None,
                   top_logprobs=s.top_logprobs if state.top_logprobs_num else None,
                   prompt_ids=state.prompt_ids,
                   logprob_start_len=state.logprob_start_len if state.return_logprob else -1,
                   input_logprobs=s.input_logprobs, input_top_logprobs=s.input_top_logprobs)


def native_result(out: SampleOutput, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """SGLang's result object; logprob entries are (logprob, token id, token text), the
    text None unless ``token_text`` is given (SGLang's return_text_in_logprobs)."""
    def entry(lp: float | None, t: int) -> tuple[float | None, int, str | None]:
        return lp, t, token_text(t) if token_text is not None else None

    finish = dict(out.finish) if out.finish is not None else None
    if finish is not None and finish.get("type") == "length":
        finish["length"] = len(out.output_ids)  # SGLang says how long the output got
    meta: dict[str, Any] = {
        "id": out.rid, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens, "finish_reason": finish, "retractions": out.retractions,
    }
    if out.spec_verify_ct:
        meta["spec_verify_ct"] = out.spec_verify_ct
        meta["spec_accepted_drafts"] = out.spec_accepted_drafts
    if out.logprobs is not None:
        meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(out.logprobs, out.output_ids)]
    if out.top_logprobs is not None:
        meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in step] for step in out.top_logprobs]
    if out.logprob_start_len >= 0:
        # Empty where this server did not run the prompt (decode of a PD pair): SGLang's
        # router and pdserve's fill them from the prefill server's answer.
        lps = out.input_logprobs or ()
        meta["input_token_logprobs"] = [entry(lp, t) for lp, t in zip(lps, out.prompt_ids[out.logprob_start_len:])]
        if out.top_logprobs is not None:
            meta["input_top_logprobs"] = [None if step is None else [entry(lp, t) for lp, t in step]
                                          for step in (out.input_top_logprobs or ())]
    return {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}


# ---- OpenAI ------------------------------------------------------------------------------
def openai_finish(finish: Mapping[str, Any] | None) -> str | None:
    if finish is None:
        return None
    return {"stop": "stop", "length": "length"}.get(finish.get("type", ""), "abort")


def usage(states: Sequence["RequestState"]) -> dict[str, Any]:
    """Usage of the prompts of one HTTP request. A prompt's cached tokens count once:
    its samples share the prompt's prefill."""
    prompt = sum(len(st.prompt_ids) for st in states)
    completion = sum(len(s.output_ids) for st in states for s in st.samples)
    cached = sum(st.samples[0].cached_tokens for st in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenTexts:
    """Text of single tokens, decoded once each: logprob entries name every token, and
    the same few thousand tokens come back again and again."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token])
        return text


def completion_logprobs(texts: TokenTexts, ids: Sequence[int], lps: Sequence[float],
                        tops: TopLogprobs | None, offset: int) -> dict[str, Any]:
    """OpenAI's completions logprobs; `offset` is where the first token starts in the
    choice's text, each next token starts where the previous one's text ends."""
    tokens = [texts(t) for t in ids]
    return {"tokens": tokens, "token_logprobs": list(lps),
            "top_logprobs": [{texts(t): lp for lp, t in step} for step in tops] if tops
            else [None] * len(ids),
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
            if tokens else []}


def echo_logprobs(texts: TokenTexts, prompt_ids: Sequence[int], lps: PromptLogprobs | None,
                  tops: PromptTopLogprobs | None) -> dict[str, Any]:
    """The echoed prompt's part of completions logprobs (computed from prompt position 0),
    offsets from the start of the text as vLLM counts them: the first token's logprob and
    top entry null, as OpenAI's; every value null where the prompt ran on another server
    (a decode server of a PD pair: the router fills them from the prefill server's answer)."""
    tokens = [texts(t) for t in prompt_ids]
    n = len(tokens)
    return {"tokens": tokens, "token_logprobs": list(lps) if lps is not None else [None] * n,
            "top_logprobs": [None if step is None else {texts(t): lp for lp, t in step} for step in tops]
            if tops is not None else [None] * n,
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []}


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive runs of completions logprobs as one (the prompt's, the output's)."""
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(texts: TokenTexts, ids: Sequence[int], lps: Sequence[float],
                  tops: TopLogprobs | None) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`."""
    out = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        tok = texts(t)
        top = [{"token": texts(tt), "logprob": tlp, "bytes": list(texts(tt).encode())}
               for tlp, tt in (tops[i] if tops else ())]
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
    return out
