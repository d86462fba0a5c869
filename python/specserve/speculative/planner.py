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

The costs are ``CostModel``'s: tables profiled at start-up on the forwards
real steps run, corrected online by what steps measure; the choice is
``draft_choice.choose_drafts``'s. A safety net measures what the engine
delivers under the model's decisions and under plain steps alone, in
blocks of steps per load bucket (short probes for plain while the model
leads), and gives a bucket to the model only while it measures more
goodput there; the loser runs a block now and then, less often the more
it loses by.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specserve.speculative.cost_model import ALPHA, CostModel, Ewma
from specserve.speculative.draft_choice import choose_drafts, rated_drafts, survival_of, survivals
from specserve.speculative.safety_net import PLAIN, SafetyNet, load_bucket
from specserve.speculative.step_costs import CostTable, StepCosts, profile_step_costs

if TYPE_CHECKING:  # the planner imports no stage at run time
    from specserve.config import EngineConfig
    from specserve.runner.model_runner import ModelRunner
    from specserve.speculative.base import Proposer

# The engine-wide estimates' weight of one round: slower than a request's
# own, so that they stay a longer-run reference to drift back to. (At one
# request both see the same rounds: at one weight, a request whose
# estimates fell after hard text drifted toward estimates that had fallen
# as far, and stayed plain for as long as the drift back
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
# toward the long-run ones (``LONG_ALPHA``): acceptance does not change with
# the load (the costs decide that nobody drafts), but an engine whose
# estimates a stretch of hard text, or drafts cut at a high load, took low
# must try again some time. (At DRIFT, a few dozen plain steps under load
# made every draft look likely and started rounds that lost.)
RECOVER_DRIFT = 0.02
# The long-run estimates' weight of one verified round: what the engine's
# estimates recover toward (the prior before any round). Rounds verified
# alone count, so the cuts of a high load, which count as misses in the
# engine's estimates, do not take them low; and a stretch of hard text
# moves them a little. (Recovering toward the prior instead, at 16
# requests a model deciding every step found full chains worth 1.02-1.2x
# plain every 28 steps, at 0.8 a position where verified rounds accepted
# 0.65-0.77: each such round ran about 0.8x, and the model's steps 0.944x
# plain against 0.989x for plain steps on the same engine; so, 0.976x.)
LONG_ALPHA = 0.01
# A plain choice the costs made by a wide margin holds for the next steps
# at the same load, one step per HOLD_PER_STEP of the margin (the best
# choice with drafts at 0.9 of plain's worth: 5 steps), HOLD_MAX at most:
# the estimates move a few percent per step at most, and deciding afresh
# cost a 32-request step 5% of its time (a few hundred drafts ranked and
# scanned, in Python, several times over). The same load: requests in
# the same load bucket, and prefill chunks beside of as many tokens within
# a factor of two (``_load_key``): at 64 requests a request arrives nearly
# every step, and keyed by the chunks' exact tokens no hold lasted a step
# (a decision, 0.9 ms of a 30 ms step, every step).
HOLD_PER_STEP = 0.02
HOLD_MAX = 16
# A request's context to catch up is paid once for this many rounds at
# most (fewer if it has fewer left): the regime may turn plain after a
# block of steps, and the next catch-up is paid again.
CATCH_UP_ROUNDS = 8
# The acceptance assumed before any is measured: optimistic, so that a new
# engine speculates and measures (the measured costs hold it back where
# speculation cannot pay, whatever the estimates).
PRIOR = 0.8
# Where the calibration of a confidence head starts (accepted and predicted
# alike).
CAL_PRIOR = 0.5
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
# The weight of one step's refinement in the shares of the drafted positions
# it kept (``SpecPlanner.kept``).
KEEP_ALPHA = 0.1
# A step's seconds less its chunks' (``decoding_seconds``) count at least this
# share of its decoding's alone as priced: a chunk priced dear must not make
# a step look nearly free.
CHUNK_FLOOR = 0.5


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
    measured_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "spec_steps": self.steps,
            "spec_plain_steps": self.plain_steps,
            "spec_forced_plain_steps": self.forced_plain,
            "spec_drafts_per_step": dict(sorted(self.drafts.items())),
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
        self.cost = CostModel(costs, draft_costs, draft_row)
        self.gate = gate
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        """Forgets everything learnt online (after the start-up warm-up, whose
        first launches and made-up prompts say nothing of real steps); the
        profiled table stays."""
        self.rates = [self.prior] * self.width  # engine-wide acceptance per position
        self.long_rates = [self.prior] * self.width  # the same over verified rounds, long-run
        # Calibration of confidences per position: EMA of accepted and of
        # predicted, both from one value (a scale of 1: the head's word), so
        # that a first rejection moves the scale by a step, not to 0 (which
        # would cut every later chain to nothing, and so never be measured
        # again).
        self.cal_acc = [Ewma(value=CAL_PRIOR) for _ in range(self.width)]
        self.cal_conf = [Ewma(value=CAL_PRIOR) for _ in range(self.width)]
        self.cost.reset()
        self.net = SafetyNet()  # who decides each block of steps
        # Rounds' committed and predicted tokens: the scale of the net's credit.
        self.committed = _Mean(NET_ROUNDS)
        self.predicted = _Mean(NET_ROUNDS)
        self._credit = 0.0  # the step's rounds: credited tokens less committed
        # Per load bucket, the share of the drafts at each position that
        # ``after_draft``'s cut by confidences keeps for the verify: a step
        # that drafts is priced with the verify it will run. (Priced whole,
        # as drafted, where the estimates count a cut draft as a miss, at 4
        # requests a DSPARK round was priced a verify of 32 tokens, 13.8
        # ms, where it ran 22, 12.2 ms: drafting looked worth 1.13x plain
        # where it ran 1.27x, and 38% of the decisions there were plain.)
        self.kept: dict[int, list[float]] = {}
        # A plain choice held: its load (``_load_key``), steps left.
        self._hold: tuple[tuple[int, int], int] | None = None
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
        drafted: int | None = None,
    ) -> list[float]:
        """After a verify round of ``verified`` drafts with ``accepted`` of them
        taken: updates the engine's and calibration's estimates and returns
        the request's own. ``predicted``: the tokens the planner expected
        of the round (``predicted_tokens``; None: from ``own``);
        ``drafted``: the drafts it had before ``after_draft`` cut them
        (None: ``verified``), see ``_judge``."""
        own = self.estimates(own)
        if predicted is None:
            predicted = self.predicted_tokens(own, None, verified)
        committed = accepted + 1
        self.committed.add(committed)
        self.predicted.add(predicted)
        scale = self.committed.value / max(self.predicted.value, 1e-12)
        self._credit += predicted * scale - committed
        self._judge(own, accepted, min(committed, max(verified, drafted or 0)))
        long, heads = self.long_rates, len(confidence or ())
        for j in range(min(committed, verified)):  # the verified positions
            hit = 1.0 if j < accepted else 0.0
            long[j] += LONG_ALPHA * (hit - long[j])
            if j < heads:
                self.cal_acc[j].add(hit)
                self.cal_conf[j].add(confidence[j])
        return own

    def observe_cut(self, own: list[float] | None) -> list[float]:
        """A request drafted for whose drafts ``after_draft`` cut to none (its
        step is plain): its first draft counts as not accepted (``_judge``)."""
        own = self.estimates(own)
        self._judge(own, 0, 1)
        # Verified rounds alone move the calibration, so one that a run of
        # rejections took low cut every later chain to none, never verified
        # again: at one request, after a stretch of hard text, the first
        # position's scale sat at 0.06 and up to a fifth of the steps paid
        # the drafter for nothing (1.27x plain where the chains verified
        # whole ran 1.46x). Each such cut moves it back toward the head's
        # word. (Not a partial cut's: at a high load the costs make most,
        # and a drift there would lean every estimate toward the head's.)
        for acc, conf in zip(self.cal_acc, self.cal_conf):
            if acc.value is not None and conf.value is not None:
                acc.value += DRIFT * (conf.value - acc.value)
        return own

    def _judge(self, own: list[float], accepted: int, reach: int) -> None:
        """The request's and the engine's rates at positions ``0 .. reach - 1``:
        hits below ``accepted``, a miss at it. A draft that ``after_draft``
        cut counts as a miss, as a rejected one: the rates are what a round
        commits by the time it is verified, which the decision before
        drafting must predict. (Counted where verified only, a later
        position's rate was measured on the confident chains the cut
        kept: at 8 requests the estimates before drafting promised 16%
        more tokens than the rounds committed.)"""
        for j in range(reach):
            hit = 1.0 if j < accepted else 0.0
            own[j] += ALPHA * (hit - own[j])
            self.rates[j] += ENGINE_ALPHA * (hit - self.rates[j])

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
        free: Sequence[bool] | None = None,
        chunk: bool = False,
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
        priced per round; ``free``: each request's drafts are found already
        (``Proposer.lookup``), so it drafts without the drafter's forward;
        ``chunk``: the step has prefill chunks (among ``extra``)."""
        if not self.gate:
            return list(limits)
        if self.forced_plain(requests):
            return [0] * len(owns)
        survival = survivals([self.estimates(o) for o in owns], limits)
        fixed = len(owns) + extra
        curve = self.cost.step_curve(requests, fixed, sum(limits) + 1, drafting > 0, chunk)
        draft = self.cost.draft_curve(drafting, len(owns))
        join = None
        if pending is not None:
            left = remaining or [1] * len(pending)
            join = [
                self.cost.catch_up_seconds(p) / min(max(n / (1 + sum(s)), 1.0), CATCH_UP_ROUNDS)
                for p, s, n in zip(pending, survival, left)
            ]
        fed = self.kept.get(load_bucket(requests))
        lengths, worth = rated_drafts(survival, curve, draft, MARGIN, join, free, fed)
        self._hold = None
        if any(limits) and not any(lengths):  # the costs chose plain: the estimates recover
            self._recover()
            held = min(int((1.0 - worth) / HOLD_PER_STEP), HOLD_MAX)
            if held > 0:
                self._hold = (_load_key(requests, extra), held)
        return lengths

    def _recover(self) -> None:
        """A step the costs made plain: the engine-wide rates move toward the
        long-run ones."""
        self.rates = [r + RECOVER_DRIFT * (g - r) for r, g in zip(self.rates, self.long_rates)]

    def holds_plain(self, requests: int, extra: int) -> bool:
        """Whether the costs' last plain choice holds for the next step (its
        load the same: ``requests`` running, ``extra`` tokens besides their
        anchors, as ``before_draft`` takes them; see HOLD_PER_STEP), which
        is then plain as if decided afresh."""
        hold = self._hold
        if hold is None or hold[0] != _load_key(requests, extra):
            self._hold = None
            return False
        self._hold = (hold[0], hold[1] - 1) if hold[1] > 1 else None
        self._recover()
        return True

    def after_draft(
        self,
        survival: Sequence[Sequence[float]],
        requests: int,
        fixed_tokens: int,
        chunk: bool = False,
    ) -> list[int]:
        """Refines the lengths of what was drafted; ``fixed_tokens``: the next
        step's tokens with no drafts; ``chunk``: some are prefill chunks.

        The drafting is paid by now, but every round pays it: the lengths
        maximise the round's tokens over all of its time, the drafting as
        predicted included. (Over the verify alone, a draft looked worth its
        verify only at the verify's own, higher, rate: at one request that
        cut chains the text would have taken whole, 11% of the fixed
        length's speed.) Predicted, not measured: the budget schedule
        decides from its saved tables alone, run after run alike. What it
        keeps of each position prices the next decisions' verifies
        (``kept``)."""
        n = len(survival)
        paid = self.cost.draft_seconds(n) if self.gate else self.cost.profiled_draft_seconds(n)
        curve = self.cost.step_curve(
            requests, fixed_tokens, sum(map(len, survival)) + 1, chunk=chunk
        )
        lengths = choose_drafts(survival, [t + paid for t in curve])
        self._observe_kept(requests, survival, lengths)
        return lengths

    def _observe_kept(
        self, requests: int, survival: Sequence[Sequence[float]], lengths: Sequence[int]
    ) -> None:
        """The shares of the drafted positions that a cut at ``requests``
        kept (``kept``)."""
        drafted = np.fromiter(map(len, survival), dtype=np.int64, count=len(survival))
        at = np.arange(self.width)[:, None]  # [width, 1]
        reached = drafted[None, :] > at  # [width, requests]: position drafted
        kept = reached & (np.asarray(lengths, dtype=np.int64)[None, :] > at)
        n = reached.sum(axis=1)  # [width]
        seen = n > 0
        b = load_bucket(requests)
        shares = np.asarray(self.kept.get(b, [1.0] * self.width))  # [width]
        shares[seen] += KEEP_ALPHA * (kept.sum(axis=1)[seen] / n[seen] - shares[seen])
        self.kept[b] = shares.tolist()  # host read: numpy, no device

    def regime(self, requests: int) -> str:
        """Who decides the next step (at ``requests`` running): the safety net's."""
        return self.net.regime(requests)

    def forced_plain(self, requests: int) -> bool:
        """Whether the safety net makes the next step plain (counted as such):
        nobody drafts, whatever the estimates."""
        if not self.gate or self.regime(requests) != PLAIN:
            return False
        self.stats.forced_plain += 1
        return True

    # ---- measurements ----------------------------------------------------------------

    def observe_draft(self, n: int, seconds: float, pending: int = 0) -> None:
        """A drafting round measured (``CostModel.observe_draft``)."""
        self.cost.observe_draft(n, seconds, pending)

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
        decode_tokens: int | None = None,
    ) -> None:
        """A measured step: ``requests`` of ``tokens`` in all, ``decoding`` of
        them decoding with ``drafts`` drafts verified in all and
        ``decode_tokens`` tokens fed (None: all of them; the rest are prefill
        chunks), ``generated`` tokens generated by the decoding requests, in
        ``seconds`` (plus ``draft_seconds`` spent deciding and drafting them
        the step before; ``drafted``: whether the drafter ran for it, None:
        whether it verified drafts). The net counts each of the step's
        rounds (``observe_round``, before this) at its credit
        (``NET_ROUNDS``), and of a step with prefill chunks, its seconds
        less the chunks' (``decoding_seconds``): prefill is the arrivals'
        work, not a regime's, and a probe of a few steps with a chunk or
        without measured plain at half or whole speed."""
        # Without the gate the saved table decides alone, run after run alike.
        verify = drafts > 0
        chunk = decode_tokens is not None and decode_tokens < tokens
        self.cost.observe_step(requests, tokens, seconds, self.gate, verify, chunk)
        self.stats.measured_seconds += seconds
        credit, self._credit = self._credit, 0.0
        if math.isfinite(seconds) and decoding:
            drafted = verify if drafted is None else drafted
            if chunk:
                assert decode_tokens is not None
                anchors = decode_tokens - drafts
                seconds = self.decoding_seconds(
                    seconds, requests, tokens - drafts, decoding, anchors
                )
            self.net.observe(generated + credit, seconds + draft_seconds, drafted)
        if not decoding:
            return
        self.stats.steps += 1
        self.stats.drafts[drafts] = self.stats.drafts.get(drafts, 0) + 1
        if drafts == 0:
            self.stats.plain_steps += 1

    def decoding_seconds(
        self, seconds: float, requests: int, tokens: int, decoding: int, anchors: int
    ) -> float:
        """A step's ``seconds`` less what its prefill chunks cost it, as the
        plain step of its shape (``requests`` of ``tokens``, ``decoding`` of
        them with ``anchors`` tokens) prices them against the same step
        without them, whichever regime ran it (CHUNK_FLOOR of the decoding's
        price at least): arrivals come with the tokens committed, so every
        regime's steps carry as many chunks per token, and charged alike,
        an error in their price moves both regimes' goodput the same way.
        (Each step's decoding share by its own cells, verifying or plain,
        had the net measure the model 1.01-1.03x plain at 64 requests where
        its blocks ran 0.83-0.87x.)"""
        alone = self.cost.step_seconds(decoding, anchors)
        chunks = max(self.cost.step_seconds(requests, tokens, chunk=True) - alone, 0.0)
        return max(seconds - chunks, CHUNK_FLOOR * alone)

    def metrics(self) -> dict:
        """What ``/get_server_info`` and ``/metrics`` show of the planner."""
        return {
            **self.stats.to_dict(),
            "spec_predicted_step_seconds": self.cost.predicted_seconds(),
        }


def _load_key(requests: int, extra: int) -> tuple[int, int]:
    """A held plain choice's load (see HOLD_PER_STEP): the requests' load
    bucket (C and the C - 1 left while one is replaced share one: keyed by
    the exact count, the holds broke as requests were replaced, and a model
    deciding every step at 16 requests in a closed loop decided in 235 of
    500 steps, 5.8% of a step each), and the step's other tokens within a
    factor of two."""
    return load_bucket(requests), extra.bit_length()


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
