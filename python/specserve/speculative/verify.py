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

from specserve.host import upload
from specserve.kernels.chain_verify import greedy_accept, greedy_verify, rejection_verify
from specserve.sampling.metadata import target_probs
from specserve.sampling.params import SamplingParams
from specserve.sampling.sampler import race_noise


@dataclass
class Chain:
    """One request's verify chain, its rows already processed like plain sampling."""

    logits: torch.Tensor  # [1 + L, V] processed logits of [anchor, x_1..x_L], before temperature
    drafts: list[int]  # x_1..x_L
    q: torch.Tensor | None  # [L, V] draft distributions, or None (one-hot)
    params: SamplingParams
    generator: torch.Generator | None = None  # a seeded request's own; None: the shared one


@dataclass
class ChainOutcome:
    """What verification decided, still on the device: per chain (in order)
    the accepted drafts and the token after them."""

    accept_len: torch.Tensor  # [C] int64
    next_token: torch.Tensor  # [C] int64

    def candidates(self, chains: Sequence[Chain]) -> torch.Tensor:
        """Chain ``c``'s row ``j`` commits ``x_{j+1}`` if ``j < accept_len[c]``,
        the next token at ``j == accept_len[c]``, nothing after: the token of
        every row, flat ``[sum(1 + L)]``, for scoring before the host knows
        which rows commit."""
        device = self.accept_len.device
        lengths = [len(c.drafts) for c in chains]
        width = max(lengths, default=0) + 1
        padded = [c.drafts + [0] * (width - len(c.drafts)) for c in chains]
        drafts = upload(padded, device)
        j = torch.arange(width, device=device)
        rows = torch.where(
            j[None, :] < self.accept_len[:, None], drafts, self.next_token[:, None]
        )  # [C, Lmax + 1]
        live = [c * width + k for c, n in enumerate(lengths) for k in range(n + 1)]
        return rows.flatten()[upload(live, device)]


def verify_chains(
    chains: Sequence[Chain], backend: str = "auto", shared: torch.Generator | None = None
) -> ChainOutcome:
    """All chains of a round: greedy ones in one kernel call, sampled ones in
    (at most) two, so the GPU path never loops over requests; nothing is
    read back to the host."""
    assert chains, "no chains to verify"
    device = chains[0].logits.device
    greedy = [i for i, c in enumerate(chains) if c.params.greedy]
    greedy_out = None
    if greedy:
        members = [chains[i].logits for i in greedy]
        rows = members[0] if len(members) == 1 else torch.cat(members)  # (one: no copy)
        greedy_out = greedy_verify(
            rows, *_layout([chains[i].drafts for i in greedy], device), backend
        )
        if len(greedy) == len(chains):  # every chain, in order: nothing to place
            return ChainOutcome(greedy_out[0].to(torch.int64), greedy_out[1].to(torch.int64))
    accept = torch.zeros(len(chains), dtype=torch.int64, device=device)
    nxt = torch.zeros(len(chains), dtype=torch.int64, device=device)

    def place(group: list[int], out: tuple[torch.Tensor, torch.Tensor]) -> None:
        index = upload(group, device)
        accept[index], nxt[index] = out[0].to(torch.int64), out[1].to(torch.int64)

    if greedy_out is not None:
        place(greedy, greedy_out)
    for one_hot in (True, False):
        group = [
            i for i, c in enumerate(chains) if not c.params.greedy and (c.q is None) == one_hot
        ]
        if group:
            place(group, _rejection([chains[i] for i in group], one_hot, backend, shared))
    return ChainOutcome(accept, nxt)


def accept_lengths(targets: torch.Tensor, drafts: Sequence[list[int]]) -> torch.Tensor:
    """Greedy verification from each row's greedy token ``targets
    [sum(1 + L)]`` (found where the logits are: on the shards), chains of
    ``drafts`` back to back (a plain row is a chain of none): ``[C]`` int64
    accepted drafts. Each row's token is what it commits."""
    return greedy_accept(targets, *_layout(drafts, targets.device))[0]


def _layout(
    drafts: Sequence[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row starts ``[B]``, padded drafts ``[B, Lmax]`` and lengths ``[B]``."""
    lengths = [len(d) for d in drafts]
    starts = [sum(n + 1 for n in lengths[:i]) for i in range(len(drafts))]
    width = max(max(lengths), 1)
    padded = [d + [0] * (width - len(d)) for d in drafts]
    return upload(starts, device), upload(padded, device), upload(lengths, device)


def _rejection(
    members: list[Chain], one_hot: bool, backend: str, shared: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.cat([c.logits for c in members])  # [sum(1 + L), V]
    probs = target_probs(rows, [c.params for c in members for _ in range(1 + len(c.drafts))])
    device = probs.device
    starts, drafts, lengths = _layout([c.drafts for c in members], device)
    # The accept tests (``uniforms [C, Lmax]``) and the final draw's race
    # (``noise [C, V]``). Unseeded chains draw theirs from the shared
    # generator in one call each. A seeded chain draws exactly L uniforms and
    # then V exponentials from its own, whatever else is in the batch, so
    # seeded requests stay reproducible. All on the device.
    uniforms = torch.rand(len(members), drafts.shape[1], generator=shared, device=device)
    for b, c in enumerate(members):
        if c.generator is not None:
            u = torch.rand(len(c.drafts), generator=c.generator, device=c.generator.device)
            uniforms[b, : len(c.drafts)] = u.to(device)
    noise = race_noise([c.generator for c in members], probs.shape[1], shared, device)
    q = q_starts = None
    if not one_hot:
        q = torch.cat([c.q.to(probs.dtype) for c in members])  # type: ignore[union-attr]
        q_starts = upload(
            [sum(len(m.drafts) for m in members[:b]) for b in range(len(members))], device
        )
    return rejection_verify(
        probs, starts, drafts, lengths, q, q_starts, uniforms, noise, backend=backend
    )
