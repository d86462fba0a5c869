"""How many drafts each request verifies next step: one cost model, one
decision per step, made before anything is drafted.

A step's worth is its expected committed tokens per predicted second::

    expected  = sum_i (1 + sum_{j <= k_i} S_ij)
    predicted = draft(#requests drafting)  [0 when nobody drafts]
              + step(requests, tokens of the step)

``S_ij`` is request ``i``'s estimate that its first ``j`` drafts are all
accepted: the running product of per-position acceptance rates, the
request's own (observed round by round) or, once a drafter with a
confidence head has drafted, its confidences calibrated by what was
observed. The drafts verified are a global top-B of all the ``S_ij`` (a
request's admitted drafts are always a prefix: ``S`` never grows with
``j``), B found by an exact scan, since the step cost is a staircase under
CUDA-graph buckets. B = 0 is a true plain step: no drafter forward.

The step cost comes from a table profiled at start-up on the forwards real
steps run, corrected online per cell by an EWMA of log(measured / table)
(a cell never measured: its row's, else the whole table's);
the draft cost is measured online (priced by a power law where it was
not). A safety net measures what the engine delivers under the model's
decisions and under plain steps alone, in blocks of steps per load bucket
(short probes for plain while the model leads), and gives a bucket to the
model only while it measures more goodput there; the loser runs a block
now and then, less often the more it loses by.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.speculative.safety_net import PLAIN, SafetyNet
from specserve.speculative.step_costs import (
    STEADY_ROWS,
    CostTable,
    StepCosts,
    profile_step_costs,
)

if TYPE_CHECKING:  # the planner imports no stage at run time
    from specserve.config import EngineConfig
    from specserve.runner.model_runner import ModelRunner
    from specserve.speculative.base import Proposer

# EWMA weight of one new observation.
ALPHA = 0.1
# The engine-wide estimates' weight of one round: slower than a request's
# own, so that they stay a longer-run reference to drift back to. (At one
# request both see the same rounds: at one weight, a request whose
# estimates fell after hard text drifted toward estimates that had fallen
# as far, and stayed plain for as long as the drift toward the prior
# took. At 64-token answers the model kept 94-147 of 630-840 steps plain
# where a fifth of the weight kept 44-93, offline, three runs each.)
ENGINE_ALPHA = 0.02
# A speculative step must promise this much more goodput than plain (the
# cost of being wrong: the drafter's forward for nothing).
MARGIN = 0.02
# Per step, a request not drafting moves its estimates this far toward the
# engine-wide ones: an estimate that went stale at high load recovers, and
# is measured again once the costs let it draft.
DRIFT = 0.05
# Per step that nobody drafts, the engine-wide estimates move this far
# toward the prior: acceptance does not change with the load (the costs
# decide that nobody drafts), but an engine that measured it low early must
# try again some time. (At DRIFT, a few dozen plain steps under load made
# every draft look likely and started rounds that lost.)
PRIOR_DRIFT = 0.02
# A request's context to catch up is paid once for this many rounds at
# most (fewer if it has fewer left): the regime may turn plain after a
# block of steps, and the next catch-up is paid again.
CATCH_UP_ROUNDS = 8
# How the drafter's seconds grow per doubling of its requests, in log2,
# while only one bucket is measured (0: flat, 1: linear).
DRAFT_SLOPE = 0.5
# The acceptance assumed before any is measured: optimistic, so that a new
# engine speculates and measures (the measured costs hold it back where
# speculation cannot pay, whatever the estimates).
PRIOR = 0.8
# Where the calibration of a confidence head starts (accepted and predicted
# alike).
CAL_PRIOR = 0.5
# A correction of the step table takes one measurement as at most this
# factor off its current prediction (a first launch, a stall), whatever it
# measured; measurements that keep saying so move it on, by any factor.
MAX_CORRECTION = 16.0
# The net credits a verify round the tokens the planner predicted for it,
# scaled by what rounds committed against their predictions over about
# this many rounds, not what its own text let through: at one request a
# block's rounds committed 1.5-4.5 tokens each with the text, which made
# the ratios of neighbouring blocks scatter (0.7-2.3 around a lead of 1.25)
# and a bucket the model led go plain by chance. (Crediting every round the
# average round's tokens instead hid the text altogether, easy stretches
# included: with that, and the model's own plain steps measured, at one
# request with 256-token answers the net held plain for 55-77% of the
# steps where the fixed length ran 1.7x plain.) The regimes' costs, which
# the net is there to judge, count as measured.
NET_ROUNDS = 64


# ---- the decision ----------------------------------------------------------------------


def choose_drafts(
    survival: Sequence[Sequence[float]],
    steps: Sequence[float],
    drafts: Sequence[float] | None = None,
    margin: float = 0.0,
    join_seconds: Sequence[float] | None = None,
) -> list[int]:
    """Drafts to verify per request, maximising expected tokens per second.

    ``survival[i][j - 1]``: S_ij, non-increasing in j. ``steps[b]``: the
    step with b drafts in all (its other tokens, every anchor and any
    prefill, fixed). ``drafts[k]``: drafting for k requests (None: already
    paid); ``join_seconds[i]``: what request ``i`` adds to it besides (its
    context to catch up). A choice with drafts must beat the plain step by
    ``margin`` (relative).

    The global top-B ranks drafts by S alone, so a request dear to join
    either joins as soon as its first draft ranks or, left out, keeps the
    others from their later drafts: each of the dearest few is tried left
    out of the ranking, and stays out where the step is worth more so.
    (Plain Python: over the few dozen drafts of a step, numpy's per-call
    overhead cost more than the scan, several times over at one request.)"""
    r = len(survival)
    drafts = [0.0] * (r + 1) if drafts is None else drafts
    join = [0.0] * r if join_seconds is None else join_seconds
    # Every draft, ranked: by S descending, then j, then i (a request's first
    # draft ranks before its others, so it is where the request joins).
    ranked = sorted((-x, j, i) for i, row in enumerate(survival) for j, x in enumerate(row, 1))
    plain = r / max(steps[0], 1e-12) * (1.0 + margin)

    def best(out: set[int]) -> tuple[list[int], float]:
        """The best top-B of the drafts of requests not in ``out`` (an exact
        scan over every B) and its worth: the plain step's if none beats it."""
        tokens, drafting, joined, b, top, top_b = float(r), 0, 0.0, 0, -1.0, 0
        for neg_s, j, i in ranked:
            if i in out:
                continue
            b += 1
            tokens -= neg_s
            if j == 1:
                drafting += 1
                joined += join[i]
            rate = tokens / max(steps[b] + drafts[drafting] + joined, 1e-12)
            if rate > top:
                top, top_b = rate, b
        chosen = [0] * r
        if top <= plain:
            return chosen, plain
        for _, j, i in (d for d in ranked if d[2] not in out):
            if top_b == 0:
                break
            top_b -= 1
            chosen[i] = max(chosen[i], j)
        return chosen, top

    out: set[int] = set()
    lengths, rate = best(out)
    dearest = sorted((-x, i) for i, x in enumerate(join) if x > 0 and survival[i])
    for _, i in dearest[:MAX_LEFT_OUT]:
        trial, trial_rate = best(out | {i})
        if trial_rate > rate:
            lengths, rate, out = trial, trial_rate, out | {i}
    return lengths


# How many of the requests dearest to join ``choose_drafts`` tries leaving out.
MAX_LEFT_OUT = 4


def survival_of(rates: Sequence[float]) -> list[float]:
    """Running products of per-position acceptance rates (each in [0, 1])."""
    out, a = [], 1.0
    for r in rates:
        a *= min(max(r, 0.0), 1.0)
        out.append(a)
    return out


def survivals(rates: Sequence[Sequence[float]], limits: Sequence[int]) -> list[list[float]]:
    """``survival_of`` each request's first ``limits[i]`` rates."""
    return [survival_of(r[:k]) for r, k in zip(rates, limits)]


def static_lengths(confidence: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Drafts before the first confidence below ``threshold``."""
    lengths = []
    for conf in confidence:
        n = 0
        while n < len(conf) and conf[n] >= threshold:
            n += 1
        lengths.append(n)
    return lengths


def bucket(n: int) -> int:
    """log2 load bucket: 1, 2-3, 4-7, ..."""
    return max(n, 1).bit_length() - 1


@dataclass
class _Ewma:
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + ALPHA * (x - self.value)
        self.count += 1

    def add_log(self, x: float) -> None:
        """A log-ratio, its step from the current value at most log(MAX_CORRECTION)."""
        assert self.value is not None
        limit = math.log(MAX_CORRECTION)
        self.value += ALPHA * min(max(x - self.value, -limit), limit)
        self.count += 1


@dataclass
class _Mean:
    """The mean of what was added, then an EWMA of weight 1 / ``window``."""

    window: int
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        if self.value is None:
            self.value = x
        else:
            self.value += (x - self.value) / min(self.count, self.window)


# ---- the planner -----------------------------------------------------------------------


@dataclass
class PlannerStats:
    """What the planner decided and how its predictions fared."""

    steps: int = 0  # decode steps decided
    plain_steps: int = 0  # of which verified no drafts
    forced_plain: int = 0  # of which the safety net made plain
    drafts: dict[int, int] = field(default_factory=dict)  # drafts per step -> steps
    predicted_seconds: float = 0.0  # over the measured steps
    measured_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "spec_steps": self.steps,
            "spec_plain_steps": self.plain_steps,
            "spec_forced_plain_steps": self.forced_plain,
            "spec_drafts_per_step": dict(sorted(self.drafts.items())),
            "spec_predicted_step_seconds": self.predicted_seconds,
            "spec_measured_step_seconds": self.measured_seconds,
        }


class SpecPlanner:
    """Decides each step's verify lengths (see the module's docstring)."""

    def __init__(
        self,
        width: int,
        costs: CostTable,
        gate: bool = True,
        prior: float = PRIOR,
        draft_costs: CostTable | None = None,
        draft_row: float = 0.0,
    ):
        """``width``: the most drafts a round verifies; ``gate``: decide before
        drafting (adaptive), else only refine what was drafted;
        ``draft_costs``: the drafter's round by requests, profiled (None:
        measured online only); ``draft_row``: the seconds a pending row
        past ``STEADY_ROWS`` per request adds to a round (``StepCosts``)."""
        self.width = width
        self.costs = costs
        self.draft_costs = draft_costs
        self.draft_row = draft_row if draft_costs is not None else 0.0
        self.gate = gate
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        """Forgets everything learnt online (after the start-up warm-up, whose
        first launches and made-up prompts say nothing of real steps); the
        profiled table stays."""
        self.rates = [self.prior] * self.width  # engine-wide acceptance per position
        # Calibration of confidences per position: EMA of accepted and of
        # predicted, both from one value (a scale of 1: the head's word), so
        # that a first rejection moves the scale by a step, not to 0 (which
        # would cut every later chain to nothing, and so never be measured
        # again).
        self.cal_acc = [_Ewma(value=CAL_PRIOR) for _ in range(self.width)]
        self.cal_conf = [_Ewma(value=CAL_PRIOR) for _ in range(self.width)]
        # log(measured / profiled) per cell: an EWMA in logs, so an outlier
        # moves it by a factor, not to itself. A cell never measured takes
        # its requests bucket's (every cell of it measured so far), else the
        # whole table's: a table wrong by one factor (profiled while another
        # process ran) is right again as soon as any step is measured, the
        # verify cells a plain engine never runs included. A cell's first
        # measurement starts from that.
        self.correction: dict[tuple[int, int], _Ewma] = {}
        self.row_correction: dict[int, _Ewma] = {}
        self.table_correction = _Ewma(value=0.0)
        # By drafting-requests bucket: log(measured / profiled) with a
        # profile (as the step's cells; a bucket never measured takes the
        # drafter's other buckets', else the target table's), else the
        # seconds themselves.
        self.draft_cost: dict[int, _Ewma] = {}
        self.draft_correction: _Ewma | None = None
        self.net = SafetyNet()  # who decides each block of steps
        # Rounds' committed and predicted tokens: the scale of the net's credit.
        self.committed = _Mean(NET_ROUNDS)
        self.predicted = _Mean(NET_ROUNDS)
        self._credit = 0.0  # the step's rounds: credited tokens less committed
        self.stats = PlannerStats()

    # ---- estimates -------------------------------------------------------------------

    def estimates(self, own: list[float] | None) -> list[float]:
        """A request's per-position rates (its own, or the engine's)."""
        return list(self.rates) if own is None else own

    def observe_round(
        self,
        own: list[float] | None,
        verified: int,
        accepted: int,
        confidence: Sequence[float] | None,
        predicted: float | None = None,
    ) -> list[float]:
        """After a verify round of ``verified`` drafts with ``accepted`` of them
        taken: updates the engine's and calibration's estimates and returns
        the request's own. ``predicted``: the tokens the planner expected
        of the round (``predicted_tokens``; None: from ``own``)."""
        own = self.estimates(own)
        if predicted is None:
            predicted = self.predicted_tokens(own, None, verified)
        committed = accepted + 1
        self.committed.add(committed)
        self.predicted.add(predicted)
        scale = self.committed.value / max(self.predicted.value, 1e-12)
        self._credit += predicted * scale - committed
        for j in range(min(committed, verified)):
            hit = 1.0 if j < accepted else 0.0
            own[j] += ALPHA * (hit - own[j])
            self.rates[j] += ENGINE_ALPHA * (hit - self.rates[j])
            if confidence is not None and j < len(confidence):
                self.cal_acc[j].add(hit)
                self.cal_conf[j].add(confidence[j])
        return own

    def predicted_tokens(
        self, own: list[float] | None, calibrated: Sequence[float] | None, drafts: int
    ) -> float:
        """What a round verifying ``drafts`` commits by the planner's estimate:
        from its drafter's confidences where it has them (``calibrated``,
        this round's), else the request's rates (``own``)."""
        if calibrated is None:
            calibrated = survival_of(self.estimates(own)[:drafts])
        return 1.0 + sum(calibrated[:drafts])

    def drift(self, own: list[float] | None) -> list[float] | None:
        """A step without drafting: the request's estimates move toward the engine's."""
        if own is None:
            return None
        return [r + DRIFT * (g - r) for r, g in zip(own, self.rates)]

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        """Survival from a drafter's confidences, scaled per position by the
        acceptance observed against the confidence predicted there."""
        rates = []
        for j, c in enumerate(confidence):
            acc, conf = self.cal_acc[j].value, self.cal_conf[j].value
            scale = acc / conf if acc is not None and conf else 1.0
            rates.append(c * scale)
        return survival_of(rates)

    # ---- costs -----------------------------------------------------------------------

    def step_seconds(self, requests: int, tokens: int) -> float:
        return self.step_curve(requests, tokens, 1)[0]

    def step_curve(self, requests: int, first: int, n: int) -> list[float]:
        """``step_seconds`` at ``first`` .. ``first + n - 1`` tokens."""
        out = self.costs.curve(requests, first, n)
        r = max(requests, 1)
        k = 0
        while k < n:  # one cell per run of tokens per request in one bucket
            tokens_bucket = bucket(max(first + k, 1) // r)
            end = min(n, (1 << (tokens_bucket + 1)) * r - first)
            f = self._factor((bucket(r), tokens_bucket))
            if f != 1.0:
                out[k:end] = [t * f for t in out[k:end]]
            k = max(end, k + 1)
        return out

    def _factor(self, cell: tuple[int, int]) -> float:
        """The measured / table factor of a cell (1 before any measurement)."""
        fix = self._correction_of(cell)
        return math.exp(fix.value) if fix.value else 1.0

    def _correction_of(self, cell: tuple[int, int]) -> _Ewma:
        """A cell's correction, or what stands in for it (see ``reset``)."""
        fix = self.correction.get(cell) or self.row_correction.get(cell[0])
        return fix or self.table_correction

    def draft_seconds(self, n: int) -> float:
        """The drafter for ``n`` requests (0 before any was measured)."""
        return self._draft_buckets(bucket(n))[-1] if n else 0.0

    def _draft_buckets(self, top: int) -> list[float]:
        """The drafter's seconds per requests bucket 0 .. ``top``: profiled
        and corrected online (as the step's cells), or without a profile
        measured, else a power law through the measured neighbours (past
        the largest, the slope of the two largest, within [0, 1]: never
        dearer per request for more of them). Below the smallest, its
        seconds: a bucket that drafts once is measured."""
        if self.draft_costs is not None:
            out = []
            fallback = self.draft_correction or self.table_correction
            for b in range(top + 1):
                fix = self.draft_cost.get(b, fallback)
                f = math.exp(fix.value) if fix.value else 1.0
                out.append(self.draft_costs(1 << b, 1 << b) * f)
            return out
        known = sorted((b, e.value) for b, e in self.draft_cost.items() if e.value is not None)
        if not known:
            return [0.0] * (top + 1)
        if len(known) > 1:
            (b0, v0), (b1, v1) = known[-2], known[-1]
            slope = min(max(math.log2(max(v1, 1e-12) / max(v0, 1e-12)) / (b1 - b0), 0.0), 1.0)
        else:
            slope = DRAFT_SLOPE
        out, i = [], 0
        for b in range(top + 1):
            while i < len(known) and known[i][0] < b:
                i += 1
            if i < len(known) and known[i][0] == b:
                out.append(known[i][1])
            elif i == 0:
                out.append(known[0][1])
            elif i == len(known):
                bl, vl = known[-1]
                out.append(vl * 2 ** (slope * (b - bl)))
            else:  # between two measured buckets: geometric
                (b0, v0), (b1, v1) = known[i - 1], known[i]
                out.append(v0 * (v1 / v0) ** ((b - b0) / (b1 - b0)) if v0 > 0 else v1)
        return out

    def _draft_curve(self, paid: int, n: int) -> list[float]:
        """``draft_seconds(paid + k) - draft_seconds(paid)`` for k in 0 .. n:
        the drafter's extra cost of k more requests when ``paid`` draft anyway."""
        per_bucket = self._draft_buckets(bucket(paid + n))
        base = per_bucket[bucket(paid)] if paid else 0.0
        return [
            max(per_bucket[bucket(m)] - base, 0.0) if m else 0.0 for m in range(paid, paid + n + 1)
        ]

    def catch_up_seconds(self, pending: int) -> float:
        """What a request with ``pending`` rows adds to a round's drafting,
        corrected as the drafter's round is."""
        extra = max(pending - STEADY_ROWS, 0)
        if not extra or not self.draft_row:
            return 0.0
        fix = self.draft_correction or self.table_correction
        return self.draft_row * extra * (math.exp(fix.value) if fix.value else 1.0)

    def _cell(self, requests: int, tokens: int) -> tuple[int, int]:
        return bucket(requests), bucket(max(tokens, 1) // max(requests, 1))

    # ---- decisions -------------------------------------------------------------------

    def before_draft(
        self,
        owns: Sequence[list[float] | None],
        limits: Sequence[int],
        requests: int,
        extra: int,
        drafting: int = 0,
        pending: Sequence[int] | None = None,
        remaining: Sequence[int] | None = None,
    ) -> list[int]:
        """Drafts each decoding request will verify next step, before drafting.

        ``owns``: each request's own rates; ``limits``: its most drafts;
        ``requests``: the next step's requests (decoding ones included);
        ``extra``: its tokens other than these requests' anchors (prefill,
        pinned chains); ``drafting``: requests drafting whatever is chosen
        (pinned), whose drafter forward is paid already; ``pending``: each
        request's rows to take into the drafter's context first, a cost paid
        once for the rounds it has left (``remaining`` tokens at most, at
        its expected tokens per round; ``CATCH_UP_ROUNDS`` at most), and so
        priced per round."""
        if not self.gate:
            return list(limits)
        if self.regime(requests) == PLAIN:
            self.stats.forced_plain += 1
            return [0] * len(owns)
        survival = survivals([self.estimates(o) for o in owns], limits)
        fixed = len(owns) + extra
        curve = self.step_curve(requests, fixed, sum(limits) + 1)
        draft = self._draft_curve(drafting, len(owns))
        join = None
        if pending is not None:
            left = remaining or [1] * len(pending)
            join = [
                self.catch_up_seconds(p) / min(max(n / (1 + sum(s)), 1.0), CATCH_UP_ROUNDS)
                for p, s, n in zip(pending, survival, left)
            ]
        lengths = choose_drafts(survival, curve, draft, MARGIN, join)
        if any(limits) and not any(lengths):  # the costs chose plain: the estimates recover
            self.rates = [r + PRIOR_DRIFT * (self.prior - r) for r in self.rates]
        return lengths

    def after_draft(
        self, survival: Sequence[Sequence[float]], requests: int, fixed_tokens: int
    ) -> list[int]:
        """Refines the lengths of what was drafted; ``fixed_tokens``: the next
        step's tokens with no drafts.

        The drafting is paid by now, but every round pays it: the lengths
        maximise the round's tokens over all of its time, the drafting as
        predicted included. (Over the verify alone, a draft looked worth its
        verify only at the verify's own, higher, rate: at one request that
        cut chains the text would have taken whole, 11% of the fixed
        length's speed.) Predicted, not measured: the budget schedule
        decides from its saved tables alone, run after run alike."""
        n = len(survival)
        if self.gate:
            paid = self.draft_seconds(n)
        else:
            paid = self.draft_costs(n, n) if self.draft_costs is not None and n else 0.0
        curve = self.step_curve(requests, fixed_tokens, sum(map(len, survival)) + 1)
        return choose_drafts(survival, [t + paid for t in curve])

    def regime(self, requests: int) -> str:
        """Who decides the next step (at ``requests`` running): the safety net's."""
        return self.net.regime(requests)

    # ---- measurements ----------------------------------------------------------------

    def observe_draft(self, n: int, seconds: float, pending: int = 0) -> None:
        """A round for ``n`` requests in ``seconds``, with ``pending`` rows past
        ``STEADY_ROWS`` per request to catch up in all (measured online
        only: only rounds without any are)."""
        if self.draft_costs is None:
            if not pending:
                self.draft_cost.setdefault(bucket(n), _Ewma()).add(seconds)
            return
        predicted = self.draft_costs(n, n) + self.draft_row * pending
        x = math.log(max(seconds, 1e-12) / max(predicted, 1e-12))
        start = (self.draft_correction or self.table_correction).value
        if self.draft_correction is None:
            self.draft_correction = _Ewma(value=start)
        self.draft_cost.setdefault(bucket(n), _Ewma(value=start)).add_log(x)
        self.draft_correction.add_log(x)

    def observe_step(
        self,
        requests: int,
        tokens: int,
        decoding: int,
        drafts: int,
        generated: int,
        seconds: float,
        draft_seconds: float,
        drafted: bool | None = None,
    ) -> None:
        """A measured step: ``requests`` of ``tokens`` in all, ``decoding`` of
        them decoding with ``drafts`` drafts verified in all, ``generated``
        tokens generated (by every request), in ``seconds`` (plus
        ``draft_seconds`` spent deciding and drafting them the step before;
        ``drafted``: whether the drafter ran for it, None: whether it
        verified drafts). The net counts each of the step's rounds
        (``observe_round``, before this) at its credit (``NET_ROUNDS``)."""
        cell = self._cell(requests, tokens)
        raw = self.costs(requests, tokens)
        self.stats.predicted_seconds += raw * self._factor(cell)
        if self.gate:  # without it the saved table decides alone, run after run alike
            x = math.log(max(seconds, 1e-12) / max(raw, 1e-12))
            if cell not in self.correction:
                self.correction[cell] = _Ewma(value=self._correction_of(cell).value)
            row = self.row_correction.setdefault(cell[0], _Ewma(value=self.table_correction.value))
            for fix in (self.correction[cell], row, self.table_correction):
                fix.add_log(x)
        self.stats.measured_seconds += seconds
        credit, self._credit = self._credit, 0.0
        if math.isfinite(seconds) and decoding:
            drafted = drafts > 0 if drafted is None else drafted
            self.net.observe(generated + credit, seconds + draft_seconds, drafted)
        if not decoding:
            return
        self.stats.steps += 1
        self.stats.drafts[drafts] = self.stats.drafts.get(drafts, 0) + 1
        if drafts == 0:
            self.stats.plain_steps += 1


def build_planner(
    config: EngineConfig, runner: ModelRunner, proposer: Proposer
) -> SpecPlanner | None:
    """The planner the configuration asks for (None: fixed lengths), its
    tables loaded from ``--speculative-dspark-sps-table-path`` or profiled
    now (and saved there)."""
    spec, width = config.spec, proposer.max_drafts
    if not spec.enabled or not (spec.adaptive or spec.schedule == "budget") or width == 0:
        return None
    path = spec.sps_table_path
    if path and os.path.exists(path):
        costs = StepCosts.load(path)
    else:
        costs = profile_step_costs(runner, proposer, config.scheduler.max_running_requests)
        if path:  # profiled once, reused by later starts
            costs.save(path)
    return SpecPlanner(
        width, costs.target, gate=spec.adaptive, draft_costs=costs.draft, draft_row=costs.draft_row
    )
