"""Prompt lookup: propose what followed the latest earlier occurrence of the
request's last few tokens. No network, deterministic drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.core import Req
from specserve.speculative.base import DraftProposal, Proposer


@dataclass
class NgramIndex:
    """A request's history indexed as it grows: per n-gram size, each n-gram
    to where what followed its latest occurrence starts (a history is only
    ever appended to: committed tokens stay)."""

    sizes: range
    upto: int = 0  # the n-grams ending before this position are in
    at: dict[int, dict[tuple[int, ...], int]] = field(init=False)

    def __post_init__(self) -> None:
        self.at = {size: {} for size in self.sizes}

    def extend(self, req: Req, end: int) -> None:
        """Takes in ``req``'s n-grams ending before ``end``."""
        if end <= self.upto:
            return
        lo = max(self.upto + 1 - self.sizes[-1], 0)
        window = req.tokens_from(lo, end)  # positions lo .. end - 1
        for e in range(self.upto, end):
            for size in self.sizes:
                if e + 1 >= size:
                    self.at[size][tuple(window[e + 1 - size - lo : e + 1 - lo])] = e + 1
        self.upto = end


class NgramProposer(Proposer):
    def __init__(self, max_drafts: int, max_match: int, min_match: int) -> None:
        self.max_drafts = max_drafts
        self.max_match = max_match
        self.min_match = min_match
        # By request: its history's index (scanning a 128-token history for
        # a match that is not there took 40 us, per request and step).
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        tokens = [self._lookup(r, n) for r, n in zip(reqs, max_lens)]
        return DraftProposal(tokens, [None] * len(reqs))

    def _lookup(self, req: Req, limit: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix
        of ``req``'s history (``max_match`` tokens down to ``min_match``)
        that occurred before, ``limit`` tokens at most."""
        if limit <= 0:
            return []
        index = self._indexes.get(req.rid)
        if index is None:
            sizes = range(self.min_match, self.max_match + 1)
            index = self._indexes[req.rid] = NgramIndex(sizes)
        n = req.seq_len
        # Every n-gram but those ending at the last token: not the suffix itself.
        index.extend(req, n - 1)
        for size in range(min(self.max_match, n - 1), self.min_match - 1, -1):
            start = index.at[size].get(tuple(req.tokens_from(n - size, n)))
            if start is not None:
                return req.tokens_from(start, min(start + limit, n))
        return []

    def release(self, req: Req) -> None:
        self._indexes.pop(req.rid, None)  # (no draft_state: a drafter beside it keeps its own)
