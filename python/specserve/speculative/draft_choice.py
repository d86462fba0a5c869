"""The planner's decision: how many drafts each request verifies, a global
top-B of every request's survival estimates, B found by an exact scan
over a step's cost curve (a staircase under CUDA-graph buckets)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# How many of the requests dearest to join ``choose_drafts`` tries leaving out.
MAX_LEFT_OUT = 4
# From this many drafts in all, the scan runs in numpy (``_ArrayScan``).
NUMPY_DRAFTS = 64


def choose_drafts(
    survival: Sequence[Sequence[float]],
    steps: Sequence[float],
    drafts: Sequence[float] | None = None,
    margin: float = 0.0,
    join_seconds: Sequence[float] | None = None,
    free: Sequence[bool] | None = None,
) -> list[int]:
    """``rated_drafts``'s lengths."""
    return rated_drafts(survival, steps, drafts, margin, join_seconds, free)[0]


def rated_drafts(
    survival: Sequence[Sequence[float]],
    steps: Sequence[float],
    drafts: Sequence[float] | None = None,
    margin: float = 0.0,
    join_seconds: Sequence[float] | None = None,
    free: Sequence[bool] | None = None,
    fed: Sequence[float] | None = None,
) -> tuple[list[int], float]:
    """Drafts to verify per request, maximising expected tokens per second,
    and the best choice with drafts' worth over the plain step's.

    ``survival[i][j - 1]``: S_ij, non-increasing in j. ``steps[b]``: the
    step with b drafts in all (its other tokens, every anchor and any
    prefill, fixed). ``drafts[k]``: drafting for k requests (None: already
    paid); ``join_seconds[i]``: what request ``i`` adds to it besides (its
    context to catch up). A choice with drafts must beat the plain step by
    ``margin`` (relative). ``free[i]``: request ``i``'s drafts are found
    already (prompt lookup), so it joins without the drafter (and without
    its context to catch up). ``fed[j - 1]``: the tokens a request's j-th
    draft adds to the verify, expected (fewer than one where a refinement
    by confidences will cut some: ``SpecPlanner.after_draft``); the step
    costs ``steps`` interpolated at the drafts' expected tokens (None: one
    each).

    The global top-B ranks drafts by S alone, so a request dear to join
    either joins as soon as its first draft ranks or, left out, keeps the
    others from their later drafts: each of the dearest few is tried left
    out of the ranking, and stays out where the step is worth more so; so
    is every request the drafter would run for, where drafts are found."""
    r = len(survival)
    drafts = [0.0] * (r + 1) if drafts is None else drafts
    join = [0.0] * r if join_seconds is None else list(join_seconds)
    drafter = [True] * r if free is None else [not f for f in free]
    for i, runs in enumerate(drafter):
        if not runs:
            join[i] = 0.0
    plain_rate = r / max(steps[0], 1e-12)
    big = sum(map(len, survival)) >= NUMPY_DRAFTS
    scan = (_ArrayScan if big else _ListScan)(survival, steps, drafts, join, drafter, fed)
    plain = plain_rate * (1.0 + margin)
    best_seen = 0.0  # the best rate with drafts, over every choice tried

    def best(out: set[int]) -> tuple[list[int], float]:
        """The best top-B of the drafts of requests not in ``out`` and its
        worth: the plain step's if none beats it."""
        nonlocal best_seen
        chosen, top = scan.best(out)
        best_seen = max(best_seen, top)
        return (chosen, top) if top > plain else ([0] * r, plain)

    out: set[int] = set()
    lengths, rate = best(out)
    if not all(drafter):  # the drafts found alone, no drafter's forward
        alone = {i for i, runs in enumerate(drafter) if runs}
        trial, trial_rate = best(alone)
        if trial_rate > rate:
            lengths, rate, out = trial, trial_rate, alone
    dearest = sorted((-x, i) for i, x in enumerate(join) if x > 0 and survival[i])
    for _, i in dearest[:MAX_LEFT_OUT]:
        trial, trial_rate = best(out | {i})
        if trial_rate > rate:
            lengths, rate, out = trial, trial_rate, out | {i}
    return lengths, best_seen / max(plain_rate, 1e-12)


class _ListScan:
    """The exact scan over every B, in plain Python: over the few dozen
    drafts of a step at a low load, numpy's per-call overhead cost more
    than the scan (30 us against 6.5 at one request of 7 drafts)."""

    def __init__(self, survival, steps, drafts, join, drafter, fed) -> None:
        # Every draft, ranked: by S descending, then j, then i (a request's
        # first draft ranks before its others, so it is where the request joins).
        self.ranked = sorted(
            (-x, j, i) for i, row in enumerate(survival) for j, x in enumerate(row, 1)
        )
        self.r, self.steps, self.drafts, self.join, self.drafter, self.fed = (
            len(survival), steps, drafts, join, drafter, fed,
        )  # fmt: skip

    def best(self, out: set[int]) -> tuple[list[int], float]:
        """The best top-B of the drafts of requests not in ``out`` (B >= 1)
        and its rate (-1 with no drafts)."""
        steps, drafts, join, drafter = self.steps, self.drafts, self.join, self.drafter
        fed = self.fed
        tokens, drafting, joined, b, top, top_b = float(self.r), 0, 0.0, 0, -1.0, 0
        verified = 0.0  # the drafts' expected tokens in the verify
        for neg_s, j, i in self.ranked:
            if i in out:
                continue
            b += 1
            tokens -= neg_s
            if j == 1 and drafter[i]:
                drafting += 1
                joined += join[i]
            if fed is None:
                step = steps[b]
            else:
                verified += fed[j - 1]
                step = _step_at(steps, verified)
            rate = tokens / max(step + drafts[drafting] + joined, 1e-12)
            if rate > top:
                top, top_b = rate, b
        chosen = [0] * self.r
        for _, j, i in (d for d in self.ranked if d[2] not in out):
            if top_b == 0:
                break
            top_b -= 1
            chosen[i] = max(chosen[i], j)
        return chosen, top


class _ArrayScan:
    """``_ListScan`` in numpy, the same sums in the same order (so the same
    choice): at a high load, a few hundred drafts scanned five times over
    (the dearest requests left out in turn) took 0.9 ms of a 30 ms step at
    64 requests in Python, 0.2 ms so (from about 64 drafts it is the
    faster)."""

    def __init__(self, survival, steps, drafts, join, drafter, fed) -> None:
        lens = np.fromiter(map(len, survival), dtype=np.int64, count=len(survival))
        n = int(lens.sum())
        s = np.fromiter((x for row in survival for x in row), dtype=np.float64, count=n)
        i = np.repeat(np.arange(len(survival)), lens)
        j = np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens) + 1
        order = np.lexsort((i, j, -s))  # S descending, then j, then i
        self.s, self.i, self.j = s[order], i[order], j[order]
        self.r = len(survival)
        self.steps = np.asarray(steps, dtype=np.float64)
        self.drafts = np.asarray(drafts, dtype=np.float64)
        self.join = np.asarray(join, dtype=np.float64)
        self.drafter = np.asarray(drafter, dtype=bool)
        self.fed = None if fed is None else np.asarray(fed, dtype=np.float64)

    def best(self, out: set[int]) -> tuple[list[int], float]:
        s, i, j = self.s, self.i, self.j
        if out:
            left_out = np.zeros(self.r, dtype=bool)
            left_out[list(out)] = True
            keep = ~left_out[i]
            s, i, j = s[keep], i[keep], j[keep]
        if not len(s):
            return [0] * self.r, -1.0
        first = (j == 1) & self.drafter[i]
        tokens = np.cumsum(np.concatenate(([float(self.r)], s)))[1:]
        joined = np.cumsum(np.where(first, self.join[i], 0.0))
        if self.fed is None:
            step = self.steps[1 : len(s) + 1]
        else:  # as the list's scan: summed in rank order, then interpolated
            verified = np.cumsum(self.fed[j - 1])
            lo = verified.astype(np.int64)  # (non-negative: the floor)
            hi = np.minimum(lo + 1, len(self.steps) - 1)
            step = self.steps[lo] + (self.steps[hi] - self.steps[lo]) * (verified - lo)
        cost = step + self.drafts[np.cumsum(first)] + joined
        rate = tokens / np.maximum(cost, 1e-12)
        b = int(np.argmax(rate))  # the first of equal rates, as the list's scan
        chosen = np.zeros(self.r, dtype=np.int64)
        np.maximum.at(chosen, i[: b + 1], j[: b + 1])
        return chosen.tolist(), float(rate[b])  # host read: numpy, no device


def _step_at(steps: Sequence[float], x: float) -> float:
    """``steps`` at ``x`` drafts, linear between whole ones."""
    lo = int(x)
    hi = min(lo + 1, len(steps) - 1)
    return steps[lo] + (steps[hi] - steps[lo]) * (x - lo)


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
