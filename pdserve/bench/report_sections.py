"""The seven sections of the bench_all.sh report (report.py renders them in order): each
reads its own subdirectory of the work directory and returns its markdown (heading,
what was run, the table, which side is ahead).

Split from report.py (the CLI, the machine line, the marker block) because each section
knows one benchmark's result files and nothing else; adding a section is a function
here and an entry in ``SECTIONS``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pdserve.bench.report_format import (_f, _failed_requests, _read_jsonl, _read_kv, _round, _shortest_lengths,
                                         ratio_sentence)


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


def _md_table(text: str, header_start: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header starts with ``header_start``, by column name."""
    header = next((line for line in text.splitlines() if line.startswith(header_start)), None)
    if header is None:
        return []
    names = [c.strip() for c in header.strip().strip("|").split("|")]
    return [dict(zip(names, row)) for row in _md_rows(text, header_start)]


def _first_number(cell: str) -> float | None:
    try:
        return float(cell.split()[0].rstrip("x"))
    except (ValueError, IndexError, AttributeError):
        return None


def section5(sec: Path) -> str:
    text = (sec / "kv.txt").read_text().strip() if (sec / "kv.txt").exists() else ""
    out = ["### 5. KV transfer: both engines (pdserve's transfer plan) vs raw loopback TCP, and the TTFT split", "",
           "Two processes on 127.0.0.1 (see the KV transfer section above for the method): GB/s of one prompt's "
           "KV written contiguously, and scattered as a pool that has been serving leaves it (per page size and "
           "allocation policy), vs a raw socket moving the same bytes in the same run; best of the repeats. TTFT "
           "split: a prefill and a decode scheduler in one process, one prompt at a time, median (ms).", ""]
    if not text:
        return "\n".join(out + ["not measured"])
    out.append(text)
    parts = []
    rows = _md_table(text, "| engine |")
    for engine in dict.fromkeys(r.get("engine", "") for r in rows):
        mine = [r for r in rows if r.get("engine") == engine]
        ratios = [x for x in (_first_number(r.get("contiguous / raw", "")) for r in mine) if x is not None]
        if ratios:
            parts.append(f"{engine} contiguous writes at {min(ratios):.2f}x to {max(ratios):.2f}x the raw socket")
        for column in mine[0] if mine else {}:
            if column.startswith("extent p"):
                scattered = [x for x in (_first_number(r[column].partition("(")[2].split(";")[0]) for r in mine) if x is not None]
                if scattered:
                    parts.append(f"{engine} {column.split()[1].replace('p', 'page size ')} (extent allocation) at "
                                 f"{min(scattered):.2f}x to {max(scattered):.2f}x its contiguous speed")
    for r in _md_rows(text, "| prompt tokens |"):
        try:
            colo, pdt = float(r[2]), float(r[3])
            parts.append(ratio_sentence(f"TTFT of a {r[0]}-token prompt", "colocated", colo, "PD", pdt, False, "ms"))
        except (ValueError, IndexError):
            continue
    if parts:
        out += ["", "**Measured:** " + "; ".join(parts) + "."]
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


def _decode_counters(path: Path) -> dict[str, float]:
    """The decode server's counters the section saved after its row (metric line -> value)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def section7(sec: Path) -> str:
    rows = [("P drafting (draft-state hand-off)", "p_spec"), ("plain P (decode drafts the prompt)", "p_plain")]
    out = ["### 7. ITL under a mixed long-prompt load: prefill drafting vs plain prefill", ""]
    got = {name: _round(_read_jsonl(sec / f"{key}.jsonl"), None) for name, key in rows}
    anyrec = next((r for r in got.values() if r), None)
    if anyrec:
        a = anyrec["args"]
        rate = a["request_rate"]
        rate_s = "all sent at once" if str(rate) == "inf" else f"{rate} requests/s (Poisson arrivals)"
        out += [f"1P1D behind the router, decode with EAGLE on the demo model (the same decode flags in both rows, "
                f"a fresh pair per row). bench.serving random dataset: {a['num_prompts']} prompts of "
                f"{int(a['random_input_len'] * a['random_range_ratio'])}-{a['random_input_len']} tokens, "
                f"{a['random_output_len']} output tokens each, {rate_s}. Plain prefill sends target features and "
                "the decode server runs its draft over each prompt when it commits (prefill work in the decode "
                "loop); a drafting prefill sends the draft KV and state, and decode drafts nothing. Times in ms; "
                "draft prefill tokens = the decode server's `pdserve:decode_draft_prefill_tokens_total` after the "
                "row (warm-up requests included).", ""]
    out += ["| prefill | TTFT mean | TPOT mean | ITL p50 | ITL p99 | ITL max | output tok/s | decode draft prefill "
            "tokens |", "|---|---|---|---|---|---|---|---|"]
    for name, key in rows:
        r = got[name]
        drafted = _decode_counters(sec / f"{key}.decode_metrics").get("pdserve:decode_draft_prefill_tokens_total")
        if not r:
            out.append(f"| {name} | not measured | | | | | | |")
            continue
        out.append(f"| {name} | {_f(r['mean_ttft_ms'], 1)} | {_f(r['mean_tpot_ms'], 2)} | {_f(r['median_itl_ms'], 2)} "
                   f"| {_f(r['p99_itl_ms'], 2)} | {_f(r['max_itl_ms'], 2)} | {_f(r['output_throughput'])} "
                   f"| {_f(drafted, 0)} |")
    s, n = got[rows[0][0]], got[rows[1][0]]
    if s and n:
        parts = [ratio_sentence("ITL p99", "P drafting", s["p99_itl_ms"], "plain P", n["p99_itl_ms"], False, "ms", 2),
                 ratio_sentence("TPOT", "P drafting", s["mean_tpot_ms"], "plain P", n["mean_tpot_ms"], False, "ms", 2),
                 ratio_sentence("TTFT", "P drafting", s["mean_ttft_ms"], "plain P", n["mean_ttft_ms"], False, "ms")]
        out += ["", "**Which side is ahead:** " + "; ".join(parts) + "." + _failed_requests([s, n])]
    return "\n".join(out)


SECTIONS = {"1": section1, "2": section2, "3": section3, "4": section4, "5": section5, "6": section6,
            "7": section7}
