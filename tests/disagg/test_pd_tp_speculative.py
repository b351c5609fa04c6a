"""The PD x speculative matrix with tensor parallelism, on real servers: prefill
{plain, EAGLE, EAGLE3} x decode {EAGLE, EAGLE3}, for P TP2 -> D TP1, P TP1 -> D TP2 and
P TP2 -> D TP2, page sizes 1 and 16; greedy outputs equal the colocated single-rank
engine. Decode servers run --debug-tp-agreement (their ranks compare every round's tree
and accepted path). A speculative prefill pairs with a decode running the same draft
(the handshake refuses other algorithms; tests/disagg/test_layout.py) and hands over its
draft state: the draft KV, head-sharded like the target's, crosses from every prefill
rank to the decode ranks holding those heads. A plain prefill sends the features once:
each decode rank receives its slice of every row."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import pytest

from pdserve.testing import build_random_draft, build_random_model
from tests.disagg.test_pd_servers import metric_values, pd_generate_all
from tests.server.conftest import ServerProcess, free_port

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# Decode servers: (algorithm, tp) -> page size. Each TP pair meets both page sizes (EAGLE
# at 1, EAGLE3 at 16); one page size per algorithm also lets one plain prefill server per
# page size serve its decodes (a plain prefill captures the features of one draft kind,
# the first speculative decode's).
DECODES = {("EAGLE", 1): 1, ("EAGLE", 2): 1, ("EAGLE3", 1): 16, ("EAGLE3", 2): 16}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd_tp_spec")
    target = build_random_model(root / "t", "llama", num_layers=4, num_heads=4, num_kv_heads=2)
    return {"target": target, "EAGLE": build_random_draft(target, root / "e", "EAGLE", seed=3),
            "EAGLE3": build_random_draft(target, root / "e3", "EAGLE3", draft_vocab_size=60, seed=4)}


def spec_flags(dirs: dict[str, Path], algo: str | None) -> tuple[str, ...]:
    if algo is None:
        return ()
    return ("--speculative-algorithm", algo, "--speculative-draft-model-path", str(dirs[algo]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5")


@pytest.fixture(scope="module")
def decodes(dirs) -> Iterator[dict[tuple[str, int], ServerProcess]]:
    servers: dict[tuple[str, int], ServerProcess] = {}
    try:
        for (algo, tp), page in DECODES.items():
            servers[algo, tp] = ServerProcess(
                dirs["target"], "--disaggregation-mode", "decode", "--tp-size", str(tp), "--page-size", str(page),
                "--max-total-tokens", "4096", *(("--debug-tp-agreement",) if tp > 1 else ()), *spec_flags(dirs, algo))
        yield servers
        for d in servers.values():
            d.assert_pools_full()
    finally:
        for d in servers.values():
            d.close()


@pytest.fixture(scope="module")
def reference(dirs) -> tuple[list[list[int]], list[list[int]]]:
    from pdserve import Engine

    rng = random.Random(51)
    prompts = [[rng.randrange(6, 90) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    engine = Engine(model_path=str(dirs["target"]), max_total_tokens=4096)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    return prompts, [o["output_ids"] for o in outs]


def transfer_bytes(server: ServerProcess) -> dict[str, float]:
    values = metric_values(server.client.get("/metrics").text)
    return {k: values[f'pdserve:kv_transfer_bytes_total{{kind="{k}"}}'] for k in ("target_kv", "draft_kv", "features")}


@pytest.mark.parametrize("p_algo,p_tp", [(a, tp) for a in (None, "EAGLE", "EAGLE3") for tp in (1, 2)],
                         ids=[f"p-{a or 'plain'}-tp{tp}" for a in (None, "EAGLE", "EAGLE3") for tp in (1, 2)])
def test_tp_speculative_pairs_equal_colocated(dirs, decodes, reference, p_algo, p_tp):
    prompts, want = reference
    cells = [(algo, tp) for algo, tp in DECODES if not (p_tp == 1 and tp == 1) and p_algo in (None, algo)]
    rng = random.Random(hash((p_algo, p_tp)) & 0xFFFF)
    for page in sorted({DECODES[c] for c in cells}):
        boot = free_port()
        p = ServerProcess(dirs["target"], "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                          str(boot), "--tp-size", str(p_tp), "--page-size", str(page), "--chunked-prefill-size", "16",
                          "--max-total-tokens", "4096", *spec_flags(dirs, p_algo))
        try:
            for cell in [c for c in cells if DECODES[c] == page]:
                d = decodes[cell]
                # Decode would serve prompts it saw in another cell from its prefix cache.
                assert d.client.post("/flush_cache").status_code == 200
                before = [transfer_bytes(s) for s in (p, d)]
                outs = pd_generate_all(p, d, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
                assert [o["output_ids"] for o in outs] == want, (p_algo, p_tp, cell, page)
                assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in outs), cell
                # Rank 0 of each side counts: prefill rank 0 holds 1/p_tp of the KV heads
                # (target and draft alike: the draft is sharded too) and sends all of them,
                # decode rank 0 receives 1/d_tp of them.
                sent, received = ({k: after - b[k] for k, after in transfer_bytes(s).items()}
                                  for s, b in zip((p, d), before))
                shares = p_algo == cell[0]
                assert (sent["draft_kv"] > 0, sent["features"] > 0) == (shares, not shares), sent
                for kind in ("target_kv", "draft_kv"):
                    assert sent[kind] * p_tp == received[kind] * cell[1], (kind, sent, received)
                # Features are whole rows on every prefill rank: rank 0 sends each row once,
                # split over the decode ranks, which all-gather it (--debug-tp-agreement
                # and the equal outputs check the gathered rows).
                assert sent["features"] == received["features"] * cell[1], (sent, received)
            p.assert_pools_full()
        finally:
            p.close()
