"""The first seed's deployment (GLM-4.5-Air-FP8 at TP4 over PD, ../shared/seeds/000_*) typed
as its users type it, on a model the test builds: SGLang's flag spellings (a unique prefix,
`--speculative-algo`; `--attention-backend fa3`; fp8 KV) are accepted, and what pdserve
still asks for on top is refused naming the flag: the PD secret when listening beyond
loopback. The decode line's draft is the checkpoint's own MTP layer, as in SGLang."""

from __future__ import annotations

import shlex

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.model import attention_backends

PREFILL = ("--disaggregation-mode prefill --tp-size 4 --mem-fraction-static 0.8 --kv-cache-dtype fp8_e4m3 "
           "--host 0.0.0.0 --attention-backend fa3 --port 30001 --chunked-prefill-size 65536")
DECODE = ("--disaggregation-mode decode --tp-size 4 --mem-fraction-static 0.8 --kv-cache-dtype fp8_e4m3 "
          "--host 0.0.0.0 --attention-backend fa3 --port 30011 "
          "--speculative-algo EAGLE --speculative-num-steps 2 --speculative-eagle-topk 1 "
          "--speculative-num-draft-tokens 3")
SECRET = ["--disaggregation-secret", "s" * 32]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pdserve.testing import build_random_draft, build_random_model

    root = tmp_path_factory.mktemp("seed_lines")
    # GLM-4.5-Air-shaped: one multi-token-prediction layer stored after the decoder's.
    target = build_random_model(root / "t", "glm4_moe", num_layers=2, num_heads=4, num_kv_heads=4)
    return target, build_random_draft(target, root / "e", "EAGLE")


def parse(model_dir, line: str, *extra: str) -> ServerArgs:
    return ServerArgs.from_cli(["--model-path", str(model_dir), *shlex.split(line), *extra])


def test_seed_prefill_line_is_accepted_with_the_pd_secret(model):
    target, _ = model
    with pytest.raises(ConfigError, match="--disaggregation-secret"):
        parse(target, PREFILL)  # listening beyond loopback: pdserve authenticates its PD control plane
    args = parse(target, PREFILL, *SECRET)
    assert (args.tp_size, args.kv_cache_dtype, args.chunked_prefill_size, args.port) == (4, "fp8_e4m3", 65536, 30001)
    assert args.resolved_attention_backend() == attention_backends.auto_backend("cpu")  # fa3 runs as auto


def test_seed_decode_line_drafts_with_the_checkpoints_mtp_layer(model):
    target, draft = model
    args = parse(target, DECODE, *SECRET)
    assert args.speculative_algorithm == "EAGLE"  # --speculative-algo: a unique prefix, as SGLang's parser takes
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (2, 1, 3)
    # No draft path: the checkpoint itself, read as its NextN layer (speculative/draft_config.py).
    assert args.speculative_draft_model_path == str(target)
    # An EAGLE head given explicitly is taken instead.
    assert parse(target, DECODE, *SECRET, "--speculative-draft-model-path", str(draft)
                 ).speculative_draft_model_path == str(draft)


def test_an_ambiguous_prefix_is_an_error_naming_the_candidates(model):
    target, _ = model
    with pytest.raises(ConfigError, match="ambiguous option: --speculative-num could match "
                                          "--speculative-num-steps, --speculative-num-draft-tokens"):
        parse(target, "--speculative-num 2")
