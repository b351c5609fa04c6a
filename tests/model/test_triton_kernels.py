"""pdserve's Triton attention kernels against plain torch references (fp32 softmax
per row and head). Without a GPU they run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), which is slow: shapes are kept small."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from pdserve.model import triton_attention as ta  # noqa: E402

# The interpreter's runtime loop bounds go through a numpy deprecation.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# --------------------------------------------------------------------------- helpers

def make_cache(lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0,
               extra_rows: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V buffers and a request table whose rows hold scattered pages; returns
    (k_buf, v_buf, req_to_token, rows) with rows[b] the table row of length lens[b]."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page) for n in lens]
    num_pages = sum(pages_per_row) + 3           # page 0 holds the padding slot 0; a few spare
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    num_rows = len(lens) + extra_rows
    max_ctx = max(max(lens), 1) + 5
    table = torch.zeros(num_rows, max_ctx, dtype=torch.int64)
    rows = torch.randperm(num_rows, generator=g)[: len(lens)]
    for row, n, npages in zip(rows.tolist(), lens, pages_per_row):
        mine = [order.pop() for _ in range(npages)]
        pos = torch.arange(n)
        table[row, :n] = torch.tensor(mine, dtype=torch.int64)[pos // page] * page + pos % page
    shape = (num_pages * page, hkv, d)
    k_buf = torch.randn(shape, generator=g).to(dtype)
    v_buf = torch.randn(shape, generator=g).to(dtype)
    return k_buf.to(DEVICE), v_buf.to(DEVICE), table.to(DEVICE), rows.to(DEVICE)


def ref_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [n, Hq, D], keys/values [L, Hkv, D], visible [n, L] -> [n, Hq, D] fp32."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), k) * scale
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v)


def ref_decode(q, k_buf, v_buf, table, rows, lens, scale):
    out = []
    for b, n in enumerate(lens):
        slots = table[rows[b], :n]
        out.append(ref_attention(q[b: b + 1], k_buf[slots], v_buf[slots], torch.ones(1, n, dtype=torch.bool), scale))
    return torch.cat(out)


def ref_extend(q, k_buf, v_buf, table, rows, prefix, ext, masks, scale):
    out, start = [], 0
    for b, (p, e) in enumerate(zip(prefix, ext)):
        slots = table[rows[b], : p + e]
        new_vis = masks[b] if masks is not None else torch.ones(e, e, dtype=torch.bool).tril()
        visible = torch.cat([torch.ones(e, p, dtype=torch.bool), new_vis], dim=1)
        out.append(ref_attention(q[start: start + e], k_buf[slots], v_buf[slots], visible, scale))
        start += e
    return torch.cat(out)


def tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a random tree whose node i's parent precedes it."""
    parent = [-1] + [rng.randrange(i) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("src_dtype,buf_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_store_kv_casts_into_slots(src_dtype, buf_dtype):
    g = torch.Generator().manual_seed(1)
    k_buf = torch.zeros(40, 2, 24, dtype=buf_dtype, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    loc = ints([7, 3, 39, 16, 17])
    # k is a strided view (every other head of a wider tensor), as a fused qkv split gives
    k = torch.randn(5, 4, 24, generator=g).to(src_dtype).to(DEVICE)[:, ::2]
    v = torch.randn(5, 2, 24, generator=g).to(src_dtype).to(DEVICE)
    ta.store_kv(k_buf, v_buf, loc, k, v)
    exp_k, exp_v = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    exp_k[loc], exp_v[loc] = k.to(buf_dtype), v.to(buf_dtype)
    if buf_dtype == torch.bfloat16 and DEVICE == "cpu":
        # Triton's interpreter truncates fp32 -> bf16 (a GPU rounds to nearest): allow one bf16 ulp.
        torch.testing.assert_close(k_buf.float(), exp_k.float(), atol=0, rtol=2 ** -7)
        torch.testing.assert_close(v_buf.float(), exp_v.float(), atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(k_buf, exp_k) and torch.equal(v_buf, exp_v)
    ta.store_kv(k_buf, v_buf, ints([]), k[:0], v[:0])  # nothing to store


# --------------------------------------------------------------------------- decode

DECODE_CASES = [
    # lens, page, Hq, Hkv, D, dtype, splits
    ([1, 17, 70, 33, 64], 16, 4, 2, 32, torch.float32, 1),
    ([1, 17, 70, 33, 64], 16, 4, 2, 32, torch.float32, 3),
    ([1, 17, 70, 33, 64], 1, 4, 2, 32, torch.float32, 8),
    ([1, 5, 3], 16, 4, 2, 32, torch.float32, 12),          # more splits than keys
    ([9, 70, 2], 1, 8, 1, 64, torch.float16, 3),
    ([40, 1, 23], 16, 2, 2, 80, torch.bfloat16, 2),         # head_dim not a power of two
    ([65, 31], 16, 2, 2, 96, torch.float16, 1),
    ([300, 7], 16, 4, 2, 32, torch.float32, 4),           # three non-empty chunks, one empty
]


@pytest.mark.parametrize("lens,page,hq,hkv,d,dtype,splits", DECODE_CASES)
def test_decode_matches_reference(lens, page, hq, hkv, d, dtype, splits):
    k_buf, v_buf, table, rows = make_cache(lens, page, hkv, d, dtype, seed=len(lens) + d)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    scale = d ** -0.5
    out = ta.decode_attention(q, k_buf, v_buf, table, rows, ints(lens), scale, splits)
    assert out.dtype == dtype and out.shape == q.shape
    ref = ref_decode(q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), lens, scale)
    torch.testing.assert_close(out.cpu().float(), ref, atol=ATOL[dtype], rtol=0)


def test_decode_int32_inputs_strided_q_and_out():
    lens = [12, 50]
    k_buf, v_buf, table, rows = make_cache(lens, 16, 2, 32, torch.float32)
    qkv = torch.randn(2, 4 + 2 + 2, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q = qkv[:, :4]                                   # non-contiguous view of a fused projection
    out = torch.full((2, 4, 32), float("nan"), dtype=torch.float16, device=DEVICE)
    res = ta.decode_attention(q, k_buf, v_buf, table, rows.to(torch.int32), ints(lens, torch.int32),
                              0.2, 4, out=out)
    assert res is out
    ref = ref_decode(q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), lens, 0.2)
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-3, rtol=0)


def test_store_then_decode_then_extend_agree():
    """store_kv writes the new token, decode and a 1-token extend over the same cache agree."""
    lens = [8, 30]
    k_buf, v_buf, table, rows = make_cache(lens, 16, 2, 32, torch.float16)
    g = torch.Generator().manual_seed(4)
    loc = table[rows, ints(lens) - 1]
    ta.store_kv(k_buf, v_buf, loc, torch.randn(2, 2, 32, generator=g).to(DEVICE),
                torch.randn(2, 2, 32, generator=g).to(DEVICE))
    q = torch.randn(2, 4, 32, generator=g).to(torch.float16).to(DEVICE)
    dec = ta.decode_attention(q, k_buf, v_buf, table, rows, ints(lens), 0.3, ta.choose_num_splits(2, 2))
    ext = ta.extend_attention(q, k_buf, v_buf, table, rows, ints([n - 1 for n in lens]), ints([1, 1]),
                              ints([0, 1]), 1, 0.3)
    torch.testing.assert_close(dec.float(), ext.float(), atol=2e-3, rtol=0)


def test_choose_num_splits():
    assert ta.choose_num_splits(1, 8) == 16
    assert ta.choose_num_splits(1, 32) == 9
    assert ta.choose_num_splits(64, 8) == 1
    assert ta.choose_num_splits(1000, 8) == 1
    assert ta.choose_num_splits(1, 1, max_splits=4) == 4
    assert ta.choose_num_splits(0, 8) == 16


# --------------------------------------------------------------------------- extend

EXTEND_CASES = [
    # prefix, ext, max_extend_len, page, Hq, Hkv, D, dtype, tree
    ([0, 0, 0], [1, 7, 70], 80, 1, 4, 2, 32, torch.float32, False),
    ([0, 20, 65], [5, 30, 1], 30, 16, 4, 2, 32, torch.float32, False),
    ([3, 0, 40], [9, 16, 12], 20, 16, 8, 1, 64, torch.float16, True),
    ([17, 1], [6, 13], 13, 1, 2, 2, 96, torch.bfloat16, True),
    ([33, 0], [66, 2], 70, 16, 4, 2, 32, torch.float32, True),  # tree spanning two query blocks
]


@pytest.mark.parametrize("prefix,ext,max_len,page,hq,hkv,d,dtype,tree", EXTEND_CASES)
def test_extend_matches_reference(prefix, ext, max_len, page, hq, hkv, d, dtype, tree):
    lens = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, table, rows = make_cache(lens, page, hkv, d, dtype, seed=sum(lens))
    q = torch.randn(sum(ext), hq, d, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    q_starts = [sum(ext[:b]) for b in range(len(ext))]
    masks = mask = starts = None
    if tree:
        rng = random.Random(sum(ext))
        masks = [tree_mask(e, rng) for e in ext]
        mask = torch.cat([m.flatten() for m in masks]).to(DEVICE)
        starts = ints([sum(e * e for e in ext[:b]) for b in range(len(ext))])
        if dtype == torch.float16:
            mask = mask.to(torch.uint8)
    scale = d ** -0.5
    out = ta.extend_attention(q, k_buf, v_buf, table, rows, ints(prefix), ints(ext), ints(q_starts), max_len,
                              scale, custom_mask=mask, mask_starts=starts)
    assert out.dtype == dtype and out.shape == q.shape
    ref = ref_extend(q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), prefix, ext, masks, scale)
    torch.testing.assert_close(out.cpu().float(), ref, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    """Random shapes, pages, dtypes, splits and masks for both kernels."""
    rng = random.Random(seed)
    hq, hkv = rng.choice([(4, 2), (8, 1), (2, 2)])
    d, page = rng.choice([32, 48]), rng.choice([1, 16])
    dtype = rng.choice(list(ATOL))
    batch = rng.randint(1, 4)
    prefix = [rng.choice([0, rng.randint(1, 40)]) for _ in range(batch)]
    ext = [rng.randint(1, 40) for _ in range(batch)]
    lens = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, table, rows = make_cache(lens, page, hkv, d, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    scale = rng.uniform(0.05, 0.3)

    q = torch.randn(batch, hq, d, generator=gen).to(dtype).to(DEVICE)
    out = ta.decode_attention(q, k_buf, v_buf, table, rows, ints(lens), scale, rng.randint(1, 10))
    ref = ref_decode(q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), lens, scale)
    torch.testing.assert_close(out.cpu().float(), ref, atol=ATOL[dtype], rtol=0)

    q = torch.randn(sum(ext), hq, d, generator=gen).to(dtype).to(DEVICE)
    masks = [tree_mask(e, rng) for e in ext] if rng.random() < 0.5 else None
    kw = {}
    if masks is not None:
        kw = dict(custom_mask=torch.cat([m.flatten() for m in masks]).to(DEVICE),
                  mask_starts=ints([sum(e * e for e in ext[:b]) for b in range(batch)]))
    out = ta.extend_attention(q, k_buf, v_buf, table, rows, ints(prefix), ints(ext),
                              ints([sum(ext[:b]) for b in range(batch)]), max(ext) + rng.randint(0, 30), scale, **kw)
    ref = ref_extend(q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), prefix, ext, masks, scale)
    torch.testing.assert_close(out.cpu().float(), ref, atol=ATOL[dtype], rtol=0)


# --------------------------------------------------------------------------- refusals

def test_refusals():
    k_buf, v_buf, table, rows = make_cache([4, 4], 1, 2, 32, torch.float32)
    lens = ints([4, 4])
    q = torch.randn(2, 4, 32, device=DEVICE)
    base = dict(q=q, k_buf=k_buf, v_buf=v_buf, req_to_token=table, rows=rows, scale=0.1)

    def dec(**kw):
        return ta.decode_attention(**{**base, "seq_lens": lens, "num_splits": 2, **kw})

    def ext(**kw):
        return ta.extend_attention(**{**base, "prefix_lens": ints([0, 0]), "extend_lens": ints([1, 1]),
                                      "q_starts": ints([0, 1]), "max_extend_len": 1, **kw})

    big = torch.zeros(4, 1, 512, device=DEVICE)
    bad = {
        "head_dim": lambda: dec(q=torch.zeros(2, 2, 512, device=DEVICE), k_buf=big, v_buf=big),
        "multiple": lambda: dec(q=torch.randn(2, 3, 32, device=DEVICE)),
        "q dtype": lambda: dec(q=q.to(torch.float64)),
        "q shape": lambda: dec(q=q[..., :16]),
        "kv dtypes": lambda: dec(v_buf=v_buf.half()),
        "kv shapes": lambda: dec(v_buf=v_buf[:-1]),
        "rows length": lambda: dec(rows=rows[:1]),
        "seq_lens dtype": lambda: dec(seq_lens=lens.float()),
        "table dtype": lambda: dec(req_to_token=table.float()),
        "num_splits": lambda: dec(num_splits=0),
        "out shape": lambda: dec(out=torch.empty(2, 4, 16, device=DEVICE)),
        "device": lambda: dec(rows=rows.to("meta")),
        "mask without starts": lambda: ext(custom_mask=torch.ones(2, dtype=torch.bool, device=DEVICE)),
        "mask dtype": lambda: ext(custom_mask=torch.ones(2, device=DEVICE), mask_starts=ints([0, 1])),
        "max_extend_len": lambda: ext(max_extend_len=torch.tensor(1)),
        "store shape": lambda: ta.store_kv(k_buf, v_buf, ints([1]), q[:1, :2], q[:1, :3]),
        "store loc": lambda: ta.store_kv(k_buf, v_buf, ints([1]).float(), q[:1, :2], q[:1, :2]),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"{name}: accepted")


def test_launchers_never_read_device_values(monkeypatch):
    """Both launchers only look at shapes (CUDA-graph capturable): under the interpreter
    the kernels themselves read tensors, so check the Python before the launch."""
    lens = [5, 20]
    k_buf, v_buf, table, rows = make_cache(lens, 16, 2, 32, torch.float32)
    q = torch.randn(2, 4, 32, device=DEVICE)
    launched = []

    class Stop(Exception):
        pass

    def fake_launch(*args, **kwargs):
        launched.append(1)
        raise Stop

    for kernel in ("_decode_split_kernel", "_extend_kernel"):
        monkeypatch.setitem(ta.__dict__, kernel, type("K", (), {"__getitem__": lambda self, grid: fake_launch})())
    for attr in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, attr, lambda *a, **k: pytest.fail("host read of a device value"))
    with pytest.raises(Stop):
        ta.decode_attention(q, k_buf, v_buf, table, rows, ints(lens), 0.1, 3)
    with pytest.raises(Stop):
        ta.extend_attention(q, k_buf, v_buf, table, rows, ints([0, 0]), ints([1, 1]), ints([0, 1]), 1, 0.1,
                            custom_mask=torch.ones(2, dtype=torch.bool, device=DEVICE), mask_starts=ints([0, 1]))
    assert len(launched) == 2
