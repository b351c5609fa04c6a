"""EAGLE3 heads in the other public layouts load and decode exactly like plain decoding:
no ``d2t`` (full draft vocabulary, with or without ``t2d``), no own ``lm_head`` (the
target's), the architecture names LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM /
LlamaForCausalLM, the speculators library's format, a draft narrower or wider than
its target (own embedding), and drafts with more than one layer.

Each layout's tensors land in the same parameters as the SGLang layout's (same
weights written both ways give identical parameters and outputs); the shapes the
SGLang layout cannot express are checked against the independent reference
implementation; unsupported fields are refused at load naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.speculative.draft_model import DraftConfig, DraftConfigError, EagleDraftModel
from pdserve.speculative.reference import DraftHead, target_pass
from pdserve.testing import build_random_draft, build_random_model, convert_eagle3_layout
from tests.speculative.test_draft_model import DraftRun
from tests.speculative.test_eagle_engine import assert_state_equals_fresh_prefill, prompts

pytestmark = pytest.mark.fast

T = 20
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("l3_t"), "llama", num_layers=4, num_heads=4,
                              num_kv_heads=2, hidden_size=64)


@pytest.fixture(scope="module")
def runner(target) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(target), max_total_tokens=256), target, TPGroup())


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inputs(hf_target) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft rows (x_{p+1}, f_p) of one random sequence: tokens [T + 1], EAGLE3 features [T + 1, 3H]."""
    ids = torch.randint(6, 90, (1, T + 2), generator=torch.Generator().manual_seed(5))
    feats = target_pass(hf_target, ids, [0, 1, 2])["eagle3"]  # = the ids build_random_draft writes
    return ids[0, 1:], feats[0, :-1]


def run_head(run: DraftRun, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Extend over T rows, then one chain step at position T: outputs and logits of both."""
    tokens, f = inputs
    ext = run.run(tokens[:T], f[:T], prefix=0, from_target=True)
    step = run.run(tokens[T:T + 1], ext[T - 1:T], prefix=T, from_target=False)
    with torch.no_grad():
        return ext, step, run.model.compute_logits(ext), run.model.compute_logits(step)


def target_ids(model: EagleDraftModel) -> torch.Tensor:
    """Target id of each draft logit column."""
    mapping = model.draft_to_target
    return mapping if mapping is not None else torch.arange(model.config.draft_vocab_size)


def params(model: EagleDraftModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.named_parameters() if k != "d2t"}


# ---- every layout lands in the same parameters ---------------------------------------------------
@pytest.fixture(scope="module")
def standard(tmp_path_factory, target) -> dict[str, Path]:
    """SGLang-layout heads the other layouts are written from: full vocabulary (d2t all
    zeros), a 60-token draft vocabulary, and a narrow two-layer head."""
    root = tmp_path_factory.mktemp("std")
    return {"full": build_random_draft(target, root / "full", "EAGLE3", seed=3),
            "vd60": build_random_draft(target, root / "vd60", "EAGLE3", draft_vocab_size=60, seed=4),
            "multi": build_random_draft(target, root / "multi", "EAGLE3", draft_vocab_size=60, seed=5,
                                        num_layers=2, hidden_size=32)}


SAME_WEIGHTS = {  # name: (standard head, convert_eagle3_layout options)
    "no_d2t": ("full", dict(layout="sglang", d2t=False)),
    "no_d2t_no_t2d": ("full", dict(layout="sglang", d2t=False, t2d=False)),
    "arch_LlamaForCausalLM": ("vd60", dict(layout="sglang", architecture="LlamaForCausalLM")),
    "arch_Eagle3LlamaForCausalLM_midlayer": ("vd60", dict(layout="sglang", architecture="Eagle3LlamaForCausalLM")),
    "vllm": ("vd60", dict(layout="vllm")),
    "speculators": ("vd60", dict(layout="speculators")),
    "speculators_no_d2t": ("full", dict(layout="speculators", d2t=False, t2d=False)),
    "speculators_Eagle3DraftModel": ("vd60", dict(layout="speculators", architecture="Eagle3DraftModel")),
    "vllm_two_layers_narrow": ("multi", dict(layout="vllm")),
    "speculators_two_layers_narrow": ("multi", dict(layout="speculators")),
}


@pytest.mark.parametrize("name", list(SAME_WEIGHTS))
def test_layout_maps_to_the_same_parameters(tmp_path, target, runner, standard, inputs, name):
    std_name, options = SAME_WEIGHTS[name]
    layout = options.pop("layout")
    other = convert_eagle3_layout(standard[std_name], tmp_path / name, layout, target, **options)
    a, b = DraftRun(runner, standard[std_name], "EAGLE3"), DraftRun(runner, other, "EAGLE3")
    assert a.cfg.capture_layers == b.cfg.capture_layers == (1, 2, 3)
    assert a.cfg.feature_width == b.cfg.feature_width == 3 * 64
    assert b.cfg.layout == ("speculators" if layout == "speculators" else "sglang")
    pa, pb = params(a.model), params(b.model)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    assert torch.equal(target_ids(a.model), target_ids(b.model))
    for x, y in zip(run_head(a, inputs), run_head(b, inputs)):
        assert torch.equal(x, y)
    if not options.get("d2t", True):
        assert not b.cfg.has_d2t and b.model.draft_to_target is None and b.cfg.draft_vocab_size == runner.config.vocab_size


def test_head_without_lm_head_uses_the_targets(tmp_path, target, runner, standard, inputs):
    """No lm_head (and no d2t): logits are the target's head over norm(h), the same as a
    head whose own lm_head is a copy of the target's."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(standard["full"], copy)
    state = load_file(str(copy / "model.safetensors"))
    target_state = load_file(str(target / "model.safetensors"))
    state["lm_head.weight"] = target_state["lm_head.weight"]
    save_file(state, str(copy / "model.safetensors"))
    headless = tmp_path / "headless"
    shutil.copytree(copy, headless)
    del state["lm_head.weight"], state["d2t"]
    save_file(state, str(headless / "model.safetensors"))
    a, b = DraftRun(runner, copy, "EAGLE3"), DraftRun(runner, headless, "EAGLE3")
    assert not b.cfg.own_head and not hasattr(b.model, "lm_head")
    for x, y in zip(run_head(a, inputs), run_head(b, inputs)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    # A d2t that moves ids cannot go with the target's head (its columns are in target order).
    state["d2t"] = torch.zeros(runner.config.vocab_size, dtype=torch.int64)
    state["d2t"][3] = 1
    save_file(state, str(headless / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t: nonzero offsets"):
        DraftRun(runner, headless, "EAGLE3")


def test_speculators_trained_embedding_is_used(tmp_path, target, runner, standard, inputs):
    """A speculators head whose embedding was trained (embed_requires_grad) reads its own
    embed_tokens; otherwise it shares the target's (and ignores the stored copy)."""
    from safetensors.torch import load_file, save_file

    spec = convert_eagle3_layout(standard["vd60"], tmp_path / "s", "speculators", target)
    base = run_head(DraftRun(runner, standard["vd60"], "EAGLE3"), inputs)
    state = load_file(str(spec / "model.safetensors"))
    state["embed_tokens.weight"] = state["embed_tokens.weight"] * 1.5
    save_file(state, str(spec / "model.safetensors"))
    shared = DraftRun(runner, spec, "EAGLE3")
    assert not shared.cfg.own_embed
    for x, y in zip(base, run_head(shared, inputs)):
        assert torch.equal(x, y)  # the scaled copy is not read
    raw = json.loads((spec / "config.json").read_text())
    raw["embed_requires_grad"] = True
    (spec / "config.json").write_text(json.dumps(raw))
    own = DraftRun(runner, spec, "EAGLE3")
    assert own.cfg.own_embed and torch.equal(own.model.embed_tokens.weight, state["embed_tokens.weight"])
    assert not torch.allclose(base[0], run_head(own, inputs)[0])


# ---- shapes only the new layouts express: against the reference -----------------------------------
REFERENCE_SHAPES = {
    "narrow": dict(hidden_size=32),
    "wide": dict(hidden_size=96),
    "three_layers": dict(num_layers=3),
    "norm_before_residual_fc_bias": dict(norm_before_residual=True, fc_bias=True),
    "two_layers_narrow_nbr": dict(num_layers=2, hidden_size=48, norm_before_residual=True),
}


@pytest.mark.parametrize("name", list(REFERENCE_SHAPES))
def test_new_shapes_match_the_reference(tmp_path, target, runner, hf_target, inputs, name):
    from safetensors.torch import load_file

    opts = REFERENCE_SHAPES[name]
    draft_dir = build_random_draft(target, tmp_path / name, "EAGLE3", draft_vocab_size=60, seed=7, **opts)
    state = load_file(str(draft_dir / "model.safetensors"))
    vocab = torch.arange(60) + state["d2t"]
    hidden = opts.get("hidden_size", 64)
    dims = dict(hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4) if hidden != 64 else {}
    ref = DraftHead("EAGLE3", hf_target.config, hf_target.model.embed_tokens.weight, hf_target.lm_head.weight,
                    vocab, num_layers=opts.get("num_layers", 1), dims=dims,
                    norm_before_residual=opts.get("norm_before_residual", False),
                    fc_bias=opts.get("fc_bias", False), own_embed=bool(dims))
    ref.load_state_dict({k: v for k, v in state.items() if k not in ("d2t", "t2d")})
    run = DraftRun(runner, draft_dir, "EAGLE3")
    cfg = run.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.target_hidden_size) == (opts.get("num_layers", 1), hidden, 64)
    assert cfg.own_embed == (hidden != 64) and cfg.feature_width == 3 * 64
    assert cfg.norm_before_residual == opts.get("norm_before_residual", False)
    assert cfg.fc_bias == opts.get("fc_bias", False)
    assert len(run.model.layers) == cfg.num_layers
    assert [lay.self_attn.layer_id for lay in run.model.layers] == list(range(cfg.num_layers))
    tokens, f = inputs
    with torch.no_grad():
        ref_steps = ref.ttt(tokens[None], f[None], depth=2)
    ext, step, ext_logits, _ = run_head(run, inputs)
    torch.testing.assert_close(ext, ref_steps[0][0, :T], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ext_logits, ref.logits(ref_steps[0][0, :T]).float(), atol=1e-4, rtol=1e-4)
    # The chain step reads every layer's draft KV of the prefix from the pool.
    torch.testing.assert_close(step[0], ref_steps[1][0, T - 1], atol=2e-5, rtol=1e-4)
    # Every layout of the same head gives the same outputs.
    for layout in ("vllm", "speculators"):
        other = DraftRun(runner, convert_eagle3_layout(draft_dir, tmp_path / layout, layout, target), "EAGLE3")
        for x, y in zip((ext, step), run_head(other, inputs)[:2]):
            assert torch.equal(x, y)


# ---- in the engine: speculative greedy output equals plain ----------------------------------------
ENGINE_HEADS = {  # name: build_random_draft options
    "no_d2t": dict(d2t=False),
    "no_d2t_no_t2d": dict(d2t=False, t2d=False),
    "no_lm_head": dict(d2t=False, t2d=False, lm_head=False),
    "arch_LlamaForCausalLM": dict(architecture="LlamaForCausalLM", draft_vocab_size=60),
    "vllm_Eagle3LlamaForCausalLM": dict(layout="vllm", draft_vocab_size=60),
    "speculators": dict(layout="speculators", draft_vocab_size=60),
    "speculators_no_d2t": dict(layout="speculators", d2t=False, t2d=False),
    "narrow_speculators": dict(layout="speculators", hidden_size=32, draft_vocab_size=60),
    "wide": dict(hidden_size=96, draft_vocab_size=60),
    "two_layers_vllm": dict(layout="vllm", num_layers=2, draft_vocab_size=60),
    "three_layers_narrow_speculators": dict(layout="speculators", num_layers=3, hidden_size=48,
                                            norm_before_residual=True, fc_bias=True, draft_vocab_size=60),
}

_PLAIN: dict[str, Any] = {}


@pytest.mark.parametrize("name", list(ENGINE_HEADS))
def test_engine_greedy_equals_plain(tmp_path, make_engine, target, name):
    opts = ENGINE_HEADS[name]
    draft_dir = build_random_draft(target, tmp_path / name, "EAGLE3", seed=11, **opts)
    ps = prompts(4, 5, 40, seed=21)
    if "ref" not in _PLAIN:
        _PLAIN["ref"] = [r["output_ids"] for r in make_engine(target).generate(input_ids=ps, sampling_params=GREEDY)]
    engine = make_engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft_dir),
                         speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    worker = engine._scheduler.spec
    layers = opts.get("num_layers", 1)
    assert len(worker.draft.layers) == layers
    assert len(worker.draft_pool.k) == len(worker.draft_pool.v) == layers  # a KV layer per draft layer
    assert worker.draft_pool.k[0].shape[-1] == opts.get("hidden_size", 64) // 4
    assert worker.features.shape[1] == 3 * 64
    got = engine.generate(input_ids=ps, sampling_params=GREEDY)
    assert [r["output_ids"] for r in got] == _PLAIN["ref"]
    assert all(r["meta_info"]["spec_verify_ct"] >= 1 for r in got)
    assert 1.0 <= worker.avg_accept_length <= 5
    # Draft KV was written in every layer.
    assert all(bool(k.abs().sum() > 0) for k in worker.draft_pool.k)


def test_multilayer_draft_kv_equals_recomputation(tmp_path, make_engine, target):
    """A narrow three-layer head through verify rounds that accept drafts: every draft KV
    layer, the carried hidden state and the top-k equal a fresh prefill's."""
    draft_dir = build_random_draft(target, tmp_path / "d", "EAGLE3", seed=13, layout="speculators",
                                   num_layers=3, hidden_size=32, draft_vocab_size=60)
    ps = prompts(2, 10, 30, seed=23)
    ref = make_engine(target).generate(input_ids=ps, sampling_params=GREEDY)
    kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft_dir),
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6, page_size=4)
    engine, fresh = make_engine(target, **kw), make_engine(target, **kw)
    assert len(engine._scheduler.spec.draft_pool.k) == 3
    assert assert_state_equals_fresh_prefill(engine, fresh, ps, [r["output_ids"] for r in ref], 4) >= 3
    assert engine._scheduler.spec.avg_accept_length > 3  # the oracle's drafts were accepted


# ---- what is still refused, naming the field ----------------------------------------------------
def _edit(d: Path, drop: tuple[str, ...] = (), **changes: Any) -> None:
    raw = json.loads((d / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))


def _retensor(d: Path, drop: tuple[str, ...] = (), **add: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    for key in drop:
        del state[key]
    state.update(add)
    save_file(state, str(d / "model.safetensors"))


def test_unsupported_layouts_are_refused_naming_the_field(tmp_path, target, runner, standard):
    def fresh(src: str, layout: str = "sglang") -> Path:
        out = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        return convert_eagle3_layout(standard[src], out, layout, target)

    def refused(d: Path, match: str, algo: str = "EAGLE3") -> None:
        with pytest.raises(DraftConfigError, match=match):
            DraftConfig.from_dir(d, algo, runner.config)

    d = fresh("vd60", "speculators")
    _edit(d, speculators_model_type="eagle")
    refused(d, "speculators_model_type 'eagle'")
    d = fresh("vd60", "speculators")
    refused(d, "EAGLE3 draft", "EAGLE")
    raw = json.loads((d / "config.json").read_text())
    _edit(d, transformer_layer_config=dict(raw["transformer_layer_config"], model_type="qwen3"))
    refused(d, "transformer_layer_config.model_type 'qwen3'")
    d = fresh("vd60", "speculators")
    _edit(d, norm_before_fc=True)
    refused(d, "norm_before_fc")
    d = fresh("vd60", "speculators")
    _edit(d, drop=("transformer_layer_config",))
    refused(d, "transformer_layer_config")
    # SGLang's own extra-layer names (additional_layers.*) compute something else.
    d = fresh("multi")
    from safetensors.torch import load_file
    state = load_file(str(d / "model.safetensors"))
    _retensor(d, drop=tuple(k for k in state if k.startswith("layers.1.")),
              **{k.replace("layers.1.", "additional_layers.0."): v for k, v in state.items()
                 if k.startswith("layers.1.")})
    refused(d, "additional_layers")
    # A reduced draft vocabulary needs its d2t map.
    d = fresh("vd60")
    _retensor(d, drop=("d2t",))
    refused(d, "draft_vocab_size 60 .* no d2t")
    # No lm_head: the target's is used, so the draft vocabulary must be the target's.
    d = fresh("vd60")
    _retensor(d, drop=("lm_head.weight",))
    refused(d, "no lm_head.weight but draft_vocab_size 60")
    # Another width than the target's needs the head's own embedding.
    d = fresh("multi")
    _retensor(d, drop=("embed_tokens.weight",))
    refused(d, "hidden_size 32 differs .* embed_tokens.weight")
    d = fresh("multi")
    _edit(d, target_hidden_size=128)
    refused(d, "target_hidden_size 128")
    d = fresh("vd60")
    _edit(d, tie_word_embeddings=True)
    refused(d, "tie_word_embeddings")
    d = fresh("vd60")
    _edit(d, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": False})
    refused(d, "use_aux_hidden_state")
    d = fresh("vd60")
    _edit(d, eagle_aux_hidden_state_layer_ids=[1, 2, 2])  # vLLM's ids disagreeing with SGLang's [0, 1, 2]
    refused(d, "name different target layers")
    d = fresh("vd60", "vllm")
    _edit(d, eagle_aux_hidden_state_layer_ids=[0, 1, 2])  # vLLM's convention: inputs; layer 0's is the embedding
    refused(d, r"target layers \[0, 1, 2\]")
    # EAGLE-1 heads stay single-layer, of the target's width.
    e = build_random_draft(target, tmp_path / "e", "EAGLE")
    _edit(e, num_hidden_layers=2)
    refused(e, "num_hidden_layers 2", "EAGLE")
