"""Model runner: owns the weights and runs one forward over a described batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from pdserve.config import ConfigError, ServerArgs
from pdserve.model.attention_backends import (AttentionBackend, backend_class, backends_supporting, create_backend,
                                             stand_in_note)
from pdserve.model.cuda_graph import DecodeGraphs
from pdserve.model.decode_mirror import DecodeKVMirror
from pdserve.model.device_io import upload
from pdserve.model.forward_context import ForwardContext, KVStore, RowLayout, TreeMasks
from pdserve.model.kv_quant import FP8_DTYPES, KVScales, is_fp8, read_kv_scales
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
    layout: RowLayout           # rows, prefix and extend lengths (device and host)
    sample_index: torch.Tensor  # [R] packed positions whose logits are wanted
    # Tree verification: RoPE positions of the new tokens and per-row ancestry masks.
    positions: torch.Tensor | None = None
    extra_masks: TreeMasks | None = None
    # Plain decode steps only (one new token per row, no masks): one key per row
    # naming the request (see DecodeKVMirror).
    decode_keys: list[int] | None = None

    @classmethod
    def upload(cls, input_ids: Sequence[int] | torch.Tensor, rows: Sequence[int], prefix_lens: Sequence[int],
               extend_lens: Sequence[int], sample_index: Sequence[int] | None, device: torch.device,
               **extra: Any) -> "ForwardInput":
        """A forward from the scheduler's host values, uploaded without a host-device
        sync; ``sample_index`` None: every new token's logits (one per row in decode)."""
        ids = input_ids if isinstance(input_ids, torch.Tensor) else upload(input_ids, torch.int64, device)
        index = (torch.arange(sum(extend_lens), device=device) if sample_index is None
                 else upload(sample_index, torch.int64, device))
        return cls(ids, RowLayout.upload(rows, prefix_lens, extend_lens, device), index, **extra)


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
        self.kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else {**_DTYPES, **FP8_DTYPES}[args.kv_cache_dtype]
        # fp8 KV: per-layer scales from the checkpoint (1.0 where it has none; dummy
        # weights have no checkpoint). Other KV dtypes store values as they are.
        self.kv_scales = KVScales.ones(cfg.num_layers)
        if is_fp8(self.kv_dtype) and args.load_format != "dummy":
            try:
                self.kv_scales = read_kv_scales(model_dir, cfg.num_layers)
            except ValueError as exc:
                raise ConfigError(f"--kv-cache-dtype {args.kv_cache_dtype}: {exc}") from None
        # Built on the device in its dtype, the checkpoint streamed tensor by tensor (no host copy).
        self.model = build_model(lambda: model_class(cfg)(cfg, tp), model_dir, self.device, self.dtype,
                                 random_weights=args.load_format == "dummy").eval()
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.prepack()
        attn = self.model.model.layers[0].self_attn
        self.num_local_heads = attn.num_heads
        self.num_local_kv_heads = attn.num_kv_heads
        self.rotary = RotaryEmbedding(cfg.head_dim, self.context_len, cfg.rope).to(self.device)
        self.req_to_token: torch.Tensor | None = None
        self.padding_row = 0
        self.decode_mirror: DecodeKVMirror | None = None
        self.decode_graphs: DecodeGraphs | None = None

    def bind_memory(self, kv_pool: KVStore, req_to_token: torch.Tensor, pool_tokens: int, padding_row: int) -> None:
        """``padding_row``: a request-table row never handed out (every position maps to
        the padding slot 0), for rows that pad a batch to a captured size."""
        self.attention_backend = self.args.resolved_attention_backend()
        note = stand_in_note(self.args.attention_backend, self.device.type)
        if note is not None and self.tp.rank == 0:
            logger.warning(note)
        if (not self.args.disable_decode_kv_mirror and self.device.type == "cpu"
                and backend_class(self.attention_backend).supports_decode_mirror):
            # Bounded to a quarter of the pool: past that, decode gathers from the pool.
            # Not on CUDA: there the pool is sized to fill the free device memory and
            # a gather costs little next to the device's bandwidth.
            self.decode_mirror = DecodeKVMirror(kv_pool, self.config.num_layers, self.num_local_kv_heads,
                                                self.config.head_dim, self.dtype, self.device,
                                                max_tokens=pool_tokens // 4)
        self.backend = self._attention(kv_pool)
        self.model.bind(self.backend, self.rotary)
        self.req_to_token = req_to_token
        self.padding_row = padding_row

    def enable_decode_graphs(self, max_bs: int, capture: bool) -> None:
        """Plain decode forwards of up to ``max_bs`` rows go through static buffers,
        replayed from CUDA graphs when ``capture`` (else run eagerly: the CPU tests)."""
        if not self.backend.supports_cuda_graphs:
            names = " or ".join(backends_supporting("supports_cuda_graphs"))
            raise ConfigError(f"CUDA graphs need --attention-backend {names} (its decode plan reads no host lengths)")
        if capture and self.config.moe is not None:
            raise ConfigError(f"CUDA graphs are not supported for {self.config.architecture}: its MoE layers "
                              "read the per-expert token counts on the host (run without --enable-cuda-graph)")
        self.decode_graphs = DecodeGraphs(self._decode_logits, self.padding_row, max_bs, self.device)
        if capture:
            self.decode_graphs.capture()

    def _decode_logits(self, input_ids: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """One token per row, every row's logits: the forward a decode graph records."""
        assert self.req_to_token is not None
        hidden, _ = self.model(input_ids, self.backend.context(self.req_to_token, layout))
        return self.model.compute_logits(hidden)

    def _attention(self, kv_pool: KVStore) -> AttentionBackend:
        """The backend --attention-backend names (imported only now: triton's kernels
        import triton)."""
        return create_backend(self.attention_backend, kv_pool, self.num_local_heads, self.num_local_kv_heads,
                              self.config.head_dim, mirror=self.decode_mirror)

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
        layout = batch.layout
        graphs = self.decode_graphs
        if (graphs is not None and capture_layers is None and batch.extra_masks is None and batch.positions is None
                and layout.one_token_per_row and graphs.fits(layout.batch_size)):
            logits = graphs.run(batch.input_ids, layout)[batch.sample_index]
            return logits, None, self.req_to_token[layout.rows, layout.prefix_lens]
        step = None
        if self.decode_mirror is not None and batch.decode_keys is not None:
            step = self.decode_mirror.prepare(batch.decode_keys, self.req_to_token, layout.rows, layout.prefix_lens)
        if step is not None:
            ctx = ForwardContext.mirrored(self.req_to_token, layout, step)
        else:
            ctx = self.backend.context(self.req_to_token, layout, batch.extra_masks, batch.positions)
        hidden, captured = self.model(batch.input_ids, ctx, capture_layers or ())
        logits = self.model.compute_logits(hidden[batch.sample_index])
        if capture_layers is None:
            return logits, None, ctx.out_cache_loc
        return logits, (torch.cat(captured, dim=-1) if capture_layers else hidden), ctx.out_cache_loc
