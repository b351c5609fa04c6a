"""The decoder shared by the Llama-family architectures (Llama, Mistral, Qwen2, Qwen3, and
the MoE ones: Qwen3-MoE, Mixtral, GLM-4.5).

Architecture files choose the variant (biases, q/k norm) and the checkpoint
name mapping; nothing here schedules or allocates KV: the forward context says
where every token's KV goes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionBackend, ForwardContext
from pdserve.model.layers import (ColumnParallelLinear, Embedding, LMHead, QKVParallelLinear, RMSNorm,
                                  RotaryEmbedding, RowParallelLinear)
from pdserve.model.model_config import ModelConfig, MoeFail, MoeLayout, MoeRouting
from pdserve.model.moe import SparseMoeBlock
from pdserve.model.parallel import TPGroup


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, in_features: int | None = None) -> None:
        """`in_features` defaults to the hidden size (EAGLE3's draft layer reads 2x hidden)."""
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(in_features or cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp,
                                        "o_proj")
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend: AttentionBackend | None = None  # bound by the model runner
        self.rotary: RotaryEmbedding | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert self.backend is not None and self.rotary is not None
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Every layer of a forward rotates at the same positions: look them up once.
        cos_sin = ctx.rope.get(id(self.rotary))
        if cos_sin is None:
            cos_sin = ctx.rope[id(self.rotary)] = self.rotary.cos_sin(ctx.positions)
        q, k = self.rotary(q, k, cos_sin)
        return self.o_proj(self.backend.forward(self.layer_id, q, k, v, ctx))


class MLP(nn.Module):
    """SwiGLU feed-forward, ``intermediate_size`` wide (default: the config's). With
    ``reduce_results`` False its output is this rank's partial sum (the caller reduces
    it together with others: the MoE block's shared experts)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, {0: inter, 1: inter}, cfg.mlp_bias, tp, "gate_up_proj")
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp, "down_proj",
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # MoE models (Qwen3-MoE, Mixtral, GLM-4.5): the experts in the layers their config
        # marks sparse, with the shared experts' MLP where the config has them.
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_sparse(layer_id):
            shared = cfg.moe.shared_intermediate_size
            self.mlp = SparseMoeBlock(cfg, tp, MLP(cfg, tp, shared, reduce_results=False) if shared else None)
        else:
            self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states [T, H] and, for each layer index
        in `capture_layers` (in that order, repeats allowed), the residual stream
        entering that layer."""
        x = self.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured[i] = x
            x = layer(x, ctx)
        return self.norm(x), [captured[i] for i in capture_layers]


# Checkpoint names that feed our fused parameters: (our name, checkpoint name, shard).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class CausalLM(nn.Module):
    """A decoder plus its output head. Subclasses are the architectures, registered by
    Hugging Face name in pdserve/model/registry.py. Their class attributes say how
    ModelConfig.from_hf reads their config.json, as their transformers class does
    (the defaults are Llama's)."""

    stacked_params = STACKED_PARAMS
    # Checkpoint tensors that carry no weights we need.
    ignored_suffixes = ("rotary_emb.inv_freq",)
    # Per-layer fp8 KV scales (self_attn.k_scale ...) are read by model/kv_quant.py, not loaded.
    reads_kv_scales: ClassVar[bool] = True
    # The q/k/v (and o) projections' biases follow ``attention_bias``; False: the key is ignored.
    reads_attention_bias: ClassVar[bool] = True
    # q/k/v carry biases whatever ``attention_bias`` says.
    qkv_bias: ClassVar[bool] = False
    # o_proj carries a bias when ``attention_bias`` says so (False: never).
    o_proj_follows_attention_bias: ClassVar[bool] = True
    # An RMSNorm over each q and k head before RoPE (weights self_attn.q_norm / k_norm).
    qk_norm: ClassVar[bool] = False
    # The key that, true, turns that q/k norm on (GLM-4.5: use_qk_norm); None: ``qk_norm`` decides.
    qk_norm_switch: ClassVar[str | None] = None
    # The partial_rotary_factor a config without one gets (GLM-4.5: 0.5); None: every head
    # dim is rotated, and a factor other than 1 is refused.
    default_partial_rotary_factor: ClassVar[float | None] = None
    # The key counting the MTP (NextN) layers stored after the decoder's (GLM-4.5:
    # num_nextn_predict_layers): their tensors are skipped, the layers not built.
    nextn_layers_key: ClassVar[str | None] = None
    # The key that must be true for ``sliding_window`` to apply (None: a window set applies).
    sliding_window_switch: ClassVar[str | None] = None
    # Sparse MoE feed-forwards, read by ``moe_layout`` and ``moe_routing``.
    is_moe: ClassVar[bool] = False
    # Keys of other MoE designs (model_config._MOE_OFF: shared experts, grouped routing...)
    # that this architecture reads and checks itself instead of having them refused.
    moe_keys: ClassVar[frozenset[str]] = frozenset()
    # SGLang's default speculative shape for this target (num_steps, eagle_topk, num_draft_tokens).
    speculative_defaults: ClassVar[tuple[int, int, int]] = (3, 1, 4)

    @classmethod
    def moe_layout(cls, raw: dict[str, Any], num_layers: int, fail: MoeFail) -> MoeLayout:
        """MoE architectures (``is_moe``): (expert count, expert intermediate size,
        norm_topk_prob, sparse layers) from config.json; ``fail(msg)`` makes the error to
        raise. The checks shared by every MoE architecture run before (model_config)."""
        raise NotImplementedError(f"{cls.__name__} has no MoE layers")

    @classmethod
    def moe_routing(cls, raw: dict[str, Any], fail: MoeFail) -> tuple[MoeRouting, int]:
        """MoE architectures: how the router picks and weighs experts, and the shared
        experts' intermediate size (0: none). Default: softmax top-k, no shared experts."""
        return MoeRouting(), 0

    @classmethod
    def stacked_params_for(cls, cfg: ModelConfig) -> tuple[tuple[str, str, object], ...]:
        """The checkpoint names feeding fused parameters in a model of ``cfg`` (MoE
        architectures add their experts'); also what an MTP draft layer of it loads by."""
        return cls.stacked_params

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.config = cfg
        # Checkpoint tensors of layers this model does not build (the NextN layers): skipped.
        self.ignored_prefixes = tuple(f"model.layers.{cfg.num_layers + i}." for i in range(cfg.nextn_layers))
        self.model = DecoderModel(cfg, tp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, ctx, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def bind(self, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend
            layer.self_attn.rotary = rotary
