"""TP across nodes (--nnodes, --node-rank, --dist-init-addr; pdserve/server/node.py): two
launches on loopback form one TP 4 instance (2 nodes x 2 ranks) whose greedy answers
equal TP 1's; stopping node 0 ends node 1; a node that never comes, a node started with
other flags, or a node that dies end the instance with a message, never a hang."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import GREEDY, random_prompts
from tests.nodes import NodeProcess, node_flags, started_nodes, two_nodes
from tests.server.conftest import REPO_ROOT, free_port, pid_alive
from tests.waiting import wait_until

PROMPTS = random_prompts(5, 4, 50, seed=35)


@pytest.fixture(scope="module")
def tp4_model(tmp_path_factory):
    from pdserve.testing import build_random_model

    # 4 heads and 2 KV heads: TP 4 splits the heads and replicates each KV head twice.
    return build_random_model(tmp_path_factory.mktemp("mn") / "m", "llama", num_layers=2, num_heads=4,
                              num_kv_heads=2)


def test_tp4_over_two_nodes_equals_tp1(tp4_model, make_engine):
    params = dict(GREEDY, max_new_tokens=12)
    want = make_engine(tp4_model).generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    with two_nodes(tp4_model, 4, "--max-total-tokens", "2048", "--chunked-prefill-size", "32") as (node0, node1):
        got = node0.client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": params,
                                                   "return_logprob": True}).json()
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        for g, w in zip(got, want):
            lg = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
            lw = [x[0] for x in w["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(lg, lw)) < 1e-4
        # A streamed request goes through the same group (rank 0 broadcasts every step).
        with node0.client.stream("POST", "/generate", json={"input_ids": PROMPTS[0], "sampling_params": params,
                                                            "stream": True}) as r:
            assert r.status_code == 200
            assert "[DONE]" in r.read().decode()
        assert node0.info()["server_args"]["nnodes"] == 2
        node0.assert_pools_full()


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.launch_server", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO_ROOT))


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_node_alone_gives_up_after_dist_timeout(tp4_model, node_rank):
    """The other node never comes: this one exits non-zero naming the rendezvous, within
    its --dist-timeout (plus the start), rather than waiting forever."""
    r = _run(["--model-path", str(tp4_model), "--port", str(free_port()),
              *node_flags(4, node_rank, free_port(), "--dist-timeout", "3")])
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "did not meet at tcp://127.0.0.1:" in out and "within 3 s" in out, out[-3000:]


def test_nodes_with_different_flags_both_refuse(tp4_model):
    """Node 1 started with another --max-total-tokens: both nodes stop at startup, node 1
    naming the flag, node 0 pointing at the other node (a silently divergent group would
    give wrong tokens or hang)."""
    dist_port = free_port()
    node1 = NodeProcess(tp4_model, *node_flags(2, 1, dist_port, "--max-total-tokens", "1024"))
    try:
        r = _run(["--model-path", str(tp4_model), "--port", str(free_port()),
                  *node_flags(2, 0, dist_port, "--max-total-tokens", "2048")])
        assert r.returncode == 1 and "another node's command differs" in r.stderr, r.stderr[-3000:]
        assert node1.wait_exit() == 1
        assert "differs from node 0's in --max-total-tokens" in node1.output()
    finally:
        node1.kill_all()


def test_node1_stopping_ends_the_instance(tp4_model):
    """Node 1 goes away while node 0 serves: node 0's next request fails (the TP group is
    broken) and the server then reports itself unavailable, rather than hanging."""
    with started_nodes(tp4_model, 2, "--max-total-tokens", "1024") as (node0, node1):
        node1.proc.terminate()
        assert node1.wait_exit() == 0
        body = {"input_ids": PROMPTS[0], "sampling_params": dict(GREEDY, max_new_tokens=4)}
        r = node0.client.post("/generate", json=body, timeout=60)
        assert r.status_code == 503, r.text
        wait_until(lambda: node0.client.get("/health", timeout=5).status_code != 200, 30, step=0.2,
                   ignore=(httpx.HTTPError,))


def test_node0_killed_ends_node1(tp4_model):
    """Node 0 SIGKILLed (no shutdown command): its ranks die with it (PDEATHSIG), node 1's
    ranks find the group broken and node 1 exits non-zero, leaving nothing behind."""
    with started_nodes(tp4_model, 2, "--max-total-tokens", "1024") as (node0, node1):
        node0.remember_pids()
        node0.proc.kill()
        assert node1.wait_exit() == 1
        assert "the TP group ended" in node1.output()
        wait_until(lambda: not any(pid_alive(p) for p in node0.known_pids), 10, step=0.1)
