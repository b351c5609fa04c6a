"""The GPU proof in one staged run (``scripts/gpu_proof.sh`` calls it; issue 33).

A lent GPU comes with 15 minutes of device time in all, so the proof must fit about
9 of them (a rerun must still fit) and a failure in one part must not cost the
numbers of the others. Each step therefore runs in its own process, with its own
time limit and the time left, in order of what the proof needs most:

1. ``probe``: Python, torch / CUDA / triton versions, ``nvidia-smi``, a trivial Triton
   kernel compiled and run (its launcher needs a C compiler and ``Python.h``), and the
   server's imports (fastapi, uvicorn, zmq, xgrammar, mooncake) one per line. No
   device or no working Triton stops the run here;
2. ``kernels``: the Triton attention kernels against a float32 reference (relative
   tolerance), with their times;
3. ``graphs``: decode steps with no host sync but the one read, and CUDA-graph decode
   against eager decode (float32);
4. ``speed-eager`` / ``speed-graphs``: Llama-3.1-8B's shape in bf16 on random weights,
   one engine per process: batch-1 decode against the HBM roofline and prefill
   against the bf16 matmul rate (both measured in the same process), offline
   throughput;
5. ``pd``: prefill and decode schedulers in one process over ``LocalTransfer`` in every
   staging mode the device serves, outputs against colocated; EAGLE chain and tree
   against plain decoding, with and without graphs;
6. ``servers``: ``pdserve up`` deployments through Mooncake behind the router
   (colocated, 1P1D, 1P1D with EAGLE on decode), if time remains.

A step that outlives its limit gets every thread's stack dumped into its log
(``faulthandler``), then ``StepDeadline`` raised in its main thread (so servers it
started are stopped), then SIGKILL for its whole process group.

Output: ``<out>/<step>.log`` (the step's whole output) and one JSON line per step in
``<out>/gpu_proof.json`` (status, seconds, limit, what the step measured). That is
eight files, the most a device call brings back. ``--smoke`` runs every step at
tiny shapes, which is how ``scripts/gpu_proof.sh --rehearse`` checks the runner on a
CPU (under ``TRITON_INTERPRET=1``); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from pdserve.lazy import load_target

SERVER_MODULES = ("fastapi", "uvicorn", "zmq", "xgrammar", "mooncake.engine")


@dataclass(frozen=True)
class Step:
    name: str
    target: str  # "module:function" called in the step's process with (work folder, smoke)
    gpu_limit_s: int  # its time limit on a GPU (at most: the run's time left)
    smoke_limit_s: int  # under the CPU rehearsal (Triton's interpreter is slow)
    essential: bool = False  # a failure stops the run
    needs: tuple[str, ...] = ()  # modules the probe must have imported, else skipped
    min_start_s: int = 20  # not started with less time left


def _here(function: str) -> str:
    return f"{__name__}:{function}"


STEPS = (
    Step("probe", _here("probe"), 45, 120, essential=True),
    Step("kernels", _here("kernels_step"), 60, 300),
    Step("graphs", _here("graphs_step"), 70, 300),
    Step("speed-eager", _here("speed_eager_step"), 100, 300),
    Step("speed-graphs", _here("speed_graphs_step"), 80, 300),
    Step("pd", _here("pd_step"), 90, 600, needs=("zmq",)),
    Step("servers", _here("servers_step"), 150, 600, needs=SERVER_MODULES, min_start_s=60),
)
STEP_NAMES = tuple(s.name for s in STEPS)


# ---- the steps, each run in its own process ------------------------------------------------

def probe(out: Path, smoke: bool) -> None:
    """The machine as the other steps will find it; raises when it cannot run them."""
    import torch
    import triton

    res: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    try:
        import transformers
        res["transformers"] = transformers.__version__
    except ImportError as exc:
        res["transformers"] = f"missing: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res["device"] = {"name": props.name, "memory_GiB": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}
    smi = shutil.which("nvidia-smi")
    if smi:
        run = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        res["nvidia_smi"] = (run.stdout or run.stderr).strip()
    # Triton's launcher is C compiled on the machine at the first kernel: it needs both.
    res["c_compiler"] = shutil.which("cc") or shutil.which("gcc") or "missing"
    header = Path(sysconfig.get_paths()["include"], "Python.h")
    res["python_h"] = str(header) if header.exists() else f"missing ({header})"
    res["imports"] = {}
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
            res["imports"][name] = "ok"
        except Exception as exc:  # an ImportError, or a missing system library (OSError)
            res["imports"][name] = f"{type(exc).__name__}: {exc}"
    lines = [f"{key}: {res.get(key)}" for key in ("python", "torch", "cuda", "triton", "transformers",
                                                  "cuda_available", "device", "nvidia_smi", "c_compiler",
                                                  "python_h")]
    lines += [f"import {name}: {status}" for name, status in res["imports"].items()]

    def save() -> None:  # also when the kernel below fails: the console shows what was found
        (out / "probe.json").write_text(json.dumps(res, indent=1))
        (out / "probe.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    try:
        if not smoke and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch: nothing of the GPU proof can run")
        res["triton_kernel"] = triton_smoke(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        lines.append(f"triton kernel: {res['triton_kernel']}")
    except Exception as exc:
        res["triton_kernel"] = f"FAILED: {type(exc).__name__}: {exc}"
        lines.append(f"triton kernel: {res['triton_kernel']}")
        raise
    finally:
        save()


def triton_smoke(device: Any) -> str:
    """Compile and run a one-line Triton kernel; raises if its result is wrong."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.arange(1000, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    start = time.perf_counter()
    add_one[(triton.cdiv(1000, 256),)](x, y, 1000, BLOCK=256)
    if not torch.equal(y.cpu(), x.cpu() + 1):
        raise RuntimeError("a trivial Triton kernel computed a wrong result")
    return f"ok ({time.perf_counter() - start:.1f} s with its compilation)"


def _check(out: Path, smoke: bool, main: Callable[[list[str]], None], argv: list[str]) -> None:
    main(argv + ["--out", str(out)] + (["--smoke"] if smoke else []))


SPEED = ["--only", "speed", "--models", "llama-3.1-8b", "--offline-requests", "128"]


def kernels_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_check
    _check(out, smoke, gpu_check.main, ["--only", "kernels"])


def graphs_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_check
    _check(out, smoke, gpu_check.main, ["--only", "sync,graphs"])


def speed_eager_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_check
    _check(out, smoke, gpu_check.main, SPEED + ["--speed-graphs", "off"])


def speed_graphs_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_check
    _check(out, smoke, gpu_check.main, SPEED + ["--speed-graphs", "on"])


def pd_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_check_pd
    _check(out, smoke, gpu_check_pd.main, [])


def servers_step(out: Path, smoke: bool) -> None:
    from pdserve.bench import gpu_pd_servers

    # On a GPU, 48 mixed prompts of ~1k tokens and 16 conversations fit the step's limit.
    load = [] if smoke else ["--num-prompts", "48", "--input-len", "1024", "--output-len", "64",
                             "--conversations", "16"]
    _check(out, smoke, gpu_pd_servers.main, ["--only", "1P1D,1P1D decode-EAGLE", *load])


class StepDeadline(BaseException):
    """A step's time is up: not an Exception, so a check's per-section handler does not
    swallow it and start the next section."""


def run_child(name: str, target: str, out: Path, limit_s: float, smoke: bool) -> None:
    """Inside the step's process: arm the deadline, run the step."""
    # At the deadline the main thread dumps every stack (a hang shows where) and raises,
    # so that `finally` blocks stop the servers a step started. A main thread stuck in C
    # never runs that handler: the watchdog thread dumps the stacks at the limit instead,
    # and the parent kills 5 s later. The two never fire together: a dump from the
    # watchdog while the main thread runs can crash the interpreter (seen at a 1 s limit).
    deadline_s = max(1, int(limit_s - 5))

    def on_alarm(signum: int, frame: Any) -> None:
        faulthandler.dump_traceback(all_threads=True)
        raise StepDeadline(f"step {name} reached its {limit_s:.0f} s limit")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(deadline_s)
    faulthandler.dump_traceback_later(max(float(limit_s), deadline_s + 2.0), exit=False)
    out.mkdir(parents=True, exist_ok=True)
    load_target(target)(out, smoke)


# ---- the parent: one process per step, a JSON line each ---------------------------------

def failed_sections(report: dict[str, Any]) -> list[str]:
    return [k for k, v in report.items() if isinstance(v, dict) and v.get("ok") is False]


def collect(step_dir: Path) -> dict[str, Any]:
    """What a step's process left (its check reports), by file stem."""
    found: dict[str, Any] = {}
    for path in sorted(step_dir.glob("*.json")):
        try:
            found[path.stem] = json.loads(path.read_text())
        except ValueError as exc:
            found[path.stem] = {"unreadable": str(exc)}
    return found


def run_step(step: Step, limit_s: float, out: Path, work: Path, smoke: bool, python: str) -> dict[str, Any]:
    step_dir = work / step.name
    cmd = [python, "-X", "faulthandler", "-m", "pdserve.bench.gpu_proof", "--child", step.name,
           "--target", step.target, "--work", str(step_dir), "--limit", str(limit_s)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with open(out / f"{step.name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s + 5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = round(time.perf_counter() - start, 1)
    reports = collect(step_dir)
    failed = [f"{stem}: {sec}" for stem, rep in reports.items() for sec in failed_sections(rep)]
    line: dict[str, Any] = {"step": step.name, "seconds": seconds, "limit_s": round(limit_s)}
    if rc is None:
        line.update(status="timeout", ok=False, error=f"killed at its {limit_s:.0f} s limit (stacks in the log)")
    elif rc != 0:
        line.update(status="failed", ok=False, error=f"exit status {rc}: {log_tail(out / f'{step.name}.log')}")
    elif failed:
        line.update(status="failed", ok=False, error="failed sections: " + ", ".join(failed))
    elif not reports:
        line.update(status="failed", ok=False, error="the step left no report")
    else:
        line.update(status="ok", ok=True)
    line["results"] = reports
    return line


def log_tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(text[-lines:])


def summary(line: dict[str, Any]) -> str:
    """The step's status line for the console (its report lines follow it)."""
    head = f"== {line['step']}: {line['status']} ({line['seconds']} s of {line['limit_s']} s)"
    return head + (f": {line['error'][:400]}" if line.get("error") else "")


def run_all(steps: Sequence[Step], out: Path, budget_s: float, smoke: bool, python: str) -> bool:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_proof.json").write_text("")
    start = time.perf_counter()
    ok = True
    imports: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-proof-") as tmp:
        for step in steps:
            left = budget_s - (time.perf_counter() - start)
            missing = [m for m in step.needs if imports.get(m, "ok") != "ok"]
            if missing:
                line: dict[str, Any] = {"step": step.name, "status": "skipped", "ok": False, "seconds": 0,
                                        "limit_s": 0, "error": "the probe could not import " + ", ".join(
                                            f"{m} ({imports[m]})" for m in missing)}
            elif left < step.min_start_s:
                line = {"step": step.name, "status": "skipped", "ok": False, "seconds": 0, "limit_s": 0,
                        "error": f"{left:.0f} s left of the {budget_s:.0f} s budget"}
            else:
                limit = min(step.smoke_limit_s if smoke else step.gpu_limit_s, left)
                line = run_step(step, limit, out, Path(tmp), smoke, python)
            with open(out / "gpu_proof.json", "a") as f:
                f.write(json.dumps(line) + "\n")
            print(summary(line), flush=True)
            for report in Path(tmp, step.name).glob("*.txt"):
                print(report.read_text().rstrip()[-6000:], flush=True)
            ok = ok and line["ok"]
            if step.name == "probe":
                imports = line.get("results", {}).get("probe", {}).get("imports", {})
            if step.essential and not line["ok"]:
                print(f"GPU proof stopped: the {step.name} step failed, and the other steps need what it "
                      "checks", flush=True)
                break
    print(f"GPU proof: {'every step ok' if ok else 'NOT every step ok'} "
          f"({time.perf_counter() - start:.0f} s of {budget_s:.0f} s); per step: {out / 'gpu_proof.json'}",
          flush=True)
    return ok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-proof-out",
                    help="folder for gpu_proof.json and the steps' logs (default: $OUT)")
    ap.add_argument("--steps", default=",".join(STEP_NAMES), help=f"comma-separated ({','.join(STEP_NAMES)})")
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU rehearsal of the runner")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args.child, args.target, Path(args.work), args.limit, args.smoke)
        return
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - set(STEP_NAMES))
    if unknown:
        ap.error(f"--steps: unknown {unknown}; choose from {', '.join(STEP_NAMES)}")
    ok = run_all([s for s in STEPS if s.name in names], Path(args.out), args.budget, args.smoke, sys.executable)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
