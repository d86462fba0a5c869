"""Prompt lookup first, the drafter network where the lookup finds nothing.

Text that repeats itself (code, quoted context, a model looping) is drafted
for free by prompt lookup, and such drafts run long; a drafter network costs
a forward per round however easy the text. Each round, a request whose
history has an n-gram match takes the lookup's drafts; only the others run
the drafter (DSpark or DFlash). The drafter still receives every committed
position's features, so its context is whole whenever it drafts again.
Verification is the same for both kinds of draft (lookup drafts are
deterministic, one-hot ``q``), so the output is exactly plain decoding's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specserve.cache.block_pool import BlockPool
from specserve.core import Req
from specserve.speculative.base import DraftProposal, Proposer
from specserve.speculative.ngram import NgramProposer


class NgramFirstProposer(Proposer):
    looks_up = True

    def __init__(self, prompt_lookup: NgramProposer, drafter: Proposer) -> None:
        self.prompt_lookup = prompt_lookup
        self.drafter = drafter
        self.capture_layer_ids = drafter.capture_layer_ids
        self.max_drafts = drafter.max_drafts
        self.context_pages = drafter.context_pages
        # The lookup's drafts found before the planner's decision, for this
        # round's ``propose``: by (request, its tokens, the limit).
        self._found: dict[tuple[str, int, int], list[int]] = {}

    def lookup(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> list[bool]:
        """A request the lookup finds drafts for runs no drafter this round."""
        found = self.prompt_lookup.propose(reqs, max_lens)
        self._found = {(r.rid, r.seq_len, n): t for r, t, n in zip(reqs, found.tokens, max_lens)}
        return [bool(t) for t in found.tokens]

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        kept, self._found = self._found, {}
        keys = [(r.rid, r.seq_len, n) for r, n in zip(reqs, max_lens)]
        if all(k in kept for k in keys):  # found before the decision
            tokens = [kept[k] for k in keys]
            q: list[torch.Tensor | None] = [None] * len(reqs)
        else:
            found = self.prompt_lookup.propose(reqs, max_lens)
            tokens, q = list(found.tokens), list(found.q)
        rest = [i for i, t in enumerate(tokens) if not t]
        if not rest:
            return DraftProposal(tokens, q)
        drafted = self.drafter.propose([reqs[i] for i in rest], [max_lens[i] for i in rest])
        # Lookup drafts carry no estimate: the drafter's verify policy
        # (threshold or budget) takes them as certain.
        confidence = None if drafted.confidence is None else [[1.0] * len(t) for t in tokens]
        for j, i in enumerate(rest):
            tokens[i], q[i] = drafted.tokens[j], drafted.q[j]
            if confidence is not None:
                confidence[i] = drafted.confidence[j]
        return DraftProposal(tokens, q, confidence)

    def verify_lengths(self, proposal: DraftProposal) -> list[int]:
        return self.drafter.verify_lengths(proposal)

    def on_target_features(
        self, req: Req, start: int, captured: torch.Tensor, first: int = 0, count: int | None = None
    ) -> None:
        self.drafter.on_target_features(req, start, captured, first, count)

    def release(self, req: Req) -> None:
        self.prompt_lookup.release(req)
        self.drafter.release(req)

    def profile_round(self, n: int, prefix: int, pending: int = 2) -> Callable[[], None] | None:
        """The drafter's round: what a request the lookup finds nothing for costs."""
        return self.drafter.profile_round(n, prefix, pending)

    def pending_rows(self, req: Req) -> int:
        return self.drafter.pending_rows(req)

    @property
    def pools(self) -> list[BlockPool]:
        return self.drafter.pools

    def capture_graphs(self, runner) -> None:
        self.drafter.capture_graphs(runner)
