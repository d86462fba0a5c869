"""A small Prometheus text-format registry, owned by one server instance."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help = name, help
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip([*self.bounds, math.inf], self.counts):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class SampledHistogram:
    """A histogram over counts read at scrape time (``{value: times seen}``)."""

    def __init__(
        self,
        name: str,
        help: str,
        read: Callable[[], dict[int, int]],
        buckets: Sequence[float],
    ) -> None:
        self.name, self.help, self.read = name, help, read
        self.bounds = list(buckets)

    def render(self) -> list[str]:
        seen = self.read()
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for bound in [*self.bounds, math.inf]:
            le = "+Inf" if bound == math.inf else repr(bound)
            below = sum(n for v, n in seen.items() if v <= bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {below}')
        total = sum(v * n for v, n in seen.items())
        lines += [f"{self.name}_sum {total}", f"{self.name}_count {sum(seen.values())}"]
        return lines


class Sampled:
    """A counter or gauge whose value (or labelled values) is read at scrape time."""

    def __init__(
        self,
        name: str,
        help: str,
        kind: str,
        read: Callable[[], float | dict[str, float]],
        label: str = "",
    ) -> None:
        self.name, self.help, self.kind, self.read, self.label = name, help, kind, read, label

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        value = self.read()
        if isinstance(value, dict):
            lines += [f'{self.name}{{{self.label}="{k}"}} {v}' for k, v in sorted(value.items())]
        else:
            lines.append(f"{self.name} {value}")
        return lines


Metric = Histogram | Sampled | SampledHistogram


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"
