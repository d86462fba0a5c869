"""Speculative decoding vs plain decoding on one target, same prompts.

For each configuration (plain, DSPARK, DFLASH, NGRAM) the same greedy batch
is generated; repetitions are interleaved (plain, spec, plain, spec, ...) and
medians reported: output tok/s, the speedup over plain, and the mean
accepted length tau (committed tokens per verify round, bonus included).

    python benchmark/bench_spec.py --model-path T --draft-model-path D
    python benchmark/bench_spec.py            # tiny random target + drafters
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-path", default=None, help="target checkpoint (default: a tiny random Qwen3)"
    )
    p.add_argument(
        "--draft-model-path", default=None, help="DSpark drafter (default: a tiny random one)"
    )
    p.add_argument(
        "--dflash-model-path",
        default=None,
        help="DFlash drafter (default: the DSpark one without heads)",
    )
    p.add_argument(
        "--algorithms",
        nargs="+",
        choices=(
            "DSPARK",
            "DSPARK-full-vocab",
            "DSPARK-ngram-first",
            "DSPARK-budget",
            "DFLASH",
            "NGRAM",
        ),
        default=["DSPARK", "DFLASH", "NGRAM"],
        help="DSPARK-full-vocab: DSPARK drafting from the whole vocabulary (no token map); "
        "DSPARK-ngram-first: with --speculative-ngram-first",
    )
    p.add_argument(
        "--token-map",
        default=None,
        help="--speculative-token-map for DSPARK, DSPARK-budget and DFLASH (default with "
        "--demo: the demo's; 'none': the whole vocabulary)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="prompts per measurement, run --batch-sizes at a time (at least one batch)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--prompts-file", default=None, help="text prompts, one per line (default: random ids)"
    )
    p.add_argument("--demo", action="store_true", help="the bundled demo target and its drafters")
    p.add_argument(
        "--dataset",
        choices=("random", "held-in", "held-out"),
        default="random",
        help="prompts: random ids, or windows of the standard library sources the demo was "
        "(held-in) or was not (held-out) trained on",
    )
    p.add_argument(
        "--logprob-overhead",
        type=int,
        default=None,
        metavar="BATCH",
        help="instead: DSPARK tok/s with top_logprobs=5 vs without at this batch size",
    )
    p.add_argument(
        "--round-profile",
        action="store_true",
        help="instead: where a DSPARK round's time goes at batch 1, against a plain step",
    )
    p.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, ..."
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="every engine (plain too) over this many tensor-parallel ranks",
    )
    p.add_argument(
        "--draft-tp-size",
        type=int,
        default=None,
        help="--speculative-draft-tensor-parallel-size of the drafter engines (with --tp-size)",
    )
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from specserve import Engine
    from specserve.tools.tiny_model import make_tiny_dspark, make_tiny_model

    root = tempfile.mkdtemp(prefix="bench-spec-")
    if args.demo:
        from specserve.assets import demo_path, demo_token_map

        try:
            args.model_path = args.model_path or demo_path("target")
            args.draft_model_path = args.draft_model_path or demo_path("dspark")
            args.dflash_model_path = args.dflash_model_path or demo_path("dflash")
            args.token_map = args.token_map or demo_token_map()
        except ValueError as e:
            print(f"bench_spec: {e}", file=sys.stderr)
            return 1
    target = args.model_path or make_tiny_model(
        os.path.join(root, "target"),
        num_layers=4,
        hidden_size=128,
        intermediate_size=384,
        head_dim=32,
    )
    paths = [target, args.draft_model_path, args.dflash_model_path]
    for path in filter(None, paths):
        if not os.path.isfile(os.path.join(path, "config.json")):
            print(f"bench_spec: no checkpoint at {path}", file=sys.stderr)
            return 1
    drafter = args.draft_model_path or make_tiny_dspark(os.path.join(root, "dspark"), target)
    dflash = args.dflash_model_path or drafter
    max_bs = max(args.batch_sizes)
    common = dict(
        tp_size=args.tp_size,
        dtype=args.dtype,
        max_running_requests=max_bs,
        max_total_tokens=max_bs * (args.input_len + args.output_len + 64),
    )
    hot = {} if args.token_map in (None, "none") else {"speculative_token_map": args.token_map}
    place = {}  # where every drafter engine's drafter runs
    if args.draft_tp_size is not None:
        place["speculative_draft_tensor_parallel_size"] = args.draft_tp_size
    dspark = {
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": drafter,
        **place,
    }
    specs = {
        "plain": {},
        "DSPARK": {**dspark, **hot},
        "DSPARK-full-vocab": dspark,
        # DSpark where prompt lookup finds no n-gram match, lookup drafts elsewhere
        "DSPARK-ngram-first": {**dspark, **hot, "speculative_ngram_first": True},
        # DSpark with the paper's verify-token budget (confidence head + profiled step rates)
        "DSPARK-budget": {**dspark, **hot, "speculative_dspark_schedule": "budget"},
        "DFLASH": {
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": dflash,
            **hot,
            **place,
        },
        "NGRAM": {"speculative_algorithm": "NGRAM"},
    }
    engines = {
        name: Engine(model_path=target, **common, **specs[name])
        for name in ["plain", *args.algorithms]
    }
    tok = engines["plain"].tokenizer
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.strip() for line in f if line.strip()]
        prompts = [tok.encode(t)[: args.input_len] for t in texts]
    elif args.dataset != "random":
        prompts = source_windows(tok, args.dataset, max(max_bs, args.num_prompts), args.input_len)
    else:
        g = torch.Generator().manual_seed(0)
        count = max(max_bs, args.num_prompts)
        prompts = torch.randint(4, 500, (count, args.input_len), generator=g).tolist()
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    if args.logprob_overhead:
        return logprob_overhead(engines, prompts, sp, args, root)
    if args.round_profile:
        return round_profile(engines, prompts, sp, args, root)

    def run(name: str, bs: int) -> tuple[float, float]:
        """Every prompt once, ``bs`` at a time: each batch size sees the same prompts."""
        eng = engines[name]
        count = max(bs, args.num_prompts)
        batches = [
            [prompts[j % len(prompts)] for j in range(i, min(i + bs, count))]
            for i in range(0, count, bs)
        ]
        start = time.perf_counter()
        outs = [o for batch in batches for o in eng.generate(input_ids=batch, sampling_params=sp)]
        elapsed = time.perf_counter() - start
        tokens = sum(len(o["output_ids"]) for o in outs)
        # tau over all requests' rounds: tokens committed by verify rounds / rounds
        metas = [o["meta_info"] for o in outs]
        rounds = sum(m.get("spec_verify_ct", 0) for m in metas)
        committed = sum(m.get("spec_verify_ct", 0) * m.get("spec_accept_length", 0) for m in metas)
        tau = committed / rounds if rounds else 1.0
        return tokens / elapsed, tau

    rows = []
    for bs in args.batch_sizes:
        for name in engines:
            run(name, bs)  # warm-up
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name in engines:
                samples[name].append(run(name, bs))
        base = statistics.median(s[0] for s in samples["plain"])
        for name in engines:
            tps = statistics.median(s[0] for s in samples[name])
            tau = statistics.median(s[1] for s in samples[name])
            rows.append(
                {
                    "batch": bs,
                    "method": name,
                    "tok_s": tps,
                    "speedup": tps / base,
                    "tau": None if name == "plain" else tau,
                }
            )
    for eng in engines.values():
        eng.shutdown()
    shutil.rmtree(root, ignore_errors=True)

    print(
        f"target {target}, drafter {drafter}, token map {args.token_map or 'none'}, "
        f"input {args.input_len}, output {args.output_len}, median of {args.repeats}"
    )
    print(f"{'batch':>5} {'method':>18} {'tok/s':>9} {'speedup':>8} {'tau':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['method']:>18} {r['tok_s']:>9.1f} {r['speedup']:>7.2f}x "
            + ("     -" if r["tau"] is None else f"{r['tau']:>6.2f}")
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


def source_windows(tok, split: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the demo corpus split."""
    from specserve.training.demo import corpus_files

    held_in, held_out = corpus_files()
    files = held_in if split == "held-in" else held_out
    g = torch.Generator().manual_seed(7)
    picks = torch.randint(0, len(files), (count,), generator=g).tolist()
    windows = []
    for f in picks:
        with open(files[f], encoding="utf-8", errors="replace") as fh:
            ids = tok.encode(fh.read(), add_special_tokens=False)
        start = (
            int(torch.randint(0, max(1, len(ids) - length), (1,), generator=g))
            if len(ids) > length
            else 0
        )
        windows.append(ids[start : start + length] or [0])
    return windows


def round_profile(engines, prompts, sp, args, root: str) -> int:
    """Wall time of each stage of the engine step, one request at a time.

    The stages are wrapped with timers (plain and DSPARK engines in turn, every
    prompt once, after a warm-up), so the per-round table adds up to what a
    round costs (the one prefill step of each request included, as in any
    generation); a stage's share is its time over the number of steps.
    """
    from collections import defaultdict

    def instrument(eng) -> dict[str, float]:
        spent: dict[str, float] = defaultdict(float)

        def wrap(obj, attr: str, label: str) -> None:
            inner = getattr(obj, attr)

            def timed(*a, **kw):
                t = time.perf_counter()
                try:
                    return inner(*a, **kw)
                finally:
                    spent[label] += time.perf_counter() - t

            setattr(obj, attr, timed)

        core = eng.core
        wrap(core, "step", "step")
        wrap(core.runner, "forward", "target forward")
        spec = core.spec
        if spec is not None:
            wrap(spec, "propose", "drafting (propose)")
            wrap(spec, "verify", "chain verification")
            model = spec.proposer.model
            wrap(model, "block_hidden", "  draft layers (block, new context K/V)")
            wrap(model, "draft", "  lm_head + Markov steps")
            backend = getattr(spec.proposer, "attn_backend", None)  # the drafter's own
            if backend is not None:
                wrap(backend, "prepare", "  planning the paged block attention")
        return spent

    names = ["plain", "DSPARK"]
    spent = {name: instrument(engines[name]) for name in names}
    steps = {name: 0 for name in names}
    for name in names:  # warm-up
        engines[name].generate(input_ids=[prompts[0]], sampling_params=sp)
        spent[name].clear()
    for _ in range(args.repeats):
        for name in names:
            for p in prompts[: args.num_prompts]:
                out = engines[name].generate(input_ids=[p], sampling_params=sp)[0]
                meta = out["meta_info"]
                # one prefill step, then decode steps or verify rounds
                steps[name] += meta.get("spec_verify_ct") or len(out["output_ids"]) - 1
    for e in engines.values():
        e.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    plain_step = spent["plain"]["step"] / steps["plain"]
    spec = spent["DSPARK"]
    per_round = {k: v / steps["DSPARK"] for k, v in spec.items()}
    other = per_round["step"] - sum(
        per_round[k] for k in ("target forward", "drafting (propose)", "chain verification")
    )
    tokens = args.output_len - 1
    tau = tokens * args.num_prompts * args.repeats / steps["DSPARK"]
    print(f"batch 1, {args.num_prompts} prompts x {args.repeats}, output {args.output_len}")
    print(f"plain decode step: {1e3 * plain_step:.2f} ms; DSPARK tau {tau:.2f}")
    print(f"{'DSPARK round':34} {'ms':>7} {'plain steps':>12}")
    rows = [
        (k, per_round.get(k, 0.0))
        for k in (
            "target forward",
            "drafting (propose)",
            "  draft layers (block, new context K/V)",
            "  lm_head + Markov steps",
            "  planning the paged block attention",
            "chain verification",
        )
    ]
    rows += [("commit, scheduling, the rest", other), ("round", per_round["step"])]
    for k, v in rows:
        print(f"{k:34} {1e3 * v:7.2f} {v / plain_step:12.2f}")
    print(f"speedup in this run: {tau * plain_step / per_round['step']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"plain_step_s": plain_step, "tau": tau, "round_s": dict(rows)}, f, indent=2)
    return 0


def logprob_overhead(engines, prompts, sp, args, root: str) -> int:
    """DSPARK with top_logprobs=5 (and token logprobs) vs without, interleaved.

    Wall-clock tok/s and process CPU time per token are both reported: on a
    shared machine the CPU time is the steadier of the two.
    """
    eng = engines["DSPARK"]
    bs = args.logprob_overhead
    batch = [prompts[i % len(prompts)] for i in range(bs)]

    def run(logprobs: bool) -> tuple[float, float]:
        kw = dict(return_logprob=True, top_logprobs_num=5) if logprobs else {}
        wall, cpu = time.perf_counter(), time.process_time()
        outs = eng.generate(input_ids=batch, sampling_params=sp, **kw)
        tokens = sum(len(o["output_ids"]) for o in outs)
        return tokens / (time.perf_counter() - wall), (time.process_time() - cpu) / tokens

    run(False), run(True)  # warm-up
    without, with_lp = [], []
    for _ in range(args.repeats):
        without.append(run(False))
        with_lp.append(run(True))
    a, b = (statistics.median(x[0] for x in r) for r in (without, with_lp))
    ca, cb = (statistics.median(x[1] for x in r) for r in (without, with_lp))
    for e in engines.values():
        e.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    print(f"DSPARK batch {bs}, output {args.output_len}, median of {args.repeats}")
    print(f"{'':18} {'tok/s':>9} {'CPU ms/token':>13}")
    print(f"{'without logprobs':18} {a:9.1f} {1e3 * ca:13.3f}")
    print(f"{'top_logprobs=5':18} {b:9.1f} {1e3 * cb:13.3f}")
    print(
        f"slower by {100 * (a - b) / a:+.1f}% (wall clock), {100 * (cb - ca) / ca:+.1f}% (CPU time)"
    )
    if args.output_json:
        result = {
            "batch": bs,
            "tok_s": a,
            "tok_s_logprobs": b,
            "cpu_s_per_token": ca,
            "cpu_s_per_token_logprobs": cb,
        }
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
