"""Tiny random Hugging Face checkpoints (with a character tokenizer) for tests and benchmarks.

No model hub is reachable on our machines, so tests build and save their own
models with transformers and use transformers as the reference runtime.
"""

from __future__ import annotations

import json
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


_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def build_random_model(out_dir: str | Path, arch: str = "llama", *, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       intermediate_size: int = 128, vocab_size: int | None = None,
                       tie_word_embeddings: bool = False, max_position_embeddings: int = 1024,
                       seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random `arch` checkpoint + character tokenizer to out_dir."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = build_char_tokenizer(out)
    cfg_cls_name, model_cls_name = _ARCH[arch]
    cfg_cls = getattr(transformers, cfg_cls_name)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size or tok_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(config_overrides)
    cfg = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(cfg)
    # Random init is tiny (std 0.02): widen it so logits are not flat and greedy
    # choices are well separated (parity tests compare argmaxes).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def build_random_draft(target_dir: str | Path, out_dir: str | Path, algorithm: str = "EAGLE", *,
                       draft_vocab_size: int | None = None, seed: int = 0) -> Path:
    """Write a random (untrained) EAGLE or EAGLE3 head for the target checkpoint at
    ``target_dir``, in the public layout. EAGLE3's draft vocabulary is the target's
    first ``draft_vocab_size`` ids after a seeded shuffle (nonzero ``d2t`` offsets)."""
    import torch
    from transformers import AutoConfig

    from pdserve.speculative.reference import DraftHead, aux_layer_ids, save_draft

    target_dir, out = Path(target_dir), Path(out_dir)
    cfg = AutoConfig.from_pretrained(str(target_dir))
    torch.manual_seed(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    draft_vocab = None
    if algorithm == "EAGLE3":
        vd = draft_vocab_size or v
        draft_vocab = torch.randperm(v)[:vd].sort().values
    # The embedding / head passed here are only needed to run the head, not to save it.
    head = DraftHead(algorithm, cfg, torch.zeros(v, h), torch.zeros(v, h), draft_vocab)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    save_draft(head, target_dir, out, aux_layer_ids(cfg.num_hidden_layers))
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random checkpoint (+ character tokenizer).")
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted(_ARCH))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    path = build_random_model(args.out_dir, args.arch, num_layers=args.layers, hidden_size=args.hidden)
    print(path)


if __name__ == "__main__":
    main()
