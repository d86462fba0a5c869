"""One engine step: schedule -> forward -> sample -> commit -> outputs.

Synchronous and not thread-safe: ``engine.py`` drives it (from the calling
thread or a background one, one at a time) only through ``add``, ``abort``
and ``step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.cache.block_pool import BlockPool
from specserve.config import EngineConfig
from specserve.core import FinishReason, Req, ReqStatus, ReqStep, ScheduledBatch, SpecStats
from specserve.distributed import DistributedError
from specserve.engine.output_processor import (
    OutputProcessor,
    PendingRuns,
    RunCommit,
    StepScores,
)
from specserve.engine.scheduler import Scheduler
from specserve.engine.spec_decoder import SpecDecoder
from specserve.host import HostStaging
from specserve.runner.model_runner import ForwardOutput, ModelRunner
from specserve.sampling.logprobs import TokenLogprob
from specserve.sampling.metadata import (
    StepRows,
    argmax_decides,
    processed_logits,
    row_peaks,
    step_rows,
)
from specserve.sampling.penalties import PenaltyState, apply_logit_bias
from specserve.sampling.sampler import Sampler
from specserve.speculative.base import Proposer
from specserve.speculative.planner import SpecPlanner
from specserve.speculative.verify import accept_lengths
from specserve.tokenizer.detokenizer import Decoder

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step added to one request (a streaming delta)."""

    rid: str
    token_ids: list[int]
    text: str
    output_logprobs: list[TokenLogprob]
    input_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    # Speculation: the request's verify rounds so far; None without it.
    spec: SpecStats | None = None

    @classmethod
    def final(cls, rid: str, reason: FinishReason) -> RequestOutput:
        """A last, empty delta that ends a request the core no longer knows."""
        return cls(rid, [], "", [], [], True, reason, 0, 0)


@dataclass
class EngineStats:
    """Running totals (read by metrics from other threads; ints only)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish type


@dataclass
class _Computed:
    """A computed step, not yet committed: the batch as run (drafts included),
    its forward, each step's run (or None), each step's scored rows, and why
    a step's run came from no distribution (None where it did)."""

    batch: ScheduledBatch
    fwd: ForwardOutput
    runs: list[RunCommit | None]
    scores: list[StepScores]
    unusable: list[Exception | None]


def is_fatal(error: BaseException) -> bool:
    """Errors after which the device, and so every request, is unusable: the
    engine stops instead of failing requests one by one."""
    if isinstance(error, DistributedError):
        return True  # a rank is lost: no request can be computed
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return any(s in text for s in ("CUDA error", "device-side assert", "CUBLAS_STATUS"))


def failure(error: Exception) -> FinishReason:
    """The finish of a request that failed: a ``ValueError`` is its own bad
    input (400), anything else an internal error (500)."""
    if isinstance(error, ValueError):
        return FinishReason("abort", message=str(error), status=400)
    return FinishReason(
        "abort", message=f"internal error: {type(error).__name__}: {error}", status=500
    )


@dataclass
class _Cursor:
    """How much of a request has been reported already."""

    tokens: int = 0
    text: int = 0
    input_logprobs: int = 0
    hold: int = 0  # chars kept back while unfinished: a stop string may still cut them


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Decoder,
        proposer: Proposer | None = None,
        planner: SpecPlanner | None = None,
    ) -> None:
        """``planner``: the cost model choosing the proposer's verify lengths
        (None: the proposer's own)."""
        self.config = config
        self.runner = runner
        self.block_pool = BlockPool(runner.num_pages, runner.page_size)
        groups = runner.cache_groups
        self.entry_pools = [
            (BlockPool(n, runner.page_size), g.rate)
            for g, n in zip(groups[1:], runner.group_pages[1:])
        ]
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_pool,
            lookahead=proposer.max_drafts if proposer else 0,
            on_release=self._release_spec if proposer else None,
            capture_layer_ids=proposer.capture_layer_ids if proposer else (),
            entry_pools=self.entry_pools,
            retain=groups[0].retain,
            context_pages=proposer.context_pages if proposer else None,
        )
        self.spec = (
            SpecDecoder(proposer, self.scheduler, config.kernel_backend, planner)
            if proposer
            else None
        )
        self.sampler = Sampler(runner.device, config.random_seed)
        self.staging = HostStaging(runner.device)
        self.output_processor = OutputProcessor(
            tokenizer, config.logprobs_mode, runner.context_length, config.kernel_backend
        )
        self._cursors: dict[str, _Cursor] = {}
        self.stats = EngineStats()
        # The loop's time between steps (``_loop_time``): the last step's
        # deltas, and when it ended with work left (None: the loop waited).
        self._loop_carry, self._loop_since = 0.0, None

    # ---- requests -------------------------------------------------------

    def add(self, req: Req) -> RequestOutput | None:
        """Queues ``req``; if it cannot even be set up, it fails alone and its
        final delta is returned."""
        hold = max((len(s) for s in req.sampling.stop), default=1) - 1
        self._cursors[req.rid] = _Cursor(hold=hold)
        try:
            device = self.runner.device
            if req.sampling.seed is not None:
                req.generator = torch.Generator(device=device)
                req.generator.manual_seed(req.sampling.seed)
            if req.sampling.has_penalties:
                req.penalty = PenaltyState.create(req.prompt_ids, self.runner.vocab_size, device)
        except Exception as e:
            if is_fatal(e):
                raise
            logger.warning("request %s failed before admission: %r", req.rid, e)
            req.finish(failure(e))
            return self._delta(req)
        self.stats.prompt_tokens += req.prompt_len
        self.scheduler.add(req)
        return None

    def abort(self, rid: str, reason: FinishReason | None = None) -> RequestOutput | None:
        req = self.scheduler.abort(rid, reason)
        return self._delta(req) if req is not None else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_stats(self) -> None:
        """Counters from zero (after the start-up warm-up)."""
        self.stats = EngineStats()
        self.scheduler.num_preemptions = 0
        if self.spec is not None:
            self.spec.stats = SpecStats()
            if self.spec.planner is not None:  # its profiled table stays
                self.spec.planner.reset()

    @property
    def pools(self) -> list[BlockPool]:
        """The page allocator of every cache group, group 0 first, then the
        proposer's own (a drafter's KV pages)."""
        drafter = self.spec.proposer.pools if self.spec is not None else []
        return [self.block_pool] + [pool for pool, _ in self.entry_pools] + drafter

    @property
    def capacity_tokens(self) -> int:
        """The longest a request may grow."""
        return self.runner.capacity_tokens

    # ---- the step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step over the scheduled batch. A request whose part of the step
        raises fails alone (finish ``abort``); the others go on as if it had
        never been there. Only device errors (``is_fatal``) propagate."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            self._loop_since = None
            return []
        self._run(batch)
        if self.spec is not None:
            self.spec.observe_step(batch, time.perf_counter() - start + self._loop_time(start))
            self._propose([step.req for step in batch.steps])
            proposed = time.perf_counter()
        self.scheduler.reap_finished()
        outputs = [self._delta(step.req) for step in batch.steps]
        if self.spec is not None:
            end = time.perf_counter()
            self._loop_carry = end - proposed
            self._loop_since = end if self.has_work() else None
        return outputs

    def idle(self) -> None:
        """The driver turns to other work before the next step (another
        engine's step in ``bench_spec_lockstep.py``): the time until then is
        no step's cost, as a wait for work is not."""
        self._loop_since = None

    def _loop_time(self, start: float) -> float:
        """What the busy loop spent since the last step's measurement besides
        drafting: that step's deltas, and delivering them and taking in
        commands until this step began (not a wait for work). Speculation
        saves it per step it saves, so the cost model counts it per step."""
        if self._loop_since is None:
            return 0.0
        return self._loop_carry + start - self._loop_since

    def _release_spec(self, req: Req) -> None:
        assert self.spec is not None
        self.spec.release(req)

    def _run(self, batch: ScheduledBatch) -> None:
        """Computes the batch's step, then commits it request by request.

        Nothing a request keeps changes before the commit but its seeded
        generators (saved here) and its draft context (rebuilt idempotently),
        so a failed computation reruns on each half of the batch until the
        request that causes it is alone and fails by itself."""
        saved = [(g, g.get_state()) for s in batch.steps if (g := s.req.generator) is not None]
        try:
            computed = self._compute(batch)
        except Exception as e:
            if is_fatal(e):
                raise
            if len(batch.steps) == 1:
                self._fail(batch.steps[0].req, e)
                return
            logger.warning(
                "a step of %d requests failed (%r); rerunning it in halves to find the cause",
                len(batch.steps), e,
            )  # fmt: skip
            for generator, state in saved:
                generator.set_state(state)
            for half in batch.halves():
                self._run(half)
            return
        self._commit(computed)

    def _propose(self, reqs: list[Req]) -> None:
        """Drafts for the next step (the step's last stage). A failure reruns on
        halves, seeded generators restored, until the request that causes it
        fails alone; the others keep the drafts they would have had alone."""
        assert self.spec is not None
        saved = [(g, g.get_state()) for r in reqs if (g := r.generator) is not None]
        try:
            self.spec.propose(reqs)
        except Exception as e:
            if is_fatal(e):
                raise
            for generator, state in saved:
                generator.set_state(state)
            if len(reqs) == 1:
                self._fail(reqs[0], e)
                return
            mid = len(reqs) // 2
            self._propose(reqs[:mid])
            self._propose(reqs[mid:])

    def _compute(self, batch: ScheduledBatch) -> _Computed:
        """The forward, sampling or verification, and the scores of every row
        that may commit: batched, and without committing anything. The device
        is read back once here (and once by a drafting proposer, at the end
        of the step)."""
        v, steps = self.runner.vocab_size, batch.steps
        # Under tensor parallelism the rows whose token is their argmax are
        # decided on the shards, and scored there with the prompt rows: their
        # logits never travel.
        decided = shard = None
        if self.runner.scores_on_shards:
            decided = step_rows(steps, batch.row_offsets, v, lambda i: argmax_decides(steps[i]))
            shard = self.output_processor.shard_rows(steps, batch.row_offsets, decided)
        fwd = self.runner.forward(batch) if shard is None else self.runner.forward(batch, shard)
        # Every other row a token is drawn or verified from, as the sampler sees it.
        others = None if decided is None else (lambda i: i not in decided.spans)
        rows = step_rows(steps, fwd.row_offsets, v, others)
        processed = processed_logits(_take(fwd.logits, rows.logit_rows), rows.metadata)
        # Each run group with the rows its tokens came from, and which peaks they have.
        peaks = [row_peaks(processed)]  # [len(rows.logit_rows)]
        groups: list[tuple[PendingRuns, StepRows, int]] = []
        sampled = self._sample(batch, rows, processed)
        if sampled is not None:
            groups.append((sampled, rows, 0))
        if self.spec is not None:
            verified = self.spec.verify(batch, rows, processed, self.sampler.generator)
            if verified is not None:
                groups.append((verified, rows, 0))
        if decided is not None and fwd.argmax is not None:
            ids, decided_peaks = fwd.argmax
            groups.append((_argmax_runs(steps, decided, ids), decided, len(peaks)))
            peaks.append(decided_peaks)  # [len(decided.logit_rows)]
        pending = [g for g, _, _ in groups]
        scoring = self._scoring_logits(batch, fwd, rows.logit_rows, processed)
        scores = self.output_processor.score(
            steps, fwd.row_offsets, pending, scoring, shard, fwd.scores
        )
        # The step's one read back: every run's tokens (and accept lengths),
        # the rows' peaks, the scores.
        run_tensors = [t for g in pending for t in g.tensors()]
        host = self.staging.fetch([*run_tensors, *peaks, *scores.tensors()])
        host_peaks = host[len(run_tensors) : len(run_tensors) + len(peaks)]
        by_step: list[RunCommit | None] = [None] * len(steps)
        unusable: list[Exception | None] = [None] * len(steps)
        candidates: list[int] = []
        for k, (group, group_rows, peaks_at) in enumerate(groups):
            tokens, accept = host[2 * k], host[2 * k + 1]
            candidates += tokens
            for run in group.commits(tokens, accept):
                by_step[run.step] = run
                # Only the rows its committed tokens came from (a chain's
                # rows after a rejection decided nothing).
                unusable[run.step] = group_rows.unusable(
                    run.step, len(run.token_ids), host_peaks[peaks_at]
                )
        step_scores = scores.finish(host[len(run_tensors) + len(peaks) :], candidates)
        return _Computed(batch, fwd, by_step, step_scores, unusable)

    def _commit(self, c: _Computed) -> None:
        """Each request takes its share of the computed step on its own."""
        first = 0  # the entry's first token among the batch's tokens
        for step, entry, run, scores, unusable in zip(
            c.batch.steps, c.batch.entries, c.runs, c.scores, c.unusable
        ):
            req, fed = step.req, len(entry.token_ids)
            try:
                if unusable is not None:
                    raise unusable
                req.num_computed = entry.prefix_len + fed  # the fed tokens' K/V are cached
                before = len(req.output_ids)
                self.output_processor.commit(step, run, scores)
                if self.spec is not None:
                    committed = len(req.output_ids) - before
                    self.spec.finish(step, entry, c.fwd.captured, first, committed)
            except Exception as e:
                if is_fatal(e):
                    raise
                self._fail(req, e)
            first += fed

    def _fail(self, req: Req, error: Exception) -> None:
        """Ends ``req`` alone after ``error`` in its part of a step."""
        logger.error("request %s failed in an engine step", req.rid, exc_info=error)
        reason = failure(error)
        if self.scheduler.abort(req.rid, reason) is None:
            req.finish(reason)  # already out of the scheduler's hands

    def _sample(
        self, batch: ScheduledBatch, rows: StepRows, processed: torch.Tensor
    ) -> PendingRuns | None:
        """One token per plain sampling step, still on the device."""
        plain = [i for i in rows.spans if not batch.steps[i].verify]
        if not plain:
            return None
        at = [rows.spans[i].start for i in plain]
        tokens = self.sampler.sample(processed[at], rows.metadata.select(at))
        return PendingRuns(plain, [[rows.logit_rows[k]] for k in at], tokens)

    def _scoring_logits(
        self,
        batch: ScheduledBatch,
        fwd: ForwardOutput,
        logit_rows: list[int],
        processed: torch.Tensor,  # [len(logit_rows), V]
    ) -> torch.Tensor:
        """Raw mode scores the model's logits. Processed mode scores what the
        sampler drew from (or verified against); prompt rows get the
        request's logit bias (there is no generated history to penalise)."""
        if self.config.logprobs_mode == "raw":
            return fwd.logits
        if not any(s.req.logprob.return_logprob for s in batch.steps):
            return fwd.logits
        logits = fwd.logits.clone()
        for i, step in enumerate(batch.steps):
            if step.num_input_logprob_rows and step.req.sampling.logit_bias:
                lo = fwd.row_offsets[i]
                apply_logit_bias(
                    logits[lo : lo + step.num_input_logprob_rows], step.req.sampling.logit_bias
                )
        if logit_rows:
            logits[logit_rows] = processed
        return logits

    # ---- outputs --------------------------------------------------------

    def _delta(self, req: Req) -> RequestOutput:
        cur = self._cursors[req.rid]
        finished = req.status is ReqStatus.FINISHED
        visible = len(req.text) if finished else max(cur.text, len(req.text) - cur.hold)
        out = RequestOutput(
            rid=req.rid,
            token_ids=req.output_ids[cur.tokens :],
            text=req.text[cur.text : visible],
            output_logprobs=req.output_logprobs[cur.tokens :] if req.logprob.return_logprob else [],
            input_logprobs=req.input_logprobs[cur.input_logprobs :],
            finished=finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            spec=req.spec.snapshot() if self.spec is not None else None,
        )
        self.stats.generated_tokens += len(out.token_ids)
        cur.tokens = len(req.output_ids)
        cur.text = visible
        cur.input_logprobs = len(req.input_logprobs)
        if finished:
            del self._cursors[req.rid]
            kind = req.finish_reason.type if req.finish_reason else "unknown"
            self.stats.finished[kind] = self.stats.finished.get(kind, 0) + 1
        return out


def _argmax_runs(steps: Sequence[ReqStep], decided: StepRows, ids: torch.Tensor) -> PendingRuns:
    """The runs of the steps ``decided`` holds, from each row's greedy token
    ``ids`` (``[len(decided.logit_rows)]``, found on the shards): a plain
    step's token, a chain's candidates with its accept length (greedy
    verification: the argmax of every row is what the row commits)."""
    members = list(decided.spans)
    scoring = [decided.logit_rows[span.start : span.stop] for span in decided.spans.values()]
    accept = None
    if any(steps[i].verify for i in members):
        accept = accept_lengths(ids, [steps[i].drafts for i in members])
    return PendingRuns(members, scoring, ids, accept)


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without a copy when the rows are all of them in order
    (a batch of verify chains only)."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits
    return logits[rows]
