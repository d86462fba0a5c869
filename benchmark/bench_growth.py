"""How the cost of an output token grows with batch size and with context length.

For plain decoding and DSpark on the same target (by default the bundled
demo model), greedy, interleaved repetitions:

* batch sweep: ``--batch-sizes`` requests of ``--input-len`` prompt tokens,
  ``--output-len`` new tokens each; reported as wall-clock milliseconds per
  output token of the whole batch (lower is better; it should fall as the
  batch grows) and per request-step.
* context sweep: one request whose prompt fills the context up to each of
  ``--context-lengths``; the decode cost per token is measured as the time of
  ``--output-len`` tokens minus the time of one (which is all prefill).

    python benchmark/bench_growth.py --plot docs/growth.png --output-json growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="target (default: the bundled demo model)")
    p.add_argument("--draft-model-path", default=None, help="DSpark drafter (default: the demo's)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument(
        "--context-lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096]
    )
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG with both sweeps")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from specserve import Engine
    from specserve.assets import demo_path

    try:
        target = args.model_path or demo_path("target")
        drafter = args.draft_model_path or demo_path("dspark")
    except ValueError as e:
        print(f"bench_growth: {e}", file=sys.stderr)
        return 1
    for path in (target, drafter):
        if not os.path.isfile(os.path.join(path, "config.json")):
            print(f"bench_growth: no checkpoint at {path}", file=sys.stderr)
            return 1
    max_bs = max(args.batch_sizes)
    max_ctx = max(args.context_lengths)
    capacity = max(max_bs * (args.input_len + args.output_len + 16), max_ctx + 64)
    common = dict(
        max_running_requests=max_bs, max_total_tokens=capacity, context_length=max_ctx + 8
    )
    engines = {
        "plain": Engine(model_path=target, **common),
        "DSPARK": Engine(
            model_path=target,
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=drafter,
            **common,
        ),
    }
    vocab = len(engines["plain"].tokenizer)
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(4, vocab, (max_bs, max_ctx), generator=g).tolist()

    def timed(eng: Engine, prompts: list[list[int]], new: int) -> tuple[float, int]:
        sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        start = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        return time.perf_counter() - start, sum(len(o["output_ids"]) for o in outs)

    rows = []
    for bs in args.batch_sizes:
        prompts = [p[: args.input_len] for p in pool[:bs]]
        samples: dict[str, list[float]] = {name: [] for name in engines}
        for eng in engines.values():
            timed(eng, prompts, args.output_len)  # warm-up
        for _ in range(args.repeats):
            for name, eng in engines.items():
                elapsed, tokens = timed(eng, prompts, args.output_len)
                samples[name].append(1e3 * elapsed / tokens)
        for name in engines:
            ms = statistics.median(samples[name])
            rows.append(
                {
                    "sweep": "batch",
                    "x": bs,
                    "method": name,
                    "ms_per_token": ms,
                    "ms_per_request_step": ms * bs,
                }
            )
    for ctx in args.context_lengths:
        prompt = [pool[0][: max(1, ctx - args.output_len)]]
        samples = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, eng in engines.items():
                full, tokens = timed(eng, prompt, args.output_len)
                first, _ = timed(eng, prompt, 1)
                samples[name].append(1e3 * (full - first) / max(tokens - 1, 1))
        for name in engines:
            rows.append(
                {
                    "sweep": "context",
                    "x": ctx,
                    "method": name,
                    "ms_per_token": statistics.median(samples[name]),
                }
            )
    for eng in engines.values():
        eng.shutdown()

    print(
        f"target {target}, drafter {drafter}, median of {args.repeats}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'sweep':>8} {'x':>6} {'method':>7} {'ms/token':>9}")
    for r in rows:
        print(f"{r['sweep']:>8} {r['x']:>6} {r['method']:>7} {r['ms_per_token']:>9.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep, label in (
        (axes[0], "batch", "batch size"),
        (axes[1], "context", "context length (tokens)"),
    ):
        for method in sorted({r["method"] for r in rows}):
            pts = [
                (r["x"], r["ms_per_token"])
                for r in rows
                if r["sweep"] == sweep and r["method"] == method
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("ms per output token")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_title("cost per output token vs batch size")
    axes[1].set_title("decode cost per token vs context (batch 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
