"""A test-double proposer shared by the speculative tests."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.core import Req
from specserve.speculative.base import DraftProposal, Proposer


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, corrupted at a chosen
    draft index each round, so that the accept length of round k is known."""

    def __init__(
        self, continuations: dict[str, list[int]], schedule: list[int], max_drafts: int
    ) -> None:
        self.continuations = continuations
        self.schedule = schedule
        self.max_drafts = max_drafts
        self.planned: dict[str, list[int]] = {}
        self.observed: dict[str, list[int]] = {}
        self.last_len: dict[str, int] = {}

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        out = []
        for r, limit in zip(reqs, max_lens):
            plan = self.planned.setdefault(r.rid, [])
            if r.rid in self.last_len:  # what the last round committed tells its accept length
                self.observed.setdefault(r.rid, []).append(
                    len(r.output_ids) - self.last_len[r.rid] - 1
                )
            self.last_len[r.rid] = len(r.output_ids)
            known = self.continuations.get(r.rid, [])
            truth = known[len(r.output_ids) : len(r.output_ids) + limit]
            cut = self.schedule[len(plan) % len(self.schedule)]
            drafts = list(truth)
            if cut < len(drafts):
                drafts[cut] = (drafts[cut] + 1) % 500
            plan.append(min(cut, len(drafts)))
            out.append(drafts)
        return DraftProposal(out, [None] * len(reqs))
