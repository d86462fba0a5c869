"""CUDA graphs on vs off: plain and DSPARK decoding of the bundled demo on a GPU.

Four engines in one process (plain and DSPARK, each with captured forwards
and with ``disable_cuda_graph``) generate the same held-out prompts, greedy,
``--output-len`` tokens each; repetitions are interleaved and medians
reported per batch size: tok/s of each, graphs' speedup over eager, and
DSPARK's over plain with graphs on. Without CUDA it says so and exits 0.

    python benchmark/bench_cuda_graph.py
    python benchmark/bench_cuda_graph.py --batch-sizes 1 8 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda; cpu runs the script end to end with no graphs on either side (a dry run)",
    )
    p.add_argument("--output-json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench_cuda_graph: no CUDA device; nothing to measure")
        return 0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from bench_spec import source_windows
    from specserve import Engine
    from specserve.assets import demo_path, demo_token_map

    spec = {
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": demo_path("dspark"),
    }
    if demo_token_map() is not None:
        spec["speculative_token_map"] = demo_token_map()
    bs_max = max(args.batch_sizes)
    configs = {
        f"{name} {mode}": (extra, mode == "eager")
        for name, extra in (("plain", {}), ("DSPARK", spec))
        for mode in ("graphs", "eager")
    }
    engines = {
        label: Engine(
            model_path=demo_path("target"),
            device=args.device,
            dtype=args.dtype,
            grammar_backend="none",
            max_running_requests=bs_max,
            max_total_tokens=bs_max * (args.input_len + args.output_len + 64),
            disable_cuda_graph=eager,
            **extra,
        )
        for label, (extra, eager) in configs.items()
    }
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    tok = next(iter(engines.values())).tokenizer
    rows = []
    try:
        for bs in args.batch_sizes:
            prompts = source_windows(tok, "held-out", bs, args.input_len)
            for eng in engines.values():
                eng.generate(input_ids=prompts, sampling_params=sp)  # warm-up
            rates: dict[str, list[float]] = {label: [] for label in engines}
            for _ in range(args.repeats):
                for label, eng in engines.items():
                    sync()
                    start = time.perf_counter()
                    eng.generate(input_ids=prompts, sampling_params=sp)
                    sync()
                    rates[label].append(bs * args.output_len / (time.perf_counter() - start))
            med = {label: statistics.median(r) for label, r in rates.items()}
            rows.append(
                {
                    "batch": bs,
                    "tok_s": med,
                    "plain_graphs_over_eager": med["plain graphs"] / med["plain eager"],
                    "dspark_graphs_over_eager": med["DSPARK graphs"] / med["DSPARK eager"],
                    "dspark_over_plain_graphs": med["DSPARK graphs"] / med["plain graphs"],
                }
            )
    finally:
        for eng in engines.values():
            eng.shutdown()
    print(
        f"demo on {args.device}, {args.dtype}, held-out, {args.output_len} tokens, median of {args.repeats}"
    )
    for r in rows:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in r["tok_s"].items())
        print(
            f"batch {r['batch']}: tok/s {rates}; graphs/eager plain "
            f"{r['plain_graphs_over_eager']:.2f}x, DSPARK {r['dspark_graphs_over_eager']:.2f}x; "
            f"DSPARK/plain (graphs) {r['dspark_over_plain_graphs']:.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
