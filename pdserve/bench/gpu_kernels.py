"""Section 1 of the GPU check (gpu_check.py): the triton backend's decode and extend
kernels against a float32 reference in bf16 at Llama-3-8B attention shapes (32 query /
8 KV heads, head dim 128, contexts up to 8k, batch up to 256), with their time per call.

Split from gpu_check.py because it tests kernels alone, on tensors it makes itself: no
engine, model config or tokenizer (the other sections build engines on random weights).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from pdserve.bench.gpu_report import Report, timed


def reference_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        masks: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Per row: q [n, Hq, D] against keys/values [L, Hkv, D] in float32."""
    outs = []
    for qi, ki, vi, mi in zip(q, keys, values, masks):
        group = qi.shape[1] // ki.shape[1]
        k = ki.float().repeat_interleave(group, 1).transpose(0, 1)
        v = vi.float().repeat_interleave(group, 1).transpose(0, 1)
        s = qi.float().transpose(0, 1) @ k.transpose(1, 2) * qi.shape[-1] ** -0.5
        if mi is not None:
            s = s.masked_fill(~mi, float("-inf"))
        outs.append((torch.softmax(s, -1) @ v).transpose(0, 1))
    return outs


# A kernel's error is measured against the largest magnitude of the float32 reference:
# attention outputs over long random contexts are ~0.03, so an absolute bound of the
# same size would pass a wrong answer. bf16 keeps 8 significant bits (~4e-3).
REL_TOL = 2e-2


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max |want| over every row compared."""
    scale = max(float(w.abs().max()) for w in want)
    return max(float((g.float() - w).abs().max()) for g, w in zip(got, want)) / max(scale, 1e-30)


def tree_ancestry(batch: int, size: int, seed: int = 0) -> torch.Tensor:
    """[batch, size, size] bool: node j sees itself and its ancestors (random parents)."""
    blocks = torch.zeros(batch, size, size, dtype=torch.bool)
    for b in range(batch):
        rng = random.Random(seed + b)
        for j in range(size):
            blocks[b, j, j] = True
            if j:
                blocks[b, j] |= blocks[b, rng.randrange(0, j)]
    return blocks


def check_kernels(rep: Report, entry: dict[str, Any], device: torch.device, smoke: bool) -> None:
    from pdserve.model import triton_attention as K

    hq, hkv, dim = (4, 2, 32) if smoke else (32, 8, 128)
    dtype = torch.bfloat16
    cases = [(1, 64), (3, 40)] if smoke else [(1, 8192), (8, 4096), (64, 2048), (256, 1024), (256, 128)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    worst = 0.0
    blind: list[str] = []
    for batch, ctx in cases:
        slots = batch * ctx + 1
        k_buf = torch.randn(slots, hkv, dim, generator=gen).to(device, dtype)
        v_buf = torch.randn(slots, hkv, dim, generator=gen).to(device, dtype)
        perm = torch.randperm(slots - 1, generator=gen)[: batch * ctx] + 1
        table = perm.view(batch, ctx).to(device)
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (batch,), generator=gen)
        lens[0] = ctx
        q = torch.randn(batch, hq, dim, generator=gen).to(device, dtype)
        rows, seq = torch.arange(batch, device=device), lens.to(device)
        splits = K.choose_num_splits(batch, hkv)
        got = K.decode_attention(q, k_buf, v_buf, table, rows, seq, dim ** -0.5, splits)
        check = min(batch, 4)
        want = reference_attention(q[:check].unsqueeze(1), [k_buf[table[b, :lens[b]]] for b in range(check)],
                                   [v_buf[table[b, :lens[b]]] for b in range(check)], [None] * check)
        err = relative_error([got[b] for b in range(check)], [w[0] for w in want])
        secs = timed(lambda: K.decode_attention(q, k_buf, v_buf, table, rows, seq, dim ** -0.5, splits), device)
        kv_bytes = 2 * int(lens.sum()) * hkv * dim * 2
        gbps = kv_bytes / secs / 1e9
        worst = max(worst, err)
        entry[f"decode_b{batch}_ctx{ctx}"] = {"rel_err": err, "ms": secs * 1e3, "kv_GBps": gbps, "splits": splits}
        rep.say(f"decode  batch {batch:4d} ctx {ctx:5d} splits {splits:2d}: rel err {err:.2e}, "
                f"{secs * 1e3:.3f} ms, KV read {gbps:.0f} GB/s")
    # extend: prompts over a cached prefix, causal; and tree-masked verifies over a long
    # prefix (the seed's shape) and a short one (where a wrong mask changes the most)
    for batch, prefix, ext, tree in ([(2, 16, 24, False), (2, 8, 5, True), (2, 0, 6, True)] if smoke else
                                     [(4, 1024, 2048, False), (16, 0, 1024, False), (64, 2000, 8, True),
                                      (64, 3, 8, True)]):
        total = prefix + ext
        slots = batch * total + 1
        k_buf = torch.randn(slots, hkv, dim, generator=gen).to(device, dtype)
        v_buf = torch.randn(slots, hkv, dim, generator=gen).to(device, dtype)
        table = (torch.randperm(slots - 1, generator=gen)[: batch * total] + 1).view(batch, total).to(device)
        q = torch.randn(batch * ext, hq, dim, generator=gen).to(device, dtype)
        masks = tree_ancestry(batch, ext).to(device) if tree else None
        rows = torch.arange(batch, device=device)
        pre = torch.full((batch,), prefix, device=device)
        lens = torch.full((batch,), ext, device=device)
        starts = torch.arange(batch, device=device) * ext
        custom = masks.reshape(-1).to(torch.uint8) if masks is not None else None
        mstarts = torch.arange(batch, device=device) * ext * ext if masks is not None else None

        def run() -> torch.Tensor:
            return K.extend_attention(q, k_buf, v_buf, table, rows, pre, lens, starts, ext, dim ** -0.5,
                                      custom, mstarts)
        got = run()
        check = min(batch, 2)

        def reference(tree_masks: torch.Tensor | None) -> list[torch.Tensor]:
            ref_masks = []
            for b in range(check):
                causal = torch.ones(ext, total, dtype=torch.bool, device=device).tril(prefix)
                if tree_masks is not None:
                    causal[:, prefix:] = tree_masks[b]
                ref_masks.append(causal.unsqueeze(0))
            return reference_attention(q.view(batch, ext, hq, dim)[:check], [k_buf[table[b]] for b in range(check)],
                                       [v_buf[table[b]] for b in range(check)], ref_masks)
        rows_got = [got.view(batch, ext, hq, dim)[b] for b in range(check)]
        err = relative_error(rows_got, reference(masks))
        name = f"extend_b{batch}_pre{prefix}_ext{ext}{'_tree' if tree else ''}"
        result: dict[str, Any] = {"rel_err": err}
        if tree:
            # The check must be able to fail: a plain causal mask in place of the tree
            # has to read as wrong at this tolerance.
            wrong = relative_error(rows_got, reference(None))
            result["rel_err_vs_causal_mask"] = wrong
            if wrong < REL_TOL:
                blind.append(name)
        secs = timed(run, device)
        flops = 4 * batch * ext * (prefix + ext / 2) * hq * dim
        worst = max(worst, err)
        entry[name] = {**result, "ms": secs * 1e3, "TFLOPs": flops / secs / 1e12}
        rep.say(f"extend  batch {batch:4d} prefix {prefix:5d} new {ext:5d}{' tree' if tree else '     '}: "
                f"rel err {err:.2e}{f' (vs a causal mask {wrong:.2e})' if tree else ''}, {secs * 1e3:.3f} ms, "
                f"{flops / secs / 1e12:.1f} TFLOP/s")
    entry["worst_rel_err"] = worst
    entry["tolerance"] = REL_TOL
    entry["ok"] = worst < REL_TOL and not blind
    if blind:
        rep.say(f"a wrong tree mask went unnoticed in: {', '.join(blind)}")
    rep.say(f"worst error {worst:.2e} of the reference's largest magnitude (tolerance {REL_TOL:.0e})")
    rep.say("flashinfer: not wired in (refused at startup); no numbers")
