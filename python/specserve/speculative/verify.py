"""The one acceptance rule every proposer goes through.

Greedy requests accept a draft while it equals the target's argmax and then
take the argmax. Sampled requests use rejection sampling: draft ``x_j`` drawn
from ``q_j`` is accepted with probability ``min(1, P_{j-1}(x_j) / q_j(x_j))``;
the first rejection draws from ``norm(max(0, P - q))`` (``P`` if that is all
zero); when every draft is accepted the bonus token is drawn from ``P_L``.
``P`` is exactly what plain decoding would sample from (penalties, bias,
grammar mask, temperature, top-k/top-p/min-p), so output is lossless.
Deterministic drafts have one-hot ``q``.
"""

from __future__ import annotations

import torch

from specserve.sampling.params import SamplingParams
from specserve.sampling.sampler import filter_probs
from specserve.speculative.base import VerifyResult


def verify_chain(
    logits: torch.Tensor,  # [1 + L, V] processed logits of [anchor, x_1..x_L], before temperature
    drafts: list[int],  # x_1..x_L
    q: torch.Tensor | None,  # [L, V] draft distributions, or None (one-hot)
    params: SamplingParams,
    generator: torch.Generator,
) -> VerifyResult:
    """The committed tokens (accepted drafts + one more), how many drafts were
    accepted, and the chain row (0-based) that scored each committed token."""
    tokens, accepted = _accept(logits, drafts, q, params, generator)
    return VerifyResult(tokens, accepted, list(range(accepted + 1)))


def _accept(
    logits: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    num = len(drafts)
    assert logits.shape[0] == num + 1, "one verify row per draft plus the anchor's"
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()  # [1 + L]
        accepted = 0
        while accepted < num and drafts[accepted] == best[accepted]:
            accepted += 1
        return drafts[:accepted] + [best[accepted]], accepted
    probs = target_probs(logits, params)  # [1 + L, V]
    for j, token in enumerate(drafts):
        p = float(probs[j, token])
        qx = 1.0 if q is None else float(q[j, token])
        u = float(torch.rand((), generator=generator, device=probs.device))
        if qx > 0 and u * qx < p:
            continue  # accepted: u < p / q
        if q is None:
            residual = probs[j].clone()
            residual[token] = 0.0
        else:
            residual = (probs[j] - q[j].to(probs.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = probs[j]
        return drafts[:j] + [_draw(residual, generator)], j
    return drafts + [_draw(probs[num], generator)], num


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from: temperature, then top-k/top-p/min-p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.needs_filter:
        probs = filter_probs(probs, [params] * probs.shape[0])
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))
