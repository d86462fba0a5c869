"""The CPU's two matmul paths against each other in whole decode steps.

Engines on the demo in lockstep (``bench_spec_lockstep.py``'s harness:
closed loops of C requests, one step each in a shuffled order per round,
the target's weights shared), each step run under one policy for every
serving matmul: ``packed`` (over oneDNN's packed weight wherever it can
pack, the path before the timing; the reference), ``timed`` (what serving
does: each weight shape's row class on the path it timed faster,
``packed_rows``) and ``dense`` (``F.linear`` throughout). With ``--spec``,
speculative configurations too, packed and timed. Each ratio is the
median window's tok/s over the packed plain engine's.

    python benchmark/bench_cpu_linear.py --concurrency 1 4 16 64
    python benchmark/bench_cpu_linear.py --spec DSPARK-fixed
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--spec", nargs="*", default=[], help="bench_spec_lockstep.py configs")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window", type=int, default=100, help="rounds (one step each) per window")
    p.add_argument("--warm-up", type=int, default=100, help="rounds before measuring, per C")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    return p.parse_args()


def policy_serves(policy: str, timed: Callable[[Any, torch.Tensor], bool]) -> Callable:
    """``layers.linear.PackedWeight.serves`` under ``policy`` (``timed``:
    serving's own)."""
    from specserve.layers.linear import serving

    def serves(packed: Any, x: torch.Tensor) -> bool:
        if policy == "dense":
            return False
        if policy == "timed":
            return timed(packed, x)
        return packed._wins is not None and serving(x, packed._dtype)  # packed at load

    return serves


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import specserve.layers.linear as linear
    from bench_spec_lockstep import demo_loops, format_row, measure
    from specserve.engine.engine import device_scope

    # (engine name, its config, its policy): the packed plain engine first
    runs = [("plain", "plain", "packed"), ("plain-timed", "plain", "timed")]
    runs += [("plain-dense", "plain", "dense")]
    runs += [
        (f"{s}{sfx}", s, p) for s in args.spec for sfx, p in (("", "packed"), ("-timed", "timed"))
    ]
    loops = demo_loops([(name, config) for name, config, _ in runs], args)
    own = linear.PackedWeight.serves
    for name, _, policy in runs:
        loops[name].step = _under(loops[name].step, policy_serves(policy, own), linear)
    try:
        with device_scope(loops["plain"].engine.runner.device):
            for c in args.concurrency:
                print(format_row(measure(loops, c, args), list(loops)[1:]), flush=True)
    finally:
        linear.PackedWeight.serves = own
        for loop in loops.values():
            loop.engine.shutdown()
    return 0


def _under(step: Callable[[int], None], serves: Callable, linear: Any) -> Callable[[int], None]:
    """``step`` run with ``linear.PackedWeight.serves`` replaced by ``serves``."""

    def run(clients: int) -> None:
        saved, linear.PackedWeight.serves = linear.PackedWeight.serves, serves
        try:
            step(clients)
        finally:
            linear.PackedWeight.serves = saved

    return run


if __name__ == "__main__":
    sys.exit(main())
