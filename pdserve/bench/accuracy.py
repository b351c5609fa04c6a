"""Demo-model accuracy through any OpenAI-compatible server: the end-to-end alarm.

Held-out questions of the embedded demo model's tasks (never seen in training,
``pdserve.assets.demo_tasks``) go through ``/v1/chat/completions`` with greedy
decoding; an answer counts when it equals the reference exactly.  A broken KV
handoff makes the model answer from the wrong context, so accuracy collapses
(SGLang's EAGLE-across-the-split bug: 0.92 -> 0.011).

    python -m pdserve.bench.accuracy --base-url http://127.0.0.1:30000 \\
        --num-questions 200 --parallel 32 --task all

Per task it prints Accuracy, Invalid (answers not even shaped like one),
Latency (wall time of the task's run), Output throughput; ``--output-file``
writes the same as JSON.  ``multi-turn`` asks each question after three
earlier turns (long prompts); ``all`` runs the three single-turn tasks and
multi-turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from pdserve.assets import demo_tasks

TASK_CHOICES = (*demo_tasks.TASKS, "multi-turn", "all")


@dataclass(frozen=True)
class TaskResult:
    task: str
    num_questions: int
    accuracy: float
    invalid: float
    errors: int  # requests the server failed (counted as wrong, not invalid)
    latency_s: float
    output_tokens: int
    output_throughput: float  # completion tokens per second of wall time
    first_error: str | None = None


def _expand(task: str) -> list[str]:
    return [*demo_tasks.TASKS, "multi-turn"] if task == "all" else [task]


async def _ask(client: httpx.AsyncClient, sem: asyncio.Semaphore, model: str | None,
               conv: demo_tasks.Conversation, max_tokens: int) -> tuple[str | None, int, str | None]:
    """(answer text or None on error, completion tokens, error message)."""
    body: dict[str, Any] = {"messages": list(conv.messages), "max_tokens": max_tokens, "temperature": 0}
    if model:
        body["model"] = model
    async with sem:
        try:
            r = await client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            return None, 0, f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, 0, f"HTTP {r.status_code}: {r.text[:300]}"
    data = r.json()
    return data["choices"][0]["message"]["content"] or "", int(data["usage"]["completion_tokens"]), None


async def _run_task(client: httpx.AsyncClient, task: str, n: int, parallel: int, seed: int,
                    model: str | None, progress: Any) -> TaskResult:
    convs = demo_tasks.heldout_conversations(task, n, seed)
    sem = asyncio.Semaphore(parallel)
    t0 = time.perf_counter()

    async def one(conv: demo_tasks.Conversation) -> tuple[str | None, int, str | None]:
        # Room for the longest right answer plus a few tokens: a wrong answer that
        # rambles is cut short and still counts as wrong.
        out = await _ask(client, sem, model, conv, len(conv.answer) + 8)
        progress.update(1)
        return out

    answers = await asyncio.gather(*[one(c) for c in convs])
    latency = time.perf_counter() - t0
    correct = invalid = errors = tokens = 0
    first_error = None
    for conv, (text, n_tok, err) in zip(convs, answers):
        if text is None:
            errors += 1
            first_error = first_error or err
            continue
        tokens += n_tok
        text = text.strip()
        correct += text == conv.answer
        invalid += not demo_tasks.is_valid_answer(conv.task, text)
    return TaskResult(task, n, correct / n, invalid / n, errors, latency, tokens,
                      tokens / latency if latency > 0 else 0.0, first_error)


async def run_accuracy(base_url: str, num_questions: int, parallel: int, task: str = "all", seed: int = 0,
                       model: str | None = None, api_key: str | None = None, timeout_s: float = 600.0,
                       show_progress: bool = True) -> list[TaskResult]:
    """Run the benchmark against ``base_url``; one result per task."""
    if task not in TASK_CHOICES:
        raise ValueError(f"--task must be one of {', '.join(TASK_CHOICES)}, got {task!r}")
    if num_questions < 1 or parallel < 1:
        raise ValueError("--num-questions and --parallel must be >= 1")
    from tqdm import tqdm

    tasks = _expand(task)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
    results = []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers,
                                 limits=limits) as client:
        with tqdm(total=num_questions * len(tasks), disable=not show_progress, file=sys.stderr) as bar:
            for t in tasks:
                bar.set_description(t)
                results.append(await _run_task(client, t, num_questions, parallel, seed, model, bar))
    return results


def format_results(results: list[TaskResult]) -> str:
    lines = []
    for r in results:
        lines += [
            f"Task: {r.task} ({r.num_questions} questions)",
            f"Accuracy: {r.accuracy:.3f}",
            f"Invalid: {r.invalid:.3f}",
            f"Latency: {r.latency_s:.3f} s",
            f"Output throughput: {r.output_throughput:.3f} token/s",
        ]
        if r.errors:
            lines.append(f"Errors: {r.errors} (first: {r.first_error})")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    ap.add_argument("--num-questions", type=int, default=200, help="held-out questions per task")
    ap.add_argument("--parallel", type=int, default=32, help="requests in flight at once")
    ap.add_argument("--task", choices=TASK_CHOICES, default="all")
    ap.add_argument("--seed", type=int, default=0, help="which held-out questions (deterministic per seed)")
    ap.add_argument("--model", default=None, help="the request's model field (default: omitted)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--output-file", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.num_questions < 1:
        ap.error("--num-questions must be >= 1")
    if args.parallel < 1:
        ap.error("--parallel must be >= 1")
    results = asyncio.run(run_accuracy(args.base_url, args.num_questions, args.parallel, args.task, args.seed,
                                       args.model, args.api_key))
    print(format_results(results))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"base_url": args.base_url, "seed": args.seed, "results": [asdict(r) for r in results]}, f,
                      indent=2)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
