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

POLICIES = ("packed", "timed", "dense")


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


def policy_packs(policy: str, timed: Callable[[torch.Tensor, torch.Tensor], bool]) -> Callable:
    """``layers.linear.packs`` under ``policy`` (``timed``: serving's own)."""
    import specserve.layers.linear as linear

    def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
        if policy == "dense":
            return False
        if policy == "timed":
            return timed(x, weight)
        return (
            not torch.is_grad_enabled()
            and linear._packable(x.device, x.dtype, weight)
            and not torch.compiler.is_compiling()
        )

    return packs


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import specserve.layers.linear as linear
    from bench_spec_load import held_out_prompts, spread_lengths
    from bench_spec_lockstep import CONFIGS, ClosedLoop, format_row, measure, share_target_weights
    from specserve import Engine
    from specserve.assets import demo_path
    from specserve.engine.engine import device_scope

    most = max(args.concurrency)
    prompts = held_out_prompts(max(4 * most, 64), args.input_len, None)
    max_tokens = spread_lengths(len(prompts), args.output_len)
    common = {
        "model_path": demo_path("target"),
        "device": "cpu",
        "max_running_requests": most,
        "max_total_tokens": most * (args.input_len + args.output_len + 64),
    }
    # (engine name, its config, its policy): the packed plain engine first
    runs = [("plain", "plain", "packed"), ("plain-timed", "plain", "timed")]
    runs += [("plain-dense", "plain", "dense")]
    runs += [
        (f"{s}{sfx}", s, p) for s in args.spec for sfx, p in (("", "packed"), ("-timed", "timed"))
    ]
    engines: dict[str, Any] = {}
    for name, config, _ in runs:
        kw = dict(CONFIGS.get(config, {}))
        alg = kw.get("speculative_algorithm")
        if alg in ("DSPARK", "DFLASH"):
            kw["speculative_draft_model_path"] = demo_path(alg.lower())
        engines[name] = Engine(**common, **kw)
    share_target_weights(list(engines.values()))
    serving = linear.packs
    loops = {n: ClosedLoop(e, prompts, max_tokens) for n, e in engines.items()}
    for name, _, policy in runs:
        loops[name].step = _under(loops[name].step, policy_packs(policy, serving), linear)
    try:
        with device_scope(engines["plain"].runner.device):
            for c in args.concurrency:
                print(format_row(measure(loops, c, args), list(loops)[1:]), flush=True)
    finally:
        linear.packs = serving
        for e in engines.values():
            e.shutdown()
    return 0


def _under(step: Callable[[int], None], packs: Callable, linear: Any) -> Callable[[int], None]:
    """``step`` run with ``linear.packs`` replaced by ``packs``."""

    def run(clients: int) -> None:
        saved, linear.packs = linear.packs, packs
        try:
            step(clients)
        finally:
            linear.packs = saved

    return run


if __name__ == "__main__":
    sys.exit(main())
