"""Draws one token per row: greedy, or from the target distribution (temperature,
top-k / top-p / min-p) by an exponential race."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.kernels.chain_verify import greedy_argmax, race_pick
from specserve.sampling.metadata import SamplingMetadata, target_probs


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Unseeded requests share this stream; seeded ones carry their own.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row of ``processed [N, V]`` (``processed_logits`` of
        ``meta``'s rows): the argmax for greedy rows, a draw from
        ``target_probs`` for the others. ``[N]`` int64, on the device."""
        tokens = greedy_argmax(processed)  # [N]; greedy rows keep this
        sampled = [i for i, p in enumerate(meta.params) if not p.greedy]
        if sampled:
            part = meta.select(sampled)
            probs = target_probs(processed[sampled], part.params)
            tokens[sampled] = exponential_race(probs, part.generators, self.generator)
        return tokens


def exponential_race(
    probs: torch.Tensor,  # [S, V], rows need not be normalised
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One draw per row: ``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from
    ``p``. Unlike an inverse-CDF draw, whose token moves whenever rounding
    moves any of the V boundaries below it, this one changes only at a
    near-tie of two scores: the same seed draws the same token on every CPU
    and tensor-parallel layout."""
    noise = race_noise(generators, probs.shape[1], shared, probs.device)  # [S, V]
    return race_pick(probs, noise)  # [S]


def race_noise(
    generators: Sequence[torch.Generator | None],
    vocab: int,
    shared: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``E ~ Exp(1)``, ``[len(generators), vocab]`` float32: rows with a
    generator (seeded requests) draw theirs from it, so batch-mates never
    shift them; the others share ``shared``, in one call."""
    noise = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
    common = [i for i, g in enumerate(generators) if g is None]
    if common:
        noise[common] = torch.empty(
            len(common), vocab, dtype=torch.float32, device=device
        ).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise
