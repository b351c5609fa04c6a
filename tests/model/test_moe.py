"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against Hugging Face transformers on tiny
random checkpoints: greedy tokens and logprobs at TP 1, TP 2 and through a 1P1D pair; the
grouped expert compute and its TP sharding against a per-token reference; the router's
normalisations; refusals of what is not implemented."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdserve.model.loader import WeightLoadError, build_model
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.model.moe import FusedExperts, Router
from pdserve.model.parallel import TPGroup
from pdserve.model.registry import model_class
from tests.conftest import GREEDY, hf_greedy, random_prompts

NEW = 16
MOE_MODELS = ["qwen3_moe", "qwen3_moe_step2", "mixtral"]  # tests/conftest.py MODEL_SPECS


def _ids_and_lps(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def assert_matches(outs: list[tuple[list[int], list[float]]], ref: list[tuple[list[int], list[float]]]) -> None:
    assert len(outs) == len(ref)
    for (ids, lps), (ref_ids, ref_lps) in zip(outs, ref):
        assert ids == ref_ids
        assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4


@pytest.mark.fast
def test_layouts_are_what_the_specs_say(model_dirs):
    """The parity tests below cover what they claim: dense and sparse layers where the
    config puts them, and routing that spreads tokens over the experts."""
    cfg = ModelConfig.from_dir(model_dirs("qwen3_moe"))
    assert cfg.moe is not None and cfg.moe.sparse_layers == (0, 2) and cfg.moe.norm_topk_prob
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (8, 2, 32)
    assert ModelConfig.from_dir(model_dirs("qwen3_moe_step2")).moe.sparse_layers == (1,)
    mix = ModelConfig.from_dir(model_dirs("mixtral"))
    assert mix.moe.sparse_layers == (0, 1) and mix.moe.norm_topk_prob and not mix.qk_norm
    model = build_model(lambda: model_class(cfg)(cfg, TPGroup()), model_dirs("qwen3_moe"), "cpu", torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
    x = model.model.embed_tokens(torch.tensor(random_prompts(1, 80, 80)[0]))
    ids, _ = model.model.layers[0].mlp.gate(model.model.layers[0].post_attention_layernorm(x))
    assert len(set(ids.flatten().tolist())) == 8  # every expert gets tokens


@pytest.mark.fast
@pytest.mark.parametrize("name", MOE_MODELS)
def test_greedy_tokens_and_logprobs_match_transformers(name, model_dirs, make_engine):
    check_greedy_parity(model_dirs(name), make_engine, seed=len(name))


def check_greedy_parity(model_dir, make_engine, seed: int, new: int = NEW) -> None:
    """Greedy tokens and logprobs of pdserve's engine equal transformers', batched and one by one."""
    prompts = random_prompts(4, 3, 70, seed=seed)
    ref = hf_greedy(model_dir, prompts, new)
    engine = make_engine(model_dir)
    params = dict(GREEDY, max_new_tokens=new)
    together = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    engine.flush_cache()  # the one-by-one run computes again
    one_by_one = [engine.generate(input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
    assert_matches([_ids_and_lps(o) for o in together], ref)
    assert_matches([_ids_and_lps(o) for o in one_by_one], ref)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tp2_matches_transformers(name, model_dirs, make_engine):
    """TP 2: each rank holds half of every expert's intermediate dimension."""
    model_dir = model_dirs(name)
    prompts = random_prompts(3, 5, 60, seed=21)
    ref = hf_greedy(model_dir, prompts, NEW)
    engine = make_engine(model_dir, tp_size=2, chunked_prefill_size=32)
    outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=NEW), return_logprob=True)
    assert_matches([_ids_and_lps(o) for o in outs], ref)


@pytest.mark.fast
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_pd_pair_matches_transformers(name, model_dirs):
    """1P1D in one process (prefill chunked by 16, KV handed over by the transfer managers)."""
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.prefill_side import prefill_scheduler
    from tests.disagg.test_pd_schedulers import pools_full, run_pair, sched

    model_dir = model_dirs(name)
    prompts = random_prompts(4, 5, 50, seed=5)
    ref = hf_greedy(model_dir, prompts, NEW)
    dirs = {"target": model_dir}
    p = sched(prefill_scheduler, dirs, None, {"chunked_prefill_size": 16})
    d = sched(decode_scheduler, dirs, None, {}, fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    try:
        sampling = dict(GREEDY, max_new_tokens=NEW)
        assert run_pair(p, d, prompts, sampling) == [ids for ids, _ in ref]
        pools_full(p)
        pools_full(d)
    finally:
        p.close()
        d.close()


def test_pd_servers_with_tp2_prefill_match_transformers(model_dirs):
    """Real servers (Mooncake over loopback): a TP 2 prefill hands the KV its two ranks
    computed (each through half of every expert) to a TP 1 decode."""
    import asyncio
    import random

    from tests.disagg.test_pd_servers import pd_generate, pd_pair
    from tests.server.conftest import free_port

    model_dir = model_dirs("qwen3_moe")
    prompts = random_prompts(3, 5, 60, seed=9)
    ref = hf_greedy(model_dir, prompts, NEW)
    boot = free_port()
    rooms = [random.Random(9).getrandbits(63) + i for i in range(len(prompts))]
    with pd_pair(model_dir, boot, ("--tp-size", "2", "--chunked-prefill-size", "32"), ()) as (p, d):
        async def run_all() -> list:
            return await asyncio.gather(*[pd_generate(p, d, boot, {
                "input_ids": ids, "sampling_params": dict(GREEDY, max_new_tokens=NEW), "return_logprob": True},
                room) for ids, room in zip(prompts, rooms)])
        outs = asyncio.run(run_all())
    assert_matches([_ids_and_lps(o) for o in outs], ref)


# ---- the grouped expert compute and its sharding ----------------------------------------------------
def _reference_moe(x, ids, weights, gate, up, down):
    """Token by token, slot by slot: sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(gate[e].double() @ x[t].double()) * (up[e].double() @ x[t].double())
            out[t] += float(weights[t, j]) * (down[e].double() @ h)
    return out


def _loaded_experts(gate, up, down, tp: TPGroup) -> FusedExperts:
    num, inter, hidden = gate.shape
    experts = FusedExperts(num, hidden, inter, tp)
    for e in range(num):  # through the weight loaders, with the shards the name mapping produces
        experts.gate_up.weight.weight_loader(gate[e], (e, 0))
        experts.gate_up.weight.weight_loader(up[e], (e, 1))
        experts.down.weight.weight_loader(down[e], e)
    return experts


@pytest.mark.fast
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fused_experts_match_per_token_reference_and_tp_shards_sum_to_it(tokens):
    g = torch.Generator().manual_seed(tokens)
    num, hidden, inter, k = 6, 16, 12, 2
    gate, up, down = (torch.randn(num, inter, hidden, generator=g), torch.randn(num, inter, hidden, generator=g),
                      torch.randn(num, hidden, inter, generator=g))
    x = torch.randn(tokens, hidden, generator=g)
    # Distinct experts per token, experts 4 and 5 never chosen (empty groups).
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    want = _reference_moe(x, ids, weights, gate, up, down)
    full = _loaded_experts(gate, up, down, TPGroup())(x, ids, weights)
    assert full.dtype == torch.float32
    torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-4)
    # Two ranks: each holds half of every expert's intermediate dim; the partial sums add up.
    halves = [_loaded_experts(gate, up, down, TPGroup(rank=r, size=2)) for r in (0, 1)]
    assert halves[1].gate_up.weight.shape == (num, inter, hidden)  # 2 * inter / 2
    assert torch.equal(halves[1].gate_up.weight[2, : inter // 2], gate[2, inter // 2:])
    assert torch.equal(halves[1].gate_up.weight[2, inter // 2:], up[2, inter // 2:])
    assert torch.equal(halves[1].down.weight[2], down[2, :, inter // 2:])
    partial = sum(h(x, ids, weights) for h in halves)
    torch.testing.assert_close(partial.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.fast
def test_expert_loader_checks_shapes():
    experts = FusedExperts(2, 8, 4, TPGroup())
    with pytest.raises(ValueError, match=r"experts.1.up: checkpoint shape \(4, 7\)"):
        experts.gate_up.weight.weight_loader(torch.zeros(4, 7), (1, 1))
    with pytest.raises(ValueError, match="expert 2 out of range"):
        experts.down.weight.weight_loader(torch.zeros(8, 4), 2)


@pytest.mark.fast
def test_router_normalisations():
    g = torch.Generator().manual_seed(0)
    router_w = torch.randn(5, 8, generator=g)
    x = torch.randn(7, 8, generator=g)
    logits = x @ router_w.T
    for renorm in (False, True):
        router = Router(5, 8, 2, renorm)
        router.weight.data.copy_(router_w)
        ids, weights = router(x)
        assert torch.equal(ids, logits.topk(2, dim=-1).indices)  # the top-2 experts, best first
        chosen = logits.gather(1, ids)
        if renorm:  # Mixtral's definition: a softmax over the chosen logits only
            torch.testing.assert_close(weights, torch.softmax(chosen, dim=-1))
        else:  # Qwen3-MoE without norm_topk_prob: the full softmax's probabilities
            torch.testing.assert_close(weights, torch.softmax(logits, dim=-1).gather(1, ids))
            assert bool((weights.sum(-1) < 1).all())


# ---- refusals -----------------------------------------------------------------------------------------
def _raw(name: str, **changes) -> dict:
    base = {"architectures": [name], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    if name == "MixtralForCausalLM":
        base.update(num_local_experts=4, num_experts_per_tok=2)
    else:
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.fast
@pytest.mark.parametrize("arch,changes,match", [
    ("Qwen3MoeForCausalLM", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
    ("Qwen3MoeForCausalLM", {"n_shared_experts": 1}, "n_shared_experts=1"),
    ("Qwen3MoeForCausalLM", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("MixtralForCausalLM", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("MixtralForCausalLM", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ("Qwen3MoeForCausalLM", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    ("MixtralForCausalLM", {"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
    ("MixtralForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("Qwen3MoeForCausalLM", {"num_experts": None}, "lacks the expert count"),
    ("Qwen3MoeForCausalLM", {"num_local_experts": 8}, "disagree"),
])
def test_unsupported_moe_configs_are_refused(arch, changes, match):
    with pytest.raises(ModelConfigError, match=match) as info:
        ModelConfig.from_hf(_raw(arch, **changes))
    assert str(info.value).startswith(arch)


@pytest.mark.fast
def test_moe_config_fields():
    mix = ModelConfig.from_hf(_raw("MixtralForCausalLM", sliding_window=256, max_position_embeddings=4096,
                                   attention_bias=True, norm_topk_prob=False))
    # Mixtral: always renormalised, no attention biases (transformers ignores both keys);
    # a sliding window caps the context as for Mistral.
    assert mix.moe.norm_topk_prob and not mix.attention_bias and mix.context_limit == 256
    assert mix.moe.intermediate_size == 128
    qwen = ModelConfig.from_hf(_raw("Qwen3MoeForCausalLM", num_experts=None, num_local_experts=4,
                                    mlp_only_layers=[0], sliding_window=256, max_position_embeddings=4096))
    assert qwen.moe.num_experts == 4 and qwen.moe.sparse_layers == (1,) and qwen.qk_norm
    assert qwen.context_limit == 4096  # use_sliding_window is false
    assert ModelConfig.from_hf(_raw("Qwen3ForCausalLM")).moe is None


@pytest.mark.fast
def test_engine_refuses_unsupported_moe_checkpoint_at_load(model_dirs, tmp_path):
    from pdserve import Engine

    d = tmp_path / "m"
    shutil.copytree(model_dirs("mixtral"), d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "n_shared_experts": 2}))
    with pytest.raises(ModelConfigError, match="MixtralForCausalLM: n_shared_experts=2 is not supported"):
        Engine(model_path=str(d), max_total_tokens=1024)


def test_cuda_graph_capture_is_refused(model_dirs, make_engine):
    """The per-expert counts are read on the host: a captured decode graph cannot hold that."""
    from pdserve.config import ConfigError

    engine = make_engine(model_dirs("mixtral"), attention_backend="triton", max_total_tokens=1024)
    with pytest.raises(ConfigError, match="CUDA graphs are not supported for MixtralForCausalLM"):
        engine._scheduler.runner.enable_decode_graphs(max_bs=4, capture=True)


def _edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.fast
@pytest.mark.parametrize("name,edit,match", [
    ("qwen3_moe", lambda t: t.update({"model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(32, 64)}),
     r"unexpected tensors \(1\): model.layers.0.mlp.shared_expert.gate_proj.weight"),
    ("qwen3_moe", lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}),
     r"unexpected tensors \(1\): model.layers.0.mlp.experts.8.up_proj.weight"),
    ("qwen3_moe", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
     r"missing tensors \(1\): model.layers.2.mlp.experts.5.up_proj.weight"),
    ("mixtral", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
     r"missing tensors \(1\): model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("mixtral", lambda t: t.pop("model.layers.0.block_sparse_moe.gate.weight"),
     r"missing tensors \(1\): model.layers.0.block_sparse_moe.gate.weight"),
], ids=["shared-expert", "extra-expert", "missing-up", "missing-w2", "missing-router"])
def test_checkpoint_tensors_are_checked_by_name(model_dirs, tmp_path, name, edit, match):
    d = _edited_checkpoint(model_dirs(name), tmp_path / "m", edit)
    cfg = ModelConfig.from_dir(d)
    with pytest.raises(WeightLoadError, match=match):
        build_model(lambda: model_class(cfg)(cfg, TPGroup()), d, "cpu", torch.float32)


@pytest.mark.fast
def test_expert_weights_land_in_their_fused_slots(model_dirs):
    """Rank 1 of 2 holds the second half of expert e's gate, then of its up, and the second
    half of its down projection's input columns (Mixtral names: w1 gate, w3 up, w2 down)."""
    d = model_dirs("mixtral")
    cfg = ModelConfig.from_dir(d)
    model = build_model(lambda: model_class(cfg)(cfg, TPGroup(rank=1, size=2)), d, "cpu", torch.float32)
    ckpt = load_file(str(d / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    half = cfg.moe.intermediate_size // 2
    for e in range(cfg.moe.num_experts):
        pre = f"model.layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(experts.gate_up.weight[e, :half], ckpt[f"{pre}.w1.weight"][half:])
        assert torch.equal(experts.gate_up.weight[e, half:], ckpt[f"{pre}.w3.weight"][half:])
        assert torch.equal(experts.down.weight[e], ckpt[f"{pre}.w2.weight"][:, half:])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, ckpt["model.layers.1.block_sparse_moe.gate.weight"])
