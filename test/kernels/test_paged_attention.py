"""The paged-attention kernel (under TRITON_INTERPRET=1 without CUDA) against
its torch reference, and the reference against the SDPA backend: decode rows,
verify chains over a cached prefix, prefill chunks (several tiles), fresh
prefills; GQA and MHA; page sizes 1, 4 and 16; float32 and bf16;
non-causal batches (the DSpark drafter's blocks) and sliding windows at a
layer's own scale (Gemma 4), whose references are written out here as a
dense softmax."""

from __future__ import annotations

import pytest
import torch

from specserve.cache.kv_pool import KVPool
from specserve.kernels.dispatch import HAS_TRITON
from specserve.kernels.paged_attention import (
    paged_attention_ref,
    paged_attention_triton,
    plan_layout,
)
from specserve.layers.attention import AttentionMetadata, LayerAttention, TorchAttentionBackend

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

MIXED = [(9, 1), (2, 1), (6, 5), (5, 20), (0, 7), (0, 1)]  # (cached prefix, new tokens)


def make_batch(shapes, heads, kv_heads, dim, page_size, dtype, seed=0):
    """A pool holding every request's keys (pages out of order), and queries."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-(p + n) // page_size) for p, n in shapes)
    pool = KVPool(1, pages_needed + 3, page_size, kv_heads, dim, dtype, "cpu")
    order = torch.randperm(pages_needed + 3, generator=g).tolist()
    tables, at = [], 0
    for prefix, n in shapes:
        count = -(-(prefix + n) // page_size)
        tables.append(order[at : at + count])
        at += count
    new_k, new_v, slots, positions = [], [], [], []
    for (prefix, n), table in zip(shapes, tables):
        k = torch.randn(prefix + n, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(prefix + n, kv_heads, dim, generator=g).to(dtype)
        s = torch.tensor(
            [table[p // page_size] * page_size + p % page_size for p in range(prefix + n)]
        )
        pool.store(0, s[:prefix], k[:prefix], v[:prefix])
        new_k.append(k[prefix:])
        new_v.append(v[prefix:])
        slots.append(s[prefix:])
        positions.extend(range(prefix, prefix + n))
    t = sum(n for _, n in shapes)
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    return pool, tables, q, torch.cat(new_k), torch.cat(new_v), torch.cat(slots), positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page_size"),
    [(4, 2, 16, 4), (8, 1, 32, 16), (2, 2, 8, 1)],
    ids=["gqa", "mqa", "mha-d8-ps1"],
)
def test_kernel_matches_reference(dtype, heads, kv_heads, dim, page_size) -> None:
    pool, tables, q, k, v, slots, _ = make_batch(MIXED, heads, kv_heads, dim, page_size, dtype)
    pool.store(0, slots, k, v)
    q_lens = [n for _, n in MIXED]
    kv_lens = [p + n for p, n in MIXED]
    layout = plan_layout(q_lens, kv_lens, tables, page_size, q.device, group=heads // kv_heads)
    got = paged_attention_triton(q, pool.k[0], pool.v[0], layout, block_n=16)
    want = paged_attention_ref(q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, page_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_decode_only_and_tiles_of_a_long_chunk() -> None:
    """One query per request, and a chunk longer than a tile (several tiles of
    one request, the last one partial)."""
    for shapes in ([(30, 1), (3, 1), (17, 1)], [(3, 70)]):
        pool, tables, q, k, v, slots, _ = make_batch(shapes, 4, 2, 16, 4, torch.float32, 3)
        pool.store(0, slots, k, v)
        q_lens = [n for _, n in shapes]
        kv_lens = [p + n for p, n in shapes]
        layout = plan_layout(q_lens, kv_lens, tables, 4, q.device, group=2)
        got = paged_attention_triton(q, pool.k[0], pool.v[0], layout, block_n=16)
        want = paged_attention_ref(q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reference_matches_the_sdpa_backend() -> None:
    pool, tables, q, k, v, slots, positions = make_batch(MIXED, 4, 2, 16, 4, torch.float32, 5)
    meta = AttentionMetadata(
        torch.tensor(positions),
        slots,
        [n for _, n in MIXED],
        [p + n for p, n in MIXED],
        tables,
        4,
    )
    backend = TorchAttentionBackend(pool)
    backend.prepare(meta)
    sdpa = backend.forward(0, q, k, v, meta)  # stores k / v, then attends
    want = paged_attention_ref(q, pool.k[0], pool.v[0], meta.q_lens, meta.kv_lens, tables, 4)
    torch.testing.assert_close(sdpa, want, atol=1e-5, rtol=0)


def dense_full_attention(q, k_cache, v_cache, q_lens, kv_lens, tables, page_size):
    """Every query of a request sees all of its keys: gathered slot by slot."""
    out, row = [], 0
    for q_len, kv_len, table in zip(q_lens, kv_lens, tables):
        slots = [table[p // page_size] * page_size + p % page_size for p in range(kv_len)]
        g = q.shape[1] // k_cache.shape[1]
        k = k_cache[slots].float().repeat_interleave(g, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(g, dim=1)
        w = torch.softmax(
            torch.einsum("qhd,khd->hqk", q[row : row + q_len].float(), k) * q.shape[2] ** -0.5, -1
        )
        out.append(torch.einsum("hqk,khd->qhd", w, v))
        row += q_len
    return torch.cat(out)


# Draft blocks: over a context, at a page boundary, fresh (no context), longer
# than CHAIN_MAX (the torch backend's one-by-one path) and of one token.
BLOCKS = [(9, 4), (8, 4), (0, 4), (3, 20), (5, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_non_causal_blocks_on_every_path(dtype) -> None:
    pool, tables, q, k, v, slots, positions = make_batch(BLOCKS, 4, 2, 16, 4, dtype, 9)
    q_lens = [n for _, n in BLOCKS]
    kv_lens = [p + n for p, n in BLOCKS]
    meta = AttentionMetadata(
        torch.tensor(positions), slots, q_lens, kv_lens, tables, 4, causal=False
    )
    backend = TorchAttentionBackend(pool)
    backend.prepare(meta)
    sdpa = backend.forward(0, q, k, v, meta)  # stores k / v, then attends
    want = dense_full_attention(q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4)
    ref = paged_attention_ref(q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4, causal=False)
    layout = plan_layout(q_lens, kv_lens, tables, 4, q.device, group=2, causal=False)
    got = paged_attention_triton(q, pool.k[0], pool.v[0], layout, block_n=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out in (sdpa, ref, got):
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=0)
    # The causal kernel differs on these shapes: the flag is honoured.
    causal = paged_attention_ref(q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4)
    assert (causal.float() - want).abs().max() > 0.1


def dense_window_attention(q, k_cache, v_cache, q_lens, kv_lens, tables, ps, window, scale):
    """Causal attention to the last ``window`` positions of each query, at
    ``scale``, as a dense float32 softmax written out here."""
    h, hkv = q.shape[1], k_cache.shape[1]
    out, row = [], 0
    for q_len, kv_len, table in zip(q_lens, kv_lens, tables):
        slots = [table[p // ps] * ps + p % ps for p in range(kv_len)]
        k = k_cache[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + q_len].float(), k) * scale
        qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        scores[:, (key > qpos) | (key <= qpos - window)] = float("-inf")
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += q_len
    return torch.cat(out)


# Every path past a window of 6: decode rows, chains, chunks, a fresh prefill
# longer than the window, and a batch of one (the lone plan).
WINDOWED = {
    "mixed": [(9, 1), (2, 1), (6, 5), (5, 20), (0, 13), (3, 2)],
    "lone-decode": [(14, 1)],
    "lone-chain": [(11, 4)],
    "lone-prefill": [(0, 15)],
}


@pytest.mark.parametrize("batch", list(WINDOWED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sliding_window_and_scale_on_every_path(dtype, batch) -> None:
    """Gemma 4's sliding layers: a query sees the last ``window`` positions,
    its own included, at the layer's scale; a full layer of the same
    backend, in the same forward, still sees everything."""
    shapes, window, scale = WINDOWED[batch], 6, 0.5
    pool, tables, q, k, v, slots, positions = make_batch(shapes, 4, 2, 16, 4, dtype, 3)
    pool.k.append(pool.k[0].clone())  # layer 1: full attention, default scale
    pool.v.append(pool.v[0].clone())
    q_lens = [n for _, n in shapes]
    kv_lens = [p + n for p, n in shapes]
    specs = [LayerAttention(window=window, scale=scale), LayerAttention()]
    meta = AttentionMetadata(torch.tensor(positions), slots, q_lens, kv_lens, tables, 4)
    backend = TorchAttentionBackend(pool, specs)
    backend.prepare(meta)
    sdpa = backend.forward(0, q, k, v, meta)
    full = backend.forward(1, q, k, v, meta)
    want = dense_window_attention(
        q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4, window, scale
    )
    ref = paged_attention_ref(
        q, pool.k[0], pool.v[0], q_lens, kv_lens, tables, 4, scale=scale, window=window
    )
    layout = plan_layout(q_lens, kv_lens, tables, 4, q.device, group=2)
    got = paged_attention_triton(
        q, pool.k[0], pool.v[0], layout, scale=scale, block_n=16, window=window
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out in (sdpa, ref, got):
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=0)
    unwindowed = paged_attention_ref(q, pool.k[1], pool.v[1], q_lens, kv_lens, tables, 4)
    torch.testing.assert_close(full.float(), unwindowed.float(), atol=tol, rtol=0)
    assert (full.float() - want).abs().max() > 0.1  # the window and scale are honoured


@pytest.mark.gpu
def test_cuda_qwen3_8b_shapes_in_bf16() -> None:
    """32/8 heads x 128, pages of 16: decode rows over long contexts beside
    verify chains and a prefill chunk, against the reference."""
    g = torch.Generator().manual_seed(1)
    shapes = [(int(n), 1) for n in torch.randint(1, 2048, (48,), generator=g)]
    shapes += [(300, 8), (1000, 6), (0, 200), (512, 130)]
    pool, tables, q, k, v, slots, _ = make_batch(shapes, 32, 8, 128, 16, torch.bfloat16, 2)
    pool.store(0, slots, k, v)
    k_cache, v_cache, q = pool.k[0].cuda(), pool.v[0].cuda(), q.cuda()
    q_lens = [n for _, n in shapes]
    kv_lens = [p + n for p, n in shapes]
    layout = plan_layout(q_lens, kv_lens, tables, 16, q.device, group=4)
    got = paged_attention_triton(q, k_cache, v_cache, layout)
    want = paged_attention_ref(q, k_cache, v_cache, q_lens, kv_lens, tables, 16)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
