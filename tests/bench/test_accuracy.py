"""The accuracy benchmark: its question sets, answer checks, and a run against a real
pdserve server on the demo model that must reach transformers' numbers."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.assets import demo_tasks
from pdserve.bench import accuracy
from tests.server.conftest import ServerProcess

N_PER_TASK = 6


@pytest.mark.fast
def test_question_sets_are_heldout_and_deterministic():
    for task in demo_tasks.TASKS:
        convs = demo_tasks.heldout_conversations(task, 20, seed=3)
        assert convs == demo_tasks.heldout_conversations(task, 20, seed=3)
        assert convs != demo_tasks.heldout_conversations(task, 20, seed=4)
        for c in convs:
            assert c.task == task and demo_tasks.is_heldout(c.messages[-1]["content"])
            assert demo_tasks.is_valid_answer(task, c.answer)
    multi = demo_tasks.heldout_conversations("multi-turn", 6, seed=0)
    assert [c.task for c in multi] == list(demo_tasks.TASKS) * 2
    for c in multi:
        assert len(c.messages) == 7  # three earlier turns, then the question
        assert all(not demo_tasks.is_heldout(m["content"]) for m in c.messages[:-1] if m["role"] == "user")


@pytest.mark.fast
@pytest.mark.parametrize("task,text,valid", [
    ("arithmetic", "12 + 7 = 19", True), ("arithmetic", "12 + 7 = ", False), ("arithmetic", "19", False),
    ("copy", "ab12", True), ("copy", "ab 12", False),
    ("recall", "x0z", True), ("recall", "x0", False), ("recall", "x0zz", False),
])
def test_invalid_answer_shapes(task, text, valid):
    assert demo_tasks.is_valid_answer(task, text) is valid


@pytest.mark.fast
def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        accuracy.main(["--base-url", "http://127.0.0.1:1", "--num-questions", "0"])
    assert "--num-questions" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--task"):
        asyncio.run(accuracy.run_accuracy("http://127.0.0.1:1", 1, 1, task="poetry"))


@pytest.mark.fast
def test_unreachable_server_counts_errors_not_accuracy():
    res = asyncio.run(accuracy.run_accuracy("http://127.0.0.1:1", 2, 2, task="copy", timeout_s=5,
                                            show_progress=False))
    assert res[0].errors == 2 and res[0].accuracy == 0.0 and res[0].first_error


def _transformers_accuracy(task: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve import assets

    d = assets.path("demo")
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    hits = 0
    convs = demo_tasks.heldout_conversations(task, N_PER_TASK, seed=0)
    for c in convs:
        prompt = tok.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=len(c.answer) + 8, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        hits += tok.decode(out[0, len(ids):], skip_special_tokens=True).strip() == c.answer
    return hits / len(convs)


def test_against_pdserve_server_matches_transformers(tmp_path, capsys):
    from pdserve import assets

    # Small chunks so the multi-turn prompts are prefilled in several pieces.
    server = ServerProcess(assets.path("demo"), "--chunked-prefill-size", "64")
    try:
        out_file = tmp_path / "acc.json"
        rc = accuracy.main(["--base-url", server.url, "--num-questions", str(N_PER_TASK), "--parallel", "4",
                            "--task", "all", "--output-file", str(out_file)])
        assert rc == 0
        printed = capsys.readouterr().out
        for key in ("Accuracy:", "Invalid:", "Latency:", "Output throughput:"):
            assert printed.count(key) == 4, printed
        results = {r["task"]: r for r in json.loads(out_file.read_text())["results"]}
        assert set(results) == {*demo_tasks.TASKS, "multi-turn"}
        for task, r in results.items():
            assert r["errors"] == 0 and r["num_questions"] == N_PER_TASK and r["output_tokens"] > 0
            assert r["accuracy"] == pytest.approx(_transformers_accuracy(task)), task
        # The demo model answers most questions of every task (a broken KV path drops this to ~0).
        assert all(results[t]["accuracy"] >= 0.5 for t in demo_tasks.TASKS), results
        server.assert_pools_full()
    finally:
        server.close()
