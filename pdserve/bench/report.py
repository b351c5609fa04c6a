"""The report side of ``scripts/bench_all.sh`` (issue 8).

    python -m pdserve.bench.report render --work DIR --out docs/benchmarks.md
    python -m pdserve.bench.report hf-generate --model DIR --num-prompts 32 \\
        --random-input-len 512 --random-output-len 128 --random-range-ratio 0.5 \\
        --max-concurrency 8 --output-file hf.jsonl

``render`` reads the raw results the script left in its work directory (bench.serving
JSONL records, bench.accuracy JSON, bench.kv_transfer output, the commands run and
per-section load / timing) and replaces the block between ``<!-- bench_all:begin -->``
and ``<!-- bench_all:end -->`` in the output file (appended at the end if absent; the
rest of the file is left as it was).  Every table comes with its commands, the machine
(``nproc``, CPU model, memory, torch version, date) and a sentence saying which side
is ahead and by what ratio.

``hf-generate`` is section 4's Hugging Face row: the same prompts as
``bench.serving --dataset-name random`` with the same flags and seed (same tokenizer,
same token ids), answered by ``model.generate`` in static batches of
``--max-concurrency`` (left-padded, greedy, EOS ignored; a batch runs until its longest
request is done, as HF has no continuous batching).  A streamer timestamps every
decoding step, so each request gets TTFT, ITL and E2E like a streamed server response
(its E2E ends at its own last token); the record has bench.serving's metric names.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

BEGIN = "<!-- bench_all:begin -->"
END = "<!-- bench_all:end -->"


# ---- small helpers ---------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_kv(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def ratio_sentence(metric: str, a_name: str, a: float | None, b_name: str, b: float | None,
                   higher_is_better: bool, unit: str = "", nd: int = 1) -> str:
    """'<metric>: <winner> ahead by R x (<value> vs <value> <unit>)'."""
    if a is None or b is None or a <= 0 or b <= 0:
        return f"{metric}: not comparable ({a_name} {_f(a, nd)}, {b_name} {_f(b, nd)})"
    a_wins = a > b if higher_is_better else a < b
    if a == b:
        return f"{metric}: level ({_f(a, nd)}{' ' + unit if unit else ''} each)"
    w, wv, l, lv = (a_name, a, b_name, b) if a_wins else (b_name, b, a_name, a)
    r = wv / lv if higher_is_better else lv / wv
    u = f" {unit}" if unit else ""
    return f"{metric}: {w} ahead by {r:.2f}x ({_f(wv, nd)} vs {_f(lv, nd)}{u})"


def machine_info() -> dict[str, str]:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError):
        pass
    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = "not installed"
    return {"nproc": str(os.cpu_count() if not hasattr(os, "sched_getaffinity") else len(os.sched_getaffinity(0))),
            "cpu": model, "mem": mem, "torch": tv, "python": platform.python_version()}


def machine_line(m: dict[str, str], date: str, meta: dict[str, str]) -> str:
    load = ""
    if meta.get("load_start"):
        load = f"; load average (1/5/15 min) {meta['load_start']} at the start, {meta.get('load_end', '?')} at the end"
    took = f"; took {meta['elapsed_s']} s" if meta.get("elapsed_s") else ""
    return (f"Machine: `nproc` = {m['nproc']}, {m['cpu']}, {m['mem']}, torch {m['torch']}, "
            f"Python {m['python']}, {date}{load}{took}.")


def commands_block(sec: Path) -> str:
    cmds = (sec / "commands.txt").read_text().strip() if (sec / "commands.txt").exists() else ""
    return "```\n" + "\n".join(f"$ {c}" for c in cmds.splitlines()) + "\n```" if cmds else ""


def _round(recs: list[dict[str, Any]], name_start: str | None) -> dict[str, Any] | None:
    """The record of one round: None for a single-round run, else the round whose name starts so."""
    for r in recs:
        rn = r.get("round")
        if name_start is None and rn is None:
            return r
        if name_start is not None and rn and rn.startswith(name_start):
            return r
    return recs[-1] if recs and name_start is None else None


def _failed_note(sec: Path) -> str:
    f = sec / "failed"
    return f"\n**This section failed** ({f.read_text().strip()}); see the logs of the run.\n" if f.exists() else ""


def _failed_requests(recs: Iterable[dict[str, Any] | None]) -> str:
    n = sum(int(r.get("failed") or 0) for r in recs if r)
    return f" **{n} requests failed** (left out of every statistic)." if n else ""


def _shortest_lengths(args: dict[str, Any]) -> tuple[int, int]:
    """The shortest input and output lengths bench.serving's random dataset draws."""
    ratio = args["random_range_ratio"]
    return (max(1, int(args["random_input_len"] * ratio)), max(1, int(args["random_output_len"] * ratio)))


# ---- sections -------------------------------------------------------------------------------------
def section1(sec: Path) -> str:
    rows = [("colocated (direct)", _round(_read_jsonl(sec / "colocated.jsonl"), None)),
            ("1P1D (router in front)", _round(_read_jsonl(sec / "pd.jsonl"), None))]
    out = ["### 1. Colocated vs 1P1D (router in front), long prompts and long generations", ""]
    first = next((r for _, r in rows if r), None)
    if first:
        a = first["args"]
        lo_in, lo_out = _shortest_lengths(a)
        out += [f"Demo model; bench.serving random dataset: {a['num_prompts']} prompts of {lo_in}-"
                f"{a['random_input_len']} tokens, {lo_out}-{a['random_output_len']} greedy output tokens (EOS "
                f"ignored), all queued at once, at most {a['max_concurrency']} in flight. Both deployments are up "
                "during the run and measured one after the other (an idle server costs ~0.3% of a core); the "
                "1P1D pair shares the machine's cores (prefill and decode compete for them).", ""]
    out += ["| deployment | output tok/s | TTFT mean (ms) | TTFT p99 (ms) | ITL mean (ms) | ITL p99 (ms) "
            "| TPOT mean (ms) | E2E mean (ms) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        if r is None:
            out.append(f"| {name} | not measured | | | | | | |")
            continue
        out.append(f"| {name} | {_f(r['output_throughput'])} | {_f(r['mean_ttft_ms'])} | {_f(r['p99_ttft_ms'])} "
                   f"| {_f(r['mean_itl_ms'])} | {_f(r['p99_itl_ms'])} | {_f(r['mean_tpot_ms'])} "
                   f"| {_f(r['mean_e2e_latency_ms'])} |")
    c, p = rows[0][1], rows[1][1]
    if c and p:
        parts = [ratio_sentence("output throughput", "colocated", c["output_throughput"], "1P1D",
                                p["output_throughput"], True, "tok/s"),
                 ratio_sentence("mean TTFT", "colocated", c["mean_ttft_ms"], "1P1D", p["mean_ttft_ms"], False, "ms"),
                 ratio_sentence("p99 TTFT", "colocated", c["p99_ttft_ms"], "1P1D", p["p99_ttft_ms"], False, "ms"),
                 ratio_sentence("mean ITL", "colocated", c["mean_itl_ms"], "1P1D", p["mean_itl_ms"], False, "ms"),
                 ratio_sentence("p99 ITL", "colocated", c["p99_itl_ms"], "1P1D", p["p99_itl_ms"], False, "ms")]
        out += ["", "**Which side is ahead:** " + "; ".join(parts) + "." + _failed_requests([c, p])]
    return "\n".join(out)


def _spec_label(name: str) -> str:
    if name == "plain":
        return "plain"
    algo, *shape = name.split("_")
    return f"{algo} ({','.join(shape)})"


def section2(sec: Path) -> str:
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for f in sorted(sec.glob("*.jsonl")):
        m = re.fullmatch(r"(.+)-c(\d+)", f.stem)
        r = _round(_read_jsonl(f), "Round 2") if m else None
        if m and r:
            runs[(m.group(1), int(m.group(2)))] = r
    out = ["### 2. Speculative vs plain decoding (colocated server, demo model)", ""]
    if runs:
        a = next(iter(runs.values()))["args"]
        out += [f"bench.serving multiturn dataset ({a['num_conversations']} conversations: demo-task chats, "
                "answers of 10-35 tokens, output length = the reference answer + its end of turn), all queued at "
                "once, at most C in flight; the table shows the measured round (round 2, whose prompts extend the "
                "warm-up round's). Accept length = tokens per verify round, the server's running average "
                "(`avg_spec_accept_length`, warm-up requests included). Shapes are "
                "(num_steps, eagle_topk, num_draft_tokens): (3,1,4) a chain, (5,4,8) a tree.", ""]
    out += ["| config | C | accept length | TPOT mean (ms) | TPOT p99 (ms) | ITL mean (ms) | TTFT mean (ms) "
            "| output tok/s | vs plain |", "|---|---|---|---|---|---|---|---|---|"]

    def order(k: tuple[str, int]) -> tuple[int, int, list[int]]:
        algo, *shape = k[0].split("_")
        return (k[1], {"plain": 0, "EAGLE": 1, "EAGLE3": 2}.get(algo, 3), [int(x) for x in shape if x.isdigit()])
    sentences = []
    for conc in sorted({c for _, c in runs}):
        plain = runs.get(("plain", conc))
        best: tuple[float, str, float | None] | None = None
        worst: tuple[float, str, float | None] | None = None
        for key in sorted((k for k in runs if k[1] == conc), key=order):
            r = runs[key]
            vs = r["output_throughput"] / plain["output_throughput"] if plain and plain["output_throughput"] else None
            acc = r.get("accept_length") if key[0] != "plain" else None
            out.append(f"| {_spec_label(key[0])} | {conc} | {_f(acc, 2)} | {_f(r['mean_tpot_ms'])} "
                       f"| {_f(r['p99_tpot_ms'])} | {_f(r['mean_itl_ms'])} | {_f(r['mean_ttft_ms'])} "
                       f"| {_f(r['output_throughput'])} | {_f(vs, 2)}x |")
            if key[0] != "plain" and vs is not None:
                if best is None or vs > best[0]:
                    best = (vs, _spec_label(key[0]), acc)
                if worst is None or vs < worst[0]:
                    worst = (vs, _spec_label(key[0]), acc)
        if best and worst:
            def say(v: tuple[float, str, float | None]) -> str:
                acc = f", accept length {v[2]:.2f}" if v[2] else ""
                side = f"ahead of plain by {v[0]:.2f}x" if v[0] >= 1 else f"behind plain by {1 / v[0]:.2f}x"
                return f"{v[1]} {side}{acc}"

            def name(v: tuple[float, str, float | None]) -> str:
                return f"{v[1]}" + (f" (accept length {v[2]:.2f})" if v[2] else "")
            if best[0] < 1:
                sentences.append(f"at C = {conc}, plain decoding is ahead of every speculative config in output "
                                 f"tok/s, by {1 / best[0]:.2f}x over the fastest, {name(best)}, to "
                                 f"{1 / worst[0]:.2f}x over the slowest, {name(worst)}")
            elif worst[0] >= 1:
                sentences.append(f"at C = {conc}, every speculative config is ahead of plain decoding in output "
                                 f"tok/s, by {best[0]:.2f}x ({name(best)}) down to {worst[0]:.2f}x ({name(worst)})")
            else:
                sentences.append(f"at C = {conc}, the fastest speculative config is {say(best)} and the slowest "
                                 f"is {say(worst)} (output tok/s)")
    if sentences:
        out += ["", "**Which side is ahead:** " + "; ".join(sentences) + "." + _failed_requests(runs.values())]
    return "\n".join(out)


def section3(sec: Path) -> str:
    rows = [("P with SPS", _read_jsonl(sec / "p_spec.jsonl")), ("P without SPS", _read_jsonl(sec / "p_plain.jsonl"))]
    out = ["### 3. The first seed's table: decode with EAGLE, prefill with vs without speculation", ""]
    anyrec = next((recs[0] for _, recs in rows if recs), None)
    if anyrec:
        a = anyrec["args"]
        rate = a["request_rate"]
        rate_s = "all sent at once" if str(rate) == "inf" else f"{rate} requests/s (Poisson arrivals)"
        shape = ""
        cmds = (sec / "commands.txt").read_text() if (sec / "commands.txt").exists() else ""
        m = re.search(r"--speculative-num-steps (\d+) --speculative-eagle-topk (\d+) "
                      r"--speculative-num-draft-tokens (\d+)", cmds)
        if m:
            shape = f" ({m.group(1)},{m.group(2)},{m.group(3)})"
        out += [f"1P1D behind the router, decode with EAGLE{shape} on the demo model; bench.serving multiturn "
                f"dataset, {a['num_conversations']} conversations, {rate_s}, no concurrency cap; round 1 "
                "warms the prefix cache up, round 2's prompts extend round 1's (SGLang's PR: 10,000 + 10,000 "
                "samples on 8 H200). TTFT / TPOT in ms (means); accept length = the decode server's running "
                "average after the round. A fresh pair per row.", ""]
    out += ["| deploy | TTFT-R1 | TPOT-R1 | TTFT-R2 | TPOT-R2 | accept length (R2) | output tok/s (R2) |",
            "|---|---|---|---|---|---|---|"]
    got: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for name, recs in rows:
        r1, r2 = _round(recs, "Round 1"), _round(recs, "Round 2")
        if not (r1 and r2):
            out.append(f"| {name} | not measured | | | | | |")
            continue
        got[name] = (r1, r2)
        out.append(f"| {name} | {_f(r1['mean_ttft_ms'], 2)} | {_f(r1['mean_tpot_ms'], 2)} "
                   f"| {_f(r2['mean_ttft_ms'], 2)} | {_f(r2['mean_tpot_ms'], 2)} | {_f(r2.get('accept_length'), 2)} "
                   f"| {_f(r2['output_throughput'])} |")
    if len(got) == 2:
        (s1, s2), (n1, n2) = got["P with SPS"], got["P without SPS"]
        parts = [ratio_sentence("TTFT-R1", "P with SPS", s1["mean_ttft_ms"], "P without SPS", n1["mean_ttft_ms"],
                                False, "ms"),
                 ratio_sentence("TTFT-R2", "P with SPS", s2["mean_ttft_ms"], "P without SPS", n2["mean_ttft_ms"],
                                False, "ms"),
                 ratio_sentence("TPOT-R1", "P with SPS", s1["mean_tpot_ms"], "P without SPS", n1["mean_tpot_ms"],
                                False, "ms", 2),
                 ratio_sentence("TPOT-R2", "P with SPS", s2["mean_tpot_ms"], "P without SPS", n2["mean_tpot_ms"],
                                False, "ms", 2)]
        out += ["", "**Which side is ahead:** " + "; ".join(parts) + ". The seed's point is that both rows are "
                "*correct* here (section 6); running the draft on prefill costs prefill time and buys the first "
                "decode round's draft state." + _failed_requests([s1, s2, n1, n2])]
    return "\n".join(out)


def section4(sec: Path) -> str:
    pd = _round(_read_jsonl(sec / "pdserve.jsonl"), None)
    vl = _round(_read_jsonl(sec / "vllm.jsonl"), None)
    hf = _round(_read_jsonl(sec / "hf.jsonl"), None)
    status = (sec / "vllm.status").read_text().strip() if (sec / "vllm.status").exists() else ""
    version = (sec / "vllm.version").read_text().strip() if (sec / "vllm.version").exists() else ""
    meta = _read_kv(sec / "meta")
    out = ["### 4. pdserve vs vLLM CPU vs Hugging Face `generate`", ""]
    first = pd or vl or hf
    if first:
        a = first["args"]
        lo_in, lo_out = _shortest_lengths(a)
        out += [f"Demo model (LlamaForCausalLM, 4 layers, hidden 256, fp32) for all three; the same "
                f"{a['num_prompts']} random prompts (bench.serving random dataset, seed {a.get('seed', 1)}: "
                f"{lo_in}-{a['random_input_len']} prompt tokens, {lo_out}-{a['random_output_len']} greedy output "
                f"tokens, EOS ignored) at most {a['max_concurrency']} in flight. pdserve and vLLM are servers "
                "measured by bench.serving over `/v1/completions` (streaming); HF `generate` runs in-process in "
                "static batches of that size (no HTTP, no continuous batching; a request's E2E ends at its own "
                "last token).", ""]
    out += ["| engine | output tok/s | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | ITL mean (ms) "
            "| E2E mean (ms) |", "|---|---|---|---|---|---|---|"]

    def row(name: str, r: dict[str, Any] | None, why: str = "not measured") -> None:
        if r is None:
            out.append(f"| {name} | {why} | | | | | |")
        else:
            out.append(f"| {name} | {_f(r['output_throughput'])} | {_f(r['mean_ttft_ms'])} | {_f(r['p99_ttft_ms'])} "
                       f"| {_f(r['mean_tpot_ms'])} | {_f(r['mean_itl_ms'])} | {_f(r['mean_e2e_latency_ms'])} |")
    row("pdserve (colocated server)", pd)
    vname = f"vLLM CPU {version} (server)" if version else "vLLM CPU (server)"
    if vl is None and meta.get("startup_s") is None and not status:
        status = "not measured"
    row(vname, vl, status.replace("|", "/") or "not measured")
    row("HF transformers `generate`", hf)
    parts = []
    if pd and vl:
        parts += [ratio_sentence("pdserve vs vLLM output throughput", "pdserve", pd["output_throughput"], "vLLM",
                                 vl["output_throughput"], True, "tok/s"),
                  ratio_sentence("mean TTFT", "pdserve", pd["mean_ttft_ms"], "vLLM", vl["mean_ttft_ms"], False, "ms"),
                  ratio_sentence("mean TPOT", "pdserve", pd["mean_tpot_ms"], "vLLM", vl["mean_tpot_ms"], False, "ms")]
    if pd and hf:
        parts += [ratio_sentence("pdserve vs HF output throughput", "pdserve", pd["output_throughput"], "HF",
                                 hf["output_throughput"], True, "tok/s"),
                  ratio_sentence("mean TPOT", "pdserve", pd["mean_tpot_ms"], "HF", hf["mean_tpot_ms"], False, "ms")]
    if vl and hf:
        parts.append(ratio_sentence("vLLM vs HF output throughput", "vLLM", vl["output_throughput"], "HF",
                                    hf["output_throughput"], True, "tok/s"))
    if parts:
        out += ["", "**Which side is ahead:** " + "; ".join(parts) + "." + _failed_requests([pd, vl])]
    if vl is None and status:
        out += ["", f"vLLM: {status}"]
    elif meta.get("startup_s"):
        out += ["", f"vLLM's server took {meta['startup_s']} s to become healthy."]
    return "\n".join(out)


def _md_rows(text: str, header_start: str) -> list[list[str]]:
    """Data rows of the markdown table whose header row starts with ``header_start``."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(header_start):
            inside = True
            continue
        if inside:
            if line.startswith("|---"):
                continue
            if not line.startswith("|"):
                if rows:
                    break
                continue
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def section5(sec: Path) -> str:
    text = (sec / "kv.txt").read_text().strip() if (sec / "kv.txt").exists() else ""
    out = ["### 5. KV transfer: Mooncake (pdserve's transfer plan) vs raw loopback TCP, and the TTFT split", "",
           "Two processes on 127.0.0.1 (see the KV transfer section above for the method): GB/s of one prompt's "
           "KV written contiguously and scattered (page size 1, shuffled) vs a raw socket moving the same bytes; "
           "best of the repeats. TTFT split: a prefill and a decode scheduler in one process, one prompt at a "
           "time, median (ms).", ""]
    if not text:
        return "\n".join(out + ["not measured"])
    out.append(text)
    parts = []
    gb = _md_rows(text, "| model |")
    ratios = []
    for r in gb:
        try:
            moon, raw = float(r[3].split()[0]), float(r[5])
            ratios.append((raw / moon if moon > 0 else math.inf, r[0], r[1], moon, raw))
        except (ValueError, IndexError):
            continue
    if ratios:
        lo, hi = min(ratios), max(ratios)
        def span(x: float, y: float) -> str:
            return f"{x:.2f}x" if f"{x:.2f}" == f"{y:.2f}" else f"{x:.2f}x to {y:.2f}x"
        if lo[0] >= 1:
            cases = [lo] if lo is hi else [lo, hi]
            parts.append(f"the raw socket is ahead of Mooncake (contiguous writes) by {span(lo[0], hi[0])} ("
                         + "; ".join(f"{c[1]}, {c[2]} tokens: {c[4]:.2f} vs {c[3]:.2f} GB/s" for c in cases) + ")")
        elif hi[0] < 1:
            cases = [lo] if lo is hi else [lo, hi]
            parts.append(f"Mooncake (contiguous writes) is ahead of the raw socket by {span(1 / hi[0], 1 / lo[0])} ("
                         + "; ".join(f"{c[1]}, {c[2]} tokens: {c[3]:.2f} vs {c[4]:.2f} GB/s" for c in cases) + ")")
        else:
            parts.append(f"Mooncake / raw TCP ranges from {1 / hi[0]:.2f}x to {1 / lo[0]:.2f}x")
    split = _md_rows(text, "| prompt tokens |")
    for r in split:
        try:
            colo, pdt = float(r[2]), float(r[3])
            parts.append(ratio_sentence(f"TTFT of a {r[0]}-token prompt", "colocated", colo, "PD", pdt, False, "ms"))
        except (ValueError, IndexError):
            continue
    if parts:
        out += ["", "**Which side is ahead:** " + "; ".join(parts) + "."]
    return "\n".join(out)


ALGOS = ("plain", "EAGLE", "EAGLE3")


def _acc_summary(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    res = json.loads(path.read_text())["results"]
    by = {r["task"]: r for r in res}
    n = sum(r["num_questions"] for r in res)
    correct = sum(r["accuracy"] * r["num_questions"] for r in res)
    return {"by": by, "overall": correct / n if n else None, "errors": sum(r["errors"] for r in res)}


def section6(sec: Path) -> str:
    out = ["### 6. Demo accuracy through 1P1D, every prefill x decode speculative combination", ""]
    colo = _acc_summary(sec / "colocated.json")
    tasks: list[str] = list(colo["by"]) if colo else []
    cells: dict[tuple[str, str], dict[str, Any] | None] = {}
    refused: dict[tuple[str, str], str] = {}
    for p in ALGOS:
        for d in ALGOS:
            cell = f"{p}__{d}"
            if (sec / f"{cell}.refused").exists():
                raw = (sec / f"{cell}.refused").read_text().strip()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:300] or "no answer"
                refused[(p, d)] = re.sub(r"^cannot reach the prefill server at \S+: ", "", msg)
            else:
                cells[(p, d)] = _acc_summary(sec / f"{cell}.json")
                if cells[(p, d)] and not tasks:
                    tasks = list(cells[(p, d)]["by"])
    nq = next((s["by"][t]["num_questions"] for s in [colo, *cells.values()] if s for t in s["by"]), None)
    out += [f"bench.accuracy (held-out demo questions, greedy, exact match; {nq} per task, `--task all`) "
            "through a router in front of one prefill and one decode server per cell; speculative servers use "
            "the demo heads with (3,1,4). The colocated row is a plain colocated server. A speculative decode "
            "behind a plain prefill builds its draft state from target features the prefill captures for it "
            "(EAGLE: the last hidden state; EAGLE3: the residual streams of layers 1-3); a plain prefill server "
            "captures one kind, so plain -> EAGLE3 has its own prefill server. EAGLE x EAGLE3 pairs are refused "
            "by design at the handshake (two speculative sides must run the same algorithm: the draft state "
            "prefill hands over is its own head's); the table shows the error a client gets (HTTP 503).", ""]
    out += ["| prefill | decode | " + " | ".join(tasks) + " | all | failed requests |",
            "|---|---|" + "---|" * len(tasks) + "---|---|"]

    def acc_row(p: str, d: str, s: dict[str, Any] | None) -> str:
        if s is None:
            return f"| {p} | {d} | " + " | ".join("-" for _ in tasks) + " | not measured | |"
        return (f"| {p} | {d} | " + " | ".join(_f(s["by"][t]["accuracy"], 3) if t in s["by"] else "-" for t in tasks)
                + f" | {_f(s['overall'], 3)} | {s['errors']} |")
    out.append(acc_row("colocated", "(same server)", colo))
    for p in ALGOS:
        for d in ALGOS:
            if (p, d) in refused:
                out.append(f"| {p} | {d} | refused: {refused[(p, d)].replace('|', '/')[:200]} |"
                           + " |" * (len(tasks) + 1))
            else:
                out.append(acc_row(p, d, cells.get((p, d))))
    measured = {k: v for k, v in cells.items() if v and v["overall"] is not None}
    if colo and colo["overall"] is not None and measured:
        base = colo["overall"]
        diffs = {k: v["overall"] - base for k, v in measured.items()}
        same = [k for k, dv in diffs.items() if abs(dv) < 1e-9]
        s = (f"{len(same)} of {len(measured)} compatible cells score exactly the colocated server's "
             f"{base:.3f}")
        other = {k: dv for k, dv in diffs.items() if abs(dv) >= 1e-9}
        if other:
            k, dv = max(other.items(), key=lambda kv: abs(kv[1]))
            got = measured[k]["overall"]
            s += "; the largest gap is " + ratio_sentence(f"{k[0]} -> {k[1]}", "colocated", base,
                                                          f"{k[0]} -> {k[1]}", got, True, "", 3)
            if measured[k]["errors"]:
                s += f" ({measured[k]['errors']} of its requests failed)"
        else:
            s += " (neither side is ahead: the PD split does not change a greedy answer)"
        errs = sum(v["errors"] for v in measured.values())
        out += ["", "**Which side is ahead:** " + s + (f"; {errs} requests failed" if errs else "")
                + (f"; {len(refused)} EAGLE x EAGLE3 cells refused as designed" if refused else "") + "."]
    return "\n".join(out)


SECTIONS = {"1": section1, "2": section2, "3": section3, "4": section4, "5": section5, "6": section6}


def render(work: Path) -> str:
    run = _read_kv(work / "run.meta")
    m = machine_info()
    date = datetime.now().strftime("%Y-%m-%d")
    if run.get("started"):
        date = run["started"][:10]
    quick = run.get("quick") == "1"
    lines = [BEGIN, "", "## All-in-one report (`scripts/bench_all.sh`)", "",
             f"Written by `{run.get('invocation', 'bash scripts/bench_all.sh')}` at commit "
             f"{run.get('git', '?')}, {run.get('started', '?')}, in {run.get('elapsed_s', '?')} s. "
             "Servers bind 127.0.0.1 on free ports; every process is started and stopped by the script. "
             "Each section's raw outputs are kept with `--workdir DIR`.", ""]
    if quick:
        lines += ["**Smoke run (`--quick`): tiny sizes, the numbers say nothing about performance.**", ""]
    for key, fn in SECTIONS.items():
        sec = work / f"s{key}"
        if not sec.exists():
            continue
        meta = _read_kv(sec / "meta")
        try:
            body = fn(sec)
        except Exception as exc:  # a broken result file must not hide the other sections
            body = f"### Section {key}\n\nreport error: {type(exc).__name__}: {exc}"
        lines += [body, _failed_note(sec), commands_block(sec), "", machine_line(m, date, meta), ""]
    lines.append(END)
    return "\n".join(x for x in lines if x is not None) + "\n"


def splice(doc: str, block: str) -> str:
    """``doc`` with the marker block replaced by ``block`` (appended when absent)."""
    b, e = doc.find(BEGIN), doc.find(END)
    if b != -1 and e != -1 and e > b:
        return doc[:b] + block.rstrip("\n") + doc[e + len(END):]
    if doc and not doc.endswith("\n"):
        doc += "\n"
    return doc + ("\n" if doc else "") + block


# ---- HF generate, the load of bench.serving's random dataset --------------------------------------------
def hf_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from pdserve.bench.serving import RequestRecord, _jsonable, compute_metrics, random_dataset
    from pdserve.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.tokenizer or args.model)
    reqs = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                          tok, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def run_batch(batch: list[Any], new: int) -> tuple[float, list[float]]:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        clock = Clock()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad, eos_token_id=None, streamer=clock)
        return t0, clock.times[-new:]  # the first put is the prompt; then one per generated token

    for _ in range(max(0, args.warmup_requests)):
        run_batch(reqs[:1], min(4, reqs[0].output_len))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), args.max_concurrency):
        batch = reqs[i:i + args.max_concurrency]
        t0, times = run_batch(batch, max(r.output_len for r in batch))
        for r in batch:
            mine = times[:r.output_len]
            records.append(RequestRecord(success=True, prompt_len=r.prompt_len, output_len=r.output_len,
                                         ttft=mine[0] - t0, itl=[b - a for a, b in zip(mine, mine[1:])],
                                         latency=mine[-1] - t0, start_time=t0 - start))
    duration = time.perf_counter() - start
    m = compute_metrics(records, duration)
    print(f"HF generate: {m.completed} requests in {duration:.2f} s, {m.output_throughput:.1f} output tok/s, "
          f"TTFT mean {m.mean_ttft_ms:.1f} ms, TPOT mean {m.mean_tpot_ms:.1f} ms (torch threads "
          f"{torch.get_num_threads()})")
    if args.output_file:
        rec = {"date": datetime.now().isoformat(timespec="seconds"), "backend": "hf-generate",
               "dataset_name": "random", "round": None, "model": args.model, "request_rate": math.inf,
               "max_concurrency": args.max_concurrency, "interrupted": False, "num_requests": len(reqs),
               **asdict(m), "args": {k: v for k, v in vars(args).items() if k != "func"}}
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(rec)) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="write the report block from a bench_all.sh work directory")
    r.add_argument("--work", required=True, type=Path)
    r.add_argument("--out", required=True, type=Path, help="markdown file to update (created if missing)")
    h = sub.add_parser("hf-generate", help="HF generate under bench.serving's random-dataset load")
    h.add_argument("--model", required=True)
    h.add_argument("--tokenizer", default=None)
    h.add_argument("--num-prompts", type=int, default=32)
    h.add_argument("--random-input-len", type=int, default=512)
    h.add_argument("--random-output-len", type=int, default=128)
    h.add_argument("--random-range-ratio", type=float, default=0.0)
    h.add_argument("--max-concurrency", type=int, default=8, help="static batch size")
    h.add_argument("--seed", type=int, default=1, help="bench.serving's --seed (same prompts)")
    h.add_argument("--warmup-requests", type=int, default=1)
    h.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    h.add_argument("--output-file", default=None, help="append one bench.serving-shaped JSONL record")
    args = ap.parse_args(argv)
    if args.cmd == "render":
        block = render(args.work)
        doc = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
        args.out.write_text(splice(doc, block))
        return 0
    if args.max_concurrency < 1 or args.num_prompts < 1:
        ap.error("--max-concurrency and --num-prompts must be >= 1")
    return hf_generate(args)


if __name__ == "__main__":
    sys.exit(main())
