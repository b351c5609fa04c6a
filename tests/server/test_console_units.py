"""What a server says about itself, in process (the end-to-end side is
tests/server/test_console.py):

- `--decode-log-interval N`: a line every N decode steps from the scheduler itself, with
  the numbers its `state()` gives /metrics; 0 or negative refused naming the flag;
- the startup summary and /get_server_info's resolved values (`Scheduler.settings()`);
- the CPU KV pool: what the server can use (max running requests x context), capped by
  the (smaller) default budget;
- one line format (pdserve/logs.py), and the drain a second Ctrl-C cuts short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from pdserve import logs
from pdserve.config import ConfigError, ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.decode_log import DecodeLog
from pdserve.scheduler.memory import TokenToKVPool
from pdserve.scheduler.memory_budget import size_kv_pages
from pdserve.scheduler.scheduler import Scheduler
from pdserve.server.drain import Drain
from pdserve.server.startup_summary import resolved_server_args, summary_line
from pdserve.up import graceful_timeout
from tests.scheduler.test_step_faults import requests, run

pytestmark = pytest.mark.fast

LINE = re.compile(r"Decode batch\. #running-req: (\d+), #queue-req: (\d+), #token: ([\d,]+) / ([\d,]+) "
                  r"\(([\d.]+)%\), gen throughput \(token/s\): ([\d.]+)(?:, accept len: ([\d.]+))?$")


# ---- --decode-log-interval ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3])
def test_decode_log_interval_below_one_is_refused_naming_the_flag(bad):
    with pytest.raises(ConfigError, match="--decode-log-interval: must be >= 1"):
        ServerArgs(decode_log_interval=bad)
    with pytest.raises(ConfigError, match="--decode-log-interval"):
        ServerArgs.from_cli(["--decode-log-interval", str(bad)])
    assert ServerArgs.from_cli(["--decode-log-interval", "7"]).decode_log_interval == 7
    assert ServerArgs().decode_log_interval == 40  # SGLang's default


def test_the_scheduler_logs_every_interval_decode_steps(llama_dir, caplog):
    args = ServerArgs(model_path=str(llama_dir), max_total_tokens=2048, chunked_prefill_size=-1,
                      decode_log_interval=4)
    sched = Scheduler(args, ModelRunner(args, llama_dir, TPGroup()), lambda ids: "")
    for group in requests(3, max_new=10):
        sched.add(group[0])
    with caplog.at_level(logging.INFO, logger="pdserve.scheduler"):
        run(sched)
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.scheduler"]
    # 3 requests prefilled together, then 9 decode steps each gaining one token per request.
    assert sched.num_decode_steps == 9
    assert len(lines) == 9 // 4, lines
    for line in lines:
        m = LINE.match(line)
        assert m, line
        running, queued, used, total, pct, throughput, accept = m.groups()
        assert (int(running), int(queued)) == (3, 0)
        assert int(total.replace(",", "")) == 2048
        assert float(pct) == pytest.approx(100 * int(used.replace(",", "")) / 2048, abs=0.01)
        assert float(throughput) > 0 and accept is None  # no speculation: no accept length


def test_decode_log_numbers_are_the_state_metrics_read():
    """The line's numbers are `state()`'s (what /metrics' gauges are set from); the
    throughput is the tokens of the interval's steps over its time; with speculation the
    accept length is the state's."""
    state = {"num_running_reqs": 5, "num_waiting_reqs": 2, "num_used_tokens": 1234, "token_usage": 1234 / 4096,
             "memory": {"kv_pages_total": 256}, "avg_spec_accept_length": 3.214}
    now = [100.0]
    lines: list[str] = []
    log = DecodeLog(3, page_size=16, clock=lambda: now[0], emit=lines.append)
    for tokens in (5, 15, 10):  # steps at t = 100, 101, 102: 30 tokens over the 2 s since the first
        log.step(tokens, lambda: state)
        now[0] += 1.0
    assert lines == ["Decode batch. #running-req: 5, #queue-req: 2, #token: 1,234 / 4,096 (30.13%), "
                     "gen throughput (token/s): 15.0, accept len: 3.21"]
    for tokens in (8, 8, 8):  # t = 103..105: counted from the previous line (t = 102)
        log.step(tokens, lambda: state)
        now[0] += 1.0
    assert lines[1].endswith("gen throughput (token/s): 8.0, accept len: 3.21"), lines


# ---- what the server resolved ---------------------------------------------------------------
def test_settings_and_summary_say_what_the_server_resolved(llama_dir):
    args = ServerArgs(model_path=str(llama_dir), max_total_tokens=1000, page_size=4)
    sched = Scheduler(args, ModelRunner(args, llama_dir, TPGroup()), lambda ids: "")
    s = sched.settings()
    cfg = sched.runner.config
    assert s["device"] == "cpu" and s["dtype"] == "float32" and s["attention_backend"] == "torch_native"
    assert s["max_total_tokens"] == 1000 and s["page_size"] == 4
    per_token = TokenToKVPool.bytes_per_token(cfg.num_layers, sched.runner.num_local_kv_heads, cfg.head_dim,
                                              torch.float32)
    assert s["kv_pool_bytes"] == (1000 + 4) * per_token  # + the padding page
    assert (s["speculative_shape"], s["disaggregation_kv_staging"], s["tp_size"]) == (None, None, 1)
    line = summary_line(args, s)
    assert line == (f"device cpu, dtype float32, attention torch_native, KV pool 1,000 tokens "
                    f"({(1004 * per_token) / 2**20:.1f} MiB, page size 4), context {s['context_length']:,}, "
                    "speculative off, PD transfer off (colocated), TP 1")
    resolved = resolved_server_args(dataclasses.asdict(args), s)
    assert (resolved["device"], resolved["dtype"], resolved["kv_cache_dtype"], resolved["attention_backend"]) == \
        ("cpu", "float32", "float32", "torch_native")
    assert resolved["context_length"] == s["context_length"] and resolved["max_total_tokens"] == 1000


def test_the_speculative_shape_the_server_picked_is_reported_not_none(tmp_path):
    """/get_server_info shows the shape a server without the shape flags picked."""
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path),
                      disaggregation_mode="decode")
    settings = {"device": "cpu", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "attention_backend": "triton",
                "max_total_tokens": 65536, "kv_pool_bytes": 3 << 30, "page_size": 16, "context_length": 8192,
                "speculative_shape": (3, 1, 4), "disaggregation_kv_staging": "host", "tp_size": 2}
    resolved = resolved_server_args(dataclasses.asdict(args), settings)
    assert (resolved["speculative_num_steps"], resolved["speculative_eagle_topk"],
            resolved["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert resolved["disaggregation_kv_staging"] == "host" and resolved["attention_backend"] == "triton"
    line = summary_line(args, settings)
    assert "speculative EAGLE num_steps 3, eagle_topk 1, num_draft_tokens 4 (default)" in line, line
    assert "KV pool 65,536 tokens (3.00 GiB, page size 16)" in line, line
    assert line.endswith("PD decode: transfer mooncake, KV staging host, TP 2"), line


def test_the_default_eagle_shape_is_the_chain_for_llama_targets():
    # docs/benchmarks.md: (3, 1, 4) ahead of (5, 4, 8) at batch 1, 8 and 32.
    assert ServerArgs().speculative_shape("LlamaForCausalLM") == (3, 1, 4)
    assert ServerArgs().speculative_shape("Qwen3ForCausalLM") == (3, 1, 4)


# ---- the CPU KV pool ----------------------------------------------------------------------------
def demo_runner() -> SimpleNamespace:
    """The demo model's KV shape: 4 layers, 4 KV heads of 32, float32 (4 KiB a token)."""
    return SimpleNamespace(config=SimpleNamespace(num_layers=4, head_dim=32), num_local_kv_heads=4,
                           kv_dtype=torch.float32, device=torch.device("cpu"), context_len=2048)


def test_the_cpu_kv_pool_is_what_the_server_can_use_capped_by_the_budget():
    per_token = TokenToKVPool.bytes_per_token(4, 4, 32, torch.float32)
    # Default budget (0.5 GiB x 0.85): the cap for 256 requests of 2048 tokens (2 GiB).
    pages = size_kv_pages(ServerArgs(device="cpu"), demo_runner(), TPGroup())  # type: ignore[arg-type]
    assert pages - 1 == int(0.5 * 2**30 * 0.85) // per_token == 111411
    assert (pages - 1) * per_token < 0.45 * 2**30  # was 2 GiB resident with the old 4 GiB default
    # Fewer requests: only what they can hold, whatever the budget.
    pages = size_kv_pages(ServerArgs(device="cpu", max_running_requests=8, cpu_kv_budget_gb=4.0),
                          demo_runner(), TPGroup())  # type: ignore[arg-type]
    assert pages - 1 == 8 * 2048


# ---- one format -------------------------------------------------------------------------------
def test_every_line_is_labelled_in_one_format():
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r" decode TP0\] Decode batch\.", logs.format_line("decode TP0", "Decode batch."))
    assert re.fullmatch(stamp + r" router\] WARNING: gone",
                        logs.format_line("router", "gone", level=logging.WARNING))
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/v1/completions", "1.1", 200), None)
    assert re.fullmatch(stamp + r' prefill\] 127\.0\.0\.1:5 - "POST /v1/completions HTTP/1\.1" 200',
                        logs.LabelFormatter("prefill").format(record))
    assert logs.tp_label("decode", 1) == "decode TP1"


def test_a_servers_label_is_its_role_unless_up_names_it(monkeypatch):
    monkeypatch.delenv(logs.LABEL_ENV, raising=False)
    assert [logs.server_label(m) for m in ("null", "prefill", "decode")] == ["server", "prefill", "decode"]
    monkeypatch.setenv(logs.LABEL_ENV, "prefill-1")
    assert logs.server_label("prefill") == "prefill-1"


def test_up_stops_the_servers_within_their_drain_deadline():
    assert graceful_timeout([]) == ServerArgs.graceful_shutdown_timeout
    assert graceful_timeout(["--page-size", "16", "--graceful-shutdown-timeout", "5"]) == 5.0
    assert graceful_timeout(["--graceful-shutdown-timeout=2.5"]) == 2.5


# ---- a second Ctrl-C --------------------------------------------------------------------------
class _InFlight:
    """One request that never finishes unless aborted."""

    def __init__(self) -> None:
        self.live = 1
        self.reasons: list[str] = []

    def in_flight_requests(self) -> int:
        return self.live

    async def abort_all(self, reason: str) -> int:
        self.reasons.append(reason)
        n, self.live = self.live, 0
        return n


def test_a_second_ctrl_c_cuts_the_drain_short():
    async def main() -> tuple[_InFlight, Drain, float]:
        manager = _InFlight()
        drain = Drain(manager, timeout=60.0)
        stopped = asyncio.Event()
        drain.stop = stopped.set
        loop = asyncio.get_running_loop()
        drain.start("SIGINT")
        began = loop.time()
        await asyncio.sleep(0.2)
        assert not stopped.is_set() and manager.live == 1  # the first Ctrl-C waits for it
        drain.cut_short("a second Ctrl-C")
        await asyncio.wait_for(stopped.wait(), 5.0)
        return manager, drain, loop.time() - began
    manager, drain, took = asyncio.run(main())
    assert took < 5.0 and drain.aborted == 1 and drain.done
    assert manager.reasons == ["server shut down (a second Ctrl-C) before the request finished"]
