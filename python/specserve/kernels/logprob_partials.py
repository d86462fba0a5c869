"""One vocabulary slice's share of each row's logprobs: the row-logprob
kernel's partial mode, for logits split over tensor-parallel ranks.

A rank holding ids ``[id_offset, id_offset + V)`` of each row reduces its
slice to what the full row's logprobs need from it: the max ``m`` of its
(temperature-scaled) logits, ``s = sum exp(x - m)``, and its top-k as
int64 keys (``logit_keys``: value descending, then global id ascending, in
one integer order). ``sampling/vocab_parallel.py`` merges the ranks' parts
into the row's logsumexp and top-k. The Triton path is
``kernels/logprobs.py``'s kernel in its slice phase (the one its own split
over the vocabulary uses), then a merge of its slices here; the torch
reference spells it out. NaN logits count as -inf, as in ``row_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import HAS_TRITON, LOGIT_DTYPES, use_triton
from specserve.kernels.logprobs import (
    DEFAULT_BLOCK_V,
    _pow2_at_least,
    _row_logprobs_kernel,
    _vocab_split,
    topk_lowest_id,
)

ID_MAX = 2**31 - 1
EMPTY_KEY = -(2**63)  # below every real key, even -inf's: "no candidate"
NEG_INF = float("-inf")


@dataclass
class RowPartials:
    maxes: torch.Tensor  # [N] float32: the slice's max (-inf: nothing possible in it)
    sums: torch.Tensor  # [N] float32: sum of exp(x - max) (meaningful where max is finite)
    top_keys: torch.Tensor  # [N, K] int64, descending; EMPTY_KEY past the slice's width


def logit_keys(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 ``x`` at global ``ids`` (broadcast): bigger key =
    bigger value, or the same value at a lower id. The high 32 bits are the
    float's bits remapped so that signed-int order is float order (-0.0
    folded into +0.0), the low 32 bits ``ID_MAX - id``: the Triton kernel's
    key."""
    bits = torch.where(x == 0, 0.0, x).view(torch.int32)  # -0.0 would sort below +0.0
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # flips negatives' magnitude bits
    return (hi.to(torch.int64) << 32) | (ID_MAX - ids)


def key_values(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 values, int64 global ids) of ``logit_keys``' keys (exact)."""
    hi = (key >> 32).to(torch.int32)
    return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).view(torch.float32), ID_MAX - (key & 0xFFFFFFFF)


def row_partials_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    id_offset: int = 0,
) -> RowPartials:
    """Torch reference: ``logits [N, V]`` (a slice of each row's vocabulary)."""
    n, v = logits.shape
    dev = logits.device
    x = logits.float()
    x = x.masked_fill(x.isnan(), NEG_INF)
    if temperatures is not None:
        x = x / temperatures.float().unsqueeze(1)  # divide, as the kernel does
    m = x.amax(dim=1) if v > 0 else torch.full((n,), NEG_INF, device=dev)  # [N]
    shift = torch.where(m.isfinite(), m, 0.0)  # all -inf: exp(-inf - -inf) is NaN
    s = torch.exp(x - shift.unsqueeze(1)).sum(dim=1)  # [N]
    keys = torch.full((n, top_k), EMPTY_KEY, dtype=torch.int64, device=dev)
    k = min(top_k, v)
    if k > 0:
        values, ids = topk_lowest_id(x, k)  # [N, k], ties to the lowest id
        keys[:, :k] = logit_keys(values, ids + id_offset)
    return RowPartials(m, s, keys)


def row_partials_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    id_offset: int = 0,
    block_v: int | None = None,
) -> RowPartials:
    """Triton path: the row-logprob kernel's slice phase over ``logits
    [N, V]`` (each row split further when there are few rows), its slices
    merged here; no read back."""
    if not HAS_TRITON:
        raise RuntimeError("row_partials_triton needs triton, which is not installed")
    assert logits.dim() == 2, f"logits must be [N, V], got shape {tuple(logits.shape)}"
    n, v = logits.shape
    dev = logits.device
    assert logits.dtype in LOGIT_DTYPES, f"logits dtype must be one of {LOGIT_DTYPES}"
    assert logits.stride(1) == 1, f"logits last dim must be contiguous, strides {logits.stride()}"
    assert v > 0, "logits must have a non-empty vocab dim"
    assert isinstance(top_k, int) and top_k >= 0, f"top_k must be >= 0, got {top_k}"
    assert id_offset >= 0 and id_offset + v <= ID_MAX, f"ids out of range: {id_offset} + {v}"
    if temperatures is not None:
        assert temperatures.shape == (n,), f"temperatures must be [{n}], got {temperatures.shape}"
        assert temperatures.dtype == torch.float32, (
            f"temperatures: float32, not {temperatures.dtype}"
        )
        assert temperatures.device == dev, f"temperatures on {temperatures.device}, logits on {dev}"
    block_v = block_v or DEFAULT_BLOCK_V
    assert block_v & (block_v - 1) == 0, f"block_v must be a power of 2: {block_v}"
    k = min(top_k, v)
    if n == 0:
        return row_partials_ref(logits, temperatures, top_k, id_offset)
    parts, split = _vocab_split(n, v, block_v)
    k_pad = _pow2_at_least(k)
    part_m = torch.empty(n * parts, dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    part_key = torch.full((n * parts * k_pad,), EMPTY_KEY, dtype=torch.int64, device=dev)
    # The slice phase reads no token ids, requested ids or outputs: any
    # pointer will do for them.
    temps = temperatures if temperatures is not None else part_m
    ids = part_key  # (unread)
    rows = (
        logits, logits.stride(0), ids, 1, ids, 1, temps, temps.stride(0),
        ids, 1, 1, part_m, part_m, ids, part_m,
    )  # fmt: skip
    flags = dict(
        HAS_ROW_IDS=False, HAS_TEMP=temperatures is not None, HAS_TOP=k > 0,
        K_PAD=k_pad, M_PAD=1,
    )  # fmt: skip
    scalars = (part_m, part_s, part_key, v, 0, k, split, parts)
    _row_logprobs_kernel[(n, parts)](*rows, *scalars, **flags, BLOCK_V=block_v, PHASE=1)
    m_p, s_p = part_m.view(n, parts), part_s.view(n, parts)
    m = m_p.amax(dim=1)  # [N]
    shift = torch.where(m == NEG_INF, 0.0, m)
    s = (s_p * torch.exp(m_p - shift.unsqueeze(1))).sum(dim=1)  # [N]
    keys = torch.full((n, top_k), EMPTY_KEY, dtype=torch.int64, device=dev)
    if k > 0:
        # Keys are unique (ids are): the slices' best k are the row's.
        best = part_key.view(n, parts * k_pad).topk(k, dim=1).values  # [N, k]
        keys[:, :k] = torch.where(best == EMPTY_KEY, best, best - id_offset)  # global ids
    return RowPartials(m, s, keys)


def row_partials(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: int = 0,
    id_offset: int = 0,
    backend: str = "auto",
) -> RowPartials:
    """Dispatch: "auto" uses Triton on CUDA tensors, the torch reference elsewhere."""
    if logits.shape[1] > 0 and use_triton(backend, logits, "row_partials"):
        return row_partials_triton(logits, temperatures, top_k, id_offset)
    return row_partials_ref(logits, temperatures, top_k, id_offset)
