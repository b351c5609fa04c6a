"""The built-in MTP draft (a GLM-4.5 checkpoint's NextN layer, no
--speculative-draft-model-path) across a real prefill/decode pair, decode at TP 2 with
--debug-tp-agreement: a plain prefill feeding an MTP decode (the first seed's cell: the
prefill sends the target features, decode builds the draft state) and an MTP prefill
feeding it (the same checkpoint + "MTP" on both sides: the draft state, draft KV
included, is handed over, no features). Greedy outputs equal the colocated engine."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import pytest

from pdserve.testing import build_random_model
from tests.disagg.test_pd_servers import pd_generate_all
from tests.disagg.test_pd_tp_speculative import transfer_bytes
from tests.server.conftest import ServerProcess, free_port

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# The first seed's decode shape, SGLang's spelling (--speculative-algo is a unique prefix).
MTP = ("--speculative-algo", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "3")


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("pd_mtp"), "glm4_moe", num_layers=3)


@pytest.fixture(scope="module")
def reference(glm) -> tuple[list[list[int]], list[list[int]]]:
    from pdserve import Engine

    rng = random.Random(61)
    prompts = [[rng.randrange(6, 90) for _ in range(rng.randrange(5, 50))] for _ in range(4)]
    engine = Engine(model_path=str(glm), max_total_tokens=4096)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    return prompts, [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def decode(glm) -> Iterator[ServerProcess]:
    d = ServerProcess(glm, "--disaggregation-mode", "decode", "--tp-size", "2", "--max-total-tokens", "4096",
                      "--debug-tp-agreement", *MTP)
    try:
        yield d
        d.assert_pools_full()
    finally:
        d.close()


@pytest.mark.parametrize("p_mtp", [False, True], ids=["p-plain", "p-mtp"])
def test_mtp_decode_behind_plain_and_mtp_prefill_equals_colocated(glm, decode, reference, p_mtp):
    prompts, want = reference
    boot = free_port()
    p = ServerProcess(glm, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                      "--chunked-prefill-size", "16", "--max-total-tokens", "4096", *(MTP if p_mtp else ()))
    try:
        assert decode.client.post("/flush_cache").status_code == 200  # the other cell's prompts
        before = transfer_bytes(p)
        rng = random.Random(int(p_mtp))
        outs = pd_generate_all(p, decode, boot, prompts, GREEDY, [rng.getrandbits(63) for _ in prompts])
        assert [o["output_ids"] for o in outs] == want
        assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in outs)
        info = decode.client.get("/get_server_info").json()
        assert info["avg_spec_accept_length"] >= 1.0
        sent = {k: v - before[k] for k, v in transfer_bytes(p).items()}
        # An MTP prefill shares decode's draft (same checkpoint + "MTP"): draft KV, no features.
        assert (sent["draft_kv"] > 0, sent["features"] > 0) == (p_mtp, not p_mtp), sent
        p.assert_pools_full()
    finally:
        p.close()


# ---- the first seed's command lines, end to end ----------------------------------------------
# The seed's prefill and decode lines (../shared/seeds/000_*) at TP 2, on a tiny FP8
# GLM-4.5 checkpoint whose NextN layer is quantised like the rest; what pdserve adds
# (--host / --port, its own) is left out: loopback needs no PD secret.
SEED_PREFILL = ("--disaggregation-mode", "prefill", "--tp-size", "2", "--mem-fraction-static", "0.8",
                "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "fa3", "--chunked-prefill-size", "65536")
SEED_DECODE = ("--disaggregation-mode", "decode", "--tp-size", "2", "--mem-fraction-static", "0.8",
               "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "fa3", *MTP)


def test_seed_command_lines_behind_the_router_equal_colocated(glm, tmp_path):
    from safetensors.torch import load_file

    from pdserve.testing import build_fp8_checkpoint
    from tests.router.conftest import RouterProcess

    fp8 = build_fp8_checkpoint(glm, tmp_path / "fp8", "compressed-tensors", strategy="channel")
    stored = load_file(str(fp8 / "model.safetensors"))
    assert stored["model.layers.3.eh_proj.weight"].dtype == stored["model.layers.3.self_attn.q_proj.weight"].dtype
    rng = random.Random(71)
    prompts = [[rng.randrange(6, 90) for _ in range(rng.randrange(5, 50))] for _ in range(3)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    chat = {"model": "default", "messages": [{"role": "user", "content": "Repeat: abc123"}], "max_tokens": 12,
            "temperature": 0}
    colocated = ServerProcess(fp8, *SEED_DECODE[2:])  # the decode line without --disaggregation-mode
    try:
        want = [o["output_ids"] for o in colocated.client.post("/generate", json=body).json()]
        want_chat = colocated.client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        args = colocated.client.get("/get_server_info").json()["server_args"]
        # No draft path on the line: the checkpoint's own (FP8, dequantised) NextN layer drafts.
        assert (args["speculative_algorithm"], args["speculative_draft_model_path"]) == ("EAGLE", str(fp8))
    finally:
        colocated.close()
    boot = free_port()
    p = ServerProcess(fp8, *SEED_PREFILL, "--disaggregation-bootstrap-port", str(boot))
    d = router = None
    try:
        d = ServerProcess(fp8, *SEED_DECODE)
        router = RouterProcess("--pd-disaggregation", "--prefill", p.url, str(boot), "--decode", d.url)
        r = router.client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == want
        assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in r.json())
        r = router.client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == want_chat, r.text
        p.assert_pools_full()
        d.assert_pools_full()
    finally:
        if router is not None:
            router.close()
        if d is not None:
            d.close()
        p.close()
