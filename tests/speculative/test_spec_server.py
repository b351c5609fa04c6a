"""The HTTP server with speculative decoding: flags on the command line, outputs equal to
plain decoding through the OpenAI and native routes, accept-length metrics, and startup
refusals that name the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.testing import build_random_draft, build_random_model
from tests.server.conftest import ServerProcess

PROMPTS = ["hello world", "the quick brown fox", "pdserve " * 6]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_srv")
    target = build_random_model(root / "t", "llama", num_layers=4, num_heads=4, num_kv_heads=2)
    return target, build_random_draft(target, root / "d", "EAGLE3", draft_vocab_size=50)


def test_server_with_eagle3_equals_plain_engine(dirs, make_engine):
    target, draft = dirs
    plain = make_engine(target)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    refs = plain.generate(PROMPTS, params)
    server = ServerProcess(target, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                           str(draft), "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                           "--speculative-num-draft-tokens", "5", "--chunked-prefill-size", "8")
    try:
        for prompt, ref in zip(PROMPTS, refs):
            r = server.client.post("/generate", json={"text": prompt, "sampling_params": params})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["output_ids"] == ref["output_ids"]
            assert body["meta_info"]["spec_verify_ct"] >= 1
            c = server.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})
            assert c.status_code == 200 and c.json()["choices"][0]["text"] == ref["text"]
        info = server.info()
        assert 1.0 <= info["avg_spec_accept_length"] <= 4.0
        assert info["server_args"]["speculative_algorithm"] == "EAGLE3"
        metrics = server.client.get("/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("pdserve:avg_spec_accept_length"))
        assert float(line.split()[-1]) >= 1.0
        server.assert_pools_full()
    finally:
        server.close()


@pytest.mark.parametrize("extra,flag", [
    (["--speculative-algorithm", "EAGLE"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "DRAFT",
      "--speculative-num-steps", "2"], "--speculative-num-steps"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "DRAFT"], "EAGLE3 draft"),
])
def test_bad_speculative_flags_stop_startup(dirs, extra, flag):
    target, draft = dirs
    argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", str(target), "--port", "0",
            *[str(draft) if a == "DRAFT" else a for a in extra]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert flag in proc.stderr, proc.stderr[-2000:]
