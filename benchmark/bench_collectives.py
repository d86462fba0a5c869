"""What a tensor-parallel step's logits cost to move: gathering rows' logits
to rank 0 against deciding or scoring them on the shards.

Two gloo ranks on this machine (this process and one spawned), each holding
its half of ``[rows, vocab]`` float32 logits. Per call, interleaved
``--repeats`` times (medians): the gather of the rows to rank 0 that sampled
rows take (``VocabParallelHead.gather``), the vocab-parallel argmax that
greedy rows take, and the vocab-parallel logprobs (top-5) their scores take.
Each includes its local work; the ratio says what a row costs gathered
against decided where it is.

    python benchmark/bench_collectives.py
    python benchmark/bench_collectives.py --vocab 8192 151936 --rows 1 8 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from specserve.distributed.group import RankGroup, connect
from specserve.distributed.launcher import free_addr
from specserve.sampling.vocab_parallel import vocab_parallel_argmax, vocab_parallel_logprobs

SIZE = 2
KINDS = ("gather", "argmax", "logprobs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--calls", type=int, default=20, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def one(kind: str, local: torch.Tensor, start: int, group: RankGroup) -> None:
    r, width = local.shape
    if kind == "gather":
        parts = group.gather_to_first(local)
        if parts is not None:
            torch.cat(parts, dim=-1)
    elif kind == "argmax":
        vocab_parallel_argmax(local, start, width, group)
    else:
        tokens = torch.zeros(r, dtype=torch.int64)
        vocab_parallel_logprobs(local, start, width, tokens, None, 5, None, group)


def run(rank: int, addr: str, args: argparse.Namespace) -> dict | None:
    torch.set_num_threads(1)
    group = connect(rank, SIZE, addr, torch.device("cpu"), timeout=120)
    out: dict = {}
    for vocab in args.vocab:
        width = vocab // SIZE
        for rows in args.rows:
            local = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank))
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            for kind in KINDS:  # warm-up
                one(kind, local, rank * width, group)
            for _ in range(args.repeats):
                for kind in KINDS:
                    group.all_reduce_max(torch.zeros(1))  # both ranks start together
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        one(kind, local, rank * width, group)
                    times[kind].append((time.perf_counter() - t) / args.calls)
            out[(vocab, rows)] = {k: statistics.median(v) for k, v in times.items()}
    return out if rank == 0 else None


def main() -> None:
    args = parse_args()
    addr = free_addr()
    worker = mp.get_context("spawn").Process(target=run, args=(1, addr, args), daemon=True)
    worker.start()
    results = run(0, addr, args)
    worker.join(timeout=120)
    print("| vocab | rows | gather us | argmax us | logprobs us | gather / argmax |")
    print("|---|---|---|---|---|---|")
    for (vocab, rows), t in results.items():
        g, a, lp = (t[k] * 1e6 for k in KINDS)
        print(f"| {vocab} | {rows} | {g:.0f} | {a:.0f} | {lp:.0f} | {g / a:.2f}x |")


if __name__ == "__main__":
    main()
