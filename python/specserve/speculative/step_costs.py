"""What a step costs: the target's forward over (running requests, step
tokens), the drafter's round over requests and what each committed
position it takes into its context beyond a steady round's adds, profiled
at start-up on the code real steps run, or read from a file."""

from __future__ import annotations

import bisect
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # profiled through the runner, imported by no stage at run time
    from specserve.runner.model_runner import ModelRunner
    from specserve.speculative.base import Proposer

logger = logging.getLogger(__name__)


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
        self._columns = [list(col) for col in zip(*self.times)]
        self._at: dict[int, list[float]] = {}  # by requests: the chains' seconds there

    def __call__(self, requests: int, tokens: int) -> float:
        requests = max(requests, 1)
        x = max(tokens, requests) / requests  # tokens per request
        return max(_lerp(self.chains, self.at(requests), x), 1e-9)

    def at(self, requests: int) -> list[float]:
        """Seconds of each profiled chain at ``requests`` (interpolated across
        the counts once per count asked: the planner asks every step)."""
        at = self._at.get(requests)
        if at is None:
            at = self._at[requests] = [_lerp(self.counts, col, requests) for col in self._columns]
        return at

    def curve(self, requests: int, first: int, n: int) -> np.ndarray:
        """Seconds at ``requests`` of ``first``, ``first + 1`` .. ``first + n - 1``
        tokens: the counts interpolated once, then each along the chains."""
        requests = max(requests, 1)
        at = self.at(requests)
        x = np.maximum(np.arange(first, first + n), requests) / requests  # tokens per request
        xs = self.chains
        if len(xs) == 1:
            one = at[0] * np.maximum(x / xs[0], 1.0)
            return np.maximum(one, 1e-9)
        out = np.interp(x, xs, at)
        below, above = x < xs[0], x > xs[-1]  # linear past either end, as its end segment
        out[below] = at[0] + (at[1] - at[0]) / (xs[1] - xs[0]) * (x[below] - xs[0])
        out[above] = at[-1] + (at[-1] - at[-2]) / (xs[-1] - xs[-2]) * (x[above] - xs[-1])
        return np.maximum(out, 1e-9)

    def to_dict(self) -> dict:
        return {"counts": self.counts, "chains": self.chains, "seconds": self.times}


@dataclass
class StepCosts:
    """The cost model's tables: the target's step, the drafter's round by
    requests (None: measured online), and the seconds each pending row
    (``Proposer.pending_rows``) past ``STEADY_ROWS`` per request adds to a
    round: a prompt's, or the positions of steps the request did not draft."""

    target: CostTable
    draft: CostTable | None = None
    draft_row: float = 0.0

    @classmethod
    def load(cls, path: str) -> StepCosts:
        """``{"counts", "chains", "seconds"}`` (the target's) and, if profiled,
        ``"draft_seconds"`` (the drafter's round at each count)."""
        try:
            with open(path) as f:
                raw = json.load(f)
            target = CostTable(raw["counts"], raw["chains"], raw["seconds"])
            draft = raw.get("draft_seconds")
            if draft is not None:
                draft = CostTable(raw["counts"], [1], [[t] for t in draft])
            return cls(target, draft, float(raw.get("draft_row_seconds", 0.0)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"speculative_dspark_sps_table_path: cannot read a cost table from {path!r}: {e!r}"
            ) from None

    def save(self, path: str) -> None:
        raw = self.target.to_dict()
        if self.draft is not None:  # at the target's counts (past the profiled: linear)
            raw["draft_seconds"] = [self.draft(n, n) for n in self.target.counts]
            raw["draft_row_seconds"] = self.draft_row
        with open(path, "w") as f:
            json.dump(raw, f, indent=1)


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
    clock: Callable[[], float] = time.perf_counter,
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
                    start = clock()
                    forward(n, c)
                    runs.append(clock() - start)
                row.append(max(statistics.median(runs), 1e-9))
            times.append(row)
    for i in range(len(counts)):  # monotone: more tokens or requests never cost less
        for j in range(len(chains)):
            up = times[i - 1][j] if i else 0.0
            left = times[i][j - 1] if j else 0.0
            times[i][j] = max(times[i][j], up, left)
    return CostTable(counts, chains, times)


# Cached positions before each chain when profiling step costs.
PROFILE_PREFIX = 256
# Pending rows per request of a profiled (steady) round: what one round commits.
STEADY_ROWS = 2
# The pending rows per request of the round that prices one more, and its
# requests (at most).
CATCH_UP_ROWS = 64
CATCH_UP_REQUESTS = 8


def median_seconds(fn: Callable[[], None], repeats: int = 5) -> float:
    """``fn``'s median time after one warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def profile_step_costs(runner: ModelRunner, proposer: Proposer, max_running: int) -> StepCosts:
    """The cost tables over the forwards as they will run (captured graphs
    where they apply): the target at 1 .. ``max_running`` requests (powers
    of two) of plain (1), short and whole (``width + 1``) verify chains, each
    over a cached prefix; the drafter's round at the same counts, where the
    proposer can run one made up."""
    width = proposer.max_drafts
    counts = sorted({min(2**k, max_running) for k in range(max_running.bit_length() + 1)})
    chains = sorted({c for c in (1, 2, 4, width + 1) if c <= width + 1})
    prefix = max(0, min(PROFILE_PREFIX, runner.context_length - width - 1))
    capture = proposer.capture_layer_ids
    start = time.perf_counter()
    target = profile_costs(
        lambda n, c: runner.verify_forward(n * c, c, prefix, capture), counts, chains
    )
    # The drafter at the counts its pool holds (the table goes on linearly).
    rounds = {
        n: r for n in counts if (r := proposer.profile_round(n, prefix, STEADY_ROWS)) is not None
    }
    draft, row = None, 0.0
    if 1 in rounds:
        draft = profile_costs(lambda n, _: rounds[n](), sorted(rounds), [1])
        # Over several requests' rows: one request's are within the noise.
        n = max(c for c in rounds if c <= CATCH_UP_REQUESTS)
        catch_up = proposer.profile_round(n, prefix, CATCH_UP_ROWS)
        if catch_up is not None:
            with torch.inference_mode():
                more = median_seconds(catch_up) - median_seconds(rounds[n])
            row = max(more, 0.0) / (n * (CATCH_UP_ROWS - STEADY_ROWS))
    logger.info(
        "step costs profiled in %.1fs (ms by requests x tokens per request %s%s): %s",
        time.perf_counter() - start,
        chains,
        f", then the drafter's round (+{1e6 * row:.1f} us per pending row)"
        if draft is not None
        else "",
        json.dumps({
            n: [round(1e3 * t, 2) for t in row] + ([round(1e3 * draft(n, n), 2)] if draft else [])
            for n, row in zip(counts, target.times)
        }),
    )  # fmt: skip
    return StepCosts(target, draft, row)
