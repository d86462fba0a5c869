"""Vocab-parallel scoring on 2 gloo ranks (this process and one spawned
worker) against the single-device oracles on the full logits:
``row_logprobs_ref`` for values (to 1e-5), ``greedy_argmax`` for the greedy
id, ``row_peaks`` for each row's peak, and, for the top-k ids, the reference's order with ties to the lowest id
(``torch.topk`` orders ties arbitrarily; the Triton kernel and the
vocab-parallel merge both take the lowest id first).

Both ranks build the same deterministic case list and run it in sequence over
one group; each checks its own results (the worker reports through its exit
code) and the two ranks' results are compared bit for bit."""

from __future__ import annotations

import runpy
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

from specserve.distributed import RankGroup
from specserve.distributed.group import connect
from specserve.distributed.launcher import free_addr
from specserve.kernels.chain_verify import greedy_argmax
from specserve.kernels.logprobs import HAS_TRITON, RowLogprobs, row_logprobs_ref
from specserve.layers.parallel import vocab_shard
from specserve.sampling.metadata import row_peaks
from specserve.sampling.vocab_parallel import (
    argmax_bytes,
    gather_bytes,
    gather_columns,
    logprob_bytes,
    vocab_parallel_argmax,
    vocab_parallel_logprobs,
)

SIZE = 2
WORKER_RUN_NAME = "__vocab_parallel_rank1__"  # __name__ in the worker
INF = float("inf")
NAN = float("nan")


@dataclass
class Case:
    name: str
    logits: torch.Tensor  # [R, V] float32, the full (unpadded) vocabulary
    token_ids: torch.Tensor  # [R]
    temps: torch.Tensor | None  # [R]
    top_k: int
    gather_ids: torch.Tensor | None  # [R, M], -1 padding


def _cases() -> list[Case]:
    """The same tensors in every process (one seeded generator)."""
    g = torch.Generator().manual_seed(1234)

    def randn(r: int, v: int) -> torch.Tensor:
        return torch.randn(r, v, generator=g)

    def ids(r: int, v: int, m: int = 0) -> torch.Tensor:
        return torch.randint(0, v, (r, m) if m else (r,), generator=g)

    cases = [Case("random", randn(5, 64), ids(5, 64), None, 4, ids(5, 64, 3))]

    x = randn(4, 64)  # shards [0, 32) and [32, 64)
    x[0, [5, 40]] = 9.0  # the max on both ranks: id 5 first
    x[1, [31, 32]] = 4.0  # the boundary ids, tied at the top
    x[1, [60, 33, 10, 2]] = 3.5  # a tie group cut by k = 5: ids 2, 10, 33 in
    x[2] = 0.0  # everything tied
    x[3] = -x[3].abs() - 1.0
    x[3, [50, 63]] = 7.0  # the tie lives on rank 1 only
    x[3, [3, 40]] = torch.tensor([-0.0, 0.0])  # -0.0 ties +0.0: id 3 first
    cases.append(Case("ties", x, torch.tensor([40, 32, 0, 63]), None, 5, None))

    x = randn(4, 64)
    x[0, ::3] = -INF
    x[1] = -INF  # no possible token
    x[2, :] = -INF
    x[2, 45] = 1.0  # one possible token, on rank 1; the -inf tail ties to ids 0, 1
    x[3, :32] = -INF  # rank 0's shard all -inf
    cases.append(Case("neg-inf", x, ids(4, 64), None, 3, ids(4, 64, 2)))

    x = randn(5, 64)
    x[0, [3, 17, 50]] = NAN
    x[1] = NAN  # no possible token (greedy: id 0)
    x[2, 7] = NAN  # NaN at the chosen and requested ids
    x[3, :32] = NAN  # rank 0's shard all NaN
    x[4, 40] = NAN  # a NaN next to rank 1's max
    x[4, 41] = 50.0
    gather = torch.tensor([[3, 50, 0], [1, 2, 3], [7, 7, 40], [0, 33, -1], [40, 41, 1]])
    cases.append(Case("nan", x, torch.tensor([3, 5, 7, 10, 40]), None, 4, gather))

    x = randn(4, 63)  # 32 + 31 real ids: rank 1 holds one padding column
    x[0, [62, 1]] = 8.0  # the last real id tied with rank 0
    x[1, 62] = 9.0  # the greedy id is the last real id
    x[2, 31:] = -INF
    cases.append(Case("padding", x, torch.tensor([62, 62, 31, 0]), None, 3, ids(4, 63, 2)))
    cases.append(Case("top-k-all", randn(3, 63), ids(3, 63), None, 63, None))  # k > a shard

    x = randn(6, 96)
    x[0, [10, 70]] = 2.0
    temps = torch.tensor([0.5, 1.0, 2.0, 0.3, 1.7, 0.05])
    cases.append(Case("temperatures", x, ids(6, 96), temps, 4, ids(6, 96, 2)))

    gather = ids(4, 64, 5)
    gather[0, 3:] = -1
    gather[1] = -1
    gather[2, 0] = -1
    cases.append(Case("gather-ids", randn(4, 64), ids(4, 64), None, 2, gather))
    cases.append(Case("top-k-0", randn(4, 64), ids(4, 64), None, 0, ids(4, 64, 3)))
    cases.append(Case("top-k-1", randn(4, 64), ids(4, 64), None, 1, None))

    x = randn(3, 64)
    x[0, 40] = INF  # log_softmax is NaN: -inf everywhere, as the reference
    x[1, [2, 50]] = INF
    x[2, 7] = INF
    x[2, 8] = NAN
    cases.append(Case("pos-inf", x, torch.tensor([40, 2, 7]), None, 3, ids(3, 64, 2)))

    x = randn(8, 1001)  # 501 + 500 real ids
    x[:, 500:502] = x[:, :2]  # ties across the boundary, in every row
    temps = torch.rand(8, generator=g) + 0.4
    cases.append(Case("larger", x * 3, ids(8, 1001), temps, 20, ids(8, 1001, 4)))
    cases.append(Case("no-rows", randn(0, 64), ids(0, 64), torch.ones(0), 3, ids(0, 64, 2)))
    return cases


CASES = _cases()


class _Counting:
    """A group that counts the bytes its collectives put on the wire (summed
    over the ranks, as ``logprob_bytes``), passing the calls on."""

    def __init__(self, group: RankGroup) -> None:
        self.group, self.size, self.rank = group, group.size, group.rank
        self.gathered = self.reduced = 0

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.gathered += self.size * (self.size - 1) * x.numel() * x.element_size()
        return self.group.all_gather(x)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced += 2 * (self.size - 1) * x.numel() * x.element_size()  # a ring
        return self.group.all_reduce_max(x)


@dataclass
class Result:
    lp: RowLogprobs
    argmax: torch.Tensor  # [R]
    peaks: torch.Tensor  # [R]
    gathered: int  # bytes the logprobs moved
    reduced: int  # bytes the argmax moved
    same_bits: bool  # both ranks' results equal bit for bit
    # A drafter's hot vocabulary (``hot_ids``), split unevenly by the shards:
    # the argmax over its columns, and the columns gathered (rank 0; None else).
    hot_argmax: torch.Tensor  # [R] global ids
    hot_gathered: torch.Tensor | None  # [R, H]


def hot_ids(v: int) -> torch.Tensor:
    """Ids a token map might hold: more of them on rank 0's shard."""
    i = torch.arange(v)
    return i[(i % 3 == 0) | (i < v // 4)]


def _bits(res: RowLogprobs, argmax: torch.Tensor, peaks: torch.Tensor) -> torch.Tensor:
    f = [res.token_logprobs, res.top_values, res.ids_logprobs, peaks]
    i = [res.top_ids, argmax]
    return torch.cat([t.flatten().view(torch.int32) for t in f] + [t.flatten().int() for t in i])


# Each shard's part by the torch reference and by the Triton kernel's
# partial mode (interpreted on the CPU).
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])
RUNS = [(backend, c) for backend in BACKENDS for c in CASES]


def _run_all(group: RankGroup) -> list[Result]:
    """Every run on this rank's shard, in order (the ranks' collectives pair up)."""
    out = []
    for backend, c in RUNS:
        start, rows, real = vocab_shard(c.logits.shape[1], group)
        local = torch.full((c.logits.shape[0], rows), 1e4)  # padding would win if read
        local[:, :real] = c.logits[:, start : start + real]
        counting = _Counting(group)
        lp = vocab_parallel_logprobs(
            local, start, real, c.token_ids, c.temps, c.top_k, c.gather_ids, counting, backend
        )
        argmax, peaks = vocab_parallel_argmax(local, start, real, counting)
        mine = _bits(lp, argmax, peaks)
        same = all(torch.equal(mine, other) for other in group.all_gather(mine))
        hot = hot_ids(c.logits.shape[1])
        counts = [int(((hot >= s) & (hot < s + n)).sum()) for s, _, n in shards(c, group)]
        cols = hot[(hot >= start) & (hot < start + real)]
        hot_local = c.logits[:, cols]  # [R, this rank's hot count]
        hot_argmax, _ = vocab_parallel_argmax(hot_local, start, real, group, cols)
        gathered = gather_columns(hot_local, counts, group)
        out.append(
            Result(
                lp, argmax, peaks, counting.gathered, counting.reduced, same, hot_argmax, gathered
            )
        )
    return out


def shards(c: Case, group: RankGroup) -> list[tuple[int, int, int]]:
    """Every rank's ``vocab_shard`` of the case's vocabulary."""
    return [vocab_shard(c.logits.shape[1], RankGroup(r, group.size)) for r in range(group.size)]


def _check(c: Case, res: Result) -> None:
    r, v = c.logits.shape
    ref = row_logprobs_ref(c.logits, c.token_ids, c.temps, c.top_k, c.gather_ids)
    tol = dict(atol=1e-5, rtol=0.0, equal_nan=True)
    lp = res.lp
    torch.testing.assert_close(lp.token_logprobs, ref.token_logprobs, **tol)
    torch.testing.assert_close(lp.ids_logprobs, ref.ids_logprobs, **tol)
    torch.testing.assert_close(lp.top_values, ref.top_values, **tol)
    # The reference's order, ties to the lowest id: a stable sort of the scaled logits.
    x = c.logits.masked_fill(c.logits.isnan(), -INF)
    if c.temps is not None:
        x = x / c.temps.unsqueeze(1)
    lowest_first = x.sort(dim=1, descending=True, stable=True).indices[:, : c.top_k]
    assert torch.equal(lp.top_ids, lowest_first), f"top ids {lp.top_ids} != {lowest_first}"
    # And each id's value is the reference's own logprob of that id.
    full = row_logprobs_ref(c.logits, c.token_ids, c.temps, 0, torch.arange(v).expand(r, v))
    torch.testing.assert_close(lp.top_values, full.ids_logprobs.gather(1, lp.top_ids), **tol)
    assert torch.equal(res.argmax, greedy_argmax(c.logits)), (res.argmax, greedy_argmax(c.logits))
    # NaN exactly where the row holds one; else the row's max (+inf, -inf too).
    torch.testing.assert_close(res.peaks, row_peaks(c.logits), rtol=0, atol=0, equal_nan=True)
    assert res.same_bits, "the ranks' results differ"
    hot = hot_ids(v)
    assert torch.equal(res.hot_argmax, hot[greedy_argmax(c.logits[:, hot])])
    if res.hot_gathered is not None:
        torch.testing.assert_close(
            res.hot_gathered, c.logits[:, hot], rtol=0, atol=0, equal_nan=True
        )
    m = 0 if c.gather_ids is None else c.gather_ids.shape[1]
    assert res.gathered == logprob_bytes(r, c.top_k, m, SIZE)
    assert res.reduced == argmax_bytes(r, SIZE)


def _worker(addr: str) -> None:
    """Rank 1: runs and checks every case; exit code 0 when all pass."""
    torch.set_num_threads(1)
    group = connect(1, SIZE, addr, torch.device("cpu"), timeout=60)
    failed = 0
    for (backend, c), res in zip(RUNS, _run_all(group)):
        try:
            _check(c, res)
        except AssertionError:
            failed += 1
            print(f"rank 1, {backend} {c.name}:\n{traceback.format_exc()}", file=sys.stderr)
    sys.exit(1 if failed else 0)


@pytest.fixture(scope="module")
def ranks() -> tuple[dict[tuple[str, str], Result], int | None]:
    """Rank 0's results by (backend, case name), and the worker's exit code."""
    addr = free_addr()
    # The worker runs this file by path: under pytest's importlib mode the
    # module is named test.distributed..., which a fresh process resolves to
    # the standard library's ``test`` package, so a pickled ``_worker`` would
    # not import there.
    init = {"_WORKER_ADDR": addr}
    proc = mp.get_context("spawn").Process(
        target=runpy.run_path, args=(__file__, init, WORKER_RUN_NAME), daemon=True
    )
    proc.start()
    try:
        group = connect(0, SIZE, addr, torch.device("cpu"), timeout=60)
        results = _run_all(group)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {(b, c.name): res for (b, c), res in zip(RUNS, results)}, proc.exitcode


@pytest.mark.parametrize(("backend", "case"), RUNS, ids=[f"{b}-{c.name}" for b, c in RUNS])
def test_rank0_matches_one_device(ranks, backend: str, case: Case) -> None:
    _check(case, ranks[0][(backend, case.name)])


def test_rank1_matches_one_device(ranks) -> None:
    assert ranks[1] == 0, "rank 1 failed a case (its stderr says which)"


def test_bytes() -> None:
    assert logprob_bytes(8, 20, 4, 1) == gather_bytes(8, 1001, 1) == argmax_bytes(8, 1) == 0
    assert logprob_bytes(8, 20, 4, 2) == 2 * 8 * (3 + 4 + 40) * 4
    assert gather_bytes(8, 1001, 2) == 8 * 501 * 4  # rank 1's padded shard
    assert gather_bytes(4, 151_936, 8) == 7 * 4 * 18_992 * 4
    # The point: a Qwen-sized vocabulary, 8 ranks, 256 rows, top-20.
    assert logprob_bytes(256, 20, 0, 8) * 50 < gather_bytes(256, 151_936, 8)


if __name__ == WORKER_RUN_NAME:
    _worker(globals()["_WORKER_ADDR"])
