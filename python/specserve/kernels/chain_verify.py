"""Verification of speculative draft chains against the target model's rows.

B chains are verified at once. Chain b holds ``L_b = lengths[b]`` drafts,
``drafts[b, :L_b]`` (the rest of its padded row is ignored), and owns the L_b + 1
target rows ``row_starts[b] .. row_starts[b] + L_b`` of a ``[R, V]`` block: row
``row_starts[b] + j`` is the target distribution at the position of draft j, and
the last row yields the bonus token when every draft is accepted.

Both verifiers return ``accept_len [B]`` and ``next_token [B]`` (int64): chain b
commits ``drafts[b, :accept_len[b]]`` followed by ``next_token[b]``, which is the
correction at the first rejected position or the bonus token.

* Greedy: a draft is accepted while it equals the argmax of its row (ties go to
  the lowest index); the next token is the argmax of the row after the
  accepted prefix.
* Rejection sampling: draft x with draft probability q and target probability
  p is accepted iff ``q > 0 and u * q < p``; at the first rejection the next
  token is drawn from the normalised residual ``max(0, p - q)`` (from p where
  that is all zero), so committed tokens follow the target distribution
  exactly.

A draw from non-negative weights w is an exponential race, as the sampler's:
with ``E ~ Exp(1)`` per token (``noise``), the token with the largest ``w / E``
among those with ``w > 0``, ties to the lowest id (0 when w is all zero, which
a normalised row never is). An inverse-CDF draw would move its token whenever
rounding moved any of the boundaries below it (about V of them), so the same
seed would draw other tokens on another CPU or tensor-parallel layout; the race
changes only at a near-tie of two scores. Greedy verification on Triton is
row-parallel: every row's argmax at once (programs over rows x vocab slices),
then the accept rule for every chain in a few vectorised ops. Rejection
sampling runs one program per chain, walks its drafts in order and stops at
the first rejection, then races over the row it stopped at in vocab chunks.
The torch references spell the rules out plainly and serve as the test
oracle.

Inputs are trusted where checking them would need a device sync: drafts must lie
in ``[0, V)``, ``lengths`` in ``[0, Lmax]`` and every row a chain uses must
exist. A NaN logit is never the greedy token (both paths); probability rows for
rejection sampling must not hold NaN.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.kernels.dispatch import HAS_TRITON, LOGIT_DTYPES, tl, triton, use_triton

# Vocab chunk per loop step; wide loads on a GPU, few steps for a 150k vocab.
DEFAULT_BLOCK_V = 1024


# --------------------------------------------------------------------------- reference


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``[R, V]``: the argmax, ties to the
    lowest index (``torch.argmax`` returns the first maximum on every device);
    NaN is never the argmax (both paths), so it counts as -inf. Plain greedy
    sampling uses it too: one rule for the greedy token."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # NumPy's argmax picks a row's first NaN if it holds one: only then is
        # the row sanitised (a pass over every row costs more than the argmax).
        a = x.detach().numpy()
        best = a.argmax(axis=-1)
        if np.isnan(np.take_along_axis(a, best[..., None], axis=-1)).any():
            best = np.where(np.isnan(a), -np.inf, a).argmax(axis=-1)
        return torch.from_numpy(best)
    inf = float("inf")
    return row_argmax(torch.nan_to_num(x.float(), nan=-inf, posinf=inf, neginf=-inf))  # [R]


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first maximum of each row; NaN counts as the
    maximum, as in torch). On the CPU through NumPy, whose vectorised argmax
    takes a tenth of torch's here (8 x 8192 float32 rows: 8 vs 83 us); the
    same index either way."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def greedy_verify_ref(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference for greedy verification; returns (accept_len, next_token)."""
    b, lmax = drafts.shape
    dev = logits.device
    assert bool(((lengths >= 0) & (lengths <= lmax)).all()), "lengths must be in [0, Lmax]"
    if b == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty.clone()
    return greedy_accept(greedy_argmax(logits), row_starts, drafts, lengths)


def greedy_accept(
    target: torch.Tensor,  # [R] each row's greedy token
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept lengths and next tokens from every row's greedy token, all
    chains at once (no loop, no host read). Both verifiers end here, and so
    do rows whose greedy tokens were found elsewhere (on the shards)."""
    lmax = drafts.shape[1]
    dev = target.device
    j = torch.arange(lmax, device=dev)  # [Lmax]
    live = j < lengths.unsqueeze(1)  # [B, Lmax]
    # Padded positions may point past the block; they are masked by `live`.
    rows = (row_starts.unsqueeze(1) + j).clamp(max=target.shape[0] - 1)  # [B, Lmax]
    match = live & (target[rows] == drafts)  # [B, Lmax]
    # Leading run of matches: the cumulative product stays 1 until the first miss.
    accept_len = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target[row_starts + accept_len]  # [B]
    return accept_len, next_token.long()


def race_pick(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's winner per row: ``argmax(w / E)`` over the
    tokens with ``w > 0`` (a zero weight never wins, whatever its noise),
    ties to the lowest id. ``weights``, ``noise``: ``[..., V]``; ``[...]`` int64."""
    score = torch.where(weights > 0, weights / noise, -1.0)
    return score.argmax(dim=-1)


def rejection_verify_ref(
    probs: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_starts: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference for rejection sampling, one chain at a time.

    ``uniforms[b, j]`` (``[B, Lmax]``) decides draft j; ``noise[b]``
    (``[B, V]``, Exp(1)) races the final draw.
    """
    b, lmax = drafts.shape
    dev = probs.device
    starts = row_starts.tolist()
    lens = lengths.tolist()
    qstarts = draft_starts.tolist() if draft_probs is not None else [0] * b
    draft_list = drafts.tolist()
    accept_len = torch.zeros(b, dtype=torch.int64, device=dev)
    next_token = torch.zeros(b, dtype=torch.int64, device=dev)
    for c in range(b):
        n = lens[c]
        assert 0 <= n <= lmax, f"lengths[{c}] = {n} is outside [0, {lmax}]"
        a = 0
        weights = probs[starts[c] + n]  # [V]; stays the bonus row if all are accepted
        while a < n:
            x = draft_list[c][a]
            p_row = probs[starts[c] + a]  # [V]
            if draft_probs is not None:
                q_row = draft_probs[qstarts[c] + a]  # [V]
            else:
                q_row = torch.zeros_like(p_row)
                q_row[x] = 1.0
            q = q_row[x]
            if q > 0 and uniforms[c, a] * q < p_row[x]:
                a += 1
                continue
            weights = (p_row - q_row).clamp(min=0.0)
            if not bool((weights > 0).any()):
                weights = p_row
            break
        accept_len[c] = a
        next_token[c] = race_pick(weights, noise[c])
    return accept_len, next_token


# --------------------------------------------------------------------------- triton

if HAS_TRITON:

    @triton.jit
    def _argmax_key_kernel(
        logits_ptr,
        stride_lr,
        out_ptr,
        stride_or,
        V,
        SPLIT_V,
        BLOCK_V: tl.constexpr,
    ):
        # Program (row, part) finds the best of one vocab slice of one row, as
        # a packed int64 key: the float's bits remapped so signed-int order is
        # float order, high; (ID_MAX - id), low. The largest key over the parts
        # is the row's max and, among equal values, its lowest id.
        ID_MAX: tl.constexpr = 2147483647
        EMPTY: tl.constexpr = -9223372036854775808
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        lo = part * SPLIT_V
        hi = tl.minimum(lo + SPLIT_V, V)
        row_ptr = logits_ptr + row * stride_lr
        best = tl.full([], EMPTY, tl.int64)
        for start in range(lo, hi, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < hi
            x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
            x = tl.where(x == x, x, float("-inf"))  # NaN is never the argmax
            bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties +0.0
            key_hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            key = (key_hi.to(tl.int64) << 32) | (ID_MAX - offs).to(tl.int64)
            best = tl.maximum(best, tl.max(tl.where(mask, key, EMPTY), axis=0))
        tl.store(out_ptr + row * stride_or + part, best)

    @triton.jit
    def _accept_draft(
        probs_ptr,
        stride_pr,
        row0,
        draft_row,
        stride_dj,
        q_ptr,
        stride_qr,
        q_row0,
        u_row,
        stride_uj,
        j,
        n,
        V,
        HAS_Q: tl.constexpr,
    ):
        live = j < n
        x = tl.load(draft_row + j * stride_dj, mask=live, other=0)
        # Out-of-vocab drafts are invalid input; masking keeps them from reading
        # out of bounds (they are rejected).
        ok = live & (x >= 0) & (x < V)
        p = tl.load(probs_ptr + (row0 + j) * stride_pr + x, mask=ok, other=0.0)
        if HAS_Q:
            q = tl.load(q_ptr + (q_row0 + j) * stride_qr + x, mask=ok, other=0.0)
        else:
            q = tl.where(ok, 1.0, 0.0)
        u = tl.load(u_row + j * stride_uj, mask=live, other=1.0)
        return ok & (q > 0.0) & (u * q < p)

    @triton.jit
    def _residual(p, q_row, offs, mask, x, rejected, HAS_Q: tl.constexpr):
        # max(0, p - q) for one chunk; q is the draft row, or one-hot at x.
        if HAS_Q:
            q = tl.load(q_row + offs, mask=mask & rejected, other=0.0)
        else:
            q = tl.where(offs == x, 1.0, 0.0)
        return tl.maximum(p - q, 0.0)

    @triton.jit
    def _rejection_verify_kernel(
        probs_ptr,
        stride_pr,
        row_starts_ptr,
        stride_rs,
        drafts_ptr,
        stride_db,
        stride_dj,
        lengths_ptr,
        stride_len,
        q_ptr,
        stride_qr,
        q_starts_ptr,
        stride_qs,
        u_ptr,
        stride_ub,
        stride_uj,
        noise_ptr,
        stride_nb,
        out_accept_ptr,
        out_next_ptr,
        V,
        HAS_Q: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        c = tl.program_id(0).to(tl.int64)
        row0 = tl.load(row_starts_ptr + c * stride_rs)
        n = tl.load(lengths_ptr + c * stride_len)
        draft_row = drafts_ptr + c * stride_db
        u_row = u_ptr + c * stride_ub
        q_row0 = tl.zeros([], tl.int64)
        if HAS_Q:
            q_row0 = tl.load(q_starts_ptr + c * stride_qs)

        # Accept drafts until the first rejection (or the end of the chain).
        j = tl.zeros([], tl.int64)
        ok = _accept_draft(
            probs_ptr,
            stride_pr,
            row0,
            draft_row,
            stride_dj,
            q_ptr,
            stride_qr,
            q_row0,
            u_row,
            stride_uj,
            j,
            n,
            V,
            HAS_Q,
        )
        while ok:
            j += 1
            ok = _accept_draft(
                probs_ptr,
                stride_pr,
                row0,
                draft_row,
                stride_dj,
                q_ptr,
                stride_qr,
                q_row0,
                u_row,
                stride_uj,
                j,
                n,
                V,
                HAS_Q,
            )
        tl.store(out_accept_ptr + c, j)

        rejected = j < n
        x = tl.load(draft_row + j * stride_dj, mask=rejected, other=-1)
        p_row = probs_ptr + (row0 + j) * stride_pr
        q_row = q_ptr + (q_row0 + j) * stride_qr  # read only when rejected
        e_row = noise_ptr + c * stride_nb

        # One pass: the race over the residual and over p (the fallback when
        # the residual is all zero), each its best score and lowest id.
        best_r = tl.full([], -1.0, tl.float32)
        best_p = tl.full([], -1.0, tl.float32)
        pick_r = tl.zeros([], tl.int32)
        pick_p = tl.zeros([], tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            p = tl.load(p_row + offs, mask=mask, other=0.0)
            e = tl.load(e_row + offs, mask=mask, other=1.0)
            score = tl.where(p > 0.0, p / e, -1.0)
            top = tl.max(score, axis=0)
            if top > best_p:  # a later chunk wins only by more: lowest id on ties
                best_p = top
                pick_p = tl.min(tl.where(score == top, offs, V), axis=0)
            if rejected:
                r = _residual(p, q_row, offs, mask, x, rejected, HAS_Q)
                score = tl.where(r > 0.0, r / e, -1.0)
                top = tl.max(score, axis=0)
                if top > best_r:
                    best_r = top
                    pick_r = tl.min(tl.where(score == top, offs, V), axis=0)
        tok = tl.where(rejected & (best_r >= 0.0), pick_r, pick_p)
        tl.store(out_next_ptr + c, tok.to(tl.int64))


def _check_chains(
    rows: torch.Tensor,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[int, int]:
    """Shape/dtype/device checks shared by the Triton wrappers; returns (B, Lmax)."""
    dev = rows.device
    assert rows.dim() == 2, f"{name} must be [R, V], got shape {tuple(rows.shape)}"
    assert rows.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {rows.dtype}"
    assert rows.stride(1) == 1, f"{name} last dim must be contiguous, strides {rows.stride()}"
    assert rows.shape[1] > 0, f"{name} must have a non-empty vocab dim"
    assert drafts.dim() == 2, f"drafts must be [B, Lmax], got shape {tuple(drafts.shape)}"
    b, lmax = drafts.shape
    for t, tname in ((row_starts, "row_starts"), (lengths, "lengths")):
        assert t.shape == (b,), f"{tname} must be [{b}], got {tuple(t.shape)}"
    for t, tname in ((row_starts, "row_starts"), (drafts, "drafts"), (lengths, "lengths")):
        assert t.dtype == torch.int64, f"{tname} must be int64, got {t.dtype}"
        assert t.device == dev, f"{tname} on {t.device}, {name} on {dev}"
    return b, lmax


# Vocab slice of one argmax program: a 151936-token row spreads over 19
# programs, so even a single short chain keeps many SMs busy.
ARGMAX_SPLIT = 8192


def greedy_verify_triton(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton greedy verification, row-parallel: every row's argmax at once
    (programs over rows x vocab slices), then the accept rule for all chains
    in a few vectorised ops. Nothing waits on a previous row."""
    if not HAS_TRITON:
        raise RuntimeError("greedy_verify_triton needs triton, which is not installed")
    b, _ = _check_chains(logits, "logits", LOGIT_DTYPES, row_starts, drafts, lengths)
    block_v = _check_block(block_v)
    dev = logits.device
    if b == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty.clone()
    r, v = logits.shape
    split = max(block_v, ARGMAX_SPLIT // block_v * block_v)
    parts = -(-v // split)
    keys = torch.empty(r, parts, dtype=torch.int64, device=dev)
    _argmax_key_kernel[(r, parts)](
        logits, logits.stride(0), keys, keys.stride(0), v, split, BLOCK_V=block_v, num_warps=4
    )
    target = 2147483647 - (keys.amax(dim=1) & 0x7FFFFFFF)  # [R] lowest id of each row's max
    return greedy_accept(target, row_starts, drafts, lengths)


def rejection_verify_triton(
    probs: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_starts: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rejection sampling: one program per chain, one pass over the final row."""
    if not HAS_TRITON:
        raise RuntimeError("rejection_verify_triton needs triton, which is not installed")
    b, lmax = _check_chains(probs, "probs", (torch.float32,), row_starts, drafts, lengths)
    dev = probs.device
    v = probs.shape[1]
    if draft_probs is not None:
        assert draft_probs.dim() == 2 and draft_probs.shape[1] == v, (
            f"draft_probs must be [D, {v}], got {tuple(draft_probs.shape)}"
        )
        assert draft_probs.dtype == torch.float32, (
            f"draft_probs must be float32, got {draft_probs.dtype}"
        )
        assert draft_probs.stride(1) == 1, (
            f"draft_probs last dim must be contiguous, strides {draft_probs.stride()}"
        )
        assert draft_probs.device == dev, f"draft_probs on {draft_probs.device}, probs on {dev}"
        assert draft_starts is not None, "draft_starts is required with draft_probs"
        assert draft_starts.shape == (b,), (
            f"draft_starts must be [{b}], got {tuple(draft_starts.shape)}"
        )
        assert draft_starts.dtype == torch.int64, (
            f"draft_starts must be int64, got {draft_starts.dtype}"
        )
        assert draft_starts.device == dev, f"draft_starts on {draft_starts.device}, probs on {dev}"
    assert uniforms.shape == (b, lmax), (
        f"uniforms must be [{b}, {lmax}], got {tuple(uniforms.shape)}"
    )
    assert uniforms.dtype == torch.float32, f"uniforms must be float32, got {uniforms.dtype}"
    assert uniforms.device == dev, f"uniforms on {uniforms.device}, probs on {dev}"
    assert noise.shape == (b, v), f"noise must be [{b}, {v}], got {tuple(noise.shape)}"
    assert noise.dtype == torch.float32, f"noise must be float32, got {noise.dtype}"
    assert noise.stride(1) == 1, f"noise last dim must be contiguous, strides {noise.stride()}"
    assert noise.device == dev, f"noise on {noise.device}, probs on {dev}"
    block_v = _check_block(block_v)
    accept_len = torch.empty(b, dtype=torch.int64, device=dev)
    next_token = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return accept_len, next_token
    # Without draft_probs the kernel never reads q; any tensors will do.
    q = draft_probs if draft_probs is not None else probs
    q_starts = draft_starts if draft_probs is not None else row_starts
    _rejection_verify_kernel[(b,)](
        probs,
        probs.stride(0),
        row_starts,
        row_starts.stride(0),
        drafts,
        drafts.stride(0),
        drafts.stride(1),
        lengths,
        lengths.stride(0),
        q,
        q.stride(0),
        q_starts,
        q_starts.stride(0),
        uniforms,
        uniforms.stride(0),
        uniforms.stride(1),
        noise,
        noise.stride(0),
        accept_len,
        next_token,
        v,
        HAS_Q=draft_probs is not None,
        BLOCK_V=block_v,
        num_warps=4,
    )
    return accept_len, next_token


def _check_block(block_v: int | None) -> int:
    if block_v is None:
        return DEFAULT_BLOCK_V
    assert block_v > 0 and block_v & (block_v - 1) == 0, f"block_v must be a power of 2: {block_v}"
    return block_v


# --------------------------------------------------------------------------- dispatch


def greedy_verify(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: "auto" uses Triton on CUDA tensors, the torch reference elsewhere."""
    if use_triton(backend, logits, "chain verify"):
        return greedy_verify_triton(logits, row_starts, drafts, lengths)
    return greedy_verify_ref(logits, row_starts, drafts, lengths)


def rejection_verify(
    probs: torch.Tensor,
    row_starts: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_starts: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: "auto" uses Triton on CUDA tensors, the torch reference elsewhere."""
    args = (probs, row_starts, drafts, lengths, draft_probs, draft_starts, uniforms, noise)
    if use_triton(backend, probs, "chain verify"):
        return rejection_verify_triton(*args)
    return rejection_verify_ref(*args)
