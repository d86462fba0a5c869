"""What the sampler sees: one metadata for every row a step draws or verifies a
token from, and the two functions every consumer of it shares.

A step's sampled rows (one per plain decoding request) and its verify rows
(``1 + L`` per chain, row ``j`` following the anchor and ``drafts[:j]``) are
described together by one ``SamplingMetadata``. ``processed_logits`` applies
the logit bias, the penalties, the min-new-tokens suppression and the grammar
masks to all of them at once; ``target_probs`` turns processed rows into the
distribution plain sampling draws from (temperature, top-k / top-p / min-p).
The sampler, greedy and rejection verification, and ``--logprobs-mode
processed`` all read these two, so speculation stays lossless by construction.

A processed row whose largest entry is not finite is no distribution: a NaN
or +inf logit (the model's forward broke down there), or nothing left
possible (every entry -inf). ``row_peaks`` finds such rows on the device for
the step's one read back, and the engine fails their requests
(``StepRows.unusable``) instead of committing whatever the sampler drew.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.core import ReqStep
from specserve.grammar.bitmask import allocate_bitmask, apply_bitmask, fill_chain_masks
from specserve.sampling.params import SamplingParams
from specserve.sampling.penalties import RowControls, process_logits


@dataclass
class SamplingMetadata:
    """``N`` logits rows of one step, each with the request state behind it."""

    controls: list[RowControls]  # [N]
    generators: list[torch.Generator | None]  # [N]: a seeded request's own, else None
    # Grammar: a bitmask ``[n, words]`` and the ``n`` rows it constrains.
    grammar: tuple[torch.Tensor, list[int]] | None = None

    @property
    def params(self) -> list[SamplingParams]:
        return [c.params for c in self.controls]

    def select(self, rows: Sequence[int]) -> SamplingMetadata:
        """The metadata of ``rows`` (after processing: no grammar left to apply)."""
        return SamplingMetadata(
            [self.controls[i] for i in rows], [self.generators[i] for i in rows]
        )


@dataclass
class StepRows:
    """Where a step's sampled and verified rows sit: ``logit_rows`` index the
    forward's logits (row ``k`` of the metadata is ``logit_rows[k]``);
    ``spans`` give each sampling or verifying step its metadata rows."""

    logit_rows: list[int]
    spans: dict[int, range]  # batch step -> its rows in the metadata
    metadata: SamplingMetadata

    def unusable(self, step: int, used: int, peaks: Sequence[float]) -> Exception | None:
        """Why a token of ``step`` came from no distribution, or None: the
        first of its first ``used`` rows (those its committed tokens were drawn
        or verified from) whose peak (``row_peaks``, fetched) is not finite.
        A row that only the request's own constraints emptied (its grammar,
        its stop ids held back by min_new_tokens) is its own doing; anything
        else (NaN, inf, a row the model made all -inf) is the model's."""
        for k in self.spans[step][:used]:
            peak = peaks[k]
            if math.isnan(peak) or peak == math.inf:
                return UnusableLogits(
                    "the model's logits at this position are not finite (NaN or inf)"
                )
            if peak == -math.inf:
                grammar = self.metadata.grammar
                if self.metadata.controls[k].holds_stops or (grammar and k in grammar[1]):
                    return NoTokenPossible(
                        "no token is possible at this position: the request's grammar, or "
                        "its stop ids held back by min_new_tokens, exclude every token"
                    )
                return UnusableLogits("the model's logits at this position are all -inf")
        return None


class UnusableLogits(RuntimeError):
    """The model gave a request's row no distribution (an internal error: 500)."""


class NoTokenPossible(ValueError):
    """The request's own constraints leave its row no token (its input: 400)."""


def argmax_decides(step: ReqStep) -> bool:
    """Whether every token the step draws or verifies is the argmax of the
    model's own logits: a greedy request that no grammar, bias, penalty or
    held stop id changes (its first row is its most constrained one), so
    ``processed_logits`` leaves its rows as they are."""
    req = step.req
    if not (step.sample or step.verify) or not req.sampling.greedy or req.grammar is not None:
        return False
    first = RowControls(req.sampling, req.penalty, len(req.output_ids), req.held_stop_ids, ())
    return not first.active


def step_rows(
    steps: Sequence[ReqStep],
    row_offsets: Sequence[int],
    vocab_size: int,
    which: Callable[[int], bool] | None = None,
) -> StepRows:
    """Every row of the step a token is drawn from (the sampling row of a
    plain step) or verified against (each row of a chain), in batch order;
    with ``which``, only those of the steps (by index) it picks."""
    logit_rows: list[int] = []
    spans: dict[int, range] = {}
    controls: list[RowControls] = []
    generators: list[torch.Generator | None] = []
    chains: list[tuple[int, ReqStep]] = []  # (first metadata row, step) of grammar requests
    for i, step in enumerate(steps):
        req = step.req
        if which is not None and not which(i):
            continue
        if step.verify:
            first, n = row_offsets[i], 1 + len(step.drafts)
        elif step.sample:
            first, n = row_offsets[i + 1] - 1, 1
        else:
            continue
        start = len(logit_rows)
        spans[i] = range(start, start + n)
        logit_rows.extend(range(first, first + n))
        done = len(req.output_ids)
        for j in range(n):
            drafts = tuple(step.drafts[:j])
            controls.append(
                RowControls(req.sampling, req.penalty, done + j, req.held_stop_ids, drafts)
            )
        generators.extend([req.generator] * n)
        if req.grammar is not None:
            chains.append((start, step))
    grammar = None
    if chains:
        bitmask = allocate_bitmask(len(logit_rows), vocab_size)
        constrained: list[int] = []
        for start, step in chains:
            # A plain row is a chain of no drafts: the mask after the committed state.
            fill_chain_masks(step.req.grammar, step.drafts, bitmask, start)  # type: ignore[arg-type]
            constrained.extend(range(start, start + 1 + len(step.drafts)))
        grammar = (bitmask[constrained], constrained)
    return StepRows(logit_rows, spans, SamplingMetadata(controls, generators, grammar))


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``logits [N, V]`` as the sampler sees them, before temperature: bias,
    penalties (a verify row counts the drafts before it), min-token
    suppression, grammar masks. ``logits`` itself when none applies, else a copy."""
    if meta.grammar is None and not any(c.active for c in meta.controls):
        return logits
    x = process_logits(logits.clone(), meta.controls)
    if meta.grammar is not None:
        apply_bitmask(x, *meta.grammar)
    return x


def row_peaks(processed: torch.Tensor) -> torch.Tensor:
    """The largest entry of each processed row ``[N]`` (NaN where the row holds
    one): finite exactly when the row is a distribution. One reduction on the
    device; the host reads it with the step's tokens."""
    return processed.amax(dim=-1)


def target_probs(processed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution plain sampling draws from ``[N, V]`` (normalised), for
    processed rows with the sampling parameters of each: softmax at the row's
    temperature (1 for greedy rows), then top-k, top-p and min-p."""
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], device=processed.device
    )
    # NaN counts as -inf (an impossible token), as for greedy and logprobs.
    x = processed.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    probs = torch.softmax(x / temps[:, None], dim=-1)
    filtered = [i for i, p in enumerate(params) if p.needs_filter]
    if filtered:
        kept = filter_probs(probs[filtered], [params[i] for i in filtered])
        probs[filtered] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
