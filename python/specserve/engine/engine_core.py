"""One engine step: schedule -> forward -> sample -> commit -> outputs.

Synchronous and not thread-safe: ``engine.py`` drives it (from the calling
thread or a background one, one at a time) only through ``add``, ``abort``
and ``step``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specserve.cache.block_pool import BlockPool
from specserve.config import EngineConfig
from specserve.engine.batch import ScheduledBatch
from specserve.engine.output_processor import OutputProcessor, RunCommit
from specserve.engine.request import FinishReason, Req, ReqStatus
from specserve.engine.scheduler import Scheduler
from specserve.grammar.bitmask import allocate_bitmask
from specserve.runner.model_runner import ForwardOutput, ModelRunner
from specserve.sampling.logprobs import TokenLogprob
from specserve.sampling.penalties import PenaltyState, RowControls, apply_logit_bias
from specserve.sampling.sampler import Sampler
from specserve.speculative.base import Proposer
from specserve.speculative.spec_decoder import SpecDecoder
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
    # Speculation: (verify rounds, tokens they committed); None without it.
    spec: tuple[int, int] | None = None


@dataclass
class EngineStats:
    """Running totals (read by metrics from other threads; ints only)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish type


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
    ) -> None:
        self.config = config
        self.runner = runner
        self.block_pool = BlockPool(runner.num_pages, runner.page_size)
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_pool,
            lookahead=proposer.max_drafts if proposer else 0,
            on_release=proposer.release if proposer else None,
        )
        self.spec = (
            SpecDecoder(proposer, self.scheduler, runner.vocab_size, config.kernel_backend)
            if proposer
            else None
        )
        self.sampler = Sampler(runner.device, config.random_seed)
        self.output_processor = OutputProcessor(
            tokenizer, config.logprobs_mode, runner.context_length, config.kernel_backend
        )
        self._cursors: dict[str, _Cursor] = {}
        self.stats = EngineStats()

    # ---- requests -------------------------------------------------------

    def add(self, req: Req) -> None:
        device = self.runner.device
        if req.sampling.seed is not None:
            req.generator = torch.Generator(device=device)
            req.generator.manual_seed(req.sampling.seed)
        if req.sampling.has_penalties:
            req.penalty = PenaltyState.create(req.prompt_ids, self.runner.vocab_size, device)
        hold = max((len(s) for s in req.sampling.stop), default=1) - 1
        self._cursors[req.rid] = _Cursor(hold=hold)
        self.stats.prompt_tokens += req.prompt_len
        self.scheduler.add(req)

    def abort(self, rid: str, message: str | None = None) -> RequestOutput | None:
        req = self.scheduler.abort(rid, message)
        return self._delta(req) if req is not None else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def capacity_tokens(self) -> int:
        return self.block_pool.total_pages() * self.block_pool.page_size

    # ---- the step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if self.spec is not None:
            self.spec.prepare(batch)
        fwd = self.runner.forward(batch)
        self.scheduler.mark_computed(batch)
        runs, processed = self._sample(batch, fwd)
        if self.spec is not None:
            spec_runs, spec_processed = self.spec.verify(batch, fwd, self.sampler.generator)
            runs += spec_runs
            processed += spec_processed
        scoring = self._scoring_logits(batch, fwd, processed)
        before = [len(step.req.output_ids) for step in batch.steps]
        self.output_processor.process(batch.steps, fwd.row_offsets, runs, scoring)
        if self.spec is not None:
            self.spec.finish_round(batch, fwd, before)
        self.scheduler.reap_finished()
        return [self._delta(step.req) for step in batch.steps]

    def _sample(
        self, batch: ScheduledBatch, fwd: ForwardOutput
    ) -> tuple[list[RunCommit], list[tuple[list[int], torch.Tensor]]]:
        """One token per plain sampling step: the runs, and the processed rows
        they were drawn from (for processed-mode logprobs)."""
        sample_steps = [i for i, s in enumerate(batch.steps) if s.sample and not s.verify]
        if not sample_steps:
            return [], []
        rows = [fwd.row_offsets[i + 1] - 1 for i in sample_steps]
        reqs = [batch.steps[i].req for i in sample_steps]
        controls = [self._controls(r) for r in reqs]
        out = self.sampler.sample(
            fwd.logits[rows], controls, [r.generator for r in reqs], self._grammar_mask(reqs)
        )
        runs = [
            RunCommit(i, [tok], [row]) for i, tok, row in zip(sample_steps, out.token_ids, rows)
        ]
        return runs, [(rows, out.processed_logits)]

    def _grammar_mask(self, reqs: list[Req]) -> tuple[torch.Tensor, list[int]] | None:
        constrained = [j for j, r in enumerate(reqs) if r.grammar is not None]
        if not constrained:
            return None
        bitmask = allocate_bitmask(len(constrained), self.runner.vocab_size)
        for k, j in enumerate(constrained):
            reqs[j].grammar.fill_mask(bitmask, k)  # type: ignore[union-attr]
        return bitmask, constrained

    @staticmethod
    def _controls(req: Req) -> RowControls:
        return RowControls(req.sampling, req.penalty, len(req.output_ids), req.held_stop_ids)

    def _scoring_logits(
        self,
        batch: ScheduledBatch,
        fwd: ForwardOutput,
        processed: list[tuple[list[int], torch.Tensor]],
    ) -> torch.Tensor:
        """Raw mode scores the model's logits. Processed mode scores what the
        sampler drew from; prompt rows get the request's logit bias (there is
        no generated history to penalise)."""
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
        for rows, values in processed:
            logits[rows] = values
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
            spec=(req.spec_verify_ct, req.spec_committed) if self.spec is not None else None,
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
