"""Tiny random Hugging Face checkpoints (with a character tokenizer) for tests and benchmarks.

No model hub is reachable on our machines, so tests build and save their own
models with transformers and use transformers as the reference runtime.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_char_tokenizer(out_dir: Path) -> int:
    """Save a character-level tokenizer (printable ASCII); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        if ch not in vocab and ch not in "\r\x0b\x0c":
            vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(vocab)


def model_types() -> dict[str, str]:
    """Model type ("llama", "qwen3_moe"...: their transformers config's) -> architecture,
    for every architecture pdserve registers (pdserve/model/registry.py) that transformers has."""
    import transformers

    from pdserve.model.registry import supported_architectures

    return {getattr(transformers, name).config_class.model_type: name for name in supported_architectures()
            if hasattr(transformers, name)}


def hf_causal_lm_name(model_type: str) -> str:
    types = model_types()
    if model_type not in types:
        raise ValueError(f"no supported architecture has model type {model_type!r} (supported: "
                         f"{', '.join(sorted(types))})")
    return types[model_type]


# Per model type, the config a tiny checkpoint gets unless the caller overrides it:
# glm4_moe is GLM-4.5-shaped (layer 0 dense, then MoE layers with grouped sigmoid routing,
# a non-zero score-correction bias, scaled weights, a shared expert; half the head dims
# rotated; q/k/v biases; one NextN layer stored after the decoder's).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                     n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                     partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1),
}


def build_random_model(out_dir: str | Path, arch: str = "llama", *, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       intermediate_size: int = 128, vocab_size: int | None = None,
                       tie_word_embeddings: bool = False, max_position_embeddings: int = 1024,
                       seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random checkpoint of model type `arch` (any whose transformers
    architecture pdserve registers) + character tokenizer to out_dir."""
    import torch
    import transformers

    model_cls = getattr(transformers, hf_causal_lm_name(arch))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = build_char_tokenizer(out)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size or tok_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    # Explicit: some configs' default is not hidden_size // num_heads (Qwen3's is 128).
    kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(ARCH_DEFAULTS.get(arch, {}))
    kwargs.update(config_overrides)
    cfg = model_cls.config_class(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    # Random init is tiny (std 0.02): widen it so logits are not flat and greedy
    # choices are well separated (parity tests compare argmaxes).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: it would not be tested
                buf.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    nextn = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if nextn:
        _add_nextn_layers(out, cfg.num_hidden_layers, nextn, hidden_size)
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _add_nextn_layers(out: Path, num_layers: int, count: int, hidden: int) -> None:
    """Store ``count`` random MTP (NextN) layers after the decoder's, as GLM-4.5's
    checkpoints do and transformers neither builds nor saves: ``model.layers.{num_layers + i}``
    with eh_proj, enorm, hnorm, shared_head.norm and a decoder layer shaped like the last one."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{num_layers - 1}."
    gen = torch.Generator().manual_seed(num_layers)
    for i in range(count):
        pre = f"model.layers.{num_layers + i}."
        extra = {"eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.15}
        for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            extra[norm] = torch.ones(hidden)
        for name, t in tensors.items():
            if name.startswith(last):
                extra[name[len(last):]] = torch.randn(t.shape, generator=gen) * 0.15
        tensors.update({pre + k: v for k, v in extra.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


# FP8 checkpoint layouts `build_fp8_checkpoint` writes: (quant_method, weight strategy).
FP8_LAYOUTS = (("fp8", "block"), ("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
               ("compressed-tensors", "block"))
# Router gates stay unquantised in public FP8 checkpoints (compressed-tensors ignores them).
_FP8_SKIPPED = ("model.embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight", ".block_sparse_moe.gate.weight")


def build_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, method: str = "fp8", *, strategy: str = "block",
                         block: tuple[int, int] = (128, 128), dequantized_dir: str | Path | None = None,
                         split_shards: bool = False) -> Path:
    """Write an FP8 version of the float checkpoint at ``src_dir`` (e.g. `build_random_model`'s):
    every linear weight (attention, MLP and expert projections; not the embeddings, the
    LM head or a router gate) as float8_e4m3fn plus its fp32 scale, in the layout of
    ``method`` / ``strategy`` (`FP8_LAYOUTS`): quant_method fp8 with ``weight_block_size``
    ``block`` and ``<name>.weight_scale_inv`` (DeepSeek-V3, Qwen3-FP8), or compressed-tensors
    float-quantized with ``<name>.weight_scale`` (channel [out, 1], tensor [1], or block).

    ``dequantized_dir``: also write the plain checkpoint of the dequantised weights (the
    reference an FP8 load must equal). ``split_shards``: two shards with an index, every
    scale in the first and half of their weights in the second (a weight and its scale
    in different files, in either order)."""
    from safetensors.torch import load_file, save_file

    from pdserve.model.fp8 import dequantize, quantize_weight
    from pdserve.model.model_config import Fp8Config

    if (method, strategy) not in FP8_LAYOUTS:
        raise ValueError(f"(method, strategy) must be one of {FP8_LAYOUTS}, got {(method, strategy)}")
    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    state: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    is_block = strategy == "block"
    suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
    quant = Fp8Config(method=method, strategy=strategy, block=tuple(block) if is_block else None,  # type: ignore[arg-type]
                      scale_suffix=suffix)
    fp8: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    dense: dict[str, Any] = {}
    for name, tensor in state.items():
        if tensor.dim() == 2 and name.endswith(".weight") and not name.endswith(_FP8_SKIPPED):
            fp8[name], scales[name.removesuffix("weight") + suffix] = quantize_weight(tensor, quant)
        else:
            dense[name] = tensor
    if method == "fp8":
        qcfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(block)}
    else:
        weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                   "strategy": strategy, "group_size": None, "block_structure": None,
                                   "actorder": None, "observer": "minmax"}
        acts: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                "strategy": "token", "group_size": None, "block_structure": None,
                                "actorder": None, "observer": None}
        if is_block:
            weights["block_structure"] = list(block)
            acts.update(strategy="group", group_size=block[1])
        qcfg = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                              "output_activations": None, "format": "float-quantized"}},
                "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"],
                "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer and generation config
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qcfg), indent=2) + "\n")
    if split_shards:
        names = sorted(fp8)
        first = {**scales, **{n: fp8[n] for n in names[::2]}}
        second = {**dense, **{n: fp8[n] for n in names[1::2]}}
        files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
        for fname, tensors in files.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / fname), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: fname for fname, tensors in files.items() for k in tensors}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        save_file({k: v.contiguous() for k, v in {**dense, **fp8, **scales}.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    if dequantized_dir is not None:
        ref = Path(dequantized_dir)
        ref.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, ref / f.name)
        plain = dict(dense)
        for name, q in fp8.items():
            plain[name] = dequantize(q, scales[name.removesuffix("weight") + suffix], quant, name)
        save_file({k: v.contiguous() for k, v in plain.items()}, str(ref / "model.safetensors"),
                  metadata={"format": "pt"})
    return out


EAGLE3_LAYOUTS = ("sglang", "vllm", "speculators")


def build_random_draft(target_dir: str | Path, out_dir: str | Path, algorithm: str = "EAGLE", *,
                       draft_vocab_size: int | None = None, seed: int = 0, layout: str = "sglang",
                       architecture: str | None = None, d2t: bool = True, t2d: bool = True, lm_head: bool = True,
                       num_layers: int = 1, hidden_size: int | None = None, norm_before_residual: bool = False,
                       fc_bias: bool = False) -> Path:
    """Write a random (untrained) EAGLE or EAGLE3 head for the target checkpoint at
    ``target_dir``, in a public layout. EAGLE3's draft vocabulary is the target's
    first ``draft_vocab_size`` ids after a seeded shuffle (nonzero ``d2t`` offsets).

    EAGLE3 options: ``layout`` (see `convert_eagle3_layout`), ``architecture`` (the
    config's name, e.g. LlamaForCausalLM as the EAGLE repo writes it), no ``d2t`` /
    ``t2d`` (full draft vocabulary), no ``lm_head`` (the target's is used),
    ``num_layers`` decoder layers, a ``hidden_size`` other than the target's (the
    head then has its own embedding), ``norm_before_residual``, an ``fc`` bias."""
    import torch
    from transformers import AutoConfig

    from pdserve.speculative.reference import DraftHead, aux_layer_ids, save_draft

    target_dir, out = Path(target_dir), Path(out_dir)
    cfg = AutoConfig.from_pretrained(str(target_dir))
    torch.manual_seed(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    draft_vocab = None
    options: dict[str, Any] = {}
    if algorithm == "EAGLE3":
        vd = draft_vocab_size or v
        if not (d2t and lm_head) and vd != v:
            raise ValueError("a head without d2t or without its own lm_head has the full vocabulary")
        draft_vocab = torch.randperm(v)[:vd].sort().values
        dims: dict[str, Any] = {}
        if hidden_size is not None and hidden_size != h:
            heads = cfg.num_attention_heads
            dims = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, head_dim=hidden_size // heads)
        options = dict(num_layers=num_layers, dims=dims, norm_before_residual=norm_before_residual,
                       fc_bias=fc_bias, own_embed=bool(dims), own_head=lm_head)
    elif (layout, architecture, d2t, t2d, lm_head, num_layers, hidden_size, norm_before_residual, fc_bias) != (
            "sglang", None, True, True, True, 1, None, False, False):
        raise ValueError("EAGLE heads come in one layout and shape: the EAGLE / SGLang one")
    # The embedding / head passed here are only needed to run the head, not to save it.
    head = DraftHead(algorithm, cfg, torch.zeros(v, h), torch.zeros(v, h), draft_vocab, **options)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if name == "embed_tokens.weight" else 0.15)
            elif name == "fc.bias":
                p.normal_(0.0, 0.1)
    if algorithm == "EAGLE" or (layout == "sglang" and architecture is None and d2t and t2d):
        save_draft(head, target_dir, out, aux_layer_ids(cfg.num_hidden_layers))
        return out
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_draft(head, target_dir, Path(tmp), aux_layer_ids(cfg.num_hidden_layers))
        return convert_eagle3_layout(Path(tmp), out, layout, target_dir, architecture=architecture, d2t=d2t,
                                     t2d=t2d)


def convert_eagle3_layout(src: str | Path, out_dir: str | Path, layout: str, target_dir: str | Path, *,
                          architecture: str | None = None, d2t: bool = True, t2d: bool = True) -> Path:
    """Rewrite the SGLang-layout EAGLE3 head at ``src`` (`save_draft`'s output) into
    another public layout, same weights:

      sglang       LlamaForCausalLMEagle3, ``midlayer.*``, SGLang's
                   ``eagle_config.eagle_aux_hidden_state_layer_ids`` (outputs of layers).
      vllm         Eagle3LlamaForCausalLM, the first layer as ``layers.0.*``, a
                   top-level ``eagle_aux_hidden_state_layer_ids`` (inputs of layers).
      speculators  the speculators library's Eagle3Speculator: the layer config
                   nested in ``transformer_layer_config``, ``layers.{i}.*``, an
                   ``embed_tokens`` (the target's copy unless the head has its own),
                   ``speculators_config`` naming the verifier.

    ``architecture`` overrides the config's name; ``d2t`` / ``t2d`` False drop them."""
    from safetensors.torch import load_file, save_file

    if layout not in EAGLE3_LAYOUTS:
        raise ValueError(f"layout must be one of {EAGLE3_LAYOUTS}, got {layout!r}")
    src, out = Path(src), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    if not d2t:
        if int(state["d2t"].abs().max()) != 0 or len(state["d2t"]) != target_cfg["vocab_size"]:
            raise ValueError("only a head over the full vocabulary in target order can drop d2t")
        del state["d2t"]
        cfg.pop("draft_vocab_size", None)
    if not t2d:
        state.pop("t2d", None)
    if layout != "sglang":
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                 for k, v in state.items()}
    ids = [i + 1 for i in cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]]  # as inputs of layers
    if layout == "sglang":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
        cfg["architectures"] = [architecture or "LlamaForCausalLMEagle3"]
    elif layout == "vllm":
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["architectures"] = [architecture or "Eagle3LlamaForCausalLM"]
    else:
        if "embed_tokens.weight" not in state:  # the library stores the verifier's embedding
            target_state: dict[str, Any] = {}
            for f in sorted(Path(target_dir).glob("*.safetensors")):
                target_state.update(load_file(str(f)))
            state["embed_tokens.weight"] = target_state["model.embed_tokens.weight"]
        layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
                      "vocab_size", "hidden_act", "num_hidden_layers", "bos_token_id", "eos_token_id",
                      "pad_token_id")
        layer = {k: cfg[k] for k in layer_keys if k in cfg}
        layer.update(model_type="llama", attention_bias=False, mlp_bias=False)
        cfg = {
            "architectures": [architecture or "Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.get("draft_vocab_size", target_cfg["vocab_size"]),
            "target_hidden_size": cfg.get("target_hidden_size"),
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": str(target_dir), "architectures": target_cfg.get("architectures")},
            },
            "torch_dtype": "float32",
        }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random checkpoint (+ character tokenizer).")
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted(model_types()))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    path = build_random_model(args.out_dir, args.arch, num_layers=args.layers, hidden_size=args.hidden)
    print(path)


if __name__ == "__main__":
    main()
