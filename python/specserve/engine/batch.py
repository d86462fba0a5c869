"""The one typed structure the scheduler hands to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.engine.request import Req


@dataclass
class BatchEntry:
    """What the runner needs of one request: plain data, no engine objects."""

    token_ids: list[int]  # tokens fed this step
    prefix_len: int  # tokens of the request already in the KV cache
    page_table: list[int]  # pages covering prefix_len + len(token_ids)
    logit_rows: list[int]  # indices into token_ids whose logits are returned


@dataclass
class ReqStep:
    """What the engine makes of one entry's logit rows after the forward.

    The rows of an entry are, in order: ``num_input_logprob_rows`` rows scoring
    prompt tokens ``input_logprob_start ..`` (row for position p scores the
    token at p + 1), then the sampling row when ``sample`` is set.
    """

    req: Req
    input_logprob_start: int = 0
    num_input_logprob_rows: int = 0
    sample: bool = False
    # Speculation: the entry is the chain [anchor, *drafts]; every row is a verify row.
    drafts: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None  # [len(drafts), V], None: one-hot drafts
    verify: bool = False
    # Feeds only the last generated token: the anchor of a speculative round.
    decoding: bool = False


@dataclass
class ScheduledBatch:
    """One forward's requests. Prefill chunks, decode tokens and verify chains
    ``[anchor, d_1..d_L]`` mix freely: each entry says what it feeds and which
    rows' logits come back, and the runner treats them all alike."""

    entries: list[BatchEntry]
    steps: list[ReqStep]  # parallel to entries; the runner never reads it
    capture_layer_ids: tuple[int, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)

    def halves(self) -> tuple[ScheduledBatch, ScheduledBatch]:
        """The first and second half of the requests, each a batch of its own
        (fault isolation reruns a failed step this way)."""
        mid = len(self.steps) // 2
        return self._subset(slice(0, mid)), self._subset(slice(mid, None))

    def _subset(self, part: slice) -> ScheduledBatch:
        # Only a scheduled batch is split, never the one speculation made of it,
        # so no step verifies yet.
        return ScheduledBatch(self.entries[part], self.steps[part], self.capture_layer_ids)
