"""Paged attention straight from the KV pool: decode rows, prefill chunks over
a cached prefix and verify chains, in one kernel; also the drafter's blocks.

Every query token of request ``b`` sits at position ``kv_len[b] - q_len[b] + i``
and attends to ``b``'s keys at positions up to its own (causal), or, for a
non-causal batch (a DSpark draft block that sees itself whole), to all
``kv_len[b]`` of them, read through the request's page table (``page_slots``
in ``cache/block_pool.py``, the KV pool's layout). Nothing is gathered into
a dense copy first (the torch backend copies every page it reads, about three
times the memory traffic, growing with batch x context).

Work is split into tiles of ``BLOCK_Q`` query tokens of one request x one KV
head; the ``G`` query heads that share the KV head are packed as rows of the
tile, so GQA reads each key once per tile. The softmax is online (running max
and sum, FlashAttention style), in float32; inputs may be float32, bf16 or
fp16. ``paged_attention_ref`` is the torch reference: per request, a dense
gather and a (causal) softmax in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import HAS_TRITON, interpreted, tl, triton

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PagedLayout:
    """The batch's ragged layout on the device, built once per forward."""

    q_starts: torch.Tensor  # [B] int32: first query row of each request
    q_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32: cached prefix + new tokens
    page_table: torch.Tensor  # [B, P] int32, padded with 0
    tiles: torch.Tensor  # [n_tiles, 2] int32: (request, first query of the tile)
    block_q: int  # query tokens per tile
    page_size: int
    causal: bool = True  # False: every query sees all kv_len keys of its request


# Query rows (tokens x heads of a group) per tile: bounds the accumulator.
TILE_ROWS = 64


def plan_layout(
    q_lens: list[int],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device,
    group: int = 1,
    causal: bool = True,
) -> PagedLayout:
    """Host-side plan (``group``: query heads per KV head): one small copy per
    tensor, no device reads."""
    # Decode batches get one query per tile; long chunks get wide tiles.
    widest = max(1, TILE_ROWS // _pow2_at_least(group))
    block_q = min(_pow2_at_least(max(q_lens)), widest)
    starts, row = [], 0
    tiles: list[tuple[int, int]] = []
    for b, q_len in enumerate(q_lens):
        starts.append(row)
        tiles.extend((b, i) for i in range(0, q_len, block_q))
        row += q_len
    tables = [t[: -(-n // page_size)] for t, n in zip(page_tables, kv_lens)]
    width = max(1, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]

    def as_int32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return PagedLayout(
        q_starts=as_int32(starts),
        q_lens=as_int32(q_lens),
        kv_lens=as_int32(kv_lens),
        page_table=as_int32(padded),
        tiles=as_int32(tiles),
        block_q=block_q,
        page_size=page_size,
        causal=causal,
    )


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    q_lens: list[int],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
) -> torch.Tensor:
    """Torch reference: per request, gather its keys densely and attend in
    float32 (causally, or to every key; ``window`` > 0: only to the last
    ``window`` positions). Returns ``[T, H, D]`` in q's dtype."""
    h, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    row = 0
    for q_len, kv_len, table in zip(q_lens, kv_lens, page_tables):
        pos = torch.arange(kv_len, device=q.device)
        pages = torch.tensor(table, device=q.device)[pos // page_size]
        slots = pages * page_size + pos % page_size
        k = k_cache[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(h // hkv, dim=1)
        qs = q[row : row + q_len].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [H, q_len, L]
        if causal:
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            hidden = pos[None, :] > qpos[:, None]  # [q_len, L]
            if window:
                hidden |= pos[None, :] <= qpos[:, None] - window
            scores = scores.masked_fill(hidden[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        out[row : row + q_len] = o.to(q.dtype)
        row += q_len
    return out


if HAS_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        stride_qt,
        stride_qh,
        k_ptr,
        v_ptr,
        stride_kt,
        stride_kh,
        o_ptr,
        stride_ot,
        stride_oh,
        q_starts_ptr,
        q_lens_ptr,
        kv_lens_ptr,
        table_ptr,
        stride_tb,
        tiles_ptr,
        scale,
        window,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        G: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        CAUSAL: tl.constexpr,
        WINDOWED: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        NEG_INF: tl.constexpr = float("-inf")
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        b = tl.load(tiles_ptr + tile * 2).to(tl.int64)
        q0 = tl.load(tiles_ptr + tile * 2 + 1)
        q_start = tl.load(q_starts_ptr + b).to(tl.int64)
        q_len = tl.load(q_lens_ptr + b)
        kv_len = tl.load(kv_lens_ptr + b)

        # Row r of the tile: query token q0 + r // G, query head kv_head * G + r % G.
        r = tl.arange(0, ROWS)
        qi = q0 + r // G
        head = kv_head * G + r % G
        row_ok = (r < BLOCK_Q * G) & (qi < q_len)
        # [ROWS]: the last key position each row sees
        qpos = kv_len - q_len + qi if CAUSAL else kv_len - 1 + 0 * qi
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q_rows = q_start + qi.to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [ROWS, D_PAD]
        if DOT_F32:
            q = q.to(tl.float32)

        m = tl.full([ROWS], NEG_INF, tl.float32)
        s = tl.full([ROWS], 0.0, tl.float32)
        acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
        # Keys past the tile's last query position are never seen.
        last = kv_len - q_len + tl.minimum(q0 + BLOCK_Q, q_len) if CAUSAL else kv_len
        # Nor, in a sliding window, keys before the tile's first query's window.
        lo = 0
        if WINDOWED:
            lo = tl.maximum(kv_len - q_len + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, last, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < last
            page = tl.load(table_ptr + b * stride_tb + n // PAGE_SIZE, mask=n_ok, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE
            kv_off = slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if DOT_F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            x = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32)
            x = x * scale  # [ROWS, BLOCK_N]
            seen = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
            if WINDOWED:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            x = tl.where(seen, x, NEG_INF)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # Rows that have seen nothing yet shift by 0: exp(-inf - -inf) is NaN.
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            p = tl.exp(x - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            s = s * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / tl.where(s > 0, s, 1.0)[:, None]
        tl.store(
            o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def _pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    layout: PagedLayout,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    window: int = 0,
) -> torch.Tensor:
    """Triton path; the K/V of the new tokens must already be in the pool.
    ``window`` > 0: each query sees the last ``window`` positions (causal only)."""
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs triton, which is not installed")
    assert q.dim() == 3 and k_cache.dim() == 3, "q must be [T, H, D], the caches [S, Hkv, D]"
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    assert v_cache.shape == k_cache.shape and k_cache.shape[2] == d, "cache shapes disagree"
    assert h % hkv == 0, f"{h} query heads cannot share {hkv} KV heads evenly"
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in KV_DTYPES, (
        f"q and the caches must share one of {KV_DTYPES}: {q.dtype}, {k_cache.dtype}"
    )
    assert q.device == k_cache.device == layout.tiles.device, "q, caches and layout on one device"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, (
        "the head dim must be contiguous"
    )
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share strides"
    assert window >= 0 and (layout.causal or not window), "a window needs a causal layout"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, (
        f"block_n must be a power of 2: {block_n}"
    )
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    n_tiles = layout.tiles.shape[0]
    if t == 0 or n_tiles == 0:
        return out
    g = h // hkv
    # tl.dot wants at least 16 rows: short tiles (decode) are padded with masked rows.
    rows = max(16, _pow2_at_least(layout.block_q * g))
    _paged_attention_kernel[(n_tiles, hkv)](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        layout.q_starts,
        layout.q_lens,
        layout.kv_lens,
        layout.page_table,
        layout.page_table.stride(0),
        layout.tiles,
        1.0 / math.sqrt(d) if scale is None else scale,
        window,
        D=d,
        D_PAD=max(16, _pow2_at_least(d)),
        G=g,
        BLOCK_Q=layout.block_q,
        ROWS=rows,
        BLOCK_N=block_n,
        PAGE_SIZE=layout.page_size,
        CAUSAL=layout.causal,
        WINDOWED=window > 0,
        # float32 models get float32 products (not TF32): logprobs must match.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=interpreted(),
        num_warps=4,
    )
    return out
