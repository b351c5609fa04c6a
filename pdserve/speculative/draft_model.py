"""EAGLE and EAGLE3 draft heads, loaded from their public checkpoint layouts.

A stack of decoder layers that reads a token embedding together with a hidden
state and predicts the token after next:

  EAGLE   h0 = fc(cat(embed(x), f)) with f the target's post-norm last hidden
          state (or the head's own previous output); the layer has no input
          norm; logits come from the target's lm_head.  Checkpoint:
          ``fc.{weight,bias}``, ``layers.0.*``; ``embed_tokens`` is ignored.
  EAGLE3  residual = fc(aux) for target features (3 target layers
          concatenated, 3 x target_hidden_size wide), the head's own pre-norm
          output otherwise; the first layer reads
          cat(input_layernorm(embed), hidden_norm(residual)) (2H wide; with
          ``norm_before_residual`` the residual is hidden_norm(residual));
          layers 1.. are plain Llama decoder layers (vLLM's and the
          speculators library's definition); logits = lm_head(norm(h)) over a
          draft vocabulary whose ids map to target ids through ``d2t`` offsets.
  MTP     the target checkpoint's NextN layer (DeepSeek-V3 / GLM-4.5):
          h0 = fc(cat(enorm(embed(x)), hnorm(f))) (checkpoint ``eh_proj``), then one
          full decoder layer shaped as the target's (input norm, attention, its MoE
          block or dense MLP), then ``shared_head.norm``; f is EAGLE's feature or the
          layer's own previous (normed) output, as SGLang carries it; logits from the
          target's lm_head. Checkpoint: ``model.layers.{num_hidden_layers}.*``.

This module is the head as it runs: its parameters, how checkpoint tensor names map
onto them (every layout's first layer, ``midlayer.`` or ``layers.0.``, is our
``layers.0.``), loading, and the forward pass. Which layout a checkpoint uses, what its
config means and whether it fits the target is decided before anything is built, in
``draft_config.py`` (split from here: that part reads only ``config.json`` and tensor
names, never tensors or torch modules); its ``DraftConfig``, ``DraftConfigError`` and
``ALGORITHMS`` are re-exported here, where callers import them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdserve.model.attention import AttentionBackend, ForwardContext
from pdserve.model.layers import ColumnParallelLinear, Embedding, Linear, LMHead, RMSNorm, RotaryEmbedding
from pdserve.model.kv_quant import is_kv_scale_name
from pdserve.model.loader import WeightLoadError, build_model
from pdserve.model.parallel import TPGroup
from pdserve.model.registry import architecture_class
from pdserve.model.transformer import MLP, STACKED_PARAMS, Attention, DecoderLayer
from pdserve.speculative.draft_config import ALGORITHMS, DraftConfig, DraftConfigError

__all__ = ["ALGORITHMS", "DraftConfig", "DraftConfigError", "DraftLayer", "EagleDraftModel"]


class DraftLayer(nn.Module):
    """The first draft layer: EAGLE's (no input norm) or EAGLE3's (2H-wide q/k/v
    over cat(input_layernorm(embed), hidden_norm(hidden)))."""

    def __init__(self, cfg: DraftConfig, tp: TPGroup) -> None:
        super().__init__()
        h = cfg.hidden_size
        eagle3 = cfg.algorithm == "EAGLE3"
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.self_attn = Attention(cfg.layer, 0, tp, in_features=2 * h if eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.mlp = MLP(cfg.layer, tp)


class EagleDraftModel(nn.Module):
    """The draft head. Its decoder layers are sharded over the TP ranks like the
    target's (heads and MLP split, two all-reduces per layer: measured faster than a
    replicated layer at real head sizes, ``pdserve.bench.draft_placement``); ``fc``,
    the norms and its own embedding / lm_head are replicated, so its output is the same
    on every rank. It shares the target's embedding (and, for EAGLE or an EAGLE3 head
    without lm_head, its lm_head) by reference. Draft layer i writes layer i of the
    draft KV pool (this rank's KV heads)."""

    stacked_params = STACKED_PARAMS
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: DraftConfig, embed: Embedding, target_head: LMHead, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        eagle3 = cfg.algorithm == "EAGLE3"
        in_fc = 3 * (cfg.target_hidden_size or h) if eagle3 else 2 * h
        self.fc = ColumnParallelLinear(in_fc, {0: h}, cfg.fc_bias, TPGroup(), "fc")
        first: nn.Module = DecoderLayer(cfg.layer, 0, tp) if cfg.is_mtp else DraftLayer(cfg, tp)
        self.layers = nn.ModuleList([first] + [DecoderLayer(cfg.layer, i, tp) for i in range(1, cfg.num_layers)])
        if cfg.is_mtp:
            # The NextN layer's norms of the embedding and of the feature, and shared_head.norm.
            self.enorm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.hnorm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
            # Its decoder layer loads as a target layer does (MoE experts into fused stacks).
            self.stacked_params = architecture_class(cfg.layer.architecture).stacked_params_for(cfg.layer)
        if cfg.own_embed:
            self.embed_tokens = Embedding(cfg.layer.vocab_size, h)
        if eagle3:
            self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
            if cfg.own_head:
                self.lm_head = LMHead(cfg.draft_vocab_size, h, TPGroup())
            if cfg.has_d2t:
                d2t = nn.Parameter(torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), requires_grad=False)
                d2t.weight_loader = self._load_d2t  # type: ignore[attr-defined]
                self.d2t = d2t
        # Not submodules: shared with (and owned by) the target model.
        self._shared = (embed, target_head)

    # ---- loading ------------------------------------------------------------------
    def _load_d2t(self, loaded: torch.Tensor, shard: object = None) -> None:
        vd, v = self.config.draft_vocab_size, self.config.layer.vocab_size
        if tuple(loaded.shape) != (vd,):
            raise WeightLoadError(f"d2t: shape {tuple(loaded.shape)}, expected ({vd},) = draft_vocab_size")
        target_ids = torch.arange(vd) + loaded.to(torch.int64)
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= v:
            raise WeightLoadError(f"d2t: draft id + offset must lie in the target vocab [0, {v}); got ids in "
                                  f"[{int(target_ids.min())}, {int(target_ids.max())}] (absolute ids stored "
                                  "instead of offsets?)")
        if not self.config.own_head and bool((loaded != 0).any()):
            raise WeightLoadError("d2t: nonzero offsets, but the head has no lm_head of its own and uses the "
                                  "target's (target token order): its d2t must be all zeros")
        self.d2t.data.copy_(loaded)

    @staticmethod
    def checkpoint_name(name: str, own_embed: bool = False) -> str | None:
        """Our parameter name for a checkpoint tensor; None for tensors we do not use
        (``t2d``; ``embed_tokens`` unless the head uses its own; the speculators
        library's ``verifier_*`` copies). Every layout's first layer (``midlayer.``,
        ``layers.0.``) is our ``layers.0.``."""
        if name == "t2d" or name.startswith("verifier_") or name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "embed_tokens.weight":
            return name if own_embed else None
        if name.startswith("midlayer."):
            return "layers.0." + name[len("midlayer."):]
        return name

    @staticmethod
    def mtp_name(name: str, prefix: str) -> str | None:
        """Our parameter name for a tensor of the target checkpoint an MTP draft loads from:
        the NextN layer's (under ``prefix``) only, its embedding and head copies and KV
        scales skipped (the target's are used; the draft KV pool has scale 1.0)."""
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        if rest.startswith(("embed_tokens.", "shared_head.head.")) or is_kv_scale_name(name) \
                or rest.endswith("rotary_emb.inv_freq"):
            return None
        mapped = {"eh_proj.weight": "fc.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                  "shared_head.norm.weight": "norm.weight"}
        return mapped.get(rest, "layers.0." + rest)

    @classmethod
    def load(cls, draft_dir: str | Path, cfg: DraftConfig, embed: Embedding, target_head: LMHead,
             device: torch.device, dtype: torch.dtype, tp: TPGroup = TPGroup()) -> "EagleDraftModel":
        # Built on the device in its dtype (d2t stays int64); the target's embedding and
        # lm_head are shared by reference, not copied (they are not submodules).
        # An MTP layer's fp8 weights (an FP8 target checkpoint) are dequantised (a rename
        # keeps build_model from switching layers to the FP8 GEMM).
        rename = ((lambda name: cls.mtp_name(name, cfg.mtp_prefix)) if cfg.is_mtp
                  else (lambda name: cls.checkpoint_name(name, cfg.own_embed)))
        model = build_model(lambda: cls(cfg, embed, target_head, tp), Path(draft_dir), device, dtype, rename=rename)
        for module in model.modules():
            if isinstance(module, Linear):
                module.prepack()
        return model.eval()

    # ---- running --------------------------------------------------------------------
    def bind(self, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend
            layer.self_attn.rotary = rotary

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[Vd] target ids of the draft vocabulary (EAGLE3 with d2t and its own lm_head); None when
        draft ids are target ids."""
        if self.config.algorithm != "EAGLE3" or not self.config.has_d2t or not self.config.own_head:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                from_target: bool) -> torch.Tensor:
        """The draft layers over packed tokens: ``input_ids`` [T] are x_{p+1}, ``hidden``
        [T, W] the feature of position p: a target feature when ``from_target``
        (EAGLE3: 3 x target_hidden_size wide), else the head's own previous output
        (H wide). Returns the pre-head output [T, H] (what the next draft step carries)."""
        embed = self.embed_tokens if self.config.own_embed else self._shared[0]
        emb = embed(input_ids)
        first = self.layers[0]
        if self.config.is_mtp:
            h = first(self.fc(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1)), ctx)
            return self.norm(h)
        if self.config.algorithm == "EAGLE":
            residual = self.fc(torch.cat([emb, hidden], dim=-1))
            x = residual
        else:
            residual = self.fc(hidden) if from_target else hidden
            normed = first.hidden_norm(residual)
            if self.config.norm_before_residual:
                residual = normed
            x = torch.cat([first.input_layernorm(emb), normed], dim=-1)
        h = residual + first.self_attn(x, ctx)
        h = h + first.mlp(first.post_attention_layernorm(h))
        for layer in self.layers[1:]:
            h = layer(h, ctx)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (EAGLE, MTP (``h`` is normed already), or no
        own lm_head: the target vocabulary)."""
        _, target_head = self._shared
        if self.config.algorithm == "EAGLE":
            return target_head(h).float()
        head = self.lm_head if self.config.own_head else target_head
        return head(self.norm(h)).float()
