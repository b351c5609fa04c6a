"""pdserve's paged-attention Triton kernels: KV store, split-KV decode, ragged extend.

KV layout. Per layer one K and one V buffer, each ``[num_slots, Hkv, D]``. A
request's KV lives in slots named by the request table ``req_to_token[row, pos]``
(int64 ``[num_rows, max_context]``). Pages are the scheduler's business: the
kernels look a slot up per position, so any page size works. Slot 0 is a padding
slot that always holds finite values, which is what masked slot loads fall back to.

Decode ("flash decoding"). With one query token per row, a grid of (B, Hkv) is
too small to fill a GPU at small batch, so each row's context is cut into
``num_splits`` chunks handled by different programs: grid (B, Hkv, num_splits).
A program takes all the query heads that share its KV head as the rows of one
block (padded to >= 16 rows so ``tl.dot`` can use tensor cores), runs an online
softmax over its chunk and writes a partial result to an fp32 workspace: the
chunk-normalised output and its log-sum-exp (-inf for an empty chunk, which then
weighs nothing). A second kernel, grid (B, Hq), merges the partials. Chunk
bounds come from ``seq_lens`` read inside the kernel and no launcher reads a
device value on the host, so every call can be captured in a CUDA graph.

Extend (prefill, chunked prefill, tree verification). Grid (B, Hq, m-blocks of
the new tokens). A program first sweeps the row's cached prefix (every key
visible), then its new keys under the causal mask or the custom (tree) mask.

FP8 KV (``--kv-cache-dtype fp8_*``). The buffers may be float8_e4m3fn / float8_e5m2:
the kernels load the bytes and multiply by the layer's ``k_scale`` / ``v_scale``
(1.0 otherwise). ``store_kv`` does not quantise: an fp8 pool is written through
``TokenToKVPool.write``, the one quantiser both backends share (and the interpreter's
fp32 -> e5m2 cast rounds wrongly, so a kernel-side cast could not be checked on CPU).

Numerics. Everything is computed in fp32 (the interpreter has no bf16
arithmetic): loads are converted to fp32, and ``tl.dot`` runs in fp32 with
``ieee`` precision for fp32 data, or ``tf32`` for fp16/bf16 data, which those
values convert to exactly. Softmax works in base 2 (``exp2``, with log2(e)
folded into the scale).

Without a GPU the kernels run on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, which must be set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model.kernel_checks import INT_DTYPES as _INT_DTYPES
from pdserve.model.kernel_checks import KV_DTYPES as _KV_DTYPES
from pdserve.model.kernel_checks import check as _check
from pdserve.model.kernel_checks import check_device as _check_device
from pdserve.model.kernel_checks import check_ints as _check_ints
from pdserve.model.kernel_checks import check_kv as _check_kv
from pdserve.model.kernel_checks import check_out as _check_out
from pdserve.model.kernel_checks import check_q as _check_q
from pdserve.model.kernel_checks import check_table as _check_table

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- kernels

@triton.jit
def _store_kv_kernel(k_buf, v_buf, loc, k, v,
                     s_bs, s_bh, s_ks, s_kh, s_vs, s_vh, H, D,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all its KV heads at once.
    t = tl.program_id(0)
    slot = tl.load(loc + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < H) & (d[None, :] < D)
    dst = slot * s_bs + h[:, None] * s_bh + d[None, :]
    kt = tl.load(k + t.to(tl.int64) * s_ks + h[:, None] * s_kh + d[None, :], mask=mask)
    vt = tl.load(v + t.to(tl.int64) * s_vs + h[:, None] * s_vh + d[None, :], mask=mask)
    tl.store(k_buf + dst, kt.to(k_buf.dtype.element_ty), mask=mask)
    tl.store(v_buf + dst, vt.to(v_buf.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv(req_to_token, k_buf, v_buf, row, pos, ok, kv_head, d, d_ok,
             s_rr, s_rp, s_ks, s_kh, s_vs, s_vh, k_scale, v_scale):
    """K and V (fp32, dequantised) of positions ``pos`` of request-table ``row``, one KV
    head; masked positions read slot 0 and load zeros."""
    slot = tl.load(req_to_token + row * s_rr + pos * s_rp, mask=ok, other=0)
    kv_mask = ok[:, None] & d_ok[None, :]
    kb = tl.load(k_buf + slot[:, None] * s_ks + kv_head * s_kh + d[None, :], mask=kv_mask, other=0.0)
    vb = tl.load(v_buf + slot[:, None] * s_vs + kv_head * s_vh + d[None, :], mask=kv_mask, other=0.0)
    return kb.to(tl.float32) * k_scale, vb.to(tl.float32) * v_scale


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One block of keys of an online softmax (base 2). Rows with nothing visible
    yet keep m = -inf; m_safe keeps them free of inf - inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(q, k_buf, v_buf, req_to_token, rows, seq_lens, ws_out, ws_lse, qk_scale, k_scale, v_scale,
                         s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_rr, s_rp,
                         s_wb, s_wh, s_ws, s_lb, s_lh,
                         GROUP, D, NUM_SPLITS,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # Chunks are whole key blocks, so no program but the last one masks keys;
    # with more splits than blocks, the trailing programs get an empty chunk.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < GROUP
    d_ok = d < D
    q_head = kv_head * GROUP + h
    qv = tl.load(q + b.to(tl.int64) * s_qb + q_head[:, None] * s_qh + d[None, :],
                 mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        kb, vb = _load_kv(req_to_token, k_buf, v_buf, row, pos, ok, kv_head, d, d_ok,
                          s_rr, s_rp, s_ks, s_kh, s_vs, s_vh, k_scale, v_scale)
        m_i, l_i, acc = _softmax_step(qv, kb, vb, ok[None, :], m_i, l_i, acc, qk_scale, DOT_PREC)

    has = l_i > 0.0  # false for an empty chunk: output 0 and lse -inf, a neutral partial
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    w_off = b.to(tl.int64) * s_wb + q_head[:, None] * s_wh + split * s_ws + d[None, :]
    tl.store(ws_out + w_off, out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(ws_lse + b.to(tl.int64) * s_lb + q_head * s_lh + split, lse, mask=h_ok)


@triton.jit
def _decode_merge_kernel(ws_out, ws_lse, out, s_wb, s_wh, s_ws, s_lb, s_lh, s_ob, s_oh,
                         D, NUM_SPLITS, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < D
    lse = tl.load(ws_lse + b * s_lb + head * s_lh + s, mask=s_ok, other=float("-inf"))
    part = tl.load(ws_out + b * s_wb + head * s_wh + s[:, None] * s_ws + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)  # seq_len 0 -> zeros
    tl.store(out + b * s_ob + head * s_oh + d, res.to(out.dtype.element_ty), mask=d_ok)


@triton.jit
def _extend_kernel(q, k_buf, v_buf, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
                   custom_mask, mask_starts, qk_scale, k_scale, v_scale,
                   s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_ot, s_oh, s_rr, s_rp,
                   GROUP, D,
                   USE_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    ext = tl.load(extend_lens + b).to(tl.int32)
    if m_start >= ext:  # the grid is sized for the longest row
        return
    row = tl.load(rows + b).to(tl.int64)
    pre = tl.load(prefix_lens + b).to(tl.int32)
    q0 = tl.load(q_starts + b).to(tl.int64)
    kv_head = head // GROUP

    i = m_start + tl.arange(0, BLOCK_M)  # index of the new token within its row
    i_ok = i < ext
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qv = tl.load(q + (q0 + i[:, None]) * s_qt + head * s_qh + d[None, :],
                 mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: the cached prefix, every key visible to every new token.
    for start in range(0, pre, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < pre
        kb, vb = _load_kv(req_to_token, k_buf, v_buf, row, pos, ok, kv_head, d, d_ok,
                          s_rr, s_rp, s_ks, s_kh, s_vs, s_vh, k_scale, v_scale)
        m_i, l_i, acc = _softmax_step(qv, kb, vb, ok[None, :], m_i, l_i, acc, qk_scale, DOT_PREC)

    # Phase 2: the new keys j (stored at positions pre + j), under the causal or custom mask.
    if USE_MASK:
        new_hi = ext
        mask_row = tl.load(mask_starts + b).to(tl.int64) + i.to(tl.int64) * ext
    else:
        new_hi = tl.minimum(ext, m_start + BLOCK_M)  # causal: later keys are invisible to the block
    for start in range(0, new_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j < ext
        kb, vb = _load_kv(req_to_token, k_buf, v_buf, row, pre + j, ok, kv_head, d, d_ok,
                          s_rr, s_rp, s_ks, s_kh, s_vs, s_vh, k_scale, v_scale)
        pair_ok = i_ok[:, None] & ok[None, :]
        if USE_MASK:
            visible = tl.load(custom_mask + mask_row[:, None] + j[None, :], mask=pair_ok, other=0) != 0
        else:
            visible = pair_ok & (j[None, :] <= i[:, None])
        m_i, l_i, acc = _softmax_step(qv, kb, vb, visible, m_i, l_i, acc, qk_scale, DOT_PREC)

    res = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out + (q0 + i[:, None]) * s_ot + head * s_oh + d[None, :], res.to(out.dtype.element_ty),
             mask=i_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------- launchers

def _dot_precision(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> str:
    # fp16/bf16 values convert to tf32 exactly; fp32 data keeps full precision. Scaled
    # fp8 keys are arbitrary fp32 values: the query's precision decides.
    dtype = q_dtype if kv_dtype.itemsize == 1 else kv_dtype
    return "tf32" if dtype != torch.float32 and torch.version.hip is None else "ieee"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _num_stages(block_d: int) -> int:
    # Wide heads: fewer pipelined K/V tiles so they fit in shared memory.
    return 2 if block_d > 128 else 3


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_buf[loc] = k and v_buf[loc] = v, cast to the buffer dtype. loc: [T] int slots,
    k/v: [T, Hkv, D] in any float dtype (a strided view is fine)."""
    num_kv_heads, head_dim = _check_kv(k_buf, v_buf)
    _check(k_buf.dtype.itemsize > 1, f"store_kv does not quantise into a {k_buf.dtype} buffer: an fp8 pool is "
           "written by TokenToKVPool.write (the quantiser both attention backends share)")
    _check(loc.dim() == 1 and loc.dtype in _INT_DTYPES, f"loc must be a 1-D int tensor, got {loc.dtype}")
    loc = loc.contiguous()  # the kernel reads slot t at loc + t (a column of a slot table is strided)
    shape = (loc.shape[0], num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        _check(tuple(t.shape) == shape and t.dtype in _KV_DTYPES and t.stride(-1) == 1,
               f"{name} must be a float tensor of shape {shape} with a contiguous last dim, "
               f"got {tuple(t.shape)} {t.dtype}")
    _check(k_buf.stride() == v_buf.stride(), "k_buf and v_buf must share strides")
    _check_device(k_buf, v_buf, loc, k, v)
    if loc.shape[0] == 0:
        return
    _store_kv_kernel[(loc.shape[0],)](
        k_buf, v_buf, loc, k, v, k_buf.stride(0), k_buf.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def choose_num_splits(batch_size: int, num_kv_heads: int, max_splits: int = 16,
                      target_programs: int = 264) -> int:
    """Splits per row for decode_attention, from shapes only (CUDA-graph safe): enough
    (B * Hkv * splits) programs to reach ``target_programs`` (2 per SM of an H100),
    1 when the batch already fills the GPU."""
    programs = max(1, batch_size * num_kv_heads)
    return max(1, min(max_splits, triton.cdiv(target_programs, programs)))


def decode_partials(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                    rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per row over its first seq_lens[b] cached keys, as per-split
    partial results: outputs [B, Hq, S, D] (fp32, each normalised over its split's
    keys) and their log-sum-exp [B, Hq, S] (base 2, of the scaled scores; -inf for
    an empty split). ``merge_partials`` combines them, with partials over other keys
    if any (a draft tree step's own ancestors). ``k_scale``/``v_scale``: fp8 buffers'
    dequantisation scales."""
    num_kv_heads, head_dim = _check_kv(k_buf, v_buf)
    num_heads = _check_q(q, num_kv_heads, head_dim)
    batch = q.shape[0]
    _check_table(req_to_token)
    _check_ints(batch, rows=rows, seq_lens=seq_lens)
    _check(isinstance(num_splits, int) and num_splits >= 1, f"num_splits must be an int >= 1, got {num_splits}")
    _check_device(q, k_buf, v_buf, req_to_token, rows, seq_lens)
    # Every split program writes its partial (an empty chunk: zeros and -inf).
    ws_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    ws_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if batch == 0:
        return ws_out, ws_lse
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, rows, seq_lens, ws_out, ws_lse, scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), req_to_token.stride(1),
        ws_out.stride(0), ws_out.stride(1), ws_out.stride(2), ws_lse.stride(0), ws_lse.stride(1),
        group, head_dim, num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=64 if block_d <= 128 else 32,
        BLOCK_D=block_d, DOT_PREC=_dot_precision(k_buf.dtype, q.dtype), num_warps=4, num_stages=_num_stages(block_d))
    return ws_out, ws_lse


def merge_partials(ws_out: torch.Tensor, ws_lse: torch.Tensor) -> torch.Tensor:
    """[B, Hq, D] fp32 attention output from partials over disjoint key sets ([B, Hq, S, D]
    outputs, [B, Hq, S] base-2 log-sum-exps; a row with no key at all gives zeros)."""
    top = ws_lse.amax(dim=-1, keepdim=True)
    weight = torch.exp2(ws_lse - torch.where(top == float("-inf"), 0.0, top))  # empty partials weigh 0
    total = weight.sum(dim=-1, keepdim=True)
    return (weight.unsqueeze(-1) * ws_out).sum(dim=-2) / torch.where(total > 0, total, 1.0)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per row over its first seq_lens[b] cached keys (its own
    included). q: [B, Hq, D]; rows, seq_lens: [B] int32/int64 on q's device.
    Returns [B, Hq, D] in q.dtype, or fills ``out``. Allocates an fp32 workspace
    of B * Hq * num_splits * (D + 1) floats per call."""
    ws_out, ws_lse = decode_partials(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale, num_splits,
                                     k_scale, v_scale)
    out = _check_out(out, q)
    batch, num_heads, _, head_dim = ws_out.shape
    if batch == 0:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        ws_out, ws_lse, out, ws_out.stride(0), ws_out.stride(1), ws_out.stride(2),
        ws_lse.stride(0), ws_lse.stride(1), out.stride(0), out.stride(1), head_dim, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=_block_d(head_dim), num_warps=4)
    return out


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     q_starts: torch.Tensor, max_extend_len: int, scale: float,
                     custom_mask: torch.Tensor | None = None, mask_starts: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """New tokens of a ragged batch over their cached prefix and each other.
    q: [T, Hq, D], row b's tokens at q[q_starts[b]: q_starts[b] + extend_lens[b]],
    their K/V already stored at positions prefix_lens[b] ... of req_to_token[rows[b]].
    New key j is visible to new token i when j <= i, or, with ``custom_mask``, when
    custom_mask[mask_starts[b] + i * extend_lens[b] + j] != 0 (flat bool/uint8).
    ``max_extend_len`` (host int >= every extend_lens[b]) only sizes the grid.
    Returns [T, Hq, D] in q.dtype, or fills ``out``."""
    num_kv_heads, head_dim = _check_kv(k_buf, v_buf)
    num_heads = _check_q(q, num_kv_heads, head_dim)
    batch = rows.shape[0] if rows.dim() == 1 else -1
    _check_table(req_to_token)
    _check_ints(batch, rows=rows, prefix_lens=prefix_lens, extend_lens=extend_lens, q_starts=q_starts)
    _check(isinstance(max_extend_len, int) and max_extend_len >= 0,
           f"max_extend_len must be a host int >= 0, got {max_extend_len!r}")
    tensors = [q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, q_starts]
    use_mask = custom_mask is not None
    if use_mask:
        _check(mask_starts is not None, "custom_mask needs mask_starts")
        assert mask_starts is not None
        _check_ints(batch, mask_starts=mask_starts)
        _check(custom_mask.dim() == 1 and custom_mask.dtype in (torch.bool, torch.uint8),
               f"custom_mask must be a flat bool/uint8 tensor, got {tuple(custom_mask.shape)} {custom_mask.dtype}")
        custom_mask = custom_mask.view(torch.uint8)  # same bytes; the kernel tests != 0
        tensors += [custom_mask, mask_starts]
    _check_device(*tensors)
    out = _check_out(out, q)
    if batch == 0 or max_extend_len == 0 or q.shape[0] == 0:
        return out
    block_d = _block_d(head_dim)
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    dummy = rows  # never read when USE_MASK is off
    _extend_kernel[(batch, num_heads, triton.cdiv(max_extend_len, block_m))](
        q, k_buf, v_buf, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
        custom_mask if use_mask else dummy, mask_starts if use_mask else dummy, scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0), req_to_token.stride(1),
        num_heads // num_kv_heads, head_dim,
        USE_MASK=use_mask, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PREC=_dot_precision(k_buf.dtype, q.dtype), num_warps=4, num_stages=_num_stages(block_d))
    return out
