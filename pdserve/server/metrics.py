"""Prometheus metrics of one server (its own registry: no process-global state)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("pdserve:num_running_reqs", "Requests being decoded or prefilled", registry=r)
        self.queued = Gauge("pdserve:num_queue_reqs", "Requests waiting for admission", registry=r)
        self.token_usage = Gauge("pdserve:token_usage", "Fraction of KV pages in use", registry=r)
        self.cache_hit_rate = Gauge("pdserve:cache_hit_rate",
                                    "Fraction of prompt tokens served from the prefix cache", registry=r)
        self.spec_accept_length = Gauge(
            "pdserve:avg_spec_accept_length",
            "Speculative decoding: tokens emitted per verify round (accepted drafts + 1); 0 when off", registry=r)
        self.pd_queue = Gauge("pdserve:disagg_queue_reqs", "Prefill/decode requests per transfer state",
                              ["state"], registry=r)
        self.pd_transfer_bytes = Gauge("pdserve:kv_transfer_bytes_total",
                                       "Bytes written (prefill server) or received in committed transfers "
                                       "(decode server), TP rank 0's, by kind: target_kv, draft_kv, features "
                                       "(per-position target features a decode draft reads), metadata (the "
                                       "handoff record)", ["kind"], registry=r)
        self.pd_draft_prefill = Gauge("pdserve:decode_draft_prefill_tokens_total",
                                      "Decode server: prompt positions its draft model ran over at commit "
                                      "(prefill work on the decode side)", registry=r)
        self.pd_prefix_hits = Gauge("pdserve:decode_prefix_hit_tokens_total",
                                    "Decode server: prompt tokens served from its own prefix cache instead of "
                                    "transferred", registry=r)
        self.pd_landed = Gauge("pdserve:decode_landed_requests_total",
                               "Decode server: requests whose scattered KV slots received their transfer "
                               "through the landing area (packed, then copied into the slots)", registry=r)
        self.pd_transfer_seconds = Gauge("pdserve:kv_transfer_seconds", "Time spent in KV writes", registry=r)
        self.pd_failures = Gauge("pdserve:disagg_failures", "Failed transfer rooms by reason", ["reason"],
                                 registry=r)
        self.pd_refused = Gauge("pdserve:disagg_refused_messages",
                                "PD control messages dropped unread (unsigned, forged, replayed, malformed)",
                                registry=r)
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("pdserve:requests", "Finished requests by outcome", ["finish"], registry=r)

    def update_state(self, state: dict[str, Any]) -> None:
        self.running.set(state["num_running_reqs"])
        self.queued.set(state["num_waiting_reqs"])
        self.token_usage.set(state["token_usage"])
        self.cache_hit_rate.set(state["cache_hit_rate"])
        self.spec_accept_length.set(state.get("avg_spec_accept_length") or 0.0)
        pd = state.get("disaggregation")
        if pd:
            for name in ("bootstrapping", "inflight", "queued", "transferring"):
                if name in pd:
                    self.pd_queue.labels(name).set(pd[name])
            for room_state, n in pd["rooms"].items():
                self.pd_queue.labels(f"room_{room_state}").set(n)
            for reason, n in pd["failures"].items():
                self.pd_failures.labels(reason).set(n)
            for kind, n in pd.get("transfer_bytes_by_kind", {}).items():
                self.pd_transfer_bytes.labels(kind).set(n)
            if "draft_prefill_tokens" in pd:
                self.pd_draft_prefill.set(pd["draft_prefill_tokens"])
            if "prefix_hit_tokens" in pd:
                self.pd_prefix_hits.set(pd["prefix_hit_tokens"])
            if "landing" in pd:
                self.pd_landed.set(pd["landing"]["landed_requests"])
            self.pd_refused.set(pd.get("refused_messages", 0))
            self.pd_transfer_seconds.set(pd.get("transfer_seconds", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
