"""Prompt lookup: propose what followed the latest earlier occurrence of the
request's last few tokens. No network, deterministic drafts."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.core import Req
from specserve.speculative.base import DraftProposal, Proposer


class NgramProposer(Proposer):
    def __init__(self, max_drafts: int, max_match: int, min_match: int) -> None:
        self.max_drafts = max_drafts
        self.max_match = max_match
        self.min_match = min_match

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        tokens = [self._lookup(r.prompt_ids + r.output_ids, n) for r, n in zip(reqs, max_lens)]
        return DraftProposal(tokens, [None] * len(reqs))

    def _lookup(self, history: list[int], limit: int) -> list[int]:
        if limit <= 0:
            return []
        for size in range(min(self.max_match, len(history) - 1), self.min_match - 1, -1):
            suffix = history[-size:]
            # The latest earlier occurrence, not the suffix itself.
            for start in range(len(history) - size - 1, -1, -1):
                if history[start : start + size] == suffix:
                    follow = history[start + size : start + size + limit]
                    if follow:
                        return follow
        return []
