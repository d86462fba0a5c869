"""One speculative round, the same for every proposer.

Before the forward, decoding requests get a draft chain: in the batch that
runs, their entry is ``[anchor, x_1..x_L]`` with every row's logits returned
(VERIFY).
After it, each chain reads its rows of the step's processed logits (the
engine processes every sampled and verified row at once: ``sampling/metadata.py``,
with penalties over the chain prefix, min-token suppression and the grammar's
chain masks), ``verify_chains`` decides what is committed, and the commit goes
through the shared output processor like any other run. Then
the rejected positions' K/V are dropped and the committed rows' captured
features go to the proposer.
"""

from __future__ import annotations

import dataclasses

import torch

from specserve.core import BatchEntry, ReqStep, ScheduledBatch, SpecStats
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

    def prepare(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch to run: every decoding entry becomes a verify chain
        (possibly of no drafts). ``batch`` itself is left as it is, so a failed
        step can be rerun from it."""
        chosen = [i for i, step in enumerate(batch.steps) if step.decoding]
        entries, steps = list(batch.entries), list(batch.steps)
        if chosen:
            reqs = [batch.steps[i].req for i in chosen]
            limits = [self.scheduler.max_drafts(r) for r in reqs]
            proposal = self.proposer.propose(reqs, limits)
            lengths = self.proposer.verify_lengths(proposal)
            for k, i in enumerate(chosen):
                n = max(0, min(lengths[k], limits[k], len(proposal.tokens[k])))
                drafts = proposal.tokens[k][:n]
                q = proposal.q[k]
                steps[i] = dataclasses.replace(
                    steps[i], verify=True, drafts=drafts, draft_q=None if q is None else q[:n]
                )
                entry = entries[i]
                entries[i] = dataclasses.replace(
                    entry, token_ids=entry.token_ids + drafts, logit_rows=list(range(1 + n))
                )
        return ScheduledBatch(entries, steps, self.proposer.capture_layer_ids)

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
            if not step.verify:
                continue
            req, span = step.req, rows.spans[i]
            x = processed[span.start : span.stop]  # [1 + L, V]
            chains.append(
                Chain(x, step.drafts, step.draft_q, req.sampling, req.generator or shared_generator)
            )
            steps.append(i)
            scoring.append(rows.logit_rows[span.start : span.stop])
        if not chains:
            return None
        outcome = verify_chains(chains, self.kernel_backend)
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
