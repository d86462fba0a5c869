"""One speculative round, the same for every proposer.

At the end of a step, every request that decodes next gets drafts
(``propose``), kept on the request; the next step's scheduler feeds them as
ordinary tokens after the anchor, a chain ``[anchor, x_1..x_L]`` with every
row's logits returned, with KV reserved for them like any token. After that
step's forward, each chain reads its rows of the step's processed logits (the
engine processes every sampled and verified row at once: ``sampling/metadata.py``,
with penalties over the chain prefix, min-token suppression and the grammar's
chain masks), ``verify_chains`` decides what is committed, and the commit goes
through the shared output processor like any other run. Then
the rejected positions' K/V are dropped and the committed rows' captured
features go to the proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core import BatchEntry, Req, ReqStep, ScheduledBatch, SpecStats
from specserve.engine.output_processor import PendingRuns
from specserve.engine.scheduler import Scheduler
from specserve.sampling.metadata import StepRows
from specserve.speculative.base import Proposer
from specserve.speculative.verify import Chain, verify_chains


class SpecDecoder:
    def __init__(
        self,
        proposer: Proposer,
        scheduler: Scheduler,
        kernel_backend: str = "auto",
    ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.kernel_backend = kernel_backend
        self.stats = SpecStats()  # request-rounds, over the engine's life

    def propose(self, reqs: Sequence[Req]) -> None:
        """Drafts for the next step of each of ``reqs`` that decodes next (its
        anchor, the last committed token, is not in the KV yet), stored on the
        request: the scheduler schedules them after the anchor. Runs at the
        end of a step, once its commits (and the features they captured) are in."""
        todo = [
            r for r in reqs if not r.finished and r.output_ids and r.num_computed == r.seq_len - 1
        ]
        if not todo:
            return
        limits = [self.scheduler.max_drafts(r) for r in todo]
        proposal = self.proposer.propose(todo, limits)
        lengths = self.proposer.verify_lengths(proposal)
        for k, req in enumerate(todo):
            n = max(0, min(lengths[k], limits[k], len(proposal.tokens[k])))
            q = proposal.q[k]
            req.set_drafts(proposal.tokens[k][:n], None if q is None else q[:n])

    def verify(
        self,
        batch: ScheduledBatch,
        rows: StepRows,
        processed: torch.Tensor,  # [len(rows.logit_rows), V]: processed_logits of rows
        shared_generator: torch.Generator,
    ) -> PendingRuns | None:
        """Every chain's run, still on the device (its candidates: the chain's
        rows, committing ``accept + 1`` of them). Each chain reads its rows of
        ``processed``: what plain sampling would see at each position."""
        chains: list[Chain] = []
        steps: list[int] = []
        scoring: list[list[int]] = []
        for i, step in enumerate(batch.steps):
            if not step.verify or i not in rows.spans:  # (or decided on the shards)
                continue
            req, span = step.req, rows.spans[i]
            x = processed[span.start : span.stop]  # [1 + L, V]
            chains.append(Chain(x, step.drafts, step.draft_q, req.sampling, req.generator))
            steps.append(i)
            scoring.append(rows.logit_rows[span.start : span.stop])
        if not chains:
            return None
        outcome = verify_chains(chains, self.kernel_backend, shared_generator)
        return PendingRuns(steps, scoring, outcome.candidates(chains), outcome.accept_len)

    def finish(
        self,
        step: ReqStep,
        entry: BatchEntry,
        features: torch.Tensor | None,
        committed: int,
    ) -> None:
        """After one request's commit: drops its rejected K/V, counts the round
        and hands the committed positions' features on.

        ``features``: the captured features of the entry's tokens; ``committed``:
        the tokens this step committed to the request."""
        req, fed = step.req, len(entry.token_ids)
        if step.verify:
            req.spec.add(committed)
            self.stats.add(committed)
            if req.finished:
                return  # its pages and draft state go with it
            # Not finished, so nothing was cut: the anchor and the accepted
            # drafts are now KV; the last committed token is the next anchor.
            fed = committed
            self.scheduler.trim(req, entry.prefix_len + fed)
        if features is not None and not req.finished:
            self.proposer.on_target_features(req, entry.prefix_len, features[:fed])
