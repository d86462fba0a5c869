"""How many drafts each request verifies, from the confidence head.

Static mode keeps the drafts before the first confidence below a threshold.
Budget mode is the paper's scheduler: candidates ``(request, j)`` are ranked
by prefix survival ``a_j = c_1 * ... * c_j``; starting from one verify token
per request (``B = R``, expected tokens ``tau = R``) they are admitted in
order while ``tau * SPS(B)`` -- expected tokens per second at a verify batch
of ``B`` tokens -- still improves, stopping at the first candidate that does
not improve it.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def static_lengths(confidence: Sequence[Sequence[float]], threshold: float) -> list[int]:
    lengths = []
    for conf in confidence:
        n = 0
        while n < len(conf) and conf[n] >= threshold:
            n += 1
        lengths.append(n)
    return lengths


def budget_lengths(confidence: Sequence[Sequence[float]], sps: Callable[[int], float]) -> list[int]:
    survival = []
    for r, conf in enumerate(confidence):
        a = 1.0
        for j, c in enumerate(conf, start=1):
            a *= c
            survival.append((a, r, j))
    # Highest survival first; a request's earlier drafts first on ties, so a
    # request's admitted drafts always form a prefix (survival never grows with j).
    survival.sort(key=lambda t: (-t[0], t[2], t[1]))
    lengths = [0] * len(confidence)
    tokens = float(len(confidence))
    batch = len(confidence)
    best = tokens * sps(batch)
    for a, r, j in survival:
        if lengths[r] != j - 1:
            continue
        gain = (tokens + a) * sps(batch + 1)
        if gain <= best:
            break  # the paper's rule: stop at the first non-improvement
        tokens, batch, best = tokens + a, batch + 1, gain
        lengths[r] = j
    return lengths


class SpsTable:
    """Verify steps per second by verify batch size, interpolated linearly in
    step time between profiled sizes (and extrapolated past the last two)."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points or any(v <= 0 for v in points.values()):
            raise ValueError("an SPS table needs positive steps/s for at least one batch size")
        self.sizes = sorted(points)
        self.times = [1.0 / points[b] for b in self.sizes]

    def __call__(self, batch: int) -> float:
        sizes, times = self.sizes, self.times
        if len(sizes) == 1:
            return 1.0 / times[0]
        i = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)
        b0, b1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        t = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        return 1.0 / max(t, 1e-9)

    @classmethod
    def load(cls, path: str) -> SpsTable:
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls({int(k): float(v) for k, v in raw.items()})
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(
                f"speculative_dspark_sps_table_path: cannot read {path!r}: {e}"
            ) from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({b: 1.0 / t for b, t in zip(self.sizes, self.times)}, f, indent=1)


def profile_sps(forward: Callable[[int], None], sizes: Sequence[int], repeats: int = 3) -> SpsTable:
    """Times ``forward(batch_tokens)`` (median of ``repeats``) for each size."""
    points = {}
    with torch.inference_mode():
        for size in sizes:
            forward(size)  # warm-up
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                forward(size)
                runs.append(time.perf_counter() - start)
            points[size] = 1.0 / max(statistics.median(runs), 1e-9)
    return SpsTable(points)
