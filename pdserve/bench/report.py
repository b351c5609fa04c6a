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

# Layout: this module is the CLI, the machine line and the marker block; the sections
# are report_sections.py's (one function per section), what they share report_format.py's,
# and the hf-generate load hf_generate.py's. Their public names are importable from here.

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import datetime
from pathlib import Path

from pdserve.bench.hf_generate import hf_generate
from pdserve.bench.report_format import _read_kv, ratio_sentence
from pdserve.bench.report_sections import SECTIONS

__all__ = ["BEGIN", "END", "SECTIONS", "hf_generate", "main", "ratio_sentence", "render", "splice"]

BEGIN = "<!-- bench_all:begin -->"
END = "<!-- bench_all:end -->"


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


def _failed_note(sec: Path) -> str:
    f = sec / "failed"
    return f"\n**This section failed** ({f.read_text().strip()}); see the logs of the run.\n" if f.exists() else ""


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
