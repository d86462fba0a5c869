"""The speculative-v2 interface: proposers propose, one verify decides, one
output processor commits.

A proposer never touches logits, acceptance or logprobs. It returns draft
chains (and, when it sampled them, the distributions ``q`` they were drawn
from) and keeps whatever per-request state it needs in ``Req.draft_state``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.core import Req

if TYPE_CHECKING:  # the proposer interface imports no stage at run time
    from specserve.cache.block_pool import BlockPool
    from specserve.runner.model_runner import ModelRunner


@dataclass
class DraftProposal:
    """Per request (in the order asked): a draft chain and how it was drawn."""

    tokens: list[list[int]]  # x_1..x_L, ragged
    # [L, V] float32: the distribution each draft was drawn from; None means
    # deterministic drafts (greedy, n-gram), treated as one-hot.
    q: list[torch.Tensor | None]
    # c_1..c_L: the drafter's estimate that draft k is accepted given k-1 were.
    confidence: list[list[float]] | None = None


class Proposer(ABC):
    # Target layers whose outputs the proposer needs, captured per token.
    capture_layer_ids: tuple[int, ...] = ()
    # Most drafts per round (the verify chain is one longer).
    max_drafts: int = 0
    # A drafter whose context K/V the target's forwards store (every rank of
    # a tensor-parallel group): the request's draft pages for its positions
    # [0, end), allocated as needed, for each entry the scheduler builds
    # (whose tokens are the positions [start, end)): (req, start, end).
    context_pages: Callable[[Req, int, int], list[int]] | None = None

    @abstractmethod
    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        """Drafts for requests whose last token (the anchor) is not yet in the KV."""

    # Whether ``lookup`` finds drafts for anyone (else it is not asked).
    looks_up: bool = False

    def lookup(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> list[bool] | None:
        """Before deciding who drafts: which of ``reqs`` this round's
        ``propose`` drafts for without a drafter network's forward (found
        now and kept for it), so that the decision prices them at nothing.
        None: every request's round costs the same."""
        return None

    def verify_lengths(self, proposal: DraftProposal) -> list[int]:
        """How many of each chain's drafts to verify (all of them by default)."""
        return [len(t) for t in proposal.tokens]

    def on_target_features(  # noqa: B027
        self, req: Req, start: int, captured: torch.Tensor, first: int = 0, count: int | None = None
    ) -> None:
        """Captured target features of committed positions ``start..``: the
        ``count`` rows of ``captured`` ``[T, m * d]`` from row ``first`` (None:
        all the rest), kept by reference: the step's tensor is not written
        again (only proposers with ``capture_layer_ids`` receive any)."""

    def release(self, req: Req) -> None:
        """Drops the request's draft state (finished, aborted or preempted)."""
        req.draft_state = None

    def profile_round(self, n: int, prefix: int, pending: int = 2) -> Callable[[], None] | None:
        """A function that drafts one round for ``n`` made-up greedy requests,
        each after ``prefix`` cached positions with ``pending`` committed
        positions still to take into its context (a steady round's: what
        one round commits), and frees them again: what the cost model times
        at start-up. None: a round costs next to nothing here, or cannot run
        made up (the cost model then measures it online)."""
        return None

    def pending_rows(self, req: Req) -> int:
        """Committed positions ``req``'s next round takes into the drafter's
        context before drafting (a prompt, or the steps it did not draft)."""
        return 0

    @property
    def pools(self) -> list[BlockPool]:
        """The page allocators of the proposer's own caches (a drafter's KV),
        counted with the target's in the engine's free and total pages."""
        return []

    def capture_graphs(self, runner: ModelRunner) -> None:  # noqa: B027
        """Once ``runner`` has captured the target's forwards (``runner.graphs``):
        captures the proposer's own for the same batch buckets with the same
        capture, if it has any worth capturing."""
