"""EAGLE and EAGLE3 draft heads, loaded from their public checkpoint layouts.

One decoder layer that reads a token embedding (the target's, shared) together
with a hidden state and predicts the token after next:

  EAGLE   h0 = fc(cat(embed(x), f)) with f the target's post-norm last hidden
          state (or the head's own previous output); the layer has no input
          norm; logits come from the target's lm_head.  Checkpoint:
          ``fc.{weight,bias}``, ``layers.0.*``; ``embed_tokens`` is ignored.
  EAGLE3  residual = fc(aux) for target features (3 target layers
          concatenated), the head's own pre-norm output otherwise; the layer
          reads cat(input_layernorm(embed), hidden_norm(residual)) (2H wide);
          logits = lm_head(norm(h)) over a reduced draft vocabulary whose ids
          map to target ids through ``d2t`` offsets.  Checkpoint: ``fc``,
          ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (``t2d`` is ignored).

``eagle_config.eagle_aux_hidden_state_layer_ids`` follows SGLang: id i is the
*output* of target layer i, i.e. the residual stream entering layer i + 1.
Without it the capture set is the residual stream entering layers
[2, L//2, L-3] (SGLang's and vLLM's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.model.attention import AttentionBackend, ForwardContext
from pdserve.model.layers import ColumnParallelLinear, Embedding, Linear, LMHead, RMSNorm, RotaryEmbedding
from pdserve.model.loader import WeightLoadError, build_model
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.model.parallel import TPGroup
from pdserve.model.transformer import MLP, STACKED_PARAMS, Attention

ALGORITHMS = ("EAGLE", "EAGLE3")
_ARCHITECTURES = {
    "EAGLE": ("LlamaForCausalLMEagle", "LlamaForCausalLM"),
    "EAGLE3": ("LlamaForCausalLMEagle3", "LlamaForCausalLM"),
}


class DraftConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DraftConfig:
    algorithm: str
    layer: ModelConfig              # the draft layer's dimensions (one layer)
    fc_bias: bool
    draft_vocab_size: int           # == target vocab for EAGLE
    capture_layers: tuple[int, ...]  # EAGLE3: target layers whose *input* residual is captured

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_width(self) -> int:
        """Width of the per-position target feature the draft reads (what disaggregation moves)."""
        return self.hidden_size * (3 if self.algorithm == "EAGLE3" else 1)

    @classmethod
    def from_dir(cls, draft_dir: str | Path, algorithm: str, target: ModelConfig) -> "DraftConfig":
        draft_dir = Path(draft_dir)
        if algorithm not in ALGORITHMS:
            raise DraftConfigError(f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, "
                                   f"got {algorithm!r}")
        path = draft_dir / "config.json"
        if not path.is_file():
            raise DraftConfigError(f"--speculative-draft-model-path {draft_dir}: no config.json")
        raw: dict[str, Any] = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        other = "EAGLE3" if algorithm == "EAGLE" else "EAGLE"
        if _ARCHITECTURES[other][0] in archs:
            raise DraftConfigError(f"{draft_dir} is an {other} draft ({archs}) but --speculative-algorithm "
                                   f"is {algorithm}")
        if not any(a in _ARCHITECTURES[algorithm] for a in archs):
            raise DraftConfigError(f"{draft_dir}: architectures {archs} is not an {algorithm} draft "
                                   f"(expected one of {', '.join(_ARCHITECTURES[algorithm])})")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise DraftConfigError(f"{draft_dir}: num_hidden_layers {raw['num_hidden_layers']}: only "
                                   "single-layer draft heads are supported")
        try:
            layer = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"]})
        except (ModelConfigError, KeyError) as exc:
            raise DraftConfigError(f"{draft_dir}: {exc}") from None
        h = layer.hidden_size
        target_hidden = int(raw.get("target_hidden_size") or h)
        if h != target.hidden_size or target_hidden != target.hidden_size:
            raise DraftConfigError(
                f"{draft_dir}: draft hidden_size {h} (target_hidden_size {target_hidden}) differs from the "
                f"target's {target.hidden_size}; drafts of another width are not supported")
        if layer.vocab_size != target.vocab_size:
            raise DraftConfigError(f"{draft_dir}: vocab_size {layer.vocab_size} differs from the target's "
                                   f"{target.vocab_size} (a draft for another tokenizer?)")
        if algorithm == "EAGLE":
            return cls(algorithm, layer, bool(raw.get("bias", True)), target.vocab_size, ())
        vd = int(raw.get("draft_vocab_size") or target.vocab_size)
        if not 0 < vd <= target.vocab_size:
            raise DraftConfigError(f"{draft_dir}: draft_vocab_size {vd} must be in [1, {target.vocab_size}]")
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = target.num_layers
        if ids is None:
            capture = (2, n // 2, n - 3)
        else:
            if len(ids) != 3 or any(not isinstance(i, int) for i in ids):
                raise DraftConfigError(f"{draft_dir}: eagle_aux_hidden_state_layer_ids must be 3 integers, "
                                       f"got {ids!r}")
            capture = tuple(i + 1 for i in ids)  # "output of layer i" = input of layer i + 1
        if any(not 1 <= c < n for c in capture):
            raise DraftConfigError(f"{draft_dir}: EAGLE3 reads the inputs of target layers {list(capture)}, "
                                   f"which must lie in [1, {n - 1}] for a {n}-layer target")
        return cls(algorithm, layer, False, vd, capture)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, tp = cfg.hidden_size, TPGroup()
        eagle3 = cfg.algorithm == "EAGLE3"
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.self_attn = Attention(cfg.layer, 0, tp, in_features=2 * h if eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.mlp = MLP(cfg.layer, tp)


class EagleDraftModel(nn.Module):
    """The draft head. Replicated on every TP rank (it is one layer); shares the
    target's embedding (and, for EAGLE, its lm_head) by reference."""

    # Checkpoint layout -> our names: both formats' layer prefix maps to `layer.`.
    stacked_params = STACKED_PARAMS
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: DraftConfig, embed: Embedding, target_head: LMHead) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        eagle3 = cfg.algorithm == "EAGLE3"
        in_fc = 3 * h if eagle3 else 2 * h
        self.fc = ColumnParallelLinear(in_fc, {0: h}, cfg.fc_bias, TPGroup(), "fc")
        self.layer = DraftLayer(cfg)
        if eagle3:
            self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
            self.lm_head = LMHead(cfg.draft_vocab_size, h, TPGroup())
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
        self.d2t.data.copy_(loaded)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name for a checkpoint tensor; None for tensors we do not use."""
        if name in ("embed_tokens.weight", "t2d") or name.endswith("rotary_emb.inv_freq"):
            return None
        for prefix in ("layers.0.", "midlayer."):
            if name.startswith(prefix):
                return "layer." + name[len(prefix):]
        return name

    @classmethod
    def load(cls, draft_dir: str | Path, cfg: DraftConfig, embed: Embedding, target_head: LMHead,
             device: torch.device, dtype: torch.dtype) -> "EagleDraftModel":
        # Built on the device in its dtype (d2t stays int64); the target's embedding and
        # lm_head are shared by reference, not copied (they are not submodules).
        model = build_model(lambda: cls(cfg, embed, target_head), Path(draft_dir), device, dtype,
                            rename=cls.checkpoint_name)
        for module in model.modules():
            if isinstance(module, Linear):
                module.prepack()
        return model.eval()

    # ---- running --------------------------------------------------------------------
    def bind(self, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        self.layer.self_attn.backend = backend
        self.layer.self_attn.rotary = rotary

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[Vd] target ids of the draft vocabulary (EAGLE3); None when it is the target vocab."""
        if self.config.algorithm != "EAGLE3":
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                from_target: bool) -> torch.Tensor:
        """One draft layer over packed tokens: ``input_ids`` [T] are x_{p+1}, ``hidden``
        [T, W] the feature of position p: a target feature when ``from_target``
        (EAGLE3: 3H wide), else the head's own previous output (H wide).
        Returns the pre-head output [T, H] (what the next draft step carries)."""
        embed, _ = self._shared
        emb = embed(input_ids)
        lay = self.layer
        if self.config.algorithm == "EAGLE":
            residual = self.fc(torch.cat([emb, hidden], dim=-1))
            x = residual
        else:
            residual = self.fc(hidden) if from_target else hidden
            x = torch.cat([lay.input_layernorm(emb), lay.hidden_norm(residual)], dim=-1)
        h = residual + lay.self_attn(x, ctx)
        return h + lay.mlp(lay.post_attention_layernorm(h))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (EAGLE: the target vocabulary)."""
        if self.config.algorithm == "EAGLE":
            _, head = self._shared
            return head(h).float()
        return self.lm_head(self.norm(h)).float()
