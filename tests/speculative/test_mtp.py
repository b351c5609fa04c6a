"""MTP: a GLM-4.5 checkpoint's own NextN layer as the EAGLE draft (no
--speculative-draft-model-path, SGLang's default; also SGLang's NEXTN spelling). The
draft's math equals an independent reference (transformers' own GLM-4.5 decoder layer
loaded with the NextN tensors, the eh_proj / enorm / hnorm / shared_head.norm algebra
written out), an FP8 checkpoint's NextN layer loads dequantised, bad checkpoints are
refused naming the problem, and in the engine the output equals plain greedy decoding
(chain and tree, TP 1 and TP 2) with acceptance reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ConfigError, ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.speculative.draft_config import MTP_LAYOUT, draft_identity
from pdserve.speculative.draft_model import DraftConfig, DraftConfigError, EagleDraftModel
from pdserve.testing import build_fp8_checkpoint, build_random_model
from tests.conftest import random_prompts
from tests.speculative.test_draft_model import DraftRun

LAYERS = 3  # layer 0 dense, 1-2 MoE; the NextN layer is model.layers.3 (MoE)
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPTS = random_prompts(5, 4, 40, vocab=95, seed=7)


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("mtp_glm"), "glm4_moe", num_layers=LAYERS)


@pytest.fixture(scope="module")
def runner(glm) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(glm), max_total_tokens=256), glm, TPGroup())


def _mtp_args(glm: Path, shape: tuple[int, int, int] | None = None, **kw) -> dict:
    out = dict(speculative_algorithm="EAGLE", **kw)
    if shape is not None:
        out.update(speculative_num_steps=shape[0], speculative_eagle_topk=shape[1],
                   speculative_num_draft_tokens=shape[2])
    return out


# ---- the draft's configuration and math ------------------------------------------------------
@pytest.mark.fast
def test_default_draft_is_the_checkpoints_nextn_layer(glm, runner):
    for algo in ("EAGLE", "NEXTN"):
        args = ServerArgs(model_path=str(glm), speculative_algorithm=algo)
        assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("EAGLE", str(glm))
    cfg = DraftConfig.from_dir(glm, "EAGLE", runner.config)
    assert cfg.is_mtp and cfg.layout == MTP_LAYOUT and cfg.mtp_prefix == f"model.layers.{LAYERS}."
    assert (cfg.num_layers, cfg.hidden_size, cfg.feature_width, cfg.capture_layers) == (1, 64, 64, ())
    assert not cfg.own_embed and not cfg.own_head and cfg.draft_vocab_size == runner.config.vocab_size
    # GLM-4.5's NextN layer is a MoE layer (it stores a router), at draft layer 0.
    assert cfg.layer.moe is not None and cfg.layer.moe.sparse_layers == (0,)
    assert cfg.layer.rope == runner.config.rope and cfg.layer.attention_bias
    # The PD identity: the target checkpoint + "MTP", the same for every server of the model.
    ident = draft_identity(glm, "EAGLE", MTP_LAYOUT)
    assert ident == draft_identity(Path(str(glm)), "EAGLE", MTP_LAYOUT) != draft_identity(glm, "EAGLE")


def _hf_nextn_reference(glm: Path, tmp: Path):
    """transformers' models: the target, and one whose layer LAYERS is the NextN layer's
    decoder (the checkpoint with num_hidden_layers + 1: transformers loads that layer's
    tensors through its own name conversion and ignores the NextN-only ones)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(glm), dtype=torch.float32).eval()
    wide = tmp / "wide"
    shutil.copytree(glm, wide)
    raw = json.loads((wide / "config.json").read_text())
    raw.update(num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=0)
    (wide / "config.json").write_text(json.dumps(raw))
    plus = AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32).eval()
    return target, plus, load_file(str(glm / "model.safetensors"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.fast
def test_mtp_draft_equals_the_nextn_reference(tmp_path, glm, runner):
    """Draft row p reads (x_{p+1}, f_p), f the target's final normed hidden state (what
    SGLang and vLLM hand the layer); a chain step reads the layer's own normed output."""
    target, plus, state = _hf_nextn_reference(glm, tmp_path)
    pre, eps = f"model.layers.{LAYERS}.", target.config.rms_norm_eps
    T = 20
    ids = torch.randint(6, 90, (1, T + 2), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = target.model(ids).last_hidden_state[0]                       # [T+2, H] post-norm

        def reference(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            emb = target.model.embed_tokens(tokens)
            h = torch.cat([_rms(emb, state[pre + "enorm.weight"], eps), _rms(hidden, state[pre + "hnorm.weight"], eps)],
                          -1) @ state[pre + "eh_proj.weight"].T
            pos = torch.arange(len(tokens))[None]
            mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
            out = plus.model.layers[LAYERS](h[None], attention_mask=mask, position_ids=pos,
                                            position_embeddings=plus.model.rotary_emb(h[None], pos))
            out = out[0] if isinstance(out, tuple) else out
            return _rms(out[0], state[pre + "shared_head.norm.weight"], eps)

        tokens, f = ids[0, 1:], feats[:-1]
        ref = reference(tokens[:T], f[:T])
        run = DraftRun(runner, glm, "EAGLE")
        assert run.cfg.is_mtp
        got = run.run(tokens[:T], f[:T], prefix=0, from_target=True)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(run.model.compute_logits(got), target.lm_head(ref).float(), atol=1e-4, rtol=1e-4)
        # A chain step at position T: token x_{T+1} with the layer's own output at T - 1.
        chained = reference(tokens[:T + 1], torch.cat([f[:T], ref[T - 1:T]]))
        step = run.run(tokens[T:T + 1], got[T - 1:T], prefix=T, from_target=False)
        torch.testing.assert_close(step[0], chained[T], atol=1e-4, rtol=1e-4)


@pytest.mark.fast
def test_fp8_checkpoint_nextn_layer_loads_dequantised(tmp_path, glm):
    """The NextN layer of an FP8 checkpoint is quantised like the rest: the draft loads it
    dequantised (as the target's loader does), equal to the dequantised checkpoint's. The
    target skips that layer's fp8 weights together with their scales (before, the scales
    were left over and reported as unexpected tensors: an FP8 GLM-4.5 did not load)."""
    deq = tmp_path / "deq"
    fp8 = build_fp8_checkpoint(glm, tmp_path / "fp8", "compressed-tensors", strategy="channel", dequantized_dir=deq)
    stored = load_file(str(fp8 / "model.safetensors"))
    assert stored[f"model.layers.{LAYERS}.eh_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"model.layers.{LAYERS}.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    models = {}
    for name, d in (("fp8", fp8), ("deq", deq)):
        r = ModelRunner(ServerArgs(model_path=str(d), max_total_tokens=64), d, TPGroup())
        cfg = DraftConfig.from_dir(d, "EAGLE", r.config)
        assert (cfg.quant is not None) == (name == "fp8")
        models[name] = EagleDraftModel.load(d, cfg, r.model.model.embed_tokens, r.model.lm_head, r.device,
                                            torch.float32)
    a, b = dict(models["fp8"].named_parameters()), dict(models["deq"].named_parameters())
    assert a.keys() == b.keys() and "fc.weight" in a and "layers.0.mlp.experts.gate_up.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.fast
def test_bad_mtp_checkpoints_are_refused(tmp_path, glm, runner):
    with pytest.raises(DraftConfigError, match="--speculative-algorithm EAGLE \\(or NEXTN\\), not EAGLE3"):
        DraftConfig.from_dir(glm, "EAGLE3", runner.config)
    with pytest.raises(ConfigError, match="draft with --speculative-algorithm EAGLE \\(or NEXTN\\), not EAGLE3"):
        ServerArgs(model_path=str(glm), speculative_algorithm="EAGLE3")
    # A NextN tensor missing: named.
    broken = tmp_path / "broken"
    shutil.copytree(glm, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state[f"model.layers.{LAYERS}.hnorm.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(DraftConfigError, match=f"lacks the NextN layer's model.layers.{LAYERS}.hnorm.weight"):
        DraftConfig.from_dir(broken, "EAGLE", runner.config)
    # An architecture pdserve does not draft NextN layers for (a Llama config with the key).
    llama = build_random_model(tmp_path / "llama", "llama", num_nextn_predict_layers=1)
    with pytest.raises(ConfigError, match="drafts with them only for Glm4MoeForCausalLM, not "
                                          "\\['LlamaForCausalLM'\\] \\(DeepSeek-V3 is not a supported"):
        ServerArgs(model_path=str(llama), speculative_algorithm="EAGLE")
    # NEXTN on a checkpoint without NextN layers.
    plain = build_random_model(tmp_path / "plain", "glm4_moe", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="NEXTN drafts with the checkpoint's own multi-token-prediction layers"):
        ServerArgs(model_path=str(plain), speculative_algorithm="NEXTN")
    # Another model's NextN layer given as the draft: refused by shape.
    other = build_random_model(tmp_path / "other", "glm4_moe", num_layers=LAYERS, hidden_size=32)
    with pytest.raises(DraftConfigError, match="hidden_size 32 differs from the target's 64"):
        DraftConfig.from_dir(other, "EAGLE", runner.config)


# ---- in the engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 1, 3), (3, 2, 6)], ids=["seed-chain", "tree"])
def test_mtp_greedy_equals_plain(make_engine, glm, shape):
    ref = [r["output_ids"] for r in make_engine(glm).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    engine = make_engine(glm, chunked_prefill_size=16, **_mtp_args(glm, shape))
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in got] == ref
    assert all(r["meta_info"]["spec_verify_ct"] >= 1 for r in got)
    accept = engine._scheduler.state()["avg_spec_accept_length"]
    assert 1.0 <= accept <= shape[0] + 1
    # Cache hits: the draft state is rebuilt from the cached features.
    again = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in again] == ref
    assert sum(r["meta_info"]["cached_tokens"] for r in again) > 0


def test_mtp_tp2_equals_tp1_plain(make_engine, glm):
    ref = [r["output_ids"] for r in make_engine(glm).generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    engine = make_engine(glm, tp_size=2, page_size=16, chunked_prefill_size=16, debug_tp_agreement=True,
                         **_mtp_args(glm, (2, 1, 3)))
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in got] == ref
    assert all(r["meta_info"]["spec_verify_ct"] >= 1 for r in got)
