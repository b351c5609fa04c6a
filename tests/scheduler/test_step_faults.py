"""A scheduler step never dies for one request: an error inside a forward fails that
batch's requests (each with the error, as a server error) and the scheduler goes on;
an error outside every guard ends every live request once, through the rank loop's
last resort. Pools return to full either way."""

from __future__ import annotations

import pytest

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.requests import RequestBuilder
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.messages import Command
from pdserve.scheduler.req import samples_from_message
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.worker import serve
from tests.conftest import GREEDY, random_prompts

pytestmark = pytest.mark.fast


@pytest.fixture
def sched(llama_dir):
    args = ServerArgs(model_path=str(llama_dir), max_total_tokens=2048, chunked_prefill_size=-1)
    return Scheduler(args, ModelRunner(args, llama_dir, TPGroup()), lambda ids: "")


def messages(n: int, max_new: int = 6, samples: int = 1) -> list:
    builder = RequestBuilder(None, 4096, 10**6, 4, 0)
    params = SamplingParams.from_dict(dict(GREEDY, max_new_tokens=max_new, n=samples))
    return [builder.group(ids, params, False, 0, rid=f"r{i}") for i, ids in enumerate(random_prompts(n, 5, 30))]


def requests(n: int, max_new: int = 6, samples: int = 1) -> list:
    return [samples_from_message(m) for m in messages(n, max_new, samples)]


def run(sched: Scheduler) -> dict:
    done = {}
    for _ in range(500):
        for r in sched.step().finished:
            assert (r.rid, r.sample_index) not in done, "a request ended twice"
            done[(r.rid, r.sample_index)] = r
        if not sched.has_work:
            return done
    raise AssertionError("the scheduler did not drain")


def pools_full(sched: Scheduler) -> None:
    assert sched.flush_cache()
    m = sched.memory_state()
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["req_slots_free"] == m["req_slots_total"], m


@pytest.mark.parametrize("fail_at", [1, 3])  # the prefill step, a decode step
def test_a_failing_forward_fails_its_batch_and_the_scheduler_goes_on(sched, monkeypatch, fail_at):
    groups = requests(2, samples=2)
    for g in groups:
        sched.add(g[0])
    real, calls = sched.forward, []

    def forward(fwd):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("device fell over")
        return real(fwd)
    monkeypatch.setattr(sched, "forward", forward)
    done = run(sched)
    assert len(done) == 4  # every sample of every request, once
    for r in done.values():
        assert r.finish.kind.value == "abort" and r.finish.server_error
        assert "internal error" in r.finish.message and "device fell over" in r.finish.message
    pools_full(sched)
    monkeypatch.undo()
    for g in requests(2):
        sched.add(g[0])
    assert all(r.finish.kind.value == "length" for r in run(sched).values())
    pools_full(sched)


class ScriptedIO:
    """Feeds the rank loop commands, collects what it publishes."""

    def __init__(self, commands: list[Command]) -> None:
        self.commands = commands
        self.finished: list = []

    def receive(self, block: bool) -> list[Command]:
        if self.commands:
            return [self.commands.pop(0)]
        return [Command(shutdown=True)] if block else []

    def reply(self, kind: str, payload: object) -> None:
        pass

    def publish(self, out) -> None:
        self.finished += out.finished


def test_a_step_failing_outside_every_guard_ends_each_live_request_once(sched, monkeypatch):
    real, steps = sched.mode.poll_external, []

    def poll_external(out):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("bookkeeping bug")
        return real(out)
    monkeypatch.setattr(sched.mode, "poll_external", poll_external)
    io = ScriptedIO([Command(add=tuple(messages(3)))])
    serve(sched, TPGroup(), io)
    assert sorted(r.rid for r in io.finished) == ["r0", "r1", "r2"]
    assert all("scheduler step failed: bookkeeping bug" in r.finish.message for r in io.finished)
    pools_full(sched)

