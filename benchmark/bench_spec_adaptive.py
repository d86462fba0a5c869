"""The planner against fixed lengths and plain, one request at a time.

Three engines of the same target live in one process: plain, the
algorithm with ``--speculative-adaptive off`` (fixed lengths) and with the
planner (the default). Each held-out prompt runs on all three in turn (the
order reversed every other prompt), greedy, natural stops, so the three
share the machine's state as closely as a 2-core box allows; the live
server harness (``bench_spec_load.py``) adds HTTP, clients on the same
cores and a spread of +-10% between waves. Reported: output tok/s of each,
the ratios to plain, and what the planner decided (its plain steps, those
the safety net forced, and each load bucket's recent model/plain ratios).

    python benchmark/bench_spec_adaptive.py                  # DSPARK, 24 prompts
    python benchmark/bench_spec_adaptive.py --algorithm DFLASH --prompts 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--algorithm", default="DSPARK", choices=["DSPARK", "DFLASH", "NGRAM"])
    p.add_argument("--prompts", type=int, default=24, help="measured (2 more warm each up)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (held-out windows)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_spec_load import held_out_prompts
    from specserve import Engine
    from specserve.assets import demo_path

    prompts = held_out_prompts(args.prompts + 2, args.input_len, None)
    spec: dict = {"speculative_algorithm": args.algorithm}
    if args.algorithm != "NGRAM":
        spec["speculative_draft_model_path"] = demo_path(args.algorithm.lower())
    kinds = {"plain": {}, "fixed": {**spec, "speculative_adaptive": "off"}, "adaptive": spec}
    engines = {
        k: Engine(model_path=demo_path("target"), device="cpu", **kw) for k, kw in kinds.items()
    }
    greedy = {"temperature": 0, "max_new_tokens": args.output_len}
    try:
        for eng in engines.values():
            for p in prompts[:2]:
                eng.generate(input_ids=p, sampling_params=greedy)
            eng.core.reset_stats()
        seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
        for i, p in enumerate(prompts[2:]):
            for name in list(engines) if i % 2 == 0 else list(reversed(engines)):
                start = time.perf_counter()
                out = engines[name].generate(input_ids=p, sampling_params=greedy)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out["output_ids"])
        rate = {k: tokens[k] / seconds[k] for k in engines}
        stats = engines["adaptive"].stats()
        planner = engines["adaptive"].core.spec.planner
        result = {
            "algorithm": args.algorithm,
            "tok_s": rate,
            "vs_plain": {k: r / rate["plain"] for k, r in rate.items()},
            "adaptive_vs_fixed": rate["adaptive"] / rate["fixed"],
            "planner": {
                k: stats.get(k)
                for k in ("spec_steps", "spec_plain_steps", "spec_forced_plain_steps")
            },
            "net_ratios": {b: net.ratios for b, net in planner.net.nets.items()},
        }
    finally:
        for eng in engines.values():
            eng.shutdown()
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
