"""Steps for the GPU proof runner's own tests (pdserve.bench.gpu_proof runs each in a
process of its own, by "module:function")."""

from __future__ import annotations

import json
import time
from pathlib import Path


def passes(out: Path, smoke: bool) -> None:
    (out / "check.json").write_text(json.dumps({"section": {"ok": True, "value": 3}}))
    (out / "check.txt").write_text("section: ok\n")


def fails_a_section(out: Path, smoke: bool) -> None:
    (out / "check.json").write_text(json.dumps({"good": {"ok": True}, "bad": {"ok": False, "error": "x"}}))


def crashes(out: Path, smoke: bool) -> None:
    raise RuntimeError("no device here")


def hangs(out: Path, smoke: bool) -> None:
    """Stuck until the deadline; its `finally` (where a check stops its servers) still runs."""
    (out / "check.json").write_text(json.dumps({"before": {"ok": True}}))
    try:
        while True:
            time.sleep(0.1)
    finally:
        (out.parent / "hangs.cleaned-up").write_text("yes")


def ignores_its_deadline(out: Path, smoke: bool) -> None:
    """Swallows the deadline (BaseException) and goes on: only SIGKILL ends it."""
    while True:
        try:
            time.sleep(100)
        except BaseException:
            pass


def probe_without_zmq(out: Path, smoke: bool) -> None:
    (out / "probe.json").write_text(json.dumps({"imports": {"zmq": "ImportError: No module named 'zmq'"}}))
