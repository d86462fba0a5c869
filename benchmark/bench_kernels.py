"""Kernel timings: each Triton kernel in specserve.kernels against its torch reference.

Cases: ``row_logprobs`` (top-k and gathered ids) on a bfloat16 and a float32
logits block and on a smaller vocab, ``greedy_verify`` and ``rejection_verify``
on chains of drafts, and paged attention (the Triton backend against the SDPA
one, which gathers the pages it reads) for a decode batch over a long context. Outputs are checked against the reference first; then
each side is timed (median over repeats, L2 flushed between them on CUDA) and
the table gives ms per call, the speedup (reference / Triton), and for the
kernels whose traffic is known the achieved GB/s and its share of the
device's peak memory bandwidth. Without CUDA only the references are timed,
on smaller shapes.

    python benchmark/bench_kernels.py                    # CUDA: 256 x 151936 rows, 64 chains
    python benchmark/bench_kernels.py --rows 1024 --peak-gbps 4800
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from specserve.kernels import chain_verify as cv
from specserve.kernels import logprobs as lp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--rows", type=int, default=None, help="logits rows (default: 256; CPU 16)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--small-vocab", type=int, default=32000, help="the smaller-vocab case")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--gather", type=int, default=4, help="gathered ids per row (some padded)")
    p.add_argument("--chains", type=int, default=None, help="verify chains (default: 64; CPU 8)")
    p.add_argument("--drafts", type=int, default=8, help="drafts per chain")
    p.add_argument(
        "--attn-batch", type=int, default=None, help="decode requests (default: 64; CPU 2)"
    )
    p.add_argument(
        "--attn-context", type=int, default=None, help="tokens of each (default: 4096; CPU 256)"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default: 50; CPU 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default: 5; CPU 1)")
    p.add_argument(
        "--peak-gbps", type=float, default=None, help="peak memory bandwidth (default: estimated)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    return p.parse_args()


# ------------------------------------------------------------------------------ timing


class Timer:
    """Median wall time of a call; CUDA events, with L2 flushed before each call so
    the kernels read from HBM as they would in a serving step."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.flush = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            self.flush = torch.empty(max(2 * l2, 256 << 20), dtype=torch.int8, device=device)

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Milliseconds per call."""
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize(self.device)
        events = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_gbps(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


# ------------------------------------------------------------------------------- cases


def lowest_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax with ties to the lowest index, as the verifiers define it."""
    x = x.float()
    hit = x == x.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(hit, idx, x.shape[-1]).min(dim=-1).values


def check_logprobs(got: lp.RowLogprobs, want: lp.RowLogprobs, logits: torch.Tensor) -> str | None:
    tol = dict(atol=1e-3, rtol=1e-4)
    try:
        torch.testing.assert_close(got.token_logprobs, want.token_logprobs, **tol)
        torch.testing.assert_close(got.top_values, want.top_values, **tol)
        torch.testing.assert_close(got.ids_logprobs, want.ids_logprobs, equal_nan=True, **tol)
        # Tied logits may come in another order from torch.topk: compare the logits
        # at the kernel's ids with the reference's, not the ids themselves.
        x = logits.float()
        torch.testing.assert_close(
            x.gather(1, got.top_ids), x.gather(1, want.top_ids), atol=0, rtol=0
        )
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


def logprobs_case(
    name: str, n: int, v: int, dtype: torch.dtype, args: argparse.Namespace, dev: torch.device
) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(args.seed)
    logits = (torch.randn(n, v, generator=g, device=dev) * 3).to(dtype)  # [N, V]
    token_ids = torch.randint(0, v, (n,), generator=g, device=dev)  # [N]
    gather = torch.randint(0, v, (n, args.gather), generator=g, device=dev)  # [N, M]
    if args.gather:
        gather[1::2, -1] = -1  # padding, as ragged requests produce
    ref = lambda: lp.row_logprobs_ref(logits, token_ids, None, args.top_k, gather)
    tri = lambda: lp.row_logprobs_triton(logits, token_ids, None, args.top_k, gather)
    return {
        "kernel": "row_logprobs",
        "case": name,
        "shape": f"[{n}, {v}] {str(dtype).removeprefix('torch.')}",
        "bytes": n * v * logits.element_size(),  # the block read once
        "ref": ref,
        "triton": tri,
        "check": lambda: check_logprobs(tri(), ref(), logits),
    }


def chains(b: int, lmax: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row starts and lengths: chain b owns rows b*(L+1) .. b*(L+1)+L."""
    starts = torch.arange(b, device=dev) * (lmax + 1)
    lengths = torch.full((b,), lmax, dtype=torch.int64, device=dev)
    return starts, lengths


def check_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> str | None:
    for name, a, w in zip(("accept_len", "next_token"), got, want):
        if not torch.equal(a, w):
            bad = int((a != w).sum())
            return f"{name} differs in {bad} of {w.numel()} chains"
    return None


def greedy_case(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    b, lmax, v = args.chains, args.drafts, args.vocab
    g = torch.Generator(device=dev).manual_seed(args.seed)
    logits = (torch.randn(b * (lmax + 1), v, generator=g, device=dev) * 3).to(torch.bfloat16)
    starts, lengths = chains(b, lmax, dev)
    # Each chain matches the argmax for a random prefix, then misses: mixed accept lengths.
    target = lowest_argmax(logits).view(b, lmax + 1)[:, :lmax]  # [B, L]
    accept = torch.randint(0, lmax + 1, (b,), generator=g, device=dev)  # [B]
    miss = torch.arange(lmax, device=dev) == accept.unsqueeze(1)  # [B, L]
    drafts = torch.where(miss, (target + 1) % v, target)
    read = logits.numel() * logits.element_size()  # row-parallel: every row once
    ref = lambda: cv.greedy_verify_ref(logits, starts, drafts, lengths)
    tri = lambda: cv.greedy_verify_triton(logits, starts, drafts, lengths)
    return {
        "kernel": "greedy_verify",
        "case": f"{b} chains x {lmax}",
        "shape": f"[{b * (lmax + 1)}, {v}] bfloat16",
        "bytes": read,
        "ref": ref,
        "triton": tri,
        "check": lambda: check_same(tri(), ref()),
    }


def rejection_case(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    b, lmax, v = args.chains, args.drafts, args.vocab
    g = torch.Generator(device=dev).manual_seed(args.seed)
    target = torch.randn(b * (lmax + 1), v, generator=g, device=dev) * 2
    probs = torch.softmax(target, dim=-1)  # [B*(L+1), V]
    starts, lengths = chains(b, lmax, dev)
    # A drafter close to the target: its rows are the target's plus noise.
    rows = starts.unsqueeze(1) + torch.arange(lmax, device=dev)  # [B, L]
    noisy = target[rows.flatten()] + torch.randn(b * lmax, v, generator=g, device=dev)
    draft_probs = torch.softmax(noisy, dim=-1)  # [B*L, V]
    draft_starts = torch.arange(b, device=dev) * lmax
    drafts = torch.multinomial(draft_probs, 1, generator=g).view(b, lmax)
    uniforms = torch.rand(b, lmax + 1, generator=g, device=dev)
    inputs = (probs, starts, drafts, lengths, draft_probs, draft_starts, uniforms)
    ref = lambda: cv.rejection_verify_ref(*inputs)
    tri = lambda: cv.rejection_verify_triton(*inputs)
    return {
        "kernel": "rejection_verify",
        "case": f"{b} chains x {lmax}",
        "shape": f"[{b * (lmax + 1)}, {v}] float32",
        "bytes": None,  # data-dependent passes over rows: no fixed traffic to quote
        "ref": ref,
        "triton": tri,
        "check": lambda: check_same(tri(), ref()),
    }


def attention_case(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """Qwen3-8B's attention shape (32 query heads, 8 KV heads of 128), pages of
    16, one layer: every request decodes one token over its whole context."""
    from specserve.cache.kv_pool import KVPool
    from specserve.layers.attention import (
        AttentionMetadata,
        TorchAttentionBackend,
        TritonAttentionBackend,
    )

    b, ctx, h, hkv, d, ps = args.attn_batch, args.attn_context, 32, 8, 128, 16
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pages_each = -(-ctx // ps)
    pool = KVPool(1, b * pages_each, ps, hkv, d, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(b)]
    slots = torch.tensor([t[(ctx - 1) // ps] * ps + (ctx - 1) % ps for t in tables], device=dev)
    meta = AttentionMetadata(
        torch.full((b,), ctx - 1, device=dev), slots, [1] * b, [ctx] * b, tables, ps
    )
    q = torch.randn(b, h, d, generator=g, device=dev).to(dtype)
    k = torch.randn(b, hkv, d, generator=g, device=dev).to(dtype)
    v = torch.randn(b, hkv, d, generator=g, device=dev).to(dtype)
    sdpa, paged = TorchAttentionBackend(pool), TritonAttentionBackend(pool, h)

    def run(backend: Any) -> torch.Tensor:
        backend.prepare(meta)
        return backend.forward(0, q, k, v, meta)

    def check() -> str | None:
        err = (run(paged).float() - run(sdpa).float()).abs().max().item()
        return None if err <= 2e-2 else f"max |difference| {err:.3g}"

    return {
        "kernel": "paged_attention",
        "case": f"{b} x {ctx} decode",
        "shape": f"32/8 heads x 128 {str(dtype).removeprefix('torch.')}",
        "bytes": 2 * b * ctx * hkv * d * pool.k[0].element_size(),  # K and V, once
        "ref": lambda: run(sdpa),
        "triton": lambda: run(paged),
        "check": check,
    }


# -------------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda given but no CUDA device is available", file=sys.stderr)
        return 1
    on_cuda = dev.type == "cuda"
    use_triton = on_cuda and lp.HAS_TRITON and cv.HAS_TRITON
    if not on_cuda:
        print("no CUDA device: timing the torch references only")
    elif not use_triton:
        print("triton is not installed: timing the torch references only")
    args.rows = args.rows or (256 if on_cuda else 16)
    args.chains = args.chains or (64 if on_cuda else 8)
    args.attn_batch = args.attn_batch or (64 if on_cuda else 2)
    args.attn_context = args.attn_context or (4096 if on_cuda else 256)
    args.repeats = args.repeats or (50 if on_cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)
    if args.gather < 0 or not 0 <= args.top_k <= args.small_vocab:
        print("bench_kernels: --gather must be >= 0 and --top-k in [0, vocab]", file=sys.stderr)
        return 2
    timer = Timer(dev, args.repeats, args.warmup)
    peak = peak_gbps(dev, args.peak_gbps)

    # bfloat16 is what a GPU serves; a CPU engine keeps float32 logits, so it leads there.
    first, second = (torch.bfloat16, torch.float32) if on_cuda else (torch.float32, torch.bfloat16)
    short = lambda d: str(d).removeprefix("torch.")
    cases = [
        logprobs_case(short(first), args.rows, args.vocab, first, args, dev),
        logprobs_case(short(second), args.rows, args.vocab, second, args, dev),
        logprobs_case("small vocab", args.rows, args.small_vocab, first, args, dev),
        greedy_case(args, dev),
        rejection_case(args, dev),
        attention_case(args, dev),
    ]

    rows, failed = [], []
    for c in cases:
        row: dict[str, Any] = {k: c[k] for k in ("kernel", "case", "shape", "bytes")}
        row["check"] = None
        if use_triton:
            err = c["check"]()
            row["check"] = "ok" if err is None else "MISMATCH"
            if err is not None:
                failed.append(f"{c['kernel']} ({c['case']}): {err}")
        row["ref_ms"] = timer(c["ref"])
        row["triton_ms"] = timer(c["triton"]) if use_triton else None
        row["speedup"] = row["ref_ms"] / row["triton_ms"] if row["triton_ms"] else None
        # Bandwidth of the faster side that was timed: the kernel's, or the reference's.
        ms = row["triton_ms"] or row["ref_ms"]
        row["gbps"] = c["bytes"] / ms / 1e6 if c["bytes"] else None
        row["peak_pct"] = 100 * row["gbps"] / peak if row["gbps"] and peak else None
        rows.append(row)

    name = torch.cuda.get_device_name(dev) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    peak_note = f", peak {peak:.0f} GB/s" if peak else ""
    print(f"device: {name}{peak_note}; median of {args.repeats} (after {args.warmup} warm-up)")
    print(
        f"{'kernel':>16} {'case':>14} {'shape':>24} {'ref ms':>9} {'triton ms':>9} "
        f"{'speedup':>7} {'GB/s':>7} {'% peak':>6} {'check':>8}"
    )
    dash = lambda v, spec: f"{'-':>{spec.split('.')[0]}}" if v is None else f"{v:{spec}}"
    for r in rows:
        print(
            f"{r['kernel']:>16} {r['case']:>14} {r['shape']:>24} {r['ref_ms']:>9.3f} "
            f"{dash(r['triton_ms'], '9.3f')} "
            + (f"{r['speedup']:>6.2f}x" if r["speedup"] else f"{'-':>7}")
            + f" {dash(r['gbps'], '7.1f')} {dash(r['peak_pct'], '6.1f')} {r['check'] or '-':>8}"
        )
    what = "Triton kernel's" if use_triton else "reference's"
    print("GB/s: bytes read (row_logprobs and greedy: the logits block once; attention:")
    print(f"the K/V of every context once) / the {what} time;")
    print("attention's ref is the SDPA backend")
    if args.output_json:
        meta = {"device": name, "peak_gbps": peak, "args": vars(args)}
        with open(args.output_json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    for msg in failed:
        print(f"bench_kernels: output mismatch: {msg}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
