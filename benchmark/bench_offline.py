"""Offline throughput: specserve vs transformers ``generate()`` on one checkpoint
(or, with ``--tp-size N``, specserve over N tensor-parallel ranks vs one).

Same prompts, greedy, exactly ``--output-len`` new tokens per prompt on both
sides (EOS ignored), interleaved repetitions in one process; prints output
tokens/s per side and their ratio at each batch size. ``--tp-size`` also
prints each rank's weight bytes and peak memory, and checks that both sides
produced the same tokens.

    python benchmark/bench_offline.py                       # builds a small random Qwen3
    python benchmark/bench_offline.py --model-path DIR --batch-sizes 1 32
    python benchmark/bench_offline.py --tp-size 2           # TP=2 vs TP=1 (gloo on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
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
        "--model-path", default=None, help="HF checkpoint; default: build a random Qwen3"
    )
    p.add_argument("--hidden-size", type=int, default=256, help="size of the built model")
    p.add_argument("--num-layers", type=int, default=4, help="layers of the built model")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--tp-size", type=int, default=1, help="> 1: specserve at this TP size vs TP=1")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident memory (Linux's VmHWM), MiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def weight_mib(engine) -> float:
    model = engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def build_model(args: argparse.Namespace) -> str:
    from specserve.tools.tiny_model import make_tiny_model

    path = os.path.join(tempfile.mkdtemp(prefix="bench-offline-"), "model")
    return make_tiny_model(
        path,
        "qwen3",
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_heads=max(1, args.hidden_size // 64),
        num_kv_heads=max(1, args.hidden_size // 128),
        head_dim=64,
        tokenizer_vocab=2048,
        init_std=0.02,
    )


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from specserve import Engine

    path = args.model_path or build_model(args)
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"bench_offline: no checkpoint at {path}", file=sys.stderr)
        return 1
    if args.tp_size > 1:
        return compare_tp(args, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    max_bs = max(args.batch_sizes)
    engine = Engine(
        model_path=path,
        device="cpu",
        max_running_requests=max_bs,
        max_total_tokens=max_bs * (args.input_len + args.output_len + 16),
    )
    vocab = min(hf.config.vocab_size, len(engine.tokenizer))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (max_bs, args.input_len), generator=g)
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}

    def run_hf(bs: int) -> float:
        ids = prompts[:bs]
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                pad_token_id=hf.config.pad_token_id,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == args.input_len + args.output_len
        return bs * args.output_len / elapsed

    def run_ours(bs: int) -> float:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts[:bs].tolist(), sampling_params=sp)
        elapsed = time.perf_counter() - start
        assert all(len(o["output_ids"]) == args.output_len for o in outs)
        return bs * args.output_len / elapsed

    rows = []
    for bs in args.batch_sizes:
        run_hf(bs)  # warm-up both sides once
        run_ours(bs)
        hf_tps, our_tps = [], []
        for _ in range(args.repeats):
            hf_tps.append(run_hf(bs))
            our_tps.append(run_ours(bs))
        h, o = statistics.median(hf_tps), statistics.median(our_tps)
        rows.append({"batch": bs, "hf_tok_s": h, "specserve_tok_s": o, "ratio": o / h})
    engine.shutdown()

    cfg = hf.config
    print(
        f"model: {path} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), "
        f"input {args.input_len}, output {args.output_len}, torch threads {torch.get_num_threads()}, "
        f"median of {args.repeats}"
    )
    print(f"{'batch':>6} {'transformers tok/s':>19} {'specserve tok/s':>16} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['batch']:>6} {r['hf_tok_s']:>19.1f} {r['specserve_tok_s']:>16.1f} {r['ratio']:>6.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


def compare_tp(args: argparse.Namespace, path: str) -> int:
    """specserve at ``--tp-size`` ranks vs one rank, interleaved."""
    from specserve import Engine

    max_bs = max(args.batch_sizes)
    kw = dict(
        model_path=path,
        device="cpu",
        max_running_requests=max_bs,
        max_total_tokens=max_bs * (args.input_len + args.output_len + 16),
    )
    one = Engine(**kw)
    many = Engine(tp_size=args.tp_size, **kw)
    vocab_size = one.runner.vocab_size
    vocab = min(vocab_size, len(one.tokenizer))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (max_bs, args.input_len), generator=g).tolist()
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}

    def run(engine, bs: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts[:bs], sampling_params=sp)
        elapsed = time.perf_counter() - start
        return bs * args.output_len / elapsed, [o["output_ids"] for o in outs]

    rows = []
    for bs in args.batch_sizes:
        _, want = run(one, bs)  # warm-up both sides once
        _, got = run(many, bs)
        same = got == want
        t1, tn = [], []
        for _ in range(args.repeats):
            t1.append(run(one, bs)[0])
            tn.append(run(many, bs)[0])
        a, b = statistics.median(t1), statistics.median(tn)
        rows.append({"batch": bs, "tp1_tok_s": a, "tpn_tok_s": b, "ratio": b / a, "same": same})
    ranks = {0: os.getpid(), **many.ranks.pids}
    memory = {
        "tp1_weights_mib": weight_mib(one),
        "rank0_weights_mib": weight_mib(many),
        # Rank 0's peak includes the TP=1 engine's (one process); the
        # workers hold only their shard.
        "peak_rss_mib": {r: peak_rss_mib(pid) for r, pid in ranks.items()},
    }
    one.shutdown()
    many.shutdown()
    print(
        f"model: {path}, input {args.input_len}, output {args.output_len}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} (rank 0), "
        f"median of {args.repeats}, gloo"
    )
    print(
        f"{'batch':>6} {'TP=1 tok/s':>11} {f'TP={args.tp_size} tok/s':>11} {'ratio':>7}  same ids"
    )
    for r in rows:
        print(
            f"{r['batch']:>6} {r['tp1_tok_s']:>11.1f} {r['tpn_tok_s']:>11.1f} "
            f"{r['ratio']:>6.2f}x  {r['same']}"
        )
    print(
        f"weights: TP=1 {memory['tp1_weights_mib']:.1f} MiB, each TP={args.tp_size} rank "
        f"{memory['rank0_weights_mib']:.1f} MiB; peak RSS by rank (MiB): {memory['peak_rss_mib']}"
    )
    # What scoring a decode step's rows moves between the ranks: the logits
    # gathered (today's engine path) vs the vocab-parallel reductions.
    from specserve.sampling.vocab_parallel import gather_bytes, logprob_bytes

    traffic = []
    for bs in args.batch_sizes:
        g = gather_bytes(bs, vocab_size, args.tp_size)
        p = logprob_bytes(bs, 5, 0, args.tp_size)
        traffic.append({"rows": bs, "gather_bytes": g, "vocab_parallel_bytes": p})
        print(
            f"bytes per step, {bs} rows with top-5 logprobs: logits gathered {g:,}, "
            f"vocab-parallel {p:,} ({g / p:.0f}x less)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"args": vars(args), "rows": rows, "memory": memory, "traffic": traffic},
                f,
                indent=2,
            )
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
