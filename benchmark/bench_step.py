"""Step efficiency: a plain decode step's time over the time of the same
step's matmuls run back to back alone.

For each dtype and batch size, an engine decodes ``--batch-size`` prompts
(greedy) and every decode step is timed; then the forward's matmuls (each
layer's fused q|k|v, o, gate|up and down projections, and the lm_head, as
the engine runs them: on the CPU over their packed weights) run alone on
inputs of the step's shape. The two alternate ``--repeats`` times and the
medians are compared: 1.0x would mean the step costs nothing beyond its
matmuls.

    python benchmark/bench_step.py                      # the bundled demo
    python benchmark/bench_step.py --model-path M --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", help="target checkpoint (default: the bundled demo)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json")
    return p.parse_args(argv)


# A projection as the engine runs it, and its weight.
Projection = tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]


def matmuls(model) -> list[Projection]:
    """The projections a decode forward runs, in order, as the engine runs
    them (on the CPU over their packed weights), each with its weight."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            out.append((lin.forward, lin.weight))
    out.append((model.lm_head.forward, model.lm_head.weight))
    return out


def time_matmuls(projections: list[Projection], batch: int, steps: int) -> float:
    """Seconds per pass of every projection, back to back."""
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for _, w in projections]
    with torch.inference_mode():
        for x, (run, _) in zip(inputs, projections):  # warm-up
            run(x)
        start = time.perf_counter()
        for _ in range(steps):
            for x, (run, _) in zip(inputs, projections):
                run(x)
        return (time.perf_counter() - start) / steps


def time_steps(eng, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of a decode step (every request decoding)."""
    core = eng.core
    times: list[float] = []
    inner = core.step

    def timed():
        t = time.perf_counter()
        try:
            return inner()
        finally:
            times.append(time.perf_counter() - t)

    core.step = timed
    try:
        sp = {"temperature": 0, "max_new_tokens": steps + 1, "ignore_eos": True}
        eng.generate(input_ids=prompts, sampling_params=sp)
    finally:
        core.step = inner
    return statistics.median(times[1:])  # the first step is the prefill


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specserve import Engine

    if args.model_path is None:
        from specserve.assets import demo_path

        try:
            args.model_path = demo_path("target")
        except ValueError as e:
            print(f"bench_step: {e}", file=sys.stderr)
            return 1
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"bench_step: no checkpoint at {args.model_path}", file=sys.stderr)
        return 1
    rows = []
    for dtype in args.dtypes:
        bs_max = max(args.batch_sizes)
        eng = Engine(
            model_path=args.model_path,
            device="cpu",
            dtype=dtype,
            max_running_requests=bs_max,
            max_total_tokens=bs_max * (16 + args.steps + 16),
        )
        try:
            projections = matmuls(eng.runner.model)
            g = torch.Generator().manual_seed(0)
            for bs in args.batch_sizes:
                prompts = torch.randint(4, 500, (bs, 16), generator=g).tolist()
                time_steps(eng, prompts, 4)  # warm-up
                step_s, mm_s = [], []
                for _ in range(args.repeats):
                    step_s.append(time_steps(eng, prompts, args.steps))
                    mm_s.append(time_matmuls(projections, bs, args.steps))
                step, mm = statistics.median(step_s), statistics.median(mm_s)
                rows.append(
                    {
                        "dtype": dtype,
                        "batch": bs,
                        "step_ms": 1e3 * step,
                        "matmul_ms": 1e3 * mm,
                        "efficiency": step / mm,
                    }  # fmt: skip
                )
        finally:
            eng.shutdown()
    print(f"model {args.model_path}, {args.steps} decode steps, median of {args.repeats}")
    print(f"{'dtype':>9} {'batch':>5} {'step ms':>8} {'matmuls ms':>11} {'step/matmuls':>13}")
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['batch']:>5} {r['step_ms']:>8.2f} {r['matmul_ms']:>11.2f} "
            f"{r['efficiency']:>12.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
