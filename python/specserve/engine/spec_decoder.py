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

import time
from collections.abc import Sequence

import torch

from specserve.core import BatchEntry, Req, ReqStep, ScheduledBatch, SpecStats
from specserve.engine.output_processor import PendingRuns
from specserve.engine.scheduler import Scheduler
from specserve.sampling.metadata import StepRows
from specserve.speculative.base import Proposer
from specserve.speculative.planner import SpecPlanner
from specserve.speculative.step_costs import STEADY_ROWS
from specserve.speculative.verify import Chain, verify_chains


class SpecDecoder:
    def __init__(
        self,
        proposer: Proposer,
        scheduler: Scheduler,
        kernel_backend: str = "auto",
        planner: SpecPlanner | None = None,
    ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.kernel_backend = kernel_backend
        # The cost model choosing verify lengths; None: the proposer's own.
        self.planner = planner
        self.stats = SpecStats()  # request-rounds, over the engine's life
        # Of drafts still to verify, by request: their confidences (None: no
        # head), the tokens the planner expects of their round and the drafts
        # before its cut (``SpecPlanner.observe_round``).
        self._rounds: dict[str, tuple[list[float] | None, float, int]] = {}
        self._draft_seconds = 0.0  # drafting for the coming step
        self._drafted = False  # whether the drafter ran for the coming step
        self._generated = 0  # tokens the step in progress committed to decoding requests

    def propose(self, reqs: Sequence[Req]) -> None:
        """Drafts for the next step of each of ``reqs`` that decodes next (its
        anchor, the last committed token, is not in the KV yet), stored on the
        request: the scheduler schedules them after the anchor. Runs at the
        end of a step, once its commits (and the features they captured) are in.

        The planner first decides who drafts at all: a request it gives no
        drafts takes a plain step next, and when nobody drafts, the drafter
        does not run. A seeded sampled request is pinned to its own lengths
        (the proposer's, as with ``--speculative-adaptive off``): how many
        drafts a round verifies changes which random numbers pick its
        tokens, so the load must not decide it."""
        start = time.perf_counter()
        self._drafted = False
        try:
            self._propose(reqs)
        finally:
            # All of it (decisions included) is the next step's cost, as
            # plain steps pay their decisions.
            self._draft_seconds = time.perf_counter() - start

    def _propose(self, reqs: Sequence[Req]) -> None:
        todo = [
            r for r in reqs if not r.finished and r.output_ids and r.num_computed == r.seq_len - 1
        ]
        if not todo:
            return
        planner = self.planner
        requests, prefill = self.scheduler.next_load()
        pinned = [r.sampling.seed is not None and not r.sampling.greedy for r in todo]
        # The safety net's plain step: nothing else to decide.
        unpinned = planner is not None and not any(pinned)
        if unpinned and planner.forced_plain(requests):
            self._stay_plain(todo)
            return
        # Whom the proposer drafts for without its network (None: nobody).
        found = None
        if planner is not None and self.proposer.looks_up:
            found = self.proposer.lookup(todo, [self.scheduler.max_drafts(r) for r in todo])
        # The costs' plain choice held, where no draft is found for free.
        if unpinned and not any(found or ()) and planner.holds_plain(requests, prefill):
            self._stay_plain(todo)
            return
        limits = [self.scheduler.max_drafts(r) for r in todo]
        pending = [self.proposer.pending_rows(r) for r in todo]
        chosen = limits
        if planner is not None:
            free = [k for k, p in enumerate(pinned) if not p]
            extra = prefill + sum(limits[k] + 1 for k, p in enumerate(pinned) if p)
            picks = planner.before_draft(
                [todo[k].accept_rates for k in free],
                [limits[k] for k in free],
                requests,
                extra,
                drafting=len(todo) - len(free),
                pending=[pending[k] for k in free],
                remaining=[todo[k].sampling.max_new_tokens - len(todo[k].output_ids) for k in free],
                free=None if found is None else [found[k] for k in free],
                chunk=prefill > 0,
            )
            chosen = list(limits)
            for k, n in zip(free, picks):
                chosen[k] = n
                if n == 0:
                    todo[k].accept_rates = planner.drift(todo[k].accept_rates)
        picked = [k for k, n in enumerate(chosen) if n > 0]
        if not picked:
            return
        drafting = [todo[k] for k in picked]
        self._drafted = True
        start = time.perf_counter()
        proposal = self.proposer.propose(drafting, [limits[k] for k in picked])
        lengths = self.proposer.verify_lengths(proposal)  # a user's threshold
        conf = proposal.confidence
        # This round's own estimates, the draft paid (None: no confidence head).
        cal = None if planner is None or conf is None else [planner.calibrated(c) for c in conf]
        if planner is not None:
            if cal is not None:
                survival = [  # a pinned chain is sure to be verified
                    [1.0] * len(s) if pinned[k] else s for s, k in zip(cal, picked)
                ]
                refined = planner.after_draft(survival, requests, len(todo) + prefill, prefill > 0)
            else:
                refined = [chosen[k] for k in picked]
            lengths = [a if pinned[k] else min(a, b) for a, b, k in zip(lengths, refined, picked)]
        for j, req in enumerate(drafting):
            n = max(0, min(lengths[j], limits[picked[j]], len(proposal.tokens[j])))
            q = proposal.q[j]
            req.set_drafts(proposal.tokens[j][:n], None if q is None else q[:n])
            if planner is None:
                continue
            # The drafts the planner's cut chose from (only a refinement by
            # confidences cuts; a pinned chain's are the proposer's own).
            cut = cal is not None and not pinned[picked[j]]
            drafted = min(limits[picked[j]], len(proposal.tokens[j])) if cut else n
            if n:
                c, s = (None, None) if conf is None or cal is None else (conf[j][:n], cal[j])
                predicted = planner.predicted_tokens(req.accept_rates, s, n)
                self._rounds[req.rid] = (c, predicted, drafted)
            elif drafted:  # cut to none: a plain step
                req.accept_rates = planner.observe_cut(req.accept_rates)
        # The drafter's round: the requests it ran for (a catch-up priced per
        # row, with a profile); a round the lookup drafted alone is nearly free.
        ran = [k for k in picked if found is None or not found[k]]
        if planner is not None and ran:
            rows = sum(max(pending[k] - STEADY_ROWS, 0) for k in ran)
            planner.observe_draft(len(ran), time.perf_counter() - start, rows)

    def _stay_plain(self, todo: Sequence[Req]) -> None:
        """A plain step decided without the costs: every request's estimates
        drift toward the engine's."""
        assert self.planner is not None
        for req in todo:
            req.accept_rates = self.planner.drift(req.accept_rates)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """The step just run, measured: the planner's tables learn from it."""
        generated, self._generated = self._generated, 0
        if self.planner is None:
            return
        tokens = decoding = drafts = decode_tokens = 0
        for step, entry in zip(batch.steps, batch.entries):  # one pass: every step
            fed = len(entry.token_ids)
            tokens += fed
            if step.decoding:
                decoding += 1
                decode_tokens += fed
            if step.verify:
                drafts += len(step.drafts)
        self.planner.observe_step(
            requests=len(batch.steps),
            tokens=tokens,
            decoding=decoding,
            drafts=drafts,
            generated=generated,
            seconds=seconds,
            draft_seconds=self._draft_seconds,
            drafted=self._drafted,
            decode_tokens=decode_tokens,
        )

    def release(self, req: Req) -> None:
        """The request's speculative state goes (finished, aborted, preempted)."""
        self._rounds.pop(req.rid, None)
        self.proposer.release(req)

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
        captured: torch.Tensor | None,
        first: int,
        committed: int,
    ) -> None:
        """After one request's commit: drops its rejected K/V, counts the round
        and hands the committed positions' features on.

        ``captured``: the step's captured features, the entry's tokens' from
        row ``first``; ``committed``: the tokens this step committed to the
        request."""
        req, fed = step.req, len(entry.token_ids)
        if step.decoding:  # (a prefill chunk's first token is the arrivals' work)
            self._generated += committed
        if step.verify:
            req.spec.add(committed)
            self.stats.add(committed, len(step.drafts))
            conf, predicted, drafted = self._rounds.pop(req.rid, (None, None, None))
            if req.finished:
                return  # its pages and draft state go with it
            if self.planner is not None:
                req.accept_rates = self.planner.observe_round(
                    req.accept_rates, len(step.drafts), committed - 1, conf, predicted, drafted
                )
            # Not finished, so nothing was cut: the anchor and the accepted
            # drafts are now KV; the last committed token is the next anchor.
            fed = committed
            self.scheduler.trim(req, entry.prefix_len + fed)
        if captured is not None and not req.finished:
            self.proposer.on_target_features(req, entry.prefix_len, captured, first, fed)
