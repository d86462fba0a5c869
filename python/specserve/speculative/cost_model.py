"""What the planner predicts a step and a drafting round cost: the
profiled tables (``step_costs.py``) corrected online by what steps measure.

A correction is an EWMA of log(measured / table) in two parts added: its
load's (requests bucket, prefill chunks or not: ``_base``), and for what
speculation adds, a verifying step's cells and the drafter's rounds,
their shape against it (what they take beyond it; a verifying cell never
measured: its row's, else every verifying step's). The table times the
forward alone, and a step that verifies pays per row besides (every
row's logits processed, the chains verified and committed, their
features handed to the drafter); a chunk's tokens are one request's in a
row, which the table, profiled over requests' chains, does not price.
The step's cost never falls with more drafts (cells apart may disagree).
The drafter's round is its profiled table's, corrected so per requests
bucket, or without a profile measured online and priced by a power law
where it was not.

A load's correction follows its steps, plain or verifying: the machine's
speed, which moves by 10-30% over seconds here; a shape follows only its
own. So the steps that draft, measured only while the model drafts,
follow the machine as the plain steps measure it. (Each cell corrected
on its own, a stretch of slow verifying steps priced them dear long
after the machine sped up again, the model stopped drafting, and nothing
measured them again: at 4 requests the verify priced at 1.4x what it
took, the engine plain where its fixed length ran 1.11-1.15x plain.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specserve.speculative.step_costs import STEADY_ROWS, CostTable

# EWMA weight of one new observation (a cost correction, an acceptance estimate).
ALPHA = 0.1
# How the drafter's seconds grow per doubling of its requests, in log2,
# while only one bucket is measured (0: flat, 1: linear).
DRAFT_SLOPE = 0.5
# A correction of the step table takes one measurement as at most this
# factor off its current prediction (a first launch, a stall), whatever it
# measured; measurements that keep saying so move it on, by any factor.
MAX_CORRECTION = 16.0
# ... and a shape (``CostModel.reset``) at most this factor: shapes are
# measured only while the model drafts, so a stall that priced them dear
# would stand until it drafted again, which a price too dear forbids; a
# load's correction, which plain steps measure too, takes the rest.
MAX_SHAPE_CORRECTION = 2.0
# Measured steps wait and correct the table in order when it is next read,
# or once this many wait: one step's correction, run alone right after its
# forward, finds its objects out of the caches (30 us of a 7 ms step at 4
# requests; 9 us run again at once), and most steps at a high load decide
# nothing that reads the table. Every read settles them first, so what it
# reads is what corrections made at once would give.
OBSERVE_BATCH = 16

# The step curves a cost model keeps (``step_curve``), at most, of each kind.
MAX_CURVES = 64

# A step table correction's cell (``_cell``).
Cell = tuple[bool, bool, int, int]


def _keep(cache: dict, key: object, value: object) -> None:
    """``cache[key] = value``, the cache emptied first when full (MAX_CURVES)."""
    if len(cache) >= MAX_CURVES:
        cache.clear()
    cache[key] = value


def bucket(n: int) -> int:
    """log2 load bucket: 1, 2-3, 4-7, ..."""
    return max(n, 1).bit_length() - 1


@dataclass
class Ewma:
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + ALPHA * (x - self.value)
        self.count += 1

    def add_log(self, x: float, most: float = MAX_CORRECTION) -> None:
        """A log-ratio, its step from the current value at most log(``most``)."""
        assert self.value is not None
        limit = math.log(most)
        self.value += ALPHA * min(max(x - self.value, -limit), limit)
        self.count += 1


class CostModel:
    """The seconds of a target step and of a drafting round, as predicted now."""

    def __init__(
        self, costs: CostTable, draft_costs: CostTable | None = None, draft_row: float = 0.0
    ):
        """``draft_costs``: the drafter's round by requests, profiled (None:
        measured online only); ``draft_row``: the seconds a pending row past
        ``STEADY_ROWS`` per request adds to a round (``StepCosts``)."""
        self.costs = costs
        self.draft_costs = draft_costs
        self.draft_row = draft_row if draft_costs is not None else 0.0
        self.reset()

    def reset(self) -> None:
        """Forgets every correction; the profiled tables stay."""
        # log(measured / profiled), EWMAs in logs, so that an outlier moves
        # them by a factor, not to itself. Per load (requests bucket, prefill
        # chunks or not: ``base``), its steps', less a verifying one's shape;
        # a load never measured takes every step's (``table_correction``): a
        # table wrong by one factor (profiled while another process ran) is
        # right again as soon as any step is measured. Per verifying cell, its
        # steps' beyond their load's (``correction``, the shape; a cell never
        # measured takes its row's, else every verifying step's,
        # ``verify_correction``). A step with prefill chunks is a load apart:
        # at 16 requests a verifying step of about 70 tokens took 17 ms and a
        # plain one with a prefill chunk as long 14 ms, and the chunks' steps,
        # four in five of those measured in the cell, priced the verify at
        # theirs; at 63 requests a plain step's correction, measured mostly
        # with a chunk, priced the decoding alone 1.6x its verifying
        # neighbour's, and a draft looked as if it made the step cheaper: the
        # model drafted one token a step, 0.95x plain.
        self.base: dict[tuple[bool, int], Ewma] = {}
        self.table_correction = Ewma(value=0.0)
        self.correction: dict[Cell, Ewma] = {}
        self.row_correction: dict[tuple[bool, int], Ewma] = {}
        self.verify_correction = Ewma(value=0.0)
        # By drafting-requests bucket: with a profile, the round's shape
        # against the load of as many requests (as a cell's; a bucket never
        # measured takes the drafter's, ``draft_correction``), else the
        # seconds themselves.
        self.draft_cost: dict[int, Ewma] = {}
        self.draft_correction = Ewma(value=0.0)
        # Steps measured, not yet corrected by (``observe_step``), and the
        # seconds predicted of those that were.
        self._waiting: list[tuple[int, int, float, bool, bool, bool]] = []
        self._predicted = 0.0
        # ``step_curve``'s answers since the corrections last moved (a step
        # asks twice at one load, before and after drafting), and the
        # table's own curves, which never move: 60 us a curve at one
        # request, its arrays out of the caches after the forward.
        self._curves: dict[tuple[int, int, int, bool, bool], list[float]] = {}
        self._table_curves: dict[tuple[int, int, int], np.ndarray] = {}

    # ---- the target's step -----------------------------------------------------------

    def step_seconds(
        self, requests: int, tokens: int, verify: bool = False, chunk: bool = False
    ) -> float:
        """A step's seconds (``step_curve``'s first point, without its
        arrays: the planner asks for points every step with prefill
        chunks); ``verify``: the step verifies drafts; ``chunk``: it has
        prefill chunks."""
        self._settle()
        return self.costs(requests, tokens) * self._factor(_cell(requests, tokens, verify, chunk))

    def step_curve(
        self, requests: int, first: int, n: int, verify: bool = False, chunk: bool = False
    ) -> list[float]:
        """``step_seconds`` at ``first`` .. ``first + n - 1`` tokens, the
        first token's plain and the others' verifying (all of them with
        ``verify``: chains verified whatever the choice), made monotone: a
        draft more never makes a step cheaper. (Shared: read, never write.)"""
        self._settle()
        key = (requests, first, n, verify, chunk)
        curve = self._curves.get(key)
        if curve is None:
            curve = self._step_curve(requests, first, n, verify, chunk)
            _keep(self._curves, key, curve)
        return curve

    def _step_curve(
        self, requests: int, first: int, n: int, verify: bool, chunk: bool
    ) -> list[float]:
        key = (requests, first, n)
        table = self._table_curves.get(key)
        if table is None:
            table = self.costs.curve(requests, first, n)
            _keep(self._table_curves, key, table)
        out = table.copy()
        r = max(requests, 1)
        k = 0
        while k < n:  # one cell per run of tokens per request in one bucket
            tokens_bucket = bucket(max(first + k, 1) // r)
            end = 1 if k == 0 else min(n, (1 << (tokens_bucket + 1)) * r - first)
            out[k:end] *= self._factor((verify or k > 0, chunk, bucket(r), tokens_bucket))
            k = max(end, k + 1)
        return np.maximum.accumulate(out).tolist()  # host read: numpy, no device

    def observe_step(
        self,
        requests: int,
        tokens: int,
        seconds: float,
        learn: bool,
        verify: bool = False,
        chunk: bool = False,
    ) -> None:
        """A step measured at ``seconds`` (see OBSERVE_BATCH). ``learn``:
        correct the table by it (without, a saved table decides alone, run
        after run alike); ``verify``: it verified drafts; ``chunk``: it had
        prefill chunks."""
        self._waiting.append((requests, tokens, seconds, learn, verify, chunk))
        if len(self._waiting) >= OBSERVE_BATCH:
            self._settle()

    def predicted_seconds(self) -> float:
        """The seconds predicted of the steps measured, each as predicted
        before its own measurement."""
        self._settle()
        return self._predicted

    def _settle(self) -> None:
        """The waiting steps' corrections, in the order they were measured."""
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, []
        self._curves.clear()
        for requests, tokens, seconds, learn, verify, chunk in waiting:
            cell = _cell(requests, tokens, verify, chunk)
            raw = self.costs(requests, tokens)
            self._predicted += raw * self._factor(cell)
            if not learn:
                continue
            x = math.log(max(seconds, 1e-12) / max(raw, 1e-12))
            load = (chunk, cell[2])
            base = self.base.get(load)
            if base is None:
                base = self.base[load] = Ewma(value=self.table_correction.value)
            shapes: tuple[Ewma, ...] = ()
            if verify:
                fix = self.correction.get(cell)
                if fix is None:
                    fix = self.correction[cell] = Ewma(value=self._shape_of(cell))
                row = self.row_correction.get(load)
                if row is None:
                    row = self.row_correction[load] = Ewma(value=self.verify_correction.value)
                shapes = (fix, row, self.verify_correction)
            shape = (shapes[0].value or 0.0) if shapes else 0.0
            self.table_correction.add_log(x - shape)
            base.add_log(x - shape)
            for each in shapes:  # by what the load's correction left
                each.add_log(x - (base.value or 0.0), MAX_SHAPE_CORRECTION)

    def _factor(self, cell: Cell) -> float:
        """The measured / table factor of a cell (1 before any measurement)."""
        log = self._base(cell[1], cell[2]) + (self._shape_of(cell) if cell[0] else 0.0)
        return math.exp(log) if log else 1.0

    def _base(self, chunk: bool, requests_bucket: int) -> float:
        """The correction of a load (``requests_bucket``, with prefill chunks
        or not; never measured: every step's)."""
        return (self.base.get((chunk, requests_bucket)) or self.table_correction).value or 0.0

    def _shape_of(self, cell: Cell) -> float:
        """A verifying cell's shape, or what stands in for it (see ``reset``)."""
        fix = self.correction.get(cell) or self.row_correction.get((cell[1], cell[2]))
        return (fix or self.verify_correction).value or 0.0

    # ---- the drafter's round ---------------------------------------------------------

    def draft_seconds(self, n: int) -> float:
        """The drafter for ``n`` requests (0 before any was measured)."""
        if not n:
            return 0.0
        self._settle()  # (a bucket never measured takes the target's correction)
        if self.draft_costs is not None:  # the profile at n, its bucket's correction
            return self.draft_costs(n, n) * self._draft_factor(bucket(n))
        return self._draft_buckets(bucket(n))[-1]

    def profiled_draft_seconds(self, n: int) -> float:
        """The drafter for ``n`` requests by its profiled table alone (0
        without one): what a saved table decides run after run alike."""
        return self.draft_costs(n, n) if self.draft_costs is not None and n else 0.0

    def draft_curve(self, paid: int, n: int) -> list[float]:
        """``draft_seconds(paid + k) - draft_seconds(paid)`` for k in 0 .. n:
        the drafter's extra cost of k more requests when ``paid`` draft anyway.
        With a profile, at each count (a bucket's requests are not all its
        first's: at 25 of 32 requests drafting, the round took 1.7x the 16
        requests' the staircase priced it at, and requests 17-31 drafted for
        free by it); measured only, by bucket."""
        self._settle()
        if self.draft_costs is not None:  # each bucket's factor once (every step asks)
            factors = [self._draft_factor(b) for b in range(bucket(paid + n) + 1)]
            at = [
                self.draft_costs(m, m) * factors[bucket(m)] if m else 0.0
                for m in range(paid, paid + n + 1)
            ]
            return [
                max(t - at[0], 0.0) if m else 0.0 for m, t in zip(range(paid, paid + n + 1), at)
            ]
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
        self._settle()
        log = (self.table_correction.value or 0.0) + (self.draft_correction.value or 0.0)
        return self.draft_row * extra * (math.exp(log) if log else 1.0)

    def observe_draft(self, n: int, seconds: float, pending: int = 0) -> None:
        """A round for ``n`` requests in ``seconds``, with ``pending`` rows past
        ``STEADY_ROWS`` per request to catch up in all (measured online
        only: only rounds without any are)."""
        if self.draft_costs is None:
            if not pending:
                self.draft_cost.setdefault(bucket(n), Ewma()).add(seconds)
            return
        predicted = self.draft_costs(n, n) + self.draft_row * pending
        self._settle()
        x = math.log(max(seconds, 1e-12) / max(predicted, 1e-12))
        b = bucket(n)
        x -= self._base(False, b)  # the round's shape against its load's
        fix = self.draft_cost.setdefault(b, Ewma(value=self.draft_correction.value))
        for each in (fix, self.draft_correction):
            each.add_log(x, MAX_SHAPE_CORRECTION)

    def _draft_factor(self, b: int) -> float:
        """A profiled drafter's measured / profiled factor in requests bucket
        ``b``: the load's (``_base``) and the round's shape against it (a
        bucket never measured: the drafter's)."""
        log = self._base(False, b) + (self.draft_cost.get(b, self.draft_correction).value or 0.0)
        return math.exp(log) if log else 1.0

    def _draft_buckets(self, top: int) -> list[float]:
        """An unprofiled drafter's seconds per requests bucket 0 .. ``top``:
        measured, else a power law through the measured neighbours (past
        the largest, the slope of the two largest, within [0, 1]: never
        dearer per request for more of them). Below the smallest, its
        seconds: a bucket that drafts once is measured."""
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


def _cell(requests: int, tokens: int, verify: bool, chunk: bool) -> Cell:
    """A correction's cell: whether the step verifies, whether it has
    prefill chunks, its requests bucket (with the first two, its row) and
    its tokens per request bucket."""
    return verify, chunk, bucket(requests), bucket(max(tokens, 1) // max(requests, 1))
