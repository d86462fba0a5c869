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
steps run, corrected online per cell by the measured / predicted ratio; the
draft cost is measured online. A safety net compares the measured goodput
of speculative and plain steps per load bucket and turns a losing bucket
plain, probing now and then.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the planner imports no stage at run time
    from specserve.config import EngineConfig
    from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# EWMA weight of one new observation.
ALPHA = 0.1
# A speculative step must promise this much more goodput than plain (the
# cost of being wrong: the drafter's forward for nothing).
MARGIN = 0.02
# Per step, a request not drafting moves its estimates this far toward the
# engine-wide ones, and those (when nobody drafts) toward the prior: an
# estimate that went stale at high load recovers, and is measured again once
# the costs let it draft.
DRIFT = 0.05
# The acceptance assumed before any is measured: optimistic, so that a new
# engine speculates and measures (the measured costs hold it back where
# speculation cannot pay, whatever the estimates).
PRIOR = 0.8
# A bucket the safety net turned plain tries speculation every this many
# decisions; one that speculates measures a plain step as often.
PROBE_EVERY = 32


# ---- the decision ----------------------------------------------------------------------


def choose_drafts(
    survival: Sequence[Sequence[float]],
    step_seconds: Callable[[int], float],
    fixed_tokens: int,
    draft_seconds: Callable[[int], float] | None = None,
    margin: float = 0.0,
) -> list[int]:
    """Drafts to verify per request, maximising expected tokens per second.

    ``survival[i][j - 1]``: S_ij, non-increasing in j. ``step_seconds(T)``:
    the step at T tokens; ``fixed_tokens``: the step's tokens with no drafts
    (every anchor, any prefill). ``draft_seconds(n)``: drafting for n
    requests (None: already paid). A choice with drafts must beat the plain
    step by ``margin`` (relative)."""
    ranked = sorted(
        ((s, j, i) for i, row in enumerate(survival) for j, s in enumerate(row, start=1)),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    base = float(len(survival))
    plain = base / max(step_seconds(fixed_tokens), 1e-12)
    best, best_b = plain * (1.0 + margin), 0
    expected, drafting = base, set()
    for b, (s, _, i) in enumerate(ranked, start=1):
        expected += s
        drafting.add(i)
        seconds = step_seconds(fixed_tokens + b)
        if draft_seconds is not None:
            seconds += draft_seconds(len(drafting))
        rate = expected / max(seconds, 1e-12)
        if rate > best:
            best, best_b = rate, b
    lengths = [0] * len(survival)
    for _, j, i in ranked[:best_b]:
        lengths[i] = max(lengths[i], j)
    return lengths


def survival_of(rates: Sequence[float]) -> list[float]:
    """Running products of per-position acceptance rates (each in [0, 1])."""
    out, a = [], 1.0
    for r in rates:
        a *= min(max(r, 0.0), 1.0)
        out.append(a)
    return out


def static_lengths(confidence: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Drafts before the first confidence below ``threshold``."""
    lengths = []
    for conf in confidence:
        n = 0
        while n < len(conf) and conf[n] >= threshold:
            n += 1
        lengths.append(n)
    return lengths


# ---- the step cost ---------------------------------------------------------------------


class CostTable:
    """Seconds of a target step over (requests, tokens), profiled at
    ``counts`` requests of ``chains`` tokens each; linear in between (per
    request's tokens within a count, then across counts) and past the ends."""

    def __init__(
        self, counts: Sequence[int], chains: Sequence[int], times: Sequence[Sequence[float]]
    ):
        if not counts or not chains or any(len(row) != len(chains) for row in times):
            raise ValueError("a cost table needs one time per (requests, tokens per request)")
        if len(times) != len(counts) or any(t <= 0 for row in times for t in row):
            raise ValueError("a cost table needs positive seconds for every profiled cell")
        self.counts, self.chains = list(counts), list(chains)
        self.times = [list(row) for row in times]

    def __call__(self, requests: int, tokens: int) -> float:
        return self.curve(requests, tokens, 1)[0]

    def curve(self, requests: int, first: int, n: int) -> list[float]:
        """Seconds at ``requests`` of ``first``, ``first + 1`` .. ``first + n - 1``
        tokens: the counts interpolated once, then each along the chains."""
        requests = max(requests, 1)
        at = [_lerp(self.counts, col, requests) for col in zip(*self.times)]
        return [
            max(_lerp(self.chains, at, max(t, requests) / requests), 1e-9)
            for t in range(first, first + n)
        ]

    def to_dict(self) -> dict:
        return {"counts": self.counts, "chains": self.chains, "seconds": self.times}

    @classmethod
    def load(cls, path: str) -> CostTable:
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls(raw["counts"], raw["chains"], raw["seconds"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"speculative_dspark_sps_table_path: cannot read a cost table from {path!r}: {e!r}"
            ) from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


def _lerp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Linear through (xs, ys), extended past the ends (proportionally when
    there is one point)."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if x > xs[0] else 1.0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def profile_costs(
    forward: Callable[[int, int], None],
    counts: Sequence[int],
    chains: Sequence[int],
    repeats: int = 3,
) -> CostTable:
    """Times ``forward(requests, tokens per request)`` (median of ``repeats``
    after a warm-up) per cell, made non-decreasing along both axes."""
    times = []
    with torch.inference_mode():
        for _ in range(2):  # the largest step first: memory it touches the first time
            forward(counts[-1], chains[-1])
        for n in counts:
            row = []
            for c in chains:
                forward(n, c)
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    forward(n, c)
                    runs.append(time.perf_counter() - start)
                row.append(max(statistics.median(runs), 1e-9))
            times.append(row)
    for i in range(len(counts)):  # monotone: more tokens or requests never cost less
        for j in range(len(chains)):
            up = times[i - 1][j] if i else 0.0
            left = times[i][j - 1] if j else 0.0
            times[i][j] = max(times[i][j], up, left)
    return CostTable(counts, chains, times)


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

    def __init__(self, width: int, costs: CostTable, gate: bool = True, prior: float = PRIOR):
        """``width``: the most drafts a round verifies; ``gate``: decide before
        drafting (adaptive), else only refine what was drafted."""
        self.width = width
        self.costs = costs
        self.gate = gate
        self.prior = prior
        self.rates = [prior] * width  # engine-wide conditional acceptance per position
        # Calibration of confidences per position: EMA of accepted and of predicted.
        self.cal_acc = [_Ewma() for _ in range(width)]
        self.cal_conf = [_Ewma() for _ in range(width)]
        self.correction: dict[tuple[int, int], _Ewma] = {}  # measured / predicted per cell
        self.draft_cost: dict[int, _Ewma] = {}  # seconds by drafting-requests bucket
        self.goodput: dict[tuple[int, bool], _Ewma] = {}  # (load bucket, speculative)
        self.decisions: dict[int, int] = {}  # per load bucket, for probing
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
    ) -> list[float]:
        """After a verify round of ``verified`` drafts with ``accepted`` of them
        taken: updates the engine's and calibration's estimates and returns
        the request's own."""
        own = self.estimates(own)
        for j in range(min(accepted + 1, verified)):
            hit = 1.0 if j < accepted else 0.0
            own[j] += 2 * ALPHA * (hit - own[j])  # a request's own moves faster
            self.rates[j] += ALPHA * (hit - self.rates[j])
            if confidence is not None and j < len(confidence):
                self.cal_acc[j].add(hit)
                self.cal_conf[j].add(confidence[j])
        return own

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
        for k in range(n):
            fix = self.correction.get(self._cell(requests, first + k))
            if fix is not None and fix.value is not None:
                out[k] *= fix.value
        return out

    def draft_seconds(self, n: int) -> float:
        """The drafter for ``n`` requests: its bucket's measured seconds, else
        the nearest measured bucket below (0 before any). Optimistic on
        purpose: a bucket never measured drafts once, which measures it."""
        b = bucket(n)
        known = [k for k, e in self.draft_cost.items() if k <= b and e.value is not None]
        return self.draft_cost[max(known)].value if known else 0.0  # type: ignore[return-value]

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
    ) -> list[int]:
        """Drafts each decoding request will verify next step, before drafting.

        ``owns``: each request's own rates; ``limits``: its most drafts;
        ``requests``: the next step's requests (decoding ones included);
        ``extra``: its tokens other than these requests' anchors (prefill,
        pinned chains); ``drafting``: requests drafting whatever is chosen
        (pinned), whose drafter forward is paid already."""
        if not self.gate:
            return list(limits)
        load = bucket(len(owns) + drafting)
        self.decisions[load] = self.decisions.get(load, 0) + 1
        probe = self.decisions[load] % PROBE_EVERY == 0
        if self._losing(load) and not probe:
            self.stats.forced_plain += 1
            return [0] * len(owns)
        if probe and self._unmeasured_plain(load):
            return [0] * len(owns)  # measure what plain gets at this load
        survival = [survival_of(self.estimates(o)[:k]) for o, k in zip(owns, limits)]
        fixed = len(owns) + extra
        curve = self.step_curve(requests, fixed, sum(limits) + 1)
        paid = self.draft_seconds(drafting) if drafting else 0.0
        draft = [max(self.draft_seconds(n + drafting) - paid, 0.0) for n in range(len(owns) + 1)]
        lengths = choose_drafts(
            survival, lambda t: curve[t - fixed], fixed, draft.__getitem__, MARGIN
        )
        if not any(lengths):  # nobody verifies: the engine's estimates recover
            self.rates = [r + DRIFT * (self.prior - r) for r in self.rates]
        return lengths

    def after_draft(
        self, survival: Sequence[Sequence[float]], requests: int, fixed_tokens: int
    ) -> list[int]:
        """Refines the lengths of what was drafted (its cost is paid);
        ``fixed_tokens``: the next step's tokens with no drafts."""
        curve = self.step_curve(requests, fixed_tokens, sum(map(len, survival)) + 1)
        return choose_drafts(survival, lambda t: curve[t - fixed_tokens], fixed_tokens)

    def _losing(self, load: int) -> bool:
        spec, plain = self.goodput.get((load, True)), self.goodput.get((load, False))
        if spec is None or plain is None or spec.value is None or plain.value is None:
            return False
        return spec.count >= 8 and plain.count >= 2 and spec.value < plain.value

    def _unmeasured_plain(self, load: int) -> bool:
        plain = self.goodput.get((load, False))
        return plain is None or plain.count < 2

    # ---- measurements ----------------------------------------------------------------

    def observe_draft(self, n: int, seconds: float) -> None:
        self.draft_cost.setdefault(bucket(n), _Ewma()).add(seconds)

    def observe_step(
        self,
        requests: int,
        tokens: int,
        decoding: int,
        drafts: int,
        committed: int,
        seconds: float,
        draft_seconds: float,
    ) -> None:
        """A measured step: ``requests`` of ``tokens`` in all, ``decoding`` of
        them decoding with ``drafts`` drafts verified in all, ``committed``
        tokens committed by those, in ``seconds`` (plus ``draft_seconds``
        spent drafting them the step before)."""
        predicted = self.step_seconds(requests, tokens)
        if self.gate:  # without it the saved table decides alone, run after run alike
            raw = self.costs(requests, tokens)
            cell = self._cell(requests, tokens)
            self.correction.setdefault(cell, _Ewma()).add(seconds / max(raw, 1e-12))
        self.stats.predicted_seconds += predicted
        self.stats.measured_seconds += seconds
        if not decoding:
            return
        self.stats.steps += 1
        self.stats.drafts[drafts] = self.stats.drafts.get(drafts, 0) + 1
        if drafts == 0:
            self.stats.plain_steps += 1
        if decoding == requests and math.isfinite(seconds):  # decode-only steps compare
            key = (bucket(decoding), drafts > 0)
            self.goodput.setdefault(key, _Ewma()).add(
                committed / max(seconds + draft_seconds, 1e-12)
            )


# Cached positions before each chain when profiling step costs.
PROFILE_PREFIX = 256


def profile_step_costs(
    runner: ModelRunner, width: int, max_running: int, capture_layer_ids: tuple[int, ...]
) -> CostTable:
    """The cost table over the target's forwards as they will run (captured
    graphs where they apply): 1 .. ``max_running`` requests (powers of two)
    of plain (1), short and whole (``width + 1``) verify chains, each over a
    cached prefix."""
    counts = sorted({min(2**k, max_running) for k in range(max_running.bit_length() + 1)})
    chains = sorted({c for c in (1, 2, 4, width + 1) if c <= width + 1})
    prefix = max(0, min(PROFILE_PREFIX, runner.context_length - width - 1))
    start = time.perf_counter()
    table = profile_costs(
        lambda n, c: runner.verify_forward(n * c, c, prefix, capture_layer_ids), counts, chains
    )
    logger.info(
        "step costs profiled in %.1fs (ms by requests x tokens per request %s): %s",
        time.perf_counter() - start,
        chains,
        json.dumps({n: [round(1e3 * t, 2) for t in row] for n, row in zip(counts, table.times)}),
    )
    return table


def build_planner(
    config: EngineConfig, runner: ModelRunner, width: int, capture: tuple[int, ...]
) -> SpecPlanner | None:
    """The planner the configuration asks for (None: fixed lengths), its
    table loaded from ``--speculative-dspark-sps-table-path`` or profiled
    now (and saved there)."""
    spec = config.spec
    if not spec.enabled or not (spec.adaptive or spec.schedule == "budget") or width == 0:
        return None
    path = spec.sps_table_path
    if path and os.path.exists(path):
        costs = CostTable.load(path)
    else:
        costs = profile_step_costs(runner, width, config.scheduler.max_running_requests, capture)
        if path:  # profiled once, reused by later starts
            costs.save(path)
    return SpecPlanner(width, costs, gate=spec.adaptive)
