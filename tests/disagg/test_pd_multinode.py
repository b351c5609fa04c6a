"""PD with one side spanning two "nodes" on loopback (--nnodes 2): every rank registers
its transfer endpoint with the prefill's bootstrap server (node 1's prefill ranks with
rank 0's registry on node 0), decode ranks on node 1 reach the prefill's bootstrap and
ranks, and pairs across unequal TP give the colocated engine's greedy tokens."""

from __future__ import annotations

import contextlib
import random

import httpx
import pytest

from tests.disagg.test_pd_servers import GREEDY, pd_generate_all, prompts_and_reference
from tests.nodes import two_nodes
from tests.server.conftest import ServerProcess, free_port


# Node 1's --host: another loopback address, as another machine's would be (Linux routes
# all of 127.0.0.0/8 to lo), so a rank that used its own --host for node 0's registry fails.
NODE1_HOST = "127.0.0.2"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from pdserve.testing import build_random_model

    # GQA: 4 heads, 2 KV heads. Prefill TP 4 replicates each KV head on two ranks.
    return build_random_model(tmp_path_factory.mktemp("pdmn") / "t", "llama", num_layers=2, num_heads=4,
                              num_kv_heads=2)


@pytest.mark.parametrize("spanning", ["prefill", "decode"])
def test_pd_with_a_side_over_two_nodes_equals_colocated(target, make_engine, spanning):
    """prefill: TP 4 = 2 nodes x 2 ranks -> decode TP 1; decode: prefill TP 1 -> decode
    TP 2 = 2 nodes x 1 rank. Page size 16 and chunked prefill, as the single-node pairs."""
    rng, prompts, ref = prompts_and_reference(make_engine, target, 35, 5, 5, 60, GREEDY)
    boot = free_port()
    common = ("--page-size", "16", "--max-total-tokens", "2048")
    prefill = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
               "--chunked-prefill-size", "32", *common)
    decode = ("--disaggregation-mode", "decode", *common)
    with contextlib.ExitStack() as stack:
        if spanning == "prefill":
            p, _ = stack.enter_context(two_nodes(target, 4, *prefill, node1_host=NODE1_HOST))
            d = ServerProcess(target, *decode)
        else:
            p = ServerProcess(target, *prefill)
            stack.callback(p.close)
            d, _ = stack.enter_context(two_nodes(target, 2, *decode, node1_host=NODE1_HOST))
        with contextlib.ExitStack() as decode_stop:
            if spanning == "prefill":
                decode_stop.callback(d.close)
                # Node 1's ranks registered with rank 0's registry on node 0 (not at their own
                # --host), each advertising its own node's address: all four listed.
                listing = httpx.get(f"http://127.0.0.1:{boot}/ranks", timeout=10).json()
                assert listing["tp_size"] == 4
                assert [(r["tp_rank"], r["host"]) for r in listing["ranks"]] == [
                    (0, "127.0.0.1"), (1, "127.0.0.1"), (2, NODE1_HOST), (3, NODE1_HOST)]
            outs = pd_generate_all(p, d, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
            assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
            # A second turn in new rooms: the transfer links between the nodes stay usable.
            again = pd_generate_all(p, d, boot, prompts[:2], GREEDY, [random.getrandbits(63) for _ in range(2)])
            assert [o["output_ids"] for o in again] == [r["output_ids"] for r in ref[:2]]
            p.assert_pools_full()
            d.assert_pools_full()
