"""What a server resolved at startup, said once: the summary line its HTTP process logs
when the scheduler reports ready, and the resolved values ``/get_server_info`` shows in
place of the flags' ``auto`` / unset defaults (the speculative shape the server picked,
the attention backend that runs, the KV pool's size, the KV staging mode).

The values come from TP rank 0's ``Scheduler.settings()`` (its ready report)."""

from __future__ import annotations

from typing import Any

from pdserve.config import ServerArgs

# server_args fields whose "auto" the settings resolve.
_AUTO_FIELDS = ("device", "dtype", "kv_cache_dtype", "disaggregation_kv_staging")
# server_args fields whose None (derived) the settings fill in.
_DERIVED_FIELDS = ("max_total_tokens", "context_length")


def summary_line(args: ServerArgs, settings: dict[str, Any]) -> str:
    """One line: device, dtype, attention backend, KV pool (tokens, bytes, page size),
    context, speculative shape, PD transfer (backend, staging), TP size."""
    s = settings
    kv = f"KV pool {s['max_total_tokens']:,} tokens ({_size(s['kv_pool_bytes'])}, page size {s['page_size']}"
    kv += f", {s['kv_cache_dtype']})" if s["kv_cache_dtype"] != s["dtype"] else ")"
    shape = s["speculative_shape"]
    if shape is None:
        spec = "speculative off"
    else:
        how = "flags" if args.speculative_num_steps is not None else "default"
        spec = (f"speculative {args.speculative_algorithm} num_steps {shape[0]}, eagle_topk {shape[1]}, "
                f"num_draft_tokens {shape[2]} ({how})")
    if args.disaggregation_mode == "null":
        pd = "PD transfer off (colocated)"
    else:
        pd = (f"PD {args.disaggregation_mode}: transfer {args.disaggregation_transfer_backend}, "
              f"KV staging {s['disaggregation_kv_staging']}")
    return (f"device {s['device']}, dtype {s['dtype']}, attention {s['attention_backend']}, {kv}, "
            f"context {s['context_length']:,}, {spec}, {pd}, TP {s['tp_size']}")


def resolved_server_args(server_args: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``server_args`` (``dataclasses.asdict`` of the flags) with what the server chose
    in place of what it was left to choose: the "auto"s, the derived sizes, the attention
    backend that runs (SGLang's kernel names run as auto), the speculative shape."""
    out = dict(server_args)
    for name in _AUTO_FIELDS:
        if out.get(name) == "auto" and settings.get(name) is not None:
            out[name] = settings[name]
    for name in _DERIVED_FIELDS:
        if out.get(name) is None:
            out[name] = settings[name]
    out["attention_backend"] = settings["attention_backend"]
    shape = settings.get("speculative_shape")
    if shape is not None:
        (out["speculative_num_steps"], out["speculative_eagle_topk"],
         out["speculative_num_draft_tokens"]) = shape
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
