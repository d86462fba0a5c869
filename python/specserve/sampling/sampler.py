"""Draws one token per row: greedy, or temperature / top-k / top-p / min-p sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.grammar.bitmask import apply_bitmask
from specserve.sampling.penalties import RowControls, process_logits


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64, on the logits' device (read with the step's fetch)
    # Logits after bias, penalties and min-token suppression, before temperature:
    # what ``--logprobs-mode processed`` scores (the kernel applies temperature).
    processed_logits: torch.Tensor  # [N, V] float32


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Unseeded requests share this stream; seeded ones carry their own.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32
        rows: Sequence[RowControls],
        generators: Sequence[torch.Generator | None],
        grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SampleOutput:
        """``grammar_mask``: a bitmask ``[n, words]`` and the ``n`` rows it constrains."""
        needs_processing = grammar_mask is not None or any(
            r.params.logit_bias
            or r.penalty is not None
            or r.num_output_tokens < r.params.min_new_tokens
            for r in rows
        )
        x = process_logits(logits.clone(), rows) if needs_processing else logits
        if grammar_mask is not None:
            apply_bitmask(x, *grammar_mask)
        tokens = x.argmax(dim=-1)  # [N]; greedy rows keep this
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            tokens[sampled] = self._draw(
                x[sampled], [rows[i] for i in sampled], [generators[i] for i in sampled]
            )
        return SampleOutput(token_ids=tokens, processed_logits=x)

    def _draw(
        self,
        x: torch.Tensor,  # [S, V]
        rows: list[RowControls],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=x.device)
        probs = torch.softmax(x / temps[:, None], dim=-1)  # [S, V]
        filtered = [i for i, r in enumerate(rows) if r.params.needs_filter]
        if filtered:
            probs[filtered] = filter_probs(probs[filtered], [rows[i].params for i in filtered])
        return exponential_race(probs, generators, self.generator)


def exponential_race(
    probs: torch.Tensor,  # [S, V], rows need not be normalised
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One draw per row: ``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from
    ``p``. Rows with a generator (seeded requests) draw E from it, so
    batch-mates never shift them; the others share ``shared``, in one call."""
    noise = torch.empty_like(probs)
    common = [i for i, g in enumerate(generators) if g is None]
    if common:
        noise[common] = torch.empty(
            len(common), probs.shape[1], dtype=probs.dtype, device=probs.device
        ).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)  # [S]


def filter_probs(probs: torch.Tensor, params: list) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude in ``probs [S, V]`` (not renormalised)."""
    vocab = probs.shape[1]
    # top_k past the vocabulary keeps everything (and would overflow int64).
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_k = torch.tensor(ks, device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
    drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.empty_like(probs).scatter_(1, order, sorted_p)
