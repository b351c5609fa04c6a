"""Model runner: owns the weights and runs one forward over a described batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import ConfigError, ServerArgs
from pdserve.model.attention import ForwardContext, KVStore, TorchNativeAttention
from pdserve.model.decode_mirror import DecodeKVMirror
from pdserve.model.layers import Linear, RotaryEmbedding
from pdserve.model.loader import build_model
from pdserve.model.model_config import ModelConfig
from pdserve.model.parallel import TPGroup
from pdserve.model.registry import model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ForwardInput:
    """One forward, described by the scheduler (all tensors on the model device)."""
    input_ids: torch.Tensor     # [T] new tokens, packed row after row
    rows: torch.Tensor          # [B] request-table rows
    prefix_lens: torch.Tensor   # [B] tokens already in the KV pool
    extend_lens: torch.Tensor   # [B] new tokens per row
    sample_index: torch.Tensor  # [R] packed positions whose logits are wanted
    # Tree verification: RoPE positions of the new tokens and per-row ancestry masks.
    positions: torch.Tensor | None = None
    extra_masks: list[torch.Tensor | None] | None = None
    # Plain decode steps only (one new token per row, no masks): one key per row
    # naming the request (see DecodeKVMirror).
    decode_keys: list[int] | None = None


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 is ~6x slower on CPUs without AVX-512 BF16
    return _DTYPES.get(cfg.torch_dtype, torch.bfloat16)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: Path, tp: TPGroup) -> None:
        self.args = args
        self.tp = tp
        self.device = args.resolved_device()
        self.config = ModelConfig.from_dir(model_dir)
        cfg = self.config
        limit = cfg.context_limit
        if args.context_length is not None and args.context_length > limit:
            raise ConfigError(f"--context-length {args.context_length} exceeds the model's limit {limit}")
        self.context_len = args.context_length or limit
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else _DTYPES[args.kv_cache_dtype]
        # Built on the device in its dtype, the checkpoint streamed tensor by tensor (no host copy).
        self.model = build_model(lambda: model_class(cfg)(cfg, tp), model_dir, self.device, self.dtype).eval()
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.prepack()
        attn = self.model.model.layers[0].self_attn
        self.num_local_heads = attn.num_heads
        self.num_local_kv_heads = attn.num_kv_heads
        self.rotary = RotaryEmbedding(cfg.head_dim, self.context_len, cfg.rope).to(self.device)
        self.req_to_token: torch.Tensor | None = None
        self.decode_mirror: DecodeKVMirror | None = None

    def bind_memory(self, kv_pool: KVStore, req_to_token: torch.Tensor, pool_tokens: int) -> None:
        if not self.args.disable_decode_kv_mirror and self.device.type == "cpu":
            # Bounded to a quarter of the pool: past that, decode gathers from the pool.
            # Not on CUDA: there the pool is sized to fill the free device memory and
            # a gather costs little next to the device's bandwidth.
            self.decode_mirror = DecodeKVMirror(kv_pool, self.config.num_layers, self.num_local_kv_heads,
                                                self.config.head_dim, self.dtype, self.device,
                                                max_tokens=pool_tokens // 4)
        backend = TorchNativeAttention(kv_pool, self.num_local_heads, self.num_local_kv_heads,
                                       self.config.head_dim, self.decode_mirror)
        self.model.bind(backend, self.rotary)
        self.req_to_token = req_to_token

    @torch.inference_mode()
    def forward(self, batch: ForwardInput) -> torch.Tensor:
        """Run the model over the new tokens; returns float32 logits [R, V]."""
        return self.forward_features(batch, None)[0]

    @torch.inference_mode()
    def forward_features(self, batch: ForwardInput, capture_layers: tuple[int, ...] | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Logits [R, V]; unless ``capture_layers`` is None, the per-token feature a
        draft head reads for every new token [T, W] (the final normed hidden state
        when ``capture_layers`` is empty (EAGLE), else the residual streams entering
        those layers, concatenated (EAGLE3)); and the KV slot of every new token [T]."""
        assert self.req_to_token is not None, "bind_memory() first"
        step = None
        if self.decode_mirror is not None and batch.decode_keys is not None:
            step = self.decode_mirror.prepare(batch.decode_keys, self.req_to_token, batch.rows, batch.prefix_lens)
        if step is not None:
            ctx = ForwardContext.mirrored(self.req_to_token, batch.rows, batch.prefix_lens, step)
        else:
            ctx = ForwardContext.build(self.req_to_token, batch.rows, batch.prefix_lens, batch.extend_lens,
                                       batch.extra_masks, batch.positions)
        hidden, captured = self.model(batch.input_ids, ctx, capture_layers or ())
        logits = self.model.compute_logits(hidden[batch.sample_index])
        if capture_layers is None:
            return logits, None, ctx.out_cache_loc
        return logits, (torch.cat(captured, dim=-1) if capture_layers else hidden), ctx.out_cache_loc
