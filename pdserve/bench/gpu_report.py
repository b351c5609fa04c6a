"""What every GPU check shares (gpu_check.py, gpu_check_pd.py, gpu_pd_servers.py): the
options they all take, the report they write section by section (a run cut short by its
timeout still leaves what it measured), and a median timer.

Split from gpu_check.py so that the PD checks take the harness without the engine
checks, and the kernel section without the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def check_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options every GPU check takes: where its report goes, and the CPU smoke mode."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help=f"folder for {name}.json / .txt")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script itself)")
    return ap


class Report:
    """Results so far, written to ``out`` after every section (a run cut short by
    its timeout still leaves what it measured)."""

    def __init__(self, out: str | None, name: str = "gpu_check") -> None:
        self.out = out
        self.name = name  # the report files' stem
        self.results: dict[str, Any] = {}
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    @contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        entry: dict[str, Any] = {}
        self.results[name] = entry
        self.say(f"== {name}")
        start = time.perf_counter()
        try:
            yield entry
            entry.setdefault("ok", True)
        except Exception as exc:  # every section reports, whatever failed before
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
            self.say(traceback.format_exc())
        entry["seconds"] = round(time.perf_counter() - start, 1)
        self.say(f"-- {name}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s)")
        self.save()

    def conclude(self, all_ok: str = "all sections ok") -> None:
        """The last line (``all_ok``, or the failed sections) and the final save."""
        failed = [k for k, v in self.results.items() if isinstance(v, dict) and v.get("ok") is False]
        self.say(all_ok if not failed else f"FAILED: {', '.join(failed)}")
        self.save()

    def save(self) -> None:
        if not self.out:
            return
        Path(self.out).mkdir(parents=True, exist_ok=True)
        Path(self.out, f"{self.name}.json").write_text(json.dumps(self.results, indent=1))
        Path(self.out, f"{self.name}.txt").write_text("\n".join(self.lines) + "\n")


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 5) -> float:
    """Median seconds of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
