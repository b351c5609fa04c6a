"""Prompt logprobs across the split: prefill computes them (it is the server that runs
the prompt), decode answers the request, so the router copies prefill's prompt
logprobs into decode's answer when the client asked for them.

A decode server answers the prompt's part empty: /generate's `input_token_logprobs` /
`input_top_logprobs` as `[]` (what SGLang's router, which concatenates prefill's and
decode's lists, expects), the echoed prompt's completions logprobs as nulls. This merge
only fills what decode left empty.
"""

from __future__ import annotations

from typing import Any

# SGLang's native prompt-logprob fields (meta_info of /generate).
GENERATE_PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def wants_prompt_logprobs(route: str, body: dict[str, Any]) -> bool:
    if route == "/generate":
        start = body.get("logprob_start_len")
        return bool(body.get("return_logprob")) and isinstance(start, int) and start >= 0
    if route == "/v1/completions":
        return bool(body.get("echo")) and body.get("logprobs") is not None
    return False  # chat has no prompt logprobs


def results_by_index(route: str, payload: Any) -> dict[int, dict[str, Any]]:
    """Index -> result object (a /generate result or a completions choice) of a response
    body or of one streamed event; later ones win (streams carry logprobs on the last)."""
    out: dict[int, dict[str, Any]] = {}
    if route == "/generate":
        items = payload if isinstance(payload, list) else [payload]
        for pos, item in enumerate(items):
            if isinstance(item, dict):
                out[item.get("index", pos) if isinstance(item.get("index"), int) else pos] = item
    elif isinstance(payload, dict):
        for pos, choice in enumerate(payload.get("choices") or ()):
            if isinstance(choice, dict):
                out[choice.get("index", pos) if isinstance(choice.get("index"), int) else pos] = choice
    return out


def _fill(dst: list[Any], src: list[Any]) -> None:
    for i in range(min(len(dst), len(src))):
        if dst[i] is None and src[i] is not None:
            dst[i] = src[i]


def merge_prompt_logprobs(route: str, payload: Any, prefill: dict[int, dict[str, Any]]) -> set[int]:
    """Fill `payload`'s (decode's answer or one streamed event) missing prompt logprobs
    from prefill's results, in place. Returns the indices that were merged."""
    merged: set[int] = set()
    for idx, item in results_by_index(route, payload).items():
        src = prefill.get(idx)
        if src is None:
            continue
        if route == "/generate":
            meta, pmeta = item.get("meta_info"), src.get("meta_info")
            if isinstance(meta, dict) and isinstance(pmeta, dict):
                for key in GENERATE_PROMPT_KEYS:
                    if not meta.get(key) and pmeta.get(key):
                        meta[key] = pmeta[key]
                merged.add(idx)
        else:
            lp, plp = item.get("logprobs"), src.get("logprobs")
            if isinstance(lp, dict) and isinstance(plp, dict):
                # Echoed prompt positions come first; decode leaves their values null.
                for key in ("token_logprobs", "top_logprobs"):
                    if isinstance(lp.get(key), list) and isinstance(plp.get(key), list):
                        _fill(lp[key], plp[key])
                merged.add(idx)
    return merged
