"""What the Triton attention launchers (``triton_attention.py``) accept, checked on the
host before a kernel is launched: shapes, dtypes, strides and devices, each refusal a
ValueError naming the argument. Apart from the kernels because it needs no Triton:
a wrong call fails the same way with or without a GPU."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors run only under the interpreter
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What the KV buffers may hold: those, or fp8 bytes the kernels dequantise with a scale.
KV_BUF_DTYPES = (*KV_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)
INT_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    check(all(t.device == device for t in tensors), "all tensors must be on the same device")
    check(device.type == "cuda" or INTERPRET,
           f"Triton attention needs CUDA tensors (got {device}); CPU tensors run only under "
           "TRITONINTERPRET=1 set before pdserve.model.triton_attention is imported")


def check_kv(k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple[int, int]:
    check(k_buf.dim() == 3 and k_buf.shape == v_buf.shape,
           f"k_buf/v_buf must both be [num_slots, num_kv_heads, head_dim], got {tuple(k_buf.shape)} "
           f"and {tuple(v_buf.shape)}")
    check(k_buf.dtype in KV_BUF_DTYPES and v_buf.dtype == k_buf.dtype,
           f"k_buf/v_buf must share one dtype among fp32/fp16/bf16/fp8 (e4m3fn, e5m2), got {k_buf.dtype} "
           f"and {v_buf.dtype}")
    check(k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1, "k_buf/v_buf need a contiguous last dim")
    head_dim = k_buf.shape[2]
    check(1 <= head_dim <= MAX_HEAD_DIM, f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    return k_buf.shape[1], head_dim


def check_q(q: torch.Tensor, num_kv_heads: int, head_dim: int, name: str = "q") -> int:
    check(q.dim() == 3 and q.shape[2] == head_dim,
           f"{name} must be [N, num_heads, {head_dim}], got {tuple(q.shape)}")
    check(q.dtype in KV_DTYPES, f"{name} must be fp32/fp16/bf16, got {q.dtype}")
    check(q.stride(-1) == 1, f"{name} needs a contiguous last dim")
    num_heads = q.shape[1]
    check(num_heads >= 1 and num_heads % num_kv_heads == 0,
           f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads


def check_ints(batch: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check(t.dim() == 1 and t.shape[0] == batch and t.dtype in INT_DTYPES and t.stride(0) == 1,
               f"{name} must be a contiguous [{batch}] int32/int64 tensor, got {tuple(t.shape)} {t.dtype} "
               f"stride {t.stride()}")


def check_table(req_to_token: torch.Tensor) -> None:
    check(req_to_token.dim() == 2 and req_to_token.dtype in INT_DTYPES,
           f"req_to_token must be a 2-D int64 (or int32) tensor, got {tuple(req_to_token.shape)} {req_to_token.dtype}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    check(out.shape == q.shape and out.dtype in KV_DTYPES and out.device == q.device
           and out.stride(-1) == 1,
           f"out must be a float tensor of shape {tuple(q.shape)} on {q.device} with a contiguous last dim")
    return out
