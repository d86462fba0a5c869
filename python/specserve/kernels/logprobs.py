"""Row-wise logprobs of a logits block in one pass over each row.

Per output row this computes, with an online max / sum-exp, the logsumexp of
the (temperature-scaled) logits row, the logprob of one chosen token, the top-k
logprobs with their ids, and the logprobs of a padded list of requested ids.
Output row i reads logits row i, or row ``row_ids[i]`` when ``row_ids`` is
given, so a ``[R, V]`` block (say, every verify row of a batch) can be scored
on a subset of its rows, in any order and with repeats, without first copying
them out. The Triton kernel reads only the listed rows, each logit of them
once; the torch reference materialises the full log-softmax of the selected
rows and serves as the test oracle.

NaN contract (both paths): a NaN logit counts as -inf, an impossible token;
a row with no possible token reports -inf for every logprob. Compiled
``tl.max`` drops NaN while the interpreter propagates it, so NaN is mapped
to -inf on load, before any reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import HAS_TRITON, LOGIT_DTYPES, tl, triton, use_triton

# Default vocab chunk per loop step: big enough to keep loads wide on a GPU,
# small enough that the top-k merge passes over a chunk stay cheap.
DEFAULT_BLOCK_V = 1024


@dataclass
class RowLogprobs:
    token_logprobs: torch.Tensor  # [N] float32
    top_values: torch.Tensor  # [N, K] float32, sorted descending (logprobs, not logits)
    top_ids: torch.Tensor  # [N, K] int64
    ids_logprobs: torch.Tensor  # [N, M] float32; entries where gather_ids == -1 are NaN


def row_logprobs_ref(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
    row_ids: torch.Tensor | None = None,
) -> RowLogprobs:
    """Torch reference: full log_softmax, then gather and topk."""
    if row_ids is not None:
        logits = logits[row_ids]  # [R, V] -> [N, V]
    x = logits.float()  # [N, V]
    x = x.masked_fill(x.isnan(), float("-inf"))  # the NaN contract (module docstring)
    if temperatures is not None:
        x = x / temperatures.float().unsqueeze(1)
    logprobs = torch.log_softmax(x, dim=-1)  # [N, V]
    # A row with no possible token at all: every logprob is -inf, not NaN.
    logprobs = logprobs.masked_fill(logprobs.isnan(), float("-inf"))
    token_logprobs = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)  # [N]
    top_values, top_ids = topk_lowest_id(logprobs, top_k)  # [N, K]
    if gather_ids is None:
        gather_ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    pad = gather_ids < 0  # [N, M]
    ids_logprobs = logprobs.gather(1, gather_ids.long().clamp(min=0))  # [N, M]
    ids_logprobs = ids_logprobs.masked_fill(pad, float("nan"))
    return RowLogprobs(token_logprobs, top_values, top_ids.long(), ids_logprobs)


def topk_lowest_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)`` of rows ``x [N, V]`` (no NaN), ties to the lowest
    index, as the kernel breaks them: ``torch.topk`` orders ties as it likes
    on the CPU (the ids of an all-equal row come out shuffled), so which of
    tied tokens a top-k reports, and in what order, would depend on the
    backend and on the tensor-parallel split."""
    if k == 0:
        return torch.topk(x, 0, dim=-1)
    # One more than asked: whether the k-th value ties with one left out.
    values, ids = torch.topk(x, min(k + 1, x.shape[-1]), dim=-1)  # [N, K (+1)]
    reorder = False
    if values.shape[1] > k:
        cut = values[:, k] == values[:, k - 1]  # [N]; -0.0 ties with +0.0
        values, ids = values[:, :k], ids[:, :k]
        if cut.any():  # rare: the tied ids taken are the lowest ones
            rows = cut.nonzero().squeeze(1)
            xr, kth = x[rows], values[rows, -1:]
            tied = xr == kth  # [n, V]
            room = k - (xr > kth).sum(dim=-1, keepdim=True)  # [n, 1] places left for the tied
            take = (xr > kth) | (tied & (tied.cumsum(dim=-1) <= room))  # [n, V]: k per row
            ids = ids.clone()
            ids[rows] = take.nonzero()[:, 1].view(rows.numel(), k)
            reorder = True
    if reorder or (k > 1 and (values[:, 1:] == values[:, :-1]).any()):  # ties: in id order
        ids = ids.sort(dim=-1).values
        values = x.gather(1, ids)
        order = values.argsort(dim=-1, descending=True, stable=True)
        values, ids = values.gather(1, order), ids.gather(1, order)
    return values, ids


if HAS_TRITON:
    # Top-k candidates are packed into one int64 key: the high 32 bits are the
    # float's bits remapped so signed-int order equals float order, the low 32
    # bits are (ID_MAX - id). One max reduction then picks the largest value
    # and, among equal values, the lowest id.

    @triton.jit
    def _merge_top(top_key, kth_key, c_key, K, K_PAD: tl.constexpr):
        """The best K of two descending key sets (keys are unique: ids are)."""
        EMPTY: tl.constexpr = -9223372036854775808  # below every real key (even -inf)
        k_offs = tl.arange(0, K_PAD)
        new_key = tl.full([K_PAD], EMPTY, tl.int64)
        for j in range(K):
            best = tl.maximum(tl.max(top_key, axis=0), tl.max(c_key, axis=0))
            new_key = tl.where(k_offs == j, best, new_key)
            kth_key = best
            # Retires exactly the pick.
            top_key = tl.where(top_key == best, EMPTY, top_key)
            c_key = tl.where(c_key == best, EMPTY, c_key)
        return new_key, kth_key

    @triton.jit
    def _scan(row_ptr, lo, hi, t, K, HAS_TEMP: tl.constexpr, HAS_TOP: tl.constexpr,
              K_PAD: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
        """Online max / sum-exp and the top-k keys of ``row[lo:hi]``."""
        NEG_INF: tl.constexpr = float("-inf")
        ID_MAX: tl.constexpr = 2147483647
        EMPTY: tl.constexpr = -9223372036854775808
        m = tl.full([], NEG_INF, tl.float32)  # running max
        s = tl.full([], 0.0, tl.float32)  # running sum of exp(x - m)
        top_key = tl.full([K_PAD], EMPTY, tl.int64)  # best keys, descending
        kth_key = tl.full([], EMPTY, tl.int64)  # key in slot K-1; EMPTY until k are seen
        for start in range(lo, hi, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < hi
            x = tl.load(row_ptr + offs, mask=mask, other=NEG_INF).to(tl.float32)
            x = tl.where(x == x, x, NEG_INF)  # NaN counts as -inf (compiled tl.max drops it)
            if HAS_TEMP:
                # Divide, not multiply by 1/t, so values match logits / t bit for bit.
                x = x / t
            if HAS_TOP:
                # -0.0 would sort below +0.0 by bits; fold it so ties stay ties.
                bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
                key_hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                c_key = (key_hi.to(tl.int64) << 32) | (ID_MAX - offs).to(tl.int64)
                c_key = tl.where(mask, c_key, EMPTY)  # [BLOCK_V]
                c_top = tl.max(c_key, axis=0)
                # The chunk max falls out of the key, saving a second reduction.
                c_hi = (c_top >> 32).to(tl.int32)
                c_max = (c_hi ^ ((c_hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            else:
                c_max = tl.max(x, axis=0)
            m_new = tl.maximum(m, c_max)
            # All -inf so far: shift by 0 instead, or exp(-inf - -inf) gives NaN.
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m = m_new
            # The constexpr test must stay separate: c_top exists only with HAS_TOP.
            if HAS_TOP:  # noqa: SIM102
                # Most chunks of a long row cannot enter the top k: skip the merge.
                if c_top > kth_key:
                    top_key, kth_key = _merge_top(top_key, kth_key, c_key, K, K_PAD)
        return m, s, top_key

    @triton.jit
    def _finish(row, row_ptr, t, m, s, top_key, token_ids_ptr, stride_t, gather_ptr,
                stride_gr, stride_gc, out_token_ptr, out_topv_ptr, out_topi_ptr, out_ids_ptr,
                M, K, HAS_TEMP: tl.constexpr, HAS_TOP: tl.constexpr, K_PAD: tl.constexpr,
                M_PAD: tl.constexpr):  # fmt: skip
        """Writes one row's logprobs from its max, sum-exp and top keys."""
        NEG_INF: tl.constexpr = float("-inf")
        ID_MAX: tl.constexpr = 2147483647
        lse = m + tl.log(s)
        # A row with no possible token: report -inf everywhere (x - lse would be NaN).
        lse_safe = tl.where(lse == NEG_INF, float("inf"), lse)

        tok = tl.load(token_ids_ptr + row * stride_t)
        x_tok = tl.load(row_ptr + tok).to(tl.float32)
        x_tok = tl.where(x_tok == x_tok, x_tok, NEG_INF)
        if HAS_TEMP:
            x_tok = x_tok / t
        tl.store(out_token_ptr + row, x_tok - lse_safe)

        if HAS_TOP:
            k_offs = tl.arange(0, K_PAD)
            top_hi = (top_key >> 32).to(tl.int32)
            top_v = (top_hi ^ ((top_hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            top_i = ID_MAX - (top_key & 0x7FFFFFFF)
            k_mask = k_offs < K
            tl.store(out_topv_ptr + row * K + k_offs, top_v - lse_safe, mask=k_mask)
            tl.store(out_topi_ptr + row * K + k_offs, top_i, mask=k_mask)

        # Requested ids are read last because they need the final lse.
        m_offs = tl.arange(0, M_PAD)
        m_mask = m_offs < M
        gid = tl.load(gather_ptr + row * stride_gr + m_offs * stride_gc, mask=m_mask, other=-1)
        valid = gid >= 0
        xg = tl.load(row_ptr + gid, mask=valid, other=0.0).to(tl.float32)
        xg = tl.where(xg == xg, xg, NEG_INF)
        if HAS_TEMP:
            xg = xg / t
        xg = tl.where(valid, xg - lse_safe, float("nan"))
        tl.store(out_ids_ptr + row * M + m_offs, xg, mask=m_mask)

    @triton.jit
    def _row_logprobs_kernel(
        logits_ptr,
        stride_lr,
        row_ids_ptr,
        stride_rid,
        token_ids_ptr,
        stride_t,
        temps_ptr,
        stride_temp,
        gather_ptr,
        stride_gr,
        stride_gc,
        out_token_ptr,
        out_topv_ptr,
        out_topi_ptr,
        out_ids_ptr,
        part_m_ptr,
        part_s_ptr,
        part_key_ptr,
        V,
        M,
        K,
        SPLIT_V,
        NUM_PARTS,
        HAS_ROW_IDS: tl.constexpr,
        HAS_TEMP: tl.constexpr,
        HAS_TOP: tl.constexpr,
        K_PAD: tl.constexpr,
        M_PAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
        PHASE: tl.constexpr,
    ):
        # PHASE 0: program (row, 0) scans its whole row and writes its logprobs.
        # PHASE 1: program (row, part) scans one vocab slice and leaves its max,
        # sum-exp and top keys; PHASE 2: program (row, 0) merges the slices
        # (the logsumexp of the parts, the top k of their keys) and writes.
        NEG_INF: tl.constexpr = float("-inf")
        EMPTY: tl.constexpr = -9223372036854775808
        # `row` indexes the per-output-row inputs and outputs; `src` the logits.
        # 64-bit offsets so huge [R, V] blocks cannot overflow.
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        src = row
        if HAS_ROW_IDS:
            src = tl.load(row_ids_ptr + row * stride_rid).to(tl.int64)
        row_ptr = logits_ptr + src * stride_lr
        t = 1.0
        if HAS_TEMP:
            t = tl.load(temps_ptr + row * stride_temp).to(tl.float32)
        if PHASE == 2:
            m = tl.full([], NEG_INF, tl.float32)
            s = tl.full([], 0.0, tl.float32)
            top_key = tl.full([K_PAD], EMPTY, tl.int64)
            kth_key = tl.full([], EMPTY, tl.int64)
            for p in range(0, NUM_PARTS):
                at = row * NUM_PARTS + p
                m_p = tl.load(part_m_ptr + at)
                s_p = tl.load(part_s_ptr + at)
                m_new = tl.maximum(m, m_p)
                m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
                s = s * tl.exp(m - m_safe) + s_p * tl.exp(m_p - m_safe)
                m = m_new
                if HAS_TOP:
                    c_key = tl.load(part_key_ptr + at * K_PAD + tl.arange(0, K_PAD))
                    if tl.max(c_key, axis=0) > kth_key:
                        top_key, kth_key = _merge_top(top_key, kth_key, c_key, K, K_PAD)
        else:
            lo = part * SPLIT_V
            hi = tl.minimum(lo + SPLIT_V, V)
            m, s, top_key = _scan(row_ptr, lo, hi, t, K, HAS_TEMP, HAS_TOP, K_PAD, BLOCK_V)
        if PHASE == 1:
            at = row * NUM_PARTS + part
            tl.store(part_m_ptr + at, m)
            tl.store(part_s_ptr + at, s)
            if HAS_TOP:
                tl.store(part_key_ptr + at * K_PAD + tl.arange(0, K_PAD), top_key)
        else:
            _finish(row, row_ptr, t, m, s, top_key, token_ids_ptr, stride_t, gather_ptr,
                    stride_gr, stride_gc, out_token_ptr, out_topv_ptr, out_topi_ptr,
                    out_ids_ptr, M, K, HAS_TEMP, HAS_TOP, K_PAD, M_PAD)  # fmt: skip


def _pow2_at_least(n: int) -> int:
    # tl.arange needs a power-of-two length of at least 1.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Programs a block should spread over (a few per SM of a large GPU): few rows
# split their vocab into slices, scanned in parallel and merged by a second,
# tiny kernel; many rows keep one program per row (each reads its row once).
TARGET_PROGRAMS = 1024


def _vocab_split(n: int, v: int, block_v: int) -> tuple[int, int]:
    """(slices per row, tokens per slice, a multiple of block_v)."""
    chunks = -(-v // block_v)
    parts = min(chunks, max(1, -(-TARGET_PROGRAMS // n)))
    split = -(-chunks // parts) * block_v
    return -(-v // split), split


def row_logprobs_triton(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
    block_v: int | None = None,
    row_ids: torch.Tensor | None = None,
) -> RowLogprobs:
    """Triton path: each logits row read once, by one program or (few rows)
    by several over slices of the vocabulary, merged by a second kernel.

    ``row_ids`` values must lie in ``[0, R)``; they are not checked here, as that
    would need a device sync.
    """
    if not HAS_TRITON:
        raise RuntimeError("row_logprobs_triton needs triton, which is not installed")
    assert logits.dim() == 2, f"logits must be [R, V], got shape {tuple(logits.shape)}"
    r, v = logits.shape
    dev = logits.device
    if row_ids is None:
        n = r
    else:
        assert row_ids.dim() == 1, f"row_ids must be 1-D [N], got {tuple(row_ids.shape)}"
        assert row_ids.dtype == torch.int64, f"row_ids must be int64, got {row_ids.dtype}"
        assert row_ids.device == dev, f"row_ids on {row_ids.device}, logits on {dev}"
        n = row_ids.shape[0]
    assert logits.dtype in LOGIT_DTYPES, f"logits dtype must be one of {LOGIT_DTYPES}"
    assert logits.stride(1) == 1, f"logits last dim must be contiguous, strides {logits.stride()}"
    assert v > 0, "logits must have a non-empty vocab dim"
    assert token_ids.shape == (n,), f"token_ids must be [{n}], got {tuple(token_ids.shape)}"
    assert token_ids.dtype == torch.int64, f"token_ids must be int64, got {token_ids.dtype}"
    assert token_ids.device == dev, f"token_ids on {token_ids.device}, logits on {dev}"
    if temperatures is not None:
        assert temperatures.shape == (n,), (
            f"temperatures must be [{n}], got {tuple(temperatures.shape)}"
        )
        assert temperatures.dtype == torch.float32, (
            f"temperatures must be float32, got {temperatures.dtype}"
        )
        assert temperatures.device == dev, f"temperatures on {temperatures.device}, logits on {dev}"
    assert isinstance(top_k, int) and 0 <= top_k <= v, f"top_k must be in [0, {v}], got {top_k}"
    if gather_ids is None:
        gather_ids = torch.empty(n, 0, dtype=torch.int64, device=dev)
    assert gather_ids.dim() == 2 and gather_ids.shape[0] == n, (
        f"gather_ids must be [{n}, M], got {tuple(gather_ids.shape)}"
    )
    assert gather_ids.dtype == torch.int64, f"gather_ids must be int64, got {gather_ids.dtype}"
    assert gather_ids.device == dev, f"gather_ids on {gather_ids.device}, logits on {dev}"
    m = gather_ids.shape[1]
    if block_v is None:
        block_v = DEFAULT_BLOCK_V
    assert block_v > 0 and block_v & (block_v - 1) == 0, f"block_v must be a power of 2: {block_v}"

    out = RowLogprobs(
        token_logprobs=torch.empty(n, dtype=torch.float32, device=dev),
        top_values=torch.empty(n, top_k, dtype=torch.float32, device=dev),
        top_ids=torch.empty(n, top_k, dtype=torch.int64, device=dev),
        ids_logprobs=torch.empty(n, m, dtype=torch.float32, device=dev),
    )
    if n == 0:
        return out
    # The kernel never reads temps (row_ids) when HAS_TEMP (HAS_ROW_IDS) is off;
    # any pointer will do.
    temps = temperatures if temperatures is not None else out.token_logprobs
    rids = row_ids if row_ids is not None else token_ids
    parts, split = _vocab_split(n, v, block_v)
    k_pad = _pow2_at_least(top_k)
    flags = dict(
        HAS_ROW_IDS=row_ids is not None,
        HAS_TEMP=temperatures is not None,
        # k itself is a runtime value: one compiled variant per power of two.
        HAS_TOP=top_k > 0,
        K_PAD=k_pad,
        M_PAD=_pow2_at_least(m),
    )
    rows = (
        logits, logits.stride(0), rids, rids.stride(0), token_ids, token_ids.stride(0),
        temps, temps.stride(0), gather_ids, gather_ids.stride(0), gather_ids.stride(1),
        out.token_logprobs, out.top_values, out.top_ids, out.ids_logprobs,
    )  # fmt: skip
    part_m = torch.empty(n * parts if parts > 1 else 1, dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    part_key = torch.empty(part_m.numel() * k_pad, dtype=torch.int64, device=dev)
    scalars = (part_m, part_s, part_key, v, m, top_k, split, parts)
    if parts == 1:
        _row_logprobs_kernel[(n, 1)](*rows, *scalars, **flags, BLOCK_V=block_v, PHASE=0)
    else:
        _row_logprobs_kernel[(n, parts)](*rows, *scalars, **flags, BLOCK_V=block_v, PHASE=1)
        _row_logprobs_kernel[(n, 1)](*rows, *scalars, **flags, BLOCK_V=block_v, PHASE=2)
    return out


def row_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
    backend: str = "auto",
    row_ids: torch.Tensor | None = None,
) -> RowLogprobs:
    """Dispatch: "auto" uses Triton on CUDA tensors, the torch reference elsewhere."""
    if use_triton(backend, logits, "row_logprobs"):
        return row_logprobs_triton(
            logits, token_ids, temperatures, top_k, gather_ids, row_ids=row_ids
        )
    return row_logprobs_ref(logits, token_ids, temperatures, top_k, gather_ids, row_ids)
