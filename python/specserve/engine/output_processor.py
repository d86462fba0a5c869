"""The shared commit path: every generated token reaches a request through here.

Plain decoding hands in runs of one sampled token; speculation will hand in
the accepted drafts plus the bonus token of each request. Either way the run
is scanned for stops (EOS / stop ids, stop strings across token boundaries,
the length cap), truncated at the first one, and only the committed tokens
are scored, from the rows of the scoring logits they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine.batch import ReqStep
from specserve.engine.request import FinishReason, Req
from specserve.grammar.bitmask import advance_committed
from specserve.sampling.logprobs import RowQuery, TokenLogprob, score_rows
from specserve.tokenizer.detokenizer import Decoder, DetokState, detok_flush, detok_step


@dataclass
class RunCommit:
    """Tokens proposed for one step's request, each with its scoring row."""

    step: int  # index into the batch's steps
    token_ids: list[int]
    rows: list[int]  # row of each token in the scoring logits


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

    def process(
        self,
        steps: Sequence[ReqStep],
        row_offsets: Sequence[int],
        runs: Sequence[RunCommit],
        scoring_logits: torch.Tensor,  # [R, V] float32
    ) -> None:
        """Commits ``runs`` and the input logprobs of ``steps`` into their requests."""
        queries: list[RowQuery] = []
        pending_inputs: list[tuple[Req, int]] = []  # (request, number of queries)
        for i, step in enumerate(steps):
            req = step.req
            opts = req.logprob
            if opts.return_logprob and req.next_input_logprob == 0:
                # Nothing conditions the first prompt token.
                req.append_input_logprobs([TokenLogprob(req.prompt_ids[0], None)])
            if step.num_input_logprob_rows:
                assert step.input_logprob_start == req.next_input_logprob, (
                    "input logprobs out of order"
                )
                for j in range(step.num_input_logprob_rows):
                    token = req.token_at(step.input_logprob_start + j)
                    queries.append(self._query(req, row_offsets[i] + j, token))
                pending_inputs.append((req, step.num_input_logprob_rows))
            if (
                not step.sample
                and req.num_computed == req.seq_len
                and req.sampling.max_new_tokens == 0
            ):
                req.finish(FinishReason("length"))

        scans: list[tuple[Req, RunCommit, _ScanResult]] = []
        for run in runs:
            req = steps[run.step].req
            scan = (
                self._scan_with_grammar(req, run.token_ids)
                if req.grammar
                else self._scan(req, run.token_ids)
            )
            scans.append((req, run, scan))
            if req.logprob.return_logprob:
                queries.extend(
                    self._query(req, row, tok)
                    for row, tok in zip(run.rows[: scan.num_tokens], run.token_ids)
                )

        scored = iter(score_rows(scoring_logits, queries, self.kernel_backend))
        for req, n in pending_inputs:
            req.append_input_logprobs([next(scored) for _ in range(n)])
        for req, run, scan in scans:
            logprobs = (
                [next(scored) for _ in range(scan.num_tokens)]
                if req.logprob.return_logprob
                else None
            )
            req.append_run(
                run.token_ids[: scan.num_tokens], scan.text, scan.detok, logprobs, scan.finish
            )

    def _query(self, req: Req, row: int, token: int) -> RowQuery:
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
