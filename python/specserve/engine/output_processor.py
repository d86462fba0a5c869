"""The shared commit path: every generated token reaches a request through here.

Plain decoding hands in runs of one sampled token; speculation hands in the
accepted drafts plus the bonus token of each request. A step is scored for
the whole batch first (one kernel call, nothing committed yet), then each
request commits on its own: its run is scanned for stops (EOS / stop ids,
stop strings across token boundaries, the length cap), truncated at the
first one, and only the committed tokens keep their logprobs, taken from
the rows of the scoring logits they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core import ARGMAX, FinishReason, Req, ReqStep, ScoreRows
from specserve.grammar.bitmask import advance_committed
from specserve.host import upload
from specserve.kernels.logprobs import RowLogprobs
from specserve.sampling.logprobs import (
    RowQuery,
    TokenLogprob,
    entries_from_host,
    score_rows_device,
    scored_tensors,
)
from specserve.sampling.metadata import StepRows
from specserve.tokenizer.detokenizer import Decoder, DetokState, detok_flush, detok_step


@dataclass
class RunCommit:
    """Tokens proposed for one step's request, each with its scoring row."""

    step: int  # index into the batch's steps
    token_ids: list[int]
    rows: list[int]  # row of each token in the scoring logits


@dataclass
class PendingRuns:
    """Runs whose tokens are still on the device (sampled or verified in this
    step): each run's candidate tokens and their scoring rows; a run commits
    all of its candidates, or with ``accept`` its first ``accept + 1``."""

    steps: list[int]  # the batch step of each run
    rows: list[list[int]]  # scoring row of each candidate, per run
    tokens: torch.Tensor  # [sum(len(rows))] int64 candidates, run after run
    accept: torch.Tensor | None = None  # [runs] accepted drafts of each chain

    def tensors(self) -> list[torch.Tensor | None]:
        """What the step's fetch copies of these runs."""
        return [self.tokens, self.accept]

    def commits(self, tokens: list[int], accept: list[int] | None) -> list[RunCommit]:
        """The runs, from the fetched ``tensors``."""
        out, at = [], 0
        for k, (step, rows) in enumerate(zip(self.steps, self.rows)):
            n = len(rows) if accept is None else accept[k] + 1
            out.append(RunCommit(step, tokens[at : at + n], rows[:n]))
            at += len(rows)
        return out


@dataclass
class PendingScores:
    """A step's scores on the device (``score``), turned into each step's
    ``StepScores`` once fetched (``finish``)."""

    queries: list[RowQuery]
    counts: list[tuple[int, int]]  # (prompt rows, run candidates) per step
    source: list[int]  # per candidate query: its index among the runs' candidates
    out: RowLogprobs | None

    def tensors(self) -> list[torch.Tensor | None]:
        return scored_tensors(self.out)

    def finish(self, host: list, candidates: list[int]) -> list[StepScores]:
        """``host``: the fetched ``tensors``; ``candidates``: every run's
        candidate tokens on the host, in ``PendingRuns`` order."""
        picked = iter(self.source)
        tokens = [
            q.token_id if q.token_id is not None else candidates[next(picked)] for q in self.queries
        ]
        scored = entries_from_host(self.queries, host, tokens)
        out, at = [], 0
        for num_in, num_run in self.counts:
            out.append(
                StepScores(scored[at : at + num_in], scored[at + num_in : at + num_in + num_run])
            )
            at += num_in + num_run
        return out


def interleave(shard: RowLogprobs, picks: Sequence[int], here: RowLogprobs | None) -> RowLogprobs:
    """The scores of every query in order: ``shard``'s row ``picks[q]`` for a
    query scored on the shards (``picks[q] >= 0``), ``here``'s next row for
    the others (top-k and requested-id columns padded to the wider; the host
    reads each query's own width)."""
    parts = [shard] if here is None else [shard, here]
    k = max(p.top_ids.shape[1] for p in parts)
    m = max(p.ids_logprobs.shape[1] for p in parts)
    n, dev = len(picks), shard.token_logprobs.device
    from_shard = [q for q, at in enumerate(picks) if at >= 0]
    taken = upload([at for at in picks if at >= 0], dev)

    def widen(t: torch.Tensor, width: int, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    def place(values: list[torch.Tensor], fill: float) -> torch.Tensor:
        out = values[0].new_full((n, *values[0].shape[1:]), fill)
        out[upload(from_shard, dev)] = values[0][taken]
        if len(values) > 1:
            out[upload([q for q, at in enumerate(picks) if at < 0], dev)] = values[1]
        return out

    return RowLogprobs(
        place([p.token_logprobs for p in parts], 0.0),
        place([widen(p.top_values, k, 0.0) for p in parts], 0.0),
        place([widen(p.top_ids, k, 0) for p in parts], 0),
        place([widen(p.ids_logprobs, m, float("nan")) for p in parts], float("nan")),
    )


@dataclass
class StepScores:
    """One step's scored rows for one request: its prompt positions, its run."""

    inputs: list[TokenLogprob]
    run: list[TokenLogprob]  # every token of the run (empty without logprobs)


@dataclass
class _ScanResult:
    num_tokens: int
    text: str
    detok: DetokState
    finish: FinishReason | None


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Decoder,
        logprobs_mode: str,
        context_length: int,
        kernel_backend: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.processed = logprobs_mode == "processed"
        self.context_length = context_length
        self.kernel_backend = kernel_backend

    def temperature(self, req: Req) -> float:
        """Scoring temperature: the request's in processed mode (greedy: 1), else 1."""
        t = req.sampling.temperature
        return t if self.processed and t > 0 else 1.0

    def score(
        self,
        steps: Sequence[ReqStep],
        row_offsets: Sequence[int],
        pending: Sequence[PendingRuns],
        scoring_logits: torch.Tensor,  # [R, V] float32
        shard: ScoreRows | None = None,
        shard_scores: RowLogprobs | None = None,
    ) -> PendingScores:
        """Scores every row a step may commit, in one kernel call on the
        device; nothing is committed or read back yet (a failed step can be
        rerun). A run's candidates are all scored: those that do not commit
        (rejected drafts, tokens past a stop) are dropped at commit.
        ``shard_scores``: the rows of ``shard`` (``shard_rows``) already
        scored where the logits are; the kernel scores the other rows alone."""
        run_of: dict[int, tuple[int, list[int]]] = {}  # step -> (first candidate, rows)
        at = 0
        for group in pending:
            for step, rows in zip(group.steps, group.rows):
                run_of[step] = (at, rows)
                at += len(rows)
        prompt = iter(self._prompt_queries(steps, row_offsets))
        queries: list[RowQuery] = []
        counts: list[tuple[int, int]] = []
        source: list[int | None] = []  # per query: its run candidate, None for a prompt row
        for i, step in enumerate(steps):
            req = step.req
            queries += [next(prompt) for _ in range(step.num_input_logprob_rows)]
            source += [None] * step.num_input_logprob_rows
            num_run = 0
            if i in run_of and req.logprob.return_logprob:
                first, rows = run_of[i]
                queries.extend(self._query(req, row, None) for row in rows)
                source.extend(range(first, first + len(rows)))
                num_run = len(rows)
            counts.append((step.num_input_logprob_rows, num_run))
        # Each query's row in shard_scores, or -1: scored here.
        scored = shard.rows if shard is not None and shard_scores is not None else []
        at_shard = {row: k for k, row in enumerate(scored)}
        picks = [at_shard.get(q.row, -1) for q in queries]
        here = [q for q, k in zip(queries, picks) if k < 0]
        wanted = [c for c, k in zip(source, picks) if c is not None and k < 0]
        device_tokens = None
        if wanted:
            candidates = torch.cat([g.tokens for g in pending])
            device_tokens = candidates[upload(wanted, candidates.device)]
        out = score_rows_device(scoring_logits, here, device_tokens, self.kernel_backend)
        if shard_scores is not None and len(here) < len(queries):
            out = interleave(shard_scores, picks, out)
        runs = [c for c in source if c is not None]
        return PendingScores(queries, counts, runs, out)

    def commit(self, step: ReqStep, run: RunCommit | None, scores: StepScores) -> None:
        """Commits one request's part of a step: its prompt logprobs, then its
        run, cut at the first stop (only the committed tokens keep logprobs)."""
        req = step.req
        if req.logprob.return_logprob and req.next_input_logprob == 0:
            # Nothing conditions the first prompt token.
            req.append_input_logprobs([TokenLogprob(req.prompt_ids[0], None)])
        if step.num_input_logprob_rows:
            assert step.input_logprob_start == req.next_input_logprob, "input logprobs out of order"
            req.append_input_logprobs(scores.inputs)
        if not step.sample and req.num_computed == req.seq_len and req.sampling.max_new_tokens == 0:
            req.finish(FinishReason("length"))
        if run is None:
            return
        tokens = run.token_ids
        scan = self._scan_with_grammar(req, tokens) if req.grammar else self._scan(req, tokens)
        logprobs = scores.run[: scan.num_tokens] if req.logprob.return_logprob else None
        req.append_run(tokens[: scan.num_tokens], scan.text, scan.detok, logprobs, scan.finish)

    def shard_rows(
        self, steps: Sequence[ReqStep], row_offsets: Sequence[int], decided: StepRows
    ) -> ScoreRows | None:
        """The rows decided and scored where the logits are (on the shards
        under tensor parallelism): every row of ``decided`` (its token is the
        row's argmax), scored there too for requests that ask logprobs, and
        every prompt row that scores the model's own logits (its token is
        known before the forward): all in raw mode, in processed mode those
        of requests without a logit bias or temperature. None when there
        are none."""
        queries = [
            q
            for i, step in enumerate(steps)
            if self._scores_model_logits(step.req)
            for q in self._inputs(step, row_offsets[i])
        ]
        for i, span in decided.spans.items():
            req = steps[i].req
            if req.logprob.return_logprob:
                queries += [self._query(req, decided.logit_rows[k], ARGMAX) for k in span]
        if not queries and not decided.logit_rows:
            return None
        width = max((len(q.ids or ()) for q in queries), default=0)
        return ScoreRows(
            [q.row for q in queries],
            [q.token_id for q in queries],  # type: ignore[misc]  # all known or ARGMAX
            max((q.top_k for q in queries), default=0),
            [list(q.ids or ()) + [-1] * (width - len(q.ids or ())) for q in queries],
            decided.logit_rows,
        )

    def _prompt_queries(
        self, steps: Sequence[ReqStep], row_offsets: Sequence[int]
    ) -> list[RowQuery]:
        return [q for i, step in enumerate(steps) for q in self._inputs(step, row_offsets[i])]

    def _inputs(self, step: ReqStep, first_row: int) -> list[RowQuery]:
        """The step's prompt rows, from its entry's ``first_row``."""
        req, start = step.req, step.input_logprob_start
        return [
            self._query(req, first_row + j, req.token_at(start + j))
            for j in range(step.num_input_logprob_rows)
        ]

    def _scores_model_logits(self, req: Req) -> bool:
        """Whether ``req``'s prompt rows score the model's logits as they are:
        always in raw mode; in processed mode unless its logit bias or its
        temperature changes them."""
        return not self.processed or not (req.sampling.logit_bias or self.temperature(req) != 1.0)

    def _query(self, req: Req, row: int, token: int | None) -> RowQuery:
        opts = req.logprob
        return RowQuery(
            row, token, self.temperature(req), opts.top_logprobs_num, opts.token_ids_logprob
        )

    def _scan_with_grammar(self, req: Req, run: list[int]) -> _ScanResult:
        """The grammar advances permanently over the run and ends it at
        termination; stops inside what it accepted end it earlier (and the
        matcher steps back over the tokens that will not be committed)."""
        assert req.grammar is not None
        adv = advance_committed(req.grammar, run)
        scan = self._scan(req, run[: adv.num_accepted])
        req.grammar.rollback(adv.num_accepted - scan.num_tokens)
        if scan.finish is None and adv.terminated:
            scan.finish = FinishReason("stop", matched=run[adv.num_accepted - 1])
        elif scan.finish is None and adv.rejected:
            bad = run[adv.num_accepted]
            scan.finish = FinishReason("abort", message=f"the grammar rejected token {bad}")
        return scan

    def _scan(self, req: Req, run: list[int]) -> _ScanResult:
        """How much of ``run`` commits, and the text after it (pure)."""
        sp = req.sampling
        text, detok = req.text, req.detok
        num_out = len(req.output_ids)
        longest_stop = max((len(s) for s in sp.stop), default=0)
        for i, token in enumerate(run):
            num_out += 1
            may_stop = num_out > sp.min_new_tokens
            if may_stop and token in req.stop_ids:
                # The stop token counts as generated but adds no text.
                return _ScanResult(i + 1, text, detok, FinishReason("stop", matched=token))
            piece, detok = detok_step(self.tokenizer, detok, token, sp.skip_special_tokens)
            if piece and sp.stop and may_stop:
                # A stop string may begin in text released by earlier tokens.
                search_from = max(0, len(text) - longest_stop + 1)
                text += piece
                hit = _find_stop(text, sp.stop, search_from)
                if hit is not None:
                    at, stop = hit
                    kept = text[: at + len(stop)] if sp.no_stop_trim else text[:at]
                    return _ScanResult(i + 1, kept, detok, FinishReason("stop", matched=stop))
            else:
                text += piece
            if num_out >= sp.max_new_tokens or req.prompt_len + num_out >= self.context_length:
                text += detok_flush(self.tokenizer, detok, sp.skip_special_tokens)
                return _ScanResult(i + 1, text, detok, FinishReason("length"))
        return _ScanResult(len(run), text, detok, None)


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best
