"""Scoring vocabulary-split logits without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its slice of the vocabulary,
``[R, Vl]`` for global ids ``[vocab_start, vocab_start + Vl)``, of which the
first ``vocab_real`` columns are real ids (``layers.parallel.vocab_shard``;
the rest is padding and never scored). Rather than moving ``R x V`` floats to
rank 0, every rank reduces its slice to a few numbers per row and the ranks
exchange only those:

- logprobs: ONE all-gather of ``[R, 3 + M + 2k]`` float32 per rank: the
  shard's max ``m_r`` and ``s_r = sum exp(x - m_r)``, the chosen token's and
  the requested ids' scaled logits (-inf from ranks that do not own the id),
  and the shard's top-k as int64 keys bit-cast to float32 (an all-gather only
  copies bytes, so the bits survive). Every rank then merges the same bytes in
  the same order: the results are bitwise equal on every rank. An id's logit
  comes from the rank that holds it; the others send -inf and the merge takes
  the max, which is exact (so would be a sum with 0s), and an id no rank holds
  (-1 padding) reads as impossible rather than as a logit of 0. One collective
  rather than max, sum and gather: each one is a round trip (latency, not
  bandwidth, dominates such small messages), and at 2 ranks an all-reduce
  moves as many bytes as the all-gather does;
- greedy argmax and row peaks: ONE all-reduce (max) of ``[R, 2]`` int64
  (each row's key, and whether the shard's row holds a NaN).

A key (``kernels.logprob_partials.logit_keys``, the row-logprob kernel's)
packs (value, global id) so that one integer comparison orders by value
descending, then id ascending. A top-k or max of keys has no ties, so ties
go to the lowest global id on any number of ranks, as on one device. Each
shard's part (max, sum-exp, top keys) comes from ``row_partials``: the
Triton kernel's partial mode on a GPU, its torch reference elsewhere.

The contract is ``kernels.logprobs``'s: NaN logits count as -inf; a row with
no possible token (all -inf, or holding +inf, where ``log_softmax`` is NaN)
reports -inf for every logprob; temperatures divide the logits; requested ids
of -1 give NaN. Token and requested ids must be below the vocabulary size and
``top_k`` at most the vocabulary size. Every input but the logits must be the
same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.core import ARGMAX, ScoreRows
from specserve.distributed import RankGroup
from specserve.host import upload
from specserve.kernels.chain_verify import greedy_argmax
from specserve.kernels.logprob_partials import EMPTY_KEY, key_values, logit_keys, row_partials
from specserve.kernels.logprobs import RowLogprobs
from specserve.sampling.logprobs import clamped

if TYPE_CHECKING:
    from specserve.layers.parallel import VocabParallelHead

NEG_INF = float("-inf")
STATS = 3  # m_r, s_r, the chosen token's logit


def _owned(x: torch.Tensor, ids: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``x``'s values at global ``ids`` ([R, M], as float32) this shard holds, -inf at the
    others (padding -1 included): the max over the ranks is then exact."""
    real = x.shape[1]
    local = ids - vocab_start  # [R, M]
    own = (local >= 0) & (local < real)
    if real == 0:
        return torch.full(ids.shape, NEG_INF, dtype=torch.float32, device=x.device)
    got = x.gather(1, local.clamp(0, real - 1)).float()  # [R, M]
    return got.masked_fill(~own, NEG_INF)


def vocab_parallel_logprobs(
    local_logits: torch.Tensor,
    vocab_start: int,
    vocab_real: int,
    token_ids: torch.Tensor,
    temps: torch.Tensor | None,
    top_k: int,
    gather_ids: torch.Tensor | None,
    group: RankGroup,
    backend: str = "auto",
) -> RowLogprobs:
    """``row_logprobs_ref`` of the full logits from this rank's shard, the
    same on every rank (values to float rounding; top ids exactly, ties to
    the lowest global id). Moves ``logprob_bytes`` bytes, not the logits."""
    r = local_logits.shape[0]
    dev = local_logits.device
    assert local_logits.dim() == 2 and 0 <= vocab_real <= local_logits.shape[1]
    assert token_ids.shape == (r,), f"token_ids must be [{r}], got {tuple(token_ids.shape)}"
    assert top_k >= 0, f"top_k must be >= 0, got {top_k}"
    if gather_ids is None:
        gather_ids = torch.empty(r, 0, dtype=torch.int64, device=dev)
    m_ids = gather_ids.shape[1]

    # The shard's logsumexp as (max, sum of exp(x - max)) and its top keys,
    # of the scaled logits (NaN as -inf); padding never read.
    part = row_partials(local_logits[:, :vocab_real], temps, top_k, vocab_start, backend)
    m_r, s_r, top = part.maxes, part.sums, part.top_keys  # [R], [R], [R, k]

    # The chosen and requested ids' scaled logits, as the reference has them.
    wanted = torch.cat([token_ids.long().unsqueeze(1), gather_ids.long()], 1)  # [R, 1 + M]
    picked = _owned(local_logits[:, :vocab_real], wanted, vocab_start)  # [R, 1 + M]
    picked = picked.masked_fill(picked.isnan(), NEG_INF)  # the NaN contract
    if temps is not None:
        picked = picked / temps.float().unsqueeze(1)  # divide, as the reference does

    # [R, 3 + M + 2k] float32: m, s, token logit, requested logits, top keys.
    payload = torch.cat([m_r.unsqueeze(1), s_r.unsqueeze(1), picked, top.view(torch.float32)], 1)
    parts = group.all_gather(payload)  # N x [R, P]
    cut = STATS + m_ids
    every = torch.stack([p[:, :cut] for p in parts])  # [N, R, 3 + M]

    m_all, s_all = every[:, :, 0], every[:, :, 1]  # [N, R]
    m = m_all.amax(dim=0)  # [R]
    ok = m.isfinite()  # else no possible token (all -inf) or +inf: -inf everywhere
    m_safe = torch.where(ok, m, 0.0)
    log_s = (s_all * torch.exp(m_all - m_safe)).sum(dim=0).log()  # [R]; S >= 1 where ok

    def logprob(v: torch.Tensor) -> torch.Tensor:  # [R, J] scaled logits -> logprobs
        # (x - max) - log(sum): the association of the reference's log_softmax.
        out = (v - m_safe.unsqueeze(1)) - log_s.unsqueeze(1)
        return out.masked_fill(~ok.unsqueeze(1), NEG_INF)

    picked = logprob(every[:, :, 2:].amax(dim=0))  # [R, 1 + M]
    ids_logprobs = picked[:, 1:].masked_fill(gather_ids < 0, float("nan"))  # [R, M]

    # Every rank's top keys as [R, N, 2k] float32 (a fresh tensor, so its bits
    # view as int64) -> [R, N * k] int64; keys are unique, so no ties.
    best = top  # [R, 0] at top_k 0 (an empty float block does not view as int64)
    if top_k > 0:
        keys = torch.stack([p[:, cut:] for p in parts], dim=1).view(torch.int64)
        best = keys.flatten(1).topk(top_k, dim=1).values  # [R, k], sorted descending
    top_x, top_ids = key_values(best)
    return RowLogprobs(picked[:, 0], logprob(top_x), top_ids, ids_logprobs)


def vocab_parallel_argmax(
    local_logits: torch.Tensor,
    vocab_start: int,
    vocab_real: int,
    group: RankGroup,
    column_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(greedy_argmax, row_peaks)`` of the full logits from this rank's
    shard: ``[R]`` int64 global ids (ties to the lowest id, NaN never chosen,
    an all NaN / -inf row gives 0) and ``[R]`` float32 row maxima (NaN where
    the row holds a NaN), in ONE all-reduce (max) of ``[R, 2]`` int64: each
    row's key and whether the shard's row holds a NaN. ``column_ids``: the
    ids of the shard's columns (``[Vr]``, ascending: a drafter's slice of its
    hot vocabulary) instead of ``vocab_start ..``."""
    r, dev = local_logits.shape[0], local_logits.device
    out = torch.zeros(r, 2, dtype=torch.int64, device=dev)  # [R, (key, has NaN)]
    if column_ids is not None:
        vocab_real = column_ids.numel()
    if vocab_real == 0:  # a shard of padding only (vocab < ranks)
        out[:, 0] = EMPTY_KEY
    elif r:
        x = local_logits[:, :vocab_real]  # [R, Vr]
        idx = greedy_argmax(x).to(dev)  # [R] local; the shard's first best
        v = x.gather(1, idx.unsqueeze(1)).squeeze(1).float()  # [R]
        has_nan = x.amax(dim=1).isnan()  # amax keeps NaN (argmax skips it)
        ids = idx + vocab_start if column_ids is None else column_ids[idx]
        # An all-NaN shard row picks its column 0, worth -inf.
        out[:, 0] = logit_keys(v.masked_fill(v.isnan(), NEG_INF), ids)
        out[:, 1] = has_nan.long()
    out = group.all_reduce_max(out)
    peaks, ids = key_values(out[:, 0])
    return ids, peaks.masked_fill(out[:, 1] > 0, float("nan"))


def gather_columns(local: torch.Tensor, counts: list[int], group: RankGroup) -> torch.Tensor | None:
    """The rows ``local [R, C]`` of every rank's columns side by side on rank
    0, ``[R, sum(counts)]`` (None elsewhere): rank r holds ``counts[r]`` real
    columns (uneven slices pad to the widest for the gather)."""
    width = max(counts)
    pad = local.new_full((local.shape[0], width), NEG_INF)
    pad[:, : counts[group.rank]] = local[:, : counts[group.rank]]
    parts = group.gather_to_first(pad)
    if parts is None:
        return None
    return torch.cat([p[:, :c] for p, c in zip(parts, counts)], dim=1)


def score_on_shards(
    head: VocabParallelHead, hidden: torch.Tensor, score: ScoreRows | None, backend: str = "auto"
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, RowLogprobs | None]:
    """``head``'s logits of ``hidden [R, d]`` on rank 0 (``[R, V]``; None on
    the others), but ``score``'s rows decided and scored here instead, from
    the shards, the same on every rank: ``(ids, peaks)`` of its ``argmax``
    rows (``vocab_parallel_argmax``) and the logprobs of its scored rows
    (clamped, as every reported logprob is). Those rows' logits never leave
    the shards; their rows of the returned logits are left unset."""
    local = head(hidden)  # [R, V / N]
    if score is None or not (score.rows or score.argmax):
        return head.gather(local), None, None
    dev = local.device
    keep = torch.ones(local.shape[0], dtype=torch.bool, device=dev)
    greedy = None
    if score.argmax:
        at = upload(score.argmax, dev)
        greedy = vocab_parallel_argmax(local[at], head.vocab_start, head.vocab_real, head.group)
        keep[at] = False
    scores = None
    if score.rows:
        n = len(score.rows)
        rows = upload(score.rows, dev)
        tokens = upload(score.token_ids, dev)
        if greedy is not None and ARGMAX in score.token_ids:
            # A scored ARGMAX row scores its own greedy token.
            where = {row: k for k, row in enumerate(score.argmax)}
            pick = [where.get(row, 0) for row in score.rows]
            tokens = torch.where(tokens == ARGMAX, greedy[0][upload(pick, dev)], tokens)
        ids = torch.tensor(score.ids, dtype=torch.int64).view(n, -1).to(dev)
        out = vocab_parallel_logprobs(
            local[rows], head.vocab_start, head.vocab_real, tokens,
            None, score.top_k, ids, head.group, backend,
        )  # fmt: skip
        scores = clamped(out)
        keep[rows] = False
    kept = local.shape[0] - len(set(score.rows) | set(score.argmax))
    return head.gather(local, keep, kept), greedy, scores


def logprob_bytes(rows: int, top_k: int, num_ids: int, size: int) -> int:
    """Bytes one ``vocab_parallel_logprobs`` call puts on the wire, summed over
    the receiving ranks: each of ``size`` ranks receives ``size - 1`` payloads
    of ``rows x (3 + num_ids + 2 top_k)`` float32 (top-k keys are int64)."""
    if size == 1:
        return 0
    return size * (size - 1) * rows * (STATS + num_ids + 2 * top_k) * 4


def gather_bytes(rows: int, vocab: int, size: int) -> int:
    """Bytes gathering the float32 logits to rank 0 moves (``VocabParallelHead
    .gather``): ``size - 1`` padded shards of ``rows x ceil(vocab / size)``."""
    if size == 1:
        return 0
    return (size - 1) * rows * -(-vocab // size) * 4


def argmax_bytes(rows: int, size: int) -> int:
    """Bytes ``vocab_parallel_argmax`` moves: a ring all-reduce of ``rows x 2``
    int64 sends ``2 (size - 1) / size`` of them from each of ``size`` ranks."""
    return 2 * (size - 1) * rows * 2 * 8
