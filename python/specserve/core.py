"""The types every stage shares: a request (its tokens, logprobs, text and
status) and the batch the scheduler hands to the runner.

The scheduler, the model runner, the engine and the proposers all import
these; this module imports none of them, so no stage depends on another
through its types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.grammar.base import GrammarMatcher
from specserve.sampling.logprobs import TokenLogprob
from specserve.sampling.params import SamplingParams
from specserve.sampling.penalties import PenaltyState
from specserve.tokenizer.detokenizer import DetokState


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Verify rounds and the tokens they committed (bonus included): of one
    request, or of the engine's life (which also counts its rounds by the
    drafts they verified and by those they accepted)."""

    rounds: int = 0
    committed: int = 0
    by_verified: list[int] = field(default_factory=list)  # [n]: rounds verifying n drafts
    by_accepted: list[int] = field(default_factory=list)  # [n]: rounds accepting n
    # The last snapshot, while no round came since (most steps of a request
    # at a high load verify nothing: its deltas share one).
    _snapshot: SpecStats | None = field(default=None, repr=False, compare=False)

    def add(self, committed: int, verified: int | None = None) -> None:
        """A round that committed ``committed`` tokens; ``verified``: its
        drafts, when the round is counted by them."""
        self._snapshot = None
        self.rounds += 1
        self.committed += committed
        if verified is not None:
            for hist, n in ((self.by_verified, verified), (self.by_accepted, committed - 1)):
                if n >= len(hist):
                    hist += [0] * (n + 1 - len(hist))
                hist[n] += 1

    def snapshot(self) -> SpecStats:
        """A copy of the counts as of now, not to be changed (the histograms
        shared, as by ``dataclasses.replace``, at a fifth of its cost: every
        delta of every step takes one; the same copy until a round comes)."""
        snap = self._snapshot
        if snap is None:
            snap = SpecStats(self.rounds, self.committed, self.by_verified, self.by_accepted)
            self._snapshot = snap
        return snap

    def per_position(self) -> tuple[list[int], list[int]]:
        """Per draft position k: the rounds that verified it, and that
        accepted it (those verifying, or accepting, more than k)."""
        out = []
        for hist in (self.by_verified, self.by_accepted):
            counts, above = [], 0
            for n in reversed(hist[1:]):
                above += n
                counts.append(above)
            out.append(counts[::-1])
        verified, accepted = out
        return verified, accepted + [0] * (len(verified) - len(accepted))

    @property
    def accept_length(self) -> float:
        """Committed tokens per round: tau."""
        return self.committed / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None
    # A request that failed: 400 (its own bad input) or 500 (an internal
    # error), the HTTP status of a non-streamed answer. Not part of to_dict.
    status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass(frozen=True)
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only; k: also prompt positions k..
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    eos_ids: frozenset[int] = frozenset()

    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # visible output text (stop strings cut)

    # KV state, managed by the scheduler. Pages of group 0 (one slot per
    # position; -1 where a sliding window has left a page behind) and of
    # each further cache group (DeepSeek-V4's compressed entries).
    page_table: list[int] = field(default_factory=list)
    entry_tables: list[list[int]] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_ids whose K/V are in the cache
    num_preemptions: int = 0

    # Logprobs. Input entries cover prompt positions logprob_start_len .. P-1.
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    next_input_logprob: int = 0  # next prompt position to score

    # Sampling state.
    generator: torch.Generator | None = None
    penalty: PenaltyState | None = None
    detok: DetokState = field(default_factory=lambda: DetokState((), 0))
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
    grammar: GrammarMatcher | None = None  # at the committed state

    # Speculation: the proposer's own state; the drafts proposed at the end of
    # the last step, which the next one schedules after the anchor (with the
    # distributions they were drawn from, None for one-hot); what verify did.
    draft_state: Any = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_q: torch.Tensor | None = None  # [len(spec_token_ids), V]
    spec: SpecStats = field(default_factory=lambda: SpecStats())
    # Its conditional acceptance estimate per draft position (the cost
    # model's, speculative/planner.py); None: the engine's.
    accept_rates: list[float] | None = None

    def set_drafts(self, tokens: list[int], q: torch.Tensor | None = None) -> None:
        self.spec_token_ids, self.spec_draft_q = tokens, q

    def __post_init__(self) -> None:
        self.detok = DetokState.start(self.prompt_ids)
        eos = frozenset() if self.sampling.ignore_eos else self.eos_ids
        self.stop_ids = eos | frozenset(self.sampling.stop_token_ids)
        opts = self.logprob
        start = (
            opts.logprob_start_len if opts.return_logprob and opts.logprob_start_len >= 0 else None
        )
        self.next_input_logprob = self.prompt_len if start is None else start

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def held_stop_ids(self) -> frozenset[int]:
        """Stop ids that ``min_new_tokens`` holds back. A grammar decides by
        itself when output ends (once complete it allows only EOS): none then."""
        return frozenset() if self.grammar is not None else self.stop_ids

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def token_at(self, pos: int) -> int:
        p = self.prompt_len
        return self.prompt_ids[pos] if pos < p else self.output_ids[pos - p]

    def tokens_from(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids``."""
        p = self.prompt_len
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def append_input_logprobs(self, entries: list[TokenLogprob]) -> None:
        self.input_logprobs.extend(entries)
        self.next_input_logprob += len(entries)

    def append_run(
        self,
        token_ids: list[int],
        text: str,
        detok: DetokState,
        logprobs: list[TokenLogprob] | None,
        finish: FinishReason | None,
    ) -> None:
        """The one mutator for generated output: a committed run of tokens, the
        visible text after it (a stop string may cut text committed earlier),
        the detokenizer state, the run's logprobs and the finish it ends in."""
        assert not self.finished, f"request {self.rid} is already finished"
        assert logprobs is None or len(logprobs) == len(token_ids)
        self.output_ids.extend(token_ids)
        self.text = text
        self.detok = detok
        if logprobs is not None:
            self.output_logprobs.extend(logprobs)
        if self.penalty is not None and token_ids:
            self.penalty.add(token_ids)
        if finish is not None:
            self.finish(finish)

    def finish(self, reason: FinishReason) -> None:
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason


# ---- the batch -------------------------------------------------------------


# A ``ScoreRows`` token id: the row's greedy token, found on the shards.
ARGMAX = -1


@dataclass
class ScoreRows:
    """Logits rows decided or scored where the logits are: on the shards under
    tensor parallelism, whose logits then never leave them. ``argmax``: rows
    whose token is the argmax of the model's logits (greedy rows that no
    penalty, bias or grammar changes), found on the shards with each row's
    peak. ``rows``: rows scored (logprobs) against a token known before the
    forward (prompt positions in raw mode) or ``ARGMAX`` (the row's own
    greedy token; the row is then one of ``argmax``)."""

    rows: list[int]  # logits rows of the forward
    token_ids: list[int]  # the token each row scores, or ARGMAX
    top_k: int  # top logprobs of every row (the most any of them asks)
    ids: list[list[int]]  # requested ids per row, padded with -1 to one width
    argmax: list[int] = field(default_factory=list)  # logits rows


@dataclass
class BatchEntry:
    """What the runner needs of one request: plain data, no engine objects."""

    token_ids: list[int]  # tokens fed this step
    prefix_len: int  # tokens of the request already in the KV cache
    page_table: list[int]  # pages covering prefix_len + len(token_ids)
    logit_rows: list[int]  # indices into token_ids whose logits are returned
    entry_tables: list[list[int]] = field(default_factory=list)  # further cache groups
    # Pages of the drafter's KV covering the same positions, when every rank
    # stores the fed tokens' draft context in the forward (tensor parallelism).
    draft_pages: list[int] = field(default_factory=list)


@dataclass
class ReqStep:
    """What the engine makes of one entry's logit rows after the forward.

    The rows of an entry are, in order: ``num_input_logprob_rows`` rows scoring
    prompt tokens ``input_logprob_start ..`` (row for position p scores the
    token at p + 1), then the sampling row when ``sample`` is set.
    """

    req: Req
    input_logprob_start: int = 0
    num_input_logprob_rows: int = 0
    sample: bool = False
    # Speculation: the entry is the chain [anchor, *drafts]; every row is a verify row.
    drafts: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None  # [len(drafts), V], None: one-hot drafts
    verify: bool = False
    # Feeds only the last generated token: the anchor of a speculative round.
    decoding: bool = False


@dataclass
class ScheduledBatch:
    """One forward's requests. Prefill chunks, decode tokens and verify chains
    ``[anchor, d_1..d_L]`` mix freely: each entry says what it feeds and which
    rows' logits come back, and the runner treats them all alike."""

    entries: list[BatchEntry]
    steps: list[ReqStep]  # parallel to entries; the runner never reads it
    capture_layer_ids: tuple[int, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)

    @property
    def row_offsets(self) -> list[int]:
        """The first logits row of each entry (``len(entries) + 1`` values)."""
        offsets = [0]
        for e in self.entries:
            offsets.append(offsets[-1] + len(e.logit_rows))
        return offsets

    def halves(self) -> tuple[ScheduledBatch, ScheduledBatch]:
        """The first and second half of the requests, each a batch of its own
        (fault isolation reruns a failed step this way)."""
        mid = len(self.steps) // 2
        return self._subset(slice(0, mid)), self._subset(slice(mid, None))

    def _subset(self, part: slice) -> ScheduledBatch:
        return ScheduledBatch(self.entries[part], self.steps[part], self.capture_layer_ids)
