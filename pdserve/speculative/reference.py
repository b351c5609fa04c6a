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
          Options: fc [H, 3 H_t] for a draft narrower or wider than the
          target (then with its own ``embed_tokens``), further plain Llama
          layers ``layers.{i}`` (vLLM / speculators), ``norm_before_residual``,
          no own ``lm_head`` (the target's), an ``fc`` bias.

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


def llama_layer_config(target_cfg: Any, **dims: Any) -> Any:
    """A Llama config with the target's layer dimensions (or ``dims``: hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, for a
    draft of another width): a draft layer is a Llama layer whatever the target
    family (Qwen's biases and q/k norms are not part of it)."""
    from transformers import LlamaConfig

    head_dim = getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads
    kw: dict[str, Any] = dict(
        hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=head_dim)
    kw.update(dims)
    return LlamaConfig(
        **kw, rms_norm_eps=target_cfg.rms_norm_eps, hidden_act=target_cfg.hidden_act,
        max_position_embeddings=target_cfg.max_position_embeddings, vocab_size=target_cfg.vocab_size,
        rope_parameters=getattr(target_cfg, "rope_parameters", None), num_hidden_layers=1)


class DraftHead(nn.Module):
    """An EAGLE or EAGLE3 draft head; parameter names are the checkpoint's (SGLang's
    layout: the first layer is ``layers.0`` for EAGLE, ``midlayer`` for EAGLE3;
    EAGLE3's further layers are ``layers.{i}``, plain Llama decoder layers)."""

    def __init__(self, algo: str, cfg: Any, embed: torch.Tensor, target_head: torch.Tensor,
                 draft_vocab: torch.Tensor | None, *, num_layers: int = 1, dims: dict[str, Any] | None = None,
                 norm_before_residual: bool = False, fc_bias: bool = False, own_embed: bool = False,
                 own_head: bool = True) -> None:
        """``cfg``: the target's transformers config (any Llama-family architecture);
        ``embed`` / ``target_head``: the target's weights (shared, frozen, not saved).
        EAGLE3 options: ``num_layers`` decoder layers, ``dims`` (the draft layers'
        dimensions when they differ from the target's), ``norm_before_residual``,
        ``fc_bias``, ``own_embed`` (an embedding of its own, saved as
        ``embed_tokens``), ``own_head`` (else logits come from the target's head)."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        target_hidden = cfg.hidden_size
        self.dims = dict(dims or {})
        cfg = llama_layer_config(cfg, **self.dims)
        self.algo = algo
        self.num_layers = num_layers
        self.norm_before_residual = norm_before_residual
        self.own_head = own_head
        h = cfg.hidden_size
        if algo == "EAGLE" and (num_layers != 1 or self.dims or norm_before_residual or own_embed or not own_head):
            raise ValueError("the EAGLE-1 head has one layer of the target's width and shares its embedding / head")
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        else:
            self.embed = embed.detach()
        self.target_head = target_head.detach()
        self.rotary = LlamaRotaryEmbedding(cfg)

        def decoder_layer(in_dim: int) -> nn.Module:
            layer = nn.Module()
            layer.self_attn = DraftAttention(cfg, in_dim)
            layer.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            layer.mlp = LlamaMLP(cfg)
            return layer

        if algo == "EAGLE":
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layers = nn.ModuleList([decoder_layer(h)])
            return
        self.fc = nn.Linear(3 * target_hidden, h, bias=fc_bias)
        self.midlayer = decoder_layer(2 * h)
        self.midlayer.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.midlayer.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        if num_layers > 1:  # keys "1", "2", ...: checkpoint names layers.{i}
            extra = {}
            for i in range(1, num_layers):
                layer = decoder_layer(h)
                layer.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
                extra[str(i)] = layer
            self.layers = nn.ModuleDict(extra)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        assert draft_vocab is not None
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)
        if own_head:
            self.lm_head = nn.Linear(h, len(draft_vocab), bias=False)
        elif len(draft_vocab) != cfg.vocab_size or h != target_hidden:
            raise ValueError("a head without its own lm_head uses the target's: full vocabulary, target width")

    @property
    def layer(self) -> nn.Module:
        """The first layer."""
        return self.layers[0] if self.algo == "EAGLE" else self.midlayer

    @property
    def all_layers(self) -> list[nn.Module]:
        if self.algo == "EAGLE" or self.num_layers == 1:
            return [self.layer]
        return [self.midlayer] + [self.layers[str(i)] for i in range(1, self.num_layers)]

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if hasattr(self, "embed_tokens") else F.embedding(tokens, self.embed)

    def step_input(self, tokens: torch.Tensor, hidden: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of the first layer in one draft step.

        ``hidden`` is a target feature at the first step (post-norm [.., H] for
        EAGLE, 3 aux layers [.., 3H] for EAGLE3) and the head's own previous
        output afterwards.  EAGLE3 applies ``fc`` to target features only.
        """
        emb = self.embedding(tokens)
        if self.algo == "EAGLE":
            h0 = self.fc(torch.cat([emb, hidden], dim=-1))
            return h0, h0
        if first:
            hidden = self.fc(hidden)
        lay = self.midlayer
        normed = lay.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([lay.input_layernorm(emb), normed], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, layer: nn.Module | None = None) -> torch.Tensor:
        layer = layer if layer is not None else self.layer
        h = residual + attn_out
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """EAGLE: target-vocab logits via the target head; EAGLE3: draft-vocab logits
        (target-vocab ones through the target's head when it has no head of its own)."""
        if self.algo == "EAGLE":
            return h @ self.target_head.T
        if not self.own_head:
            return self.norm(h) @ self.target_head.T
        return self.lm_head(self.norm(h))

    def ttt(self, tokens: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Draft outputs (pre-head hidden) of TTT steps 0..depth-1 over [B, T] rows.

        Step j, index t: token ``tokens[:, t + j]`` (= x_{t+j+1}), position t + j,
        keys (in every layer) = step-0 keys at indices <= t plus steps 1..j keys
        at index t. Indices past the row end see padding tokens and are masked in
        the loss.
        """
        b, t = tokens.shape
        layers = self.all_layers
        keys_k: list[list[torch.Tensor]] = [[] for _ in layers]
        keys_v: list[list[torch.Tensor]] = [[] for _ in layers]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        eye = torch.eye(t, dtype=torch.bool)
        outs: list[torch.Tensor] = []
        hidden = feats
        for j in range(depth):
            tok_j = F.pad(tokens[:, j:], (0, j), value=0)
            pos = (torch.arange(t) + j).unsqueeze(0).expand(b, t)
            cos, sin = self.rotary(feats, pos)
            mask = torch.cat([causal] + [eye] * j, dim=1)
            x, residual = self.step_input(tok_j, hidden, first=(j == 0))
            out = residual
            for i, layer in enumerate(layers):
                if i > 0:
                    x, residual = layer.input_layernorm(out), out
                q, k, v = layer.self_attn.qkv(x, cos, sin)
                keys_k[i].append(k)
                keys_v[i].append(v)
                attn = layer.self_attn.attend(q, torch.cat(keys_k[i], 2), torch.cat(keys_v[i], 2), mask)
                out = self.finish(attn, residual, layer)
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
    """Write ``head`` as a public-layout checkpoint (config.json + model.safetensors); returns the tensors.
    The layout is SGLang's (EAGLE3: ``midlayer.*``, further layers ``layers.{i}.*`` as
    vLLM names them, ``d2t`` / ``t2d``); ``pdserve.testing.convert_eagle3_layout``
    rewrites an EAGLE3 head into the other public layouts."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
            "vocab_size", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    draft_cfg: dict[str, Any] = {k: cfg[k] for k in keep if k in cfg}
    draft_cfg.update(head.dims)  # a draft of another width than the target
    draft_cfg.update(num_hidden_layers=head.num_layers, tie_word_embeddings=False, torch_dtype="float32",
                     model_type="llama")
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
        if head.fc.bias is not None:
            draft_cfg["bias"] = True  # SGLang builds fc's bias from this
        if head.norm_before_residual:
            draft_cfg["norm_before_residual"] = True
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=2) + "\n")
    return state
