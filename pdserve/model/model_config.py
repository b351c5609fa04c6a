"""What the engine needs to know about a Hugging Face checkpoint, read from config.json."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pdserve.model.transformer import CausalLM


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the correction range's rotation bounds, whether it is rounded to whole
    # dimensions, and the factor cos/sin are multiplied by (resolved from
    # attention_factor, or mscale / mscale_all_dim and factor, as transformers does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # Partial RoPE (GLM-4.5): only the first int(head_dim * factor) dims of each q/k head
    # are rotated (the inverse frequencies are over that many dims); the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MoeRouting:
    """How the router picks each token's experts and weighs them.

    softmax (Qwen3-MoE, Mixtral): the top_k of the softmax over the router logits.
    sigmoid (GLM-4.5; DeepSeek-V3's ``noaux_tc``): per-expert sigmoid scores; the
    experts are *chosen* by the scores plus ``e_score_correction_bias`` (when
    ``correction_bias``), first the ``topk_groups`` best of ``num_groups`` equal groups
    of experts (a group ranked by the sum of its two best corrected scores), then the
    top_k experts inside them; their *weights* are the uncorrected scores. Either way
    the weights are renormalised with ``norm_topk_prob``, then multiplied by
    ``scaling_factor`` (``routed_scaling_factor``)."""
    scoring: str = "softmax"  # softmax | sigmoid
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward: a router over ``num_experts`` picks ``top_k`` per token
    (``routing`` says how); their weights are renormalised to sum to 1 when
    ``norm_topk_prob`` (always for Mixtral). Layers not in ``sparse_layers`` keep the
    dense MLP (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``, GLM-4.5's
    ``first_k_dense_replace``). ``shared_intermediate_size`` > 0: an always-on MLP of that
    width (GLM-4.5's shared experts) is added to the routed experts' output."""
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    routing: MoeRouting = MoeRouting()
    shared_intermediate_size: int = 0

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layers


# What a quantised checkpoint's float8 weights are (and the only element type accepted).
FP8_FORMAT = "e4m3"


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint of float8_e4m3fn weights with fp32 dequantisation scales, read from
    config.json ``quantization_config``:

    - ``quant_method: fp8`` (DeepSeek-V3, Qwen3-*-FP8): ``<name>.weight_scale_inv`` of shape
      [ceil(out / block_n), ceil(in / block_k)], one scale per ``weight_block_size`` block;
    - ``quant_method: compressed-tensors``, format float-quantized (llm-compressor, GLM-4.5
      FP8): ``<name>.weight_scale``, per output channel [out, 1] (``strategy: channel``),
      one scalar (``tensor``) or per block (``block``, ``block_structure``).

    Either way W = W_fp8 * scale broadcast over its block. Which weights are fp8 is what
    the checkpoint stores (a weight with a scale tensor); ``ignore`` (compressed-tensors
    ``ignore``, fp8's ``modules_to_not_convert``) names modules that must not be fp8."""
    method: str                     # "fp8" | "compressed-tensors"
    strategy: str                   # "block" | "channel" | "tensor"
    block: tuple[int, int] | None   # (block_n, block_k) rows x columns per scale (block only)
    scale_suffix: str               # "weight_scale_inv" | "weight_scale"
    ignore: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        """Input columns per scale in the FP8 GEMM (model/fp8_gemm.py): the weight block's
        width, else DeepSeek's 128. Activations are quantised per token per ``group``."""
        return self.block[1] if self.block is not None else 128

    def ignores(self, module: str) -> bool:
        """Whether the quantization config keeps ``module`` (a checkpoint module name,
        e.g. ``lm_head``) out of fp8: compressed-tensors matches a name exactly or, with a
        ``re:`` prefix, as a regex from its start; transformers' ``modules_to_not_convert``
        matches a prefix ending at a module boundary, a regex of one, or a suffix."""
        for pattern in self.ignore:
            if self.method == "compressed-tensors":
                if (re.match(pattern[3:], module) is not None if pattern.startswith("re:")
                        else pattern == module):
                    return True
            elif re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern):
                return True
        return False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool   # q/k/v (and o for Llama) projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool          # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Sliding-window attention is not implemented: such models are capped to the window.
    sliding_window: int | None
    moe: MoeConfig | None = None  # None: every layer has the dense MLP
    # Multi-token-prediction (NextN) layers the checkpoint stores after the decoder's, as
    # model.layers.{num_layers + i}.* (GLM-4.5): not part of the target model; their
    # tensors are skipped when it loads.
    nextn_layers: int = 0
    quant: Fp8Config | None = None  # an FP8 checkpoint (None: weights in a float dtype)

    @property
    def context_limit(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
        raw: dict[str, Any] = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(raw, gen)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        """The engine's view of a config.json: the first of its ``architectures`` that
        pdserve registers (pdserve/model/registry.py) says how its quirks are read."""
        from pdserve.model.registry import find_architecture  # imports the architecture's module

        arch, model = find_architecture(raw.get("architectures") or [])
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads {heads} is not a multiple of "
                                   f"num_key_value_heads {kv_heads}")
        num_layers = int(raw["num_hidden_layers"])
        moe = _moe_config(arch, model, raw, num_layers) if model.is_moe else None
        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope = replace(_rope_config(raw, max_pos), partial_rotary_factor=_partial_rotary_factor(arch, model, raw))
        if rope.rotary_dim(head_dim) % 2 or rope.rotary_dim(head_dim) < 2:
            raise ModelConfigError(f"{arch}: partial_rotary_factor {rope.partial_rotary_factor} rotates "
                                   f"{rope.rotary_dim(head_dim)} of the {head_dim} head dims; RoPE needs an even "
                                   "number, at least 2")
        qk_norm = model.qk_norm or (model.qk_norm_switch is not None and raw.get(model.qk_norm_switch) is True)
        nextn = raw.get(model.nextn_layers_key) or 0 if model.nextn_layers_key is not None else 0
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise ModelConfigError(f"{arch}: {model.nextn_layers_key} must be a count (0 or more), got {nextn!r}")
        attention_bias = bool(raw.get("attention_bias", False)) and model.reads_attention_bias
        sliding = raw.get("sliding_window")
        if model.sliding_window_switch is not None and not raw.get(model.sliding_window_switch, False):
            sliding = None
        eos = _eos_ids(raw, generation or {})
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias or model.qkv_bias,
            o_proj_bias=attention_bias and model.o_proj_follows_attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and moe is None,  # experts carry no biases
            qk_norm=qk_norm,
            eos_token_ids=eos,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=int(sliding) if sliding else None,
            moe=moe,
            nextn_layers=nextn,
            quant=quant_config(raw),
        )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _partial_rotary_factor(arch: str, model: type[CausalLM], raw: dict[str, Any]) -> float:
    """``partial_rotary_factor``: top-level (the checkpoints' config.json) or inside
    rope_parameters / rope_scaling (where transformers 5 writes it); absent, the
    architecture's default (GLM-4.5: 0.5, as in transformers). Refused (naming the key)
    for architectures that rotate every dim."""
    found = [raw["partial_rotary_factor"]] if raw.get("partial_rotary_factor") is not None else []
    for key in ("rope_parameters", "rope_scaling"):
        nested = raw.get(key)
        if isinstance(nested, dict) and nested.get("partial_rotary_factor") is not None:
            found.append(nested["partial_rotary_factor"])
    bad = [f for f in found if isinstance(f, bool) or not isinstance(f, (int, float))]
    if bad:
        raise ModelConfigError(f"{arch}: partial_rotary_factor must be a number, got {bad[0]!r}")
    if len({float(f) for f in found}) > 1:
        raise ModelConfigError(f"{arch}: partial_rotary_factor values disagree: {found}")
    if model.default_partial_rotary_factor is None:
        if found and float(found[0]) != 1.0:
            raise ModelConfigError(f"{arch}: partial_rotary_factor={found[0]!r} is not supported "
                                   "(this architecture rotates every head dim)")
        return 1.0
    factor = float(found[0]) if found else model.default_partial_rotary_factor
    if not 0.0 < factor <= 1.0:
        raise ModelConfigError(f"{arch}: partial_rotary_factor {factor} must be in (0, 1]")
    return factor


def _rope_config(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or None
    theta = float(raw.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0)
    if not scaling:
        return RopeConfig(theta=theta)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta, rope_type="llama3", factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "yarn":
        return _yarn_config(raw, scaling, theta, max_position_embeddings)
    raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported "
                           "(supported: default, linear, llama3, yarn)")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term (paper eq. 21): 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_config(raw: dict[str, Any], scaling: dict[str, Any], theta: float,
                 max_position_embeddings: int) -> RopeConfig:
    """The yarn parameters as transformers resolves them: the pretraining length from
    a top-level ``original_max_position_embeddings`` first (Phi-3 style), else from
    rope_scaling, else max_position_embeddings; a missing factor is the ratio of the
    two lengths; a missing attention_factor comes from mscale / mscale_all_dim when
    both are set, else from the factor alone."""
    original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    original = int(original or max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    if factor < 1.0:
        raise ModelConfigError(f"rope_scaling: yarn factor {factor} is below 1")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)
    if beta_fast < beta_slow:
        raise ModelConfigError(f"rope_scaling: yarn beta_fast {beta_fast} is below beta_slow {beta_slow}")
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=beta_fast, beta_slow=beta_slow, truncate=bool(scaling.get("truncate", True)),
                      attention_factor=float(attention_factor))


# MoE settings of other architectures (shared experts, grouped or biased routing,
# sigmoid scores, scaled outputs): refused when set to anything but the value that
# means "off", since silently ignoring any of them would change the outputs.
_MOE_OFF: dict[str, tuple[object, ...]] = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "moe_shared_expert_intermediate_size": (None, 0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
    "use_expert_bias": (None, False),
}


# What an MoE architecture reads from its config.json (its ``moe_layout``): the expert
# count, the expert intermediate size (None when absent), norm_topk_prob, the sparse layers.
MoeLayout = tuple[Any, Any, bool, tuple[int, ...]]
MoeFail = Callable[[str], ModelConfigError]


def _moe_config(arch: str, model: type[CausalLM], raw: dict[str, Any], num_layers: int) -> MoeConfig:
    def fail(msg: str) -> ModelConfigError:
        return ModelConfigError(f"{arch}: {msg}")

    for key, off in _MOE_OFF.items():
        # The keys the architecture reads itself are checked by its moe_routing / moe_layout.
        if key in raw and raw[key] not in off and key not in model.moe_keys:
            raise fail(f"{key}={raw[key]!r} is not supported (only {off[-1]!r}: top-k softmax routing "
                       "over routed experts, no shared experts)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise fail(f"hidden_act {act!r} is not supported (experts use silu)")
    num_experts, inter, norm, sparse = model.moe_layout(raw, num_layers, fail)
    if num_experts is None or inter is None:
        raise fail("the config lacks the expert count or the expert intermediate size")
    num_experts, inter, top_k = int(num_experts), int(inter), int(raw.get("num_experts_per_tok", 0) or 0)
    if sparse and not 1 <= top_k <= num_experts:
        raise fail(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    routing, shared = model.moe_routing(raw, fail)
    if sparse:
        _check_routing(routing, num_experts, top_k, fail)
    if shared < 0:
        raise fail(f"the shared experts' intermediate size {shared} is negative")
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=norm,
                     sparse_layers=sparse, routing=routing, shared_intermediate_size=shared)


def _check_routing(routing: MoeRouting, num_experts: int, top_k: int, fail: MoeFail) -> None:
    """Grouped top-k as GLM-4.5 / DeepSeek-V3 configure it (n_group, topk_group) must
    describe a choice that exists: equal groups of at least two experts (a group is
    ranked by its two best scores) that hold top_k experts between them."""
    groups, keep = routing.num_groups, routing.topk_groups
    if routing.scoring not in ("softmax", "sigmoid"):
        raise fail(f"router scoring {routing.scoring!r} is not supported (softmax, sigmoid)")
    if routing.scaling_factor <= 0:
        raise fail(f"routed_scaling_factor {routing.scaling_factor} must be positive")
    if groups < 1 or num_experts % groups:
        raise fail(f"n_group {groups} must divide the number of experts ({num_experts})")
    if not 1 <= keep <= groups:
        raise fail(f"topk_group {keep} must be between 1 and n_group ({groups})")
    if groups > 1 and num_experts // groups < 2:
        raise fail(f"n_group {groups} leaves {num_experts // groups} expert per group; grouped routing ranks "
                   "a group by its two best experts")
    if top_k > keep * (num_experts // groups):
        raise fail(f"num_experts_per_tok {top_k} exceeds the {keep * (num_experts // groups)} experts of the "
                   f"topk_group {keep} groups routing keeps")


def _quant_error(key: str, value: object, supported: str) -> ModelConfigError:
    return ModelConfigError(f"quantization_config.{key}={value!r} is not supported (supported: {supported})")


def quant_config(raw: dict[str, Any]) -> Fp8Config | None:
    """The checkpoint's weight quantization: None for plain weights, an Fp8Config for
    the FP8 layouts pdserve loads; anything else is refused naming the key and value
    (loading such weights as floats would compute garbage)."""
    if raw.get("compression_config") is not None:  # compressed-tensors' name before transformers 4.45
        raise ModelConfigError("compression_config is not supported: pdserve reads quantization_config "
                               "(quant_method fp8 or compressed-tensors)")
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelConfigError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_block_config(q)
    if method == "compressed-tensors":
        return _compressed_tensors_config(q)
    raise _quant_error("quant_method", method, "'fp8' (block-scaled float8 e4m3, weight_scale_inv), "
                       "'compressed-tensors' (float8 e4m3 weights, weight_scale)")


def _block_size(key: str, value: object) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _quant_error(key, value, "two positive integers [rows, columns], e.g. [128, 128]")
    return int(value[0]), int(value[1])


def _patterns(key: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _quant_error(key, value, "a list of module names")
    return tuple(value)


# quant_method fp8 (transformers' FineGrainedFP8Config as DeepSeek-V3 and Qwen3-FP8 write it).
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "scale_fmt"}


def _fp8_block_config(q: dict[str, Any]) -> Fp8Config:
    unknown = sorted(set(q) - _FP8_KEYS)
    if unknown:
        raise ModelConfigError(f"quantization_config (quant_method fp8): unknown key(s) {unknown} "
                               f"(understood: {sorted(_FP8_KEYS)})")
    if q.get("fmt", FP8_FORMAT) != FP8_FORMAT:
        raise _quant_error("fmt", q["fmt"], f"{FP8_FORMAT!r} (float8_e4m3fn weights)")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _quant_error("activation_scheme", q["activation_scheme"],
                           "'dynamic' (activations quantised per token group at run time; static "
                           "activation scales are not implemented)")
    if q.get("scale_fmt", "float") != "float":
        raise _quant_error("scale_fmt", q["scale_fmt"], "'float' (fp32 weight_scale_inv)")
    block = _block_size("weight_block_size", q.get("weight_block_size"))
    ignore = _patterns("modules_to_not_convert", q.get("modules_to_not_convert"))
    ignore += _patterns("ignored_layers", q.get("ignored_layers"))
    return Fp8Config(method="fp8", strategy="block", block=block, scale_suffix="weight_scale_inv", ignore=ignore)


# compressed-tensors formats whose fp8 weights are stored as float8_e4m3fn tensors with a
# weight_scale next to them (naive-quantized is the same layout under an older name).
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "tensor", "block")


def _compressed_tensors_config(q: dict[str, Any]) -> Fp8Config:
    fmt = q.get("format")
    if fmt not in _CT_FORMATS:
        raise _quant_error("format", fmt, " or ".join(map(repr, _CT_FORMATS)) + " (float8 weights)")
    sparsity = q.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        raise _quant_error("sparsity_config", sparsity, "none (dense weights)")
    if q.get("transform_config"):
        raise _quant_error("transform_config", q["transform_config"], "none (no rotations)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _quant_error("config_groups", groups, "one or more groups of float8 weights")
    schemes = {name: _ct_weight_scheme(name, group, fmt) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        raise ModelConfigError(f"quantization_config.config_groups quantise weights differently "
                               f"({schemes}): mixed schemes are not supported")
    strategy, block = next(iter(schemes.values()))
    return Fp8Config(method="compressed-tensors", strategy=strategy, block=block, scale_suffix="weight_scale",
                     ignore=_patterns("ignore", q.get("ignore")))


def _ct_weight_scheme(name: str, group: Any, top_format: str) -> tuple[str, tuple[int, int] | None]:
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _quant_error(where, group, "an object with weights, input_activations, targets")
    if group.get("format", top_format) not in _CT_FORMATS:
        raise _quant_error(f"{where}.format", group["format"], " or ".join(map(repr, _CT_FORMATS)))
    if group.get("output_activations") is not None:
        raise _quant_error(f"{where}.output_activations", group["output_activations"], "null")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _quant_error(f"{where}.weights", weights, "float8 weight arguments")
    w = f"{where}.weights"
    if weights.get("type") != "float":
        raise _quant_error(f"{w}.type", weights.get("type"), "'float' (int weights are not implemented)")
    if weights.get("num_bits") != 8:
        raise _quant_error(f"{w}.num_bits", weights.get("num_bits"), "8 (float8 e4m3)")
    if weights.get("symmetric", True) is not True:
        raise _quant_error(f"{w}.symmetric", weights["symmetric"], "true (no zero points)")
    if weights.get("dynamic", False) is not False:
        raise _quant_error(f"{w}.dynamic", weights["dynamic"], "false (stored weight scales)")
    if weights.get("actorder") is not None:
        raise _quant_error(f"{w}.actorder", weights["actorder"], "null")
    strategy = weights.get("strategy")
    if strategy not in _CT_STRATEGIES:
        raise _quant_error(f"{w}.strategy", strategy, ", ".join(map(repr, _CT_STRATEGIES)))
    block = _block_size(f"{w}.block_structure", weights.get("block_structure")) if strategy == "block" else None
    acts = group.get("input_activations")
    if acts is not None:
        a = f"{where}.input_activations"
        if not isinstance(acts, dict) or acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise _quant_error(a, acts, "float8 (type float, num_bits 8) or null")
        if acts.get("dynamic") is not True:
            raise _quant_error(f"{a}.dynamic", acts.get("dynamic"),
                               "true (static activation scales (input_scale) are not implemented)")
    return strategy, block
