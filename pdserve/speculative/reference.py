"""Reference EAGLE / EAGLE3 draft heads in plain PyTorch (+ transformers layers).

The independent implementation that trains the demo heads
(``scripts/train_eagle_heads.py``), writes them in the public checkpoint
layouts (``save_draft``) and that tests compare pdserve's draft model against.
It runs on a transformers target: ``target_pass`` captures the features a
head reads (``shared/reference/eagle.md`` §1, §6):

  EAGLE   ``fc`` [H, 2H] (+bias) over ``cat(embed(x_{p+1}), f_p)``, f = the
          target's post-norm last hidden state; ``layers.0.*`` without input
          norm; the target's embedding and ``lm_head`` are shared.
  EAGLE3  ``fc`` [H, 3H] over three target layers' residual streams;
          ``midlayer.*`` with 2H-wide q/k/v over ``cat(input_norm(embed),
          hidden_norm(h))``; ``norm``; own ``lm_head`` over a draft vocabulary;
          ``d2t`` offsets (target id = draft id + d2t[draft id]); ``t2d``.

Aux layer ids follow SGLang's ``eagle_aux_hidden_state_layer_ids`` convention:
id i = the *output* of target layer i (the residual stream entering i + 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class DraftAttention(nn.Module):
    """Llama attention over ``in_dim`` inputs (2H for EAGLE3) with an explicit boolean mask."""

    def __init__(self, cfg: Any, in_dim: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rep = self.nh // self.nkv
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask
        )
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


def llama_layer_config(target_cfg: Any) -> Any:
    """A Llama config with the target's layer dimensions: a draft layer is a Llama layer
    whatever the target family (Qwen's biases and q/k norms are not part of it)."""
    from transformers import LlamaConfig

    head_dim = getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads
    return LlamaConfig(
        hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=head_dim, rms_norm_eps=target_cfg.rms_norm_eps, hidden_act=target_cfg.hidden_act,
        max_position_embeddings=target_cfg.max_position_embeddings, vocab_size=target_cfg.vocab_size,
        rope_parameters=getattr(target_cfg, "rope_parameters", None), num_hidden_layers=1)


class DraftHead(nn.Module):
    """One EAGLE or EAGLE3 draft layer; parameter names are the checkpoint's."""

    def __init__(self, algo: str, cfg: Any, embed: torch.Tensor, target_head: torch.Tensor,
                 draft_vocab: torch.Tensor | None) -> None:
        """``cfg``: the target's transformers config (any Llama-family architecture);
        ``embed`` / ``target_head``: the target's weights (shared, frozen, not saved)."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = llama_layer_config(cfg)
        self.algo = algo
        h = cfg.hidden_size
        self.embed = embed.detach()
        self.target_head = target_head.detach()
        self.rotary = LlamaRotaryEmbedding(cfg)
        layer = nn.Module()
        if algo == "EAGLE":
            self.fc = nn.Linear(2 * h, h, bias=True)
            layer.self_attn = DraftAttention(cfg, h)
        else:
            self.fc = nn.Linear(3 * h, h, bias=False)
            layer.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            layer.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            layer.self_attn = DraftAttention(cfg, 2 * h)
            self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            assert draft_vocab is not None
            self.register_buffer("draft_vocab", draft_vocab, persistent=False)
            self.lm_head = nn.Linear(h, len(draft_vocab), bias=False)
        layer.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        layer.mlp = LlamaMLP(cfg)
        if algo == "EAGLE":
            self.layers = nn.ModuleList([layer])
        else:
            self.midlayer = layer

    @property
    def layer(self) -> nn.Module:
        return self.layers[0] if self.algo == "EAGLE" else self.midlayer

    def step_input(self, tokens: torch.Tensor, hidden: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of one draft step.

        ``hidden`` is a target feature at the first step (post-norm [.., H] for
        EAGLE, 3 aux layers [.., 3H] for EAGLE3) and the head's own previous
        output afterwards.  EAGLE3 applies ``fc`` to target features only.
        """
        emb = F.embedding(tokens, self.embed)
        if self.algo == "EAGLE":
            h0 = self.fc(torch.cat([emb, hidden], dim=-1))
            return h0, h0
        if first:
            hidden = self.fc(hidden)
        lay = self.midlayer
        return torch.cat([lay.input_layernorm(emb), lay.hidden_norm(hidden)], dim=-1), hidden

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + attn_out
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """EAGLE: target-vocab logits via the target head; EAGLE3: draft-vocab logits."""
        if self.algo == "EAGLE":
            return h @ self.target_head.T
        return self.lm_head(self.norm(h))

    def ttt(self, tokens: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Draft outputs (pre-head hidden) of TTT steps 0..depth-1 over [B, T] rows.

        Step j, index t: token ``tokens[:, t + j]`` (= x_{t+j+1}), position t + j,
        keys = step-0 keys at indices <= t plus steps 1..j keys at index t.
        Indices past the row end see padding tokens and are masked in the loss.
        """
        b, t = tokens.shape
        attn = self.layer.self_attn
        keys_k: list[torch.Tensor] = []
        keys_v: list[torch.Tensor] = []
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        eye = torch.eye(t, dtype=torch.bool)
        outs: list[torch.Tensor] = []
        hidden = feats
        for j in range(depth):
            tok_j = F.pad(tokens[:, j:], (0, j), value=0)
            pos = (torch.arange(t) + j).unsqueeze(0).expand(b, t)
            cos, sin = self.rotary(feats, pos)
            x, residual = self.step_input(tok_j, hidden, first=(j == 0))
            q, k, v = attn.qkv(x, cos, sin)
            keys_k.append(k)
            keys_v.append(v)
            mask = torch.cat([causal] + [eye] * j, dim=1)
            out = self.finish(attn.attend(q, torch.cat(keys_k, 2), torch.cat(keys_v, 2), mask), residual)
            outs.append(out)
            hidden = out
        return outs


# ---------------------------------------------------------------------------
# Target features
# ---------------------------------------------------------------------------


def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE3 capture set, SGLang convention (id = output of layer id).

    Low, middle and high, distinct from 4 layers up (a 4-layer target gets
    ids 0, 1, 2: the residual streams entering layers 1, 2, 3). SGLang's
    default [2, L//2, L-3] (inputs) repeats layers for such shallow targets.
    """
    if num_layers < 2:
        raise ValueError("EAGLE3 needs a target with at least 2 layers")
    return sorted([0, max(0, num_layers // 2 - 1), num_layers - 2])


@torch.no_grad()
def target_pass(target: nn.Module, ids: torch.Tensor, aux_ids: list[int]) -> dict[str, torch.Tensor]:
    out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states  # [embeddings, out of layer 0, ..., post-norm out of the last layer]
    return {
        "eagle": hs[-1],
        "eagle3": torch.cat([hs[i + 1] for i in aux_ids], dim=-1),
        "logits": out.logits,
    }



def save_draft(head: DraftHead, target_dir: Path, out: Path, aux_ids: list[int]) -> dict[str, torch.Tensor]:
    """Write ``head`` as a public-layout checkpoint (config.json + model.safetensors); returns the tensors."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
            "vocab_size", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    draft_cfg: dict[str, Any] = {k: cfg[k] for k in keep if k in cfg}
    draft_cfg.update(num_hidden_layers=1, tie_word_embeddings=False, torch_dtype="float32", model_type="llama")
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    if head.algo == "EAGLE":
        draft_cfg.update(architectures=["LlamaForCausalLMEagle"], bias=True)
    else:
        vd = len(head.draft_vocab)
        d2t = head.draft_vocab - torch.arange(vd)
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[head.draft_vocab] = True
        state.update(d2t=d2t.to(torch.int64), t2d=t2d)
        draft_cfg.update(
            architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vd, target_hidden_size=cfg["hidden_size"],
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=2) + "\n")
    return state
