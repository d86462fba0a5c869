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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kernels.chain_verify import greedy_verify, rejection_verify
from specserve.sampling.params import SamplingParams
from specserve.sampling.sampler import filter_probs
from specserve.speculative.base import VerifyResult


@dataclass
class Chain:
    """One request's verify chain, its rows already processed like plain sampling."""

    logits: torch.Tensor  # [1 + L, V] processed logits of [anchor, x_1..x_L], before temperature
    drafts: list[int]  # x_1..x_L
    q: torch.Tensor | None  # [L, V] draft distributions, or None (one-hot)
    params: SamplingParams
    generator: torch.Generator


def verify_chains(chains: Sequence[Chain], backend: str = "auto") -> list[VerifyResult]:
    """All chains of a round: greedy ones in one kernel call, sampled ones in
    (at most) two, so the GPU path never loops over requests."""
    results: list[VerifyResult | None] = [None] * len(chains)
    greedy = [i for i, c in enumerate(chains) if c.params.greedy]
    if greedy:
        rows = torch.cat([chains[i].logits for i in greedy])
        out = greedy_verify(
            rows, *_layout([chains[i] for i in greedy], rows.device), backend=backend
        )
        _collect(results, greedy, chains, *out)
    for one_hot in (True, False):
        group = [
            i for i, c in enumerate(chains) if not c.params.greedy and (c.q is None) == one_hot
        ]
        if group:
            _rejection(results, group, chains, one_hot, backend)
    return results  # type: ignore[return-value]


def verify_chain(
    logits: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> VerifyResult:
    """One chain: the committed tokens (accepted drafts + one more), how many
    drafts were accepted, and the chain row (0-based) that scored each."""
    return verify_chains([Chain(logits, drafts, q, params, generator)])[0]


def _layout(
    group: Sequence[Chain], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row starts ``[B]``, padded drafts ``[B, Lmax]`` and lengths ``[B]``."""
    lengths = [len(c.drafts) for c in group]
    starts = [sum(n + 1 for n in lengths[:i]) for i in range(len(group))]
    width = max(max(lengths), 1)
    drafts = [c.drafts + [0] * (width - len(c.drafts)) for c in group]
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_long(starts), as_long(drafts), as_long(lengths)


def _rejection(
    results: list, group: list[int], chains: Sequence[Chain], one_hot: bool, backend: str
) -> None:
    members = [chains[i] for i in group]
    probs = torch.cat([target_probs(c.logits, c.params) for c in members])  # [sum(1 + L), V]
    starts, drafts, lengths = _layout(members, probs.device)
    width = drafts.shape[1]
    # Each chain draws exactly L + 1 uniforms from its own generator, whatever
    # else is in the batch: seeded requests stay reproducible.
    uniforms = torch.zeros(len(members), width + 1)
    for b, c in enumerate(members):
        u = torch.rand(len(c.drafts) + 1, generator=c.generator, device=c.generator.device).cpu()
        uniforms[b, : len(c.drafts)] = u[:-1]
        uniforms[b, width] = u[-1]
    q = q_starts = None
    if not one_hot:
        q = torch.cat([c.q.to(probs.dtype) for c in members])  # type: ignore[union-attr]
        q_starts = torch.tensor(
            [sum(len(m.drafts) for m in members[:b]) for b in range(len(members))],
            device=probs.device,
        )
    out = rejection_verify(
        probs, starts, drafts, lengths, q, q_starts, uniforms.to(probs.device), backend=backend
    )
    _collect(results, group, chains, *out)


def _collect(
    results: list,
    group: list[int],
    chains: Sequence[Chain],
    accept: torch.Tensor,
    nxt: torch.Tensor,
) -> None:
    for i, a, t in zip(group, accept.tolist(), nxt.tolist()):
        drafts = chains[i].drafts
        results[i] = VerifyResult(drafts[:a] + [t], a, list(range(a + 1)))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from: temperature, then top-k/top-p/min-p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.needs_filter:
        probs = filter_probs(probs, [params] * probs.shape[0])
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
