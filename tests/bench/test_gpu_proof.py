"""The GPU proof runner (issue 33): each step in its own process with its own limit,
one JSON line per step, a hang dumped and killed without costing the later steps, an
essential failure stopping the run, steps skipped when their needs or the time are
missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdserve.bench.gpu_proof import STEP_NAMES, Step, run_all
from tests.network import pypi_reachable


def step(name: str, function: str, limit: int = 60, **kw: object) -> Step:
    return Step(name, f"tests.bench.proof_steps:{function}", limit, limit, **kw)  # type: ignore[arg-type]


def lines(out: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (out / "gpu_proof.json").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_steps_report_one_line_each_and_a_hang_costs_only_itself(tmp_path):
    out = tmp_path / "out"
    ok = run_all([step("first", "passes"), step("stuck", "hangs", limit=10), step("wrong", "fails_a_section"),
                  step("crash", "crashes"), step("last", "passes")], out, 300, True, sys.executable)
    assert ok is False
    got = lines(out)
    assert list(got) == ["first", "stuck", "wrong", "crash", "last"]
    assert got["first"]["status"] == "ok" and got["first"]["results"]["check"]["section"]["value"] == 3
    assert got["last"]["status"] == "ok"
    stuck = got["stuck"]
    assert stuck["status"] == "failed" and "StepDeadline" in stuck["error"]
    assert stuck["results"]["check"]["before"]["ok"] is True  # what it measured before it hung is kept
    log = (out / "stuck.log").read_text()
    assert "most recent call first" in log and "proof_steps.py" in log  # faulthandler's stacks
    assert got["wrong"]["status"] == "failed" and "check: bad" in got["wrong"]["error"]
    assert got["crash"]["status"] == "failed" and "no device here" in got["crash"]["error"]
    # eight files at most come back from a device run: the JSON lines and a log per step
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu_proof.json"] + [f"{n}.log" for n in ("first", "stuck", "wrong", "crash", "last")])


def test_a_step_that_ignores_its_deadline_is_killed(tmp_path):
    out = tmp_path / "out"
    run_all([step("deaf", "ignores_its_deadline", limit=3), step("after", "passes")], out, 300, True,
            sys.executable)
    got = lines(out)
    assert got["deaf"]["status"] == "timeout" and got["deaf"]["seconds"] < 30
    assert got["after"]["status"] == "ok"


def test_an_essential_failure_stops_the_run(tmp_path):
    out = tmp_path / "out"
    assert run_all([step("probe", "crashes", essential=True), step("next", "passes")], out, 300, True,
                   sys.executable) is False
    assert list(lines(out)) == ["probe"]


def test_steps_are_skipped_without_their_imports_or_time(tmp_path):
    out = tmp_path / "out"
    run_all([step("probe", "probe_without_zmq", essential=True), step("pd", "passes", needs=("zmq",)),
             step("big", "passes", min_start_s=10_000)], out, 300, True, sys.executable)
    got = lines(out)
    assert got["probe"]["status"] == "ok"
    assert got["pd"]["status"] == "skipped" and "zmq" in got["pd"]["error"]
    assert got["big"]["status"] == "skipped" and "left of the" in got["big"]["error"]


def test_unknown_steps_are_refused(capsys):
    from pdserve.bench import gpu_proof

    with pytest.raises(SystemExit):
        gpu_proof.main(["--steps", "probe,warp-speed"])
    assert "warp-speed" in capsys.readouterr().err


def test_the_runner_fits_eight_files_and_nine_minutes():
    """What a device call brings back (8 files) and the time a rerun must leave."""
    from pdserve.bench.gpu_proof import STEPS

    assert len(STEP_NAMES) + 1 <= 8
    essential_path = sum(s.gpu_limit_s for s in STEPS if s.name != "servers")
    assert essential_path <= 510 - 60  # the servers step still gets its minimum


@pytest.mark.skipif(not pypi_reachable(), reason="needs PyPI (https://pypi.org) to resolve the carried wheels")
def test_the_rehearsal_runs_in_a_stand_in_of_the_device_image(tmp_path):
    """The rehearsal's cheapest form, as CI can afford it: the carried wheels resolved for
    this interpreter, installed with --no-deps on a venv holding only the image's packages,
    then the probe (server imports, a Triton kernel) and the kernel check, through the
    same script a device run uses."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PDSERVE_HOST_PYTHON=sys.executable, PDSERVE_REHEARSE_WHEELS=str(tmp_path / "whl"),
               PDSERVE_MIRROR=str(tmp_path / "mirror"), PDSERVE_SITE=str(tmp_path / "site"),
               PDSERVE_DEBS=str(tmp_path / "debs"), OUT=str(tmp_path / "out"), PYTHONPATH="")
    proc = subprocess.run(["bash", str(repo / "scripts" / "gpu_proof.sh"), "--rehearse", "--steps", "probe,kernels"],
                          env=env, capture_output=True, text=True, timeout=540)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    got = lines(tmp_path / "out")
    assert [s for s in got] == ["probe", "kernels"]
    assert all(row["status"] == "ok" for row in got.values()), output
    probe = got["probe"]["results"]["probe"]
    # the servers' modules came from the carried wheels: the stand-in image has none of them
    assert probe["imports"] == {m: "ok" for m in ("fastapi", "uvicorn", "zmq", "xgrammar", "mooncake.engine")}
    assert probe["triton_kernel"].startswith("ok")
    assert probe["executable"].startswith(str(tmp_path / "mirror"))  # the stand-in's interpreter ran it
    kernels = got["kernels"]["results"]["gpu_check"]["kernels"]
    assert kernels["ok"] is True and kernels["worst_rel_err"] < kernels["tolerance"]
