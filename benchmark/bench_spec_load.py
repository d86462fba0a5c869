"""Speculation against plain serving under load: one live server per
configuration, C clients each sending requests back to back.

Every configuration is a ``specserve serve`` of the same target (the demo
by default) on its own port. For each concurrency C and each repeat, every
speculative server gets one wave beside a plain one: C clients share ``max(C * --requests-per-client, 8)`` held-out prompts, each
sending its next request when the last one finished, greedy, natural stops
(each prompt's ``max_tokens`` drawn from half to all of ``--output-len``:
``spread_lengths``). Each speculative wave runs next to a plain
one, and its ratio to that one is what counts: the machine drifts by
several percent over minutes, and adjacent waves share its state. The
plain wave runs first on even repeats and second on odd ones (the second
wave of a pair runs slower, whatever the server: an even ``--repeats``
cancels that); ``plain-control``, a second plain server, measures what is
left of the harness's bias and noise. Reported
per C and configuration, medians over the repeats: output tok/s over the
wave, the ratio to plain (the median of the pairs' ratios), tau (committed
tokens per verify round) and the share of decode steps that verified no
drafts (``/get_server_info``'s ``spec_plain_steps`` / ``spec_steps``).

    python benchmark/bench_spec_load.py                        # the demo, every config
    python benchmark/bench_spec_load.py --concurrency 1 8 32 --configs DSPARK DSPARK-fixed
    PYTHONPATH=/old/checkout/python python benchmark/bench_spec_load.py --configs DSPARK
      # (an older checkout's servers: the environment reaches them)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

PROG = "bench_spec_load"
CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "DSPARK": ["--speculative-algorithm", "DSPARK"],
    "DSPARK-fixed": ["--speculative-algorithm", "DSPARK", "--speculative-adaptive", "off"],
    "DFLASH": ["--speculative-algorithm", "DFLASH"],
    "NGRAM": ["--speculative-algorithm", "NGRAM"],
    "DSPARK-ngram-first": ["--speculative-algorithm", "DSPARK", "--speculative-ngram-first"],
    # A second plain server measured as the others are: the harness's own
    # bias and noise (its ratio should be 1).
    "plain-control": [],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="target (default: the demo)")
    p.add_argument(
        "--configs",
        nargs="+",
        choices=[c for c in CONFIGS if c != "plain"],
        default=[c for c in CONFIGS if c not in ("plain", "plain-control")],
        help="speculative servers, each against plain",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (held-out windows)")
    p.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="the most max_tokens of a request (spread_lengths)",
    )
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--port", type=int, default=31000, help="the first server's port")
    p.add_argument("--server-args", default="", help="more flags for every server (one string)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH.png", help="tok/s against clients")
    return p.parse_args()


def start_servers(args: argparse.Namespace, names: list[str], log_dir: str) -> dict[str, Any]:
    """One server per configuration, started one after another: each
    profiles its step costs at start-up, which servers starting together
    would do on each other's cores (tables 10-70x too slow)."""
    procs = {}
    deadline = time.time() + 600
    for k, name in enumerate(names):
        port = args.port + k
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port)]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        cmd += CONFIGS[name] + args.server_args.split()
        log = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115 (closed in stop_servers)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs[name] = (proc, port, log)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} server exited; see {log_dir}/{name}.log")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the {name} server did not come up")
            time.sleep(1)
    return procs


def stop_servers(procs: dict[str, Any]) -> None:
    for proc, _, _log in procs.values():
        proc.terminate()
    for proc, _, log in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def held_out_prompts(count: int, length: int, model_path: str | None) -> list[list[int]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_spec import source_windows
    from specserve.assets import demo_path
    from specserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(model_path or demo_path("target"))
    return source_windows(tok, "held-out", count, length)


async def stats(client: httpx.AsyncClient, port: int) -> dict[str, Any]:
    r = await client.get(f"http://127.0.0.1:{port}/get_server_info")
    return r.json().get("stats") or {}


def spread_lengths(count: int, most: int) -> list[int]:
    """``max_tokens`` per prompt, drawn uniformly from ``[most / 2, most]``
    with a fixed seed. The demo seldom stops before its cap: with one cap
    for all, a plain server's requests all finish together and the next
    ones arrive together, their prompts one batched prefill, while
    speculation soon spreads its requests apart and mixes a prompt's chunk
    into many decode steps, which costs more (4% of plain's speed at 8
    requests, offline in ``bench_spec_lockstep.py``). Spread caps keep
    every server's requests apart, as real traffic's are."""
    rng = random.Random(0)
    return [rng.randint(max(most // 2, 1), most) for _ in range(count)]


async def wave(port: int, prompts: list[list[int]], clients: int, max_tokens: list[int]) -> dict:
    """One wave: ``clients`` workers drain ``prompts`` (``max_tokens``: each
    one's cap); returns tok/s and the server's speculative counters over
    the wave."""
    async with httpx.AsyncClient(timeout=600) as client:
        before = await stats(client, port)
        queue = list(zip(reversed(prompts), reversed(max_tokens)))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while queue:
                prompt, cap = queue.pop()
                body = {"prompt": prompt, "max_tokens": cap, "temperature": 0}
                r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
        after = await stats(client, port)

    def delta(key: str) -> float:
        return float(after.get(key) or 0) - float(before.get(key) or 0)

    def committed(st: dict) -> float:  # tau x rounds: the tokens verify rounds committed
        return float(st.get("spec_accept_length") or 0) * float(st.get("spec_verify_rounds") or 0)

    rounds = delta("spec_verify_rounds")
    steps = delta("spec_steps")
    return {
        "tok_s": tokens / seconds,
        "tau": (committed(after) - committed(before)) / rounds if rounds else None,
        "plain_share": delta("spec_plain_steps") / steps if steps else None,
    }


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    args = parse_args()
    names = ["plain", *args.configs]
    prompts_all = held_out_prompts(
        max(c * args.requests_per_client for c in args.concurrency) + 8,
        args.input_len,
        args.model_path,
    )
    caps_all = spread_lengths(len(prompts_all), args.output_len)
    log_dir = tempfile.mkdtemp(prefix="bench-spec-load-")
    procs = start_servers(args, names, log_dir)
    rows = []
    try:
        for name in names:  # warm-up: one request each
            asyncio.run(wave(procs[name][1], prompts_all[:1], 1, [8]))
        for c in args.concurrency:
            count = max(c * args.requests_per_client, 8)
            prompts, caps = prompts_all[:count], caps_all[:count]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            ratios: dict[str, list[float]] = {n: [] for n in args.configs}
            for rep in range(args.repeats):
                for name in args.configs:
                    # Each wave beside a plain one: their ratio cancels the
                    # machine's drift (several percent over minutes). Which
                    # runs first alternates: the second of two identical
                    # servers' waves measured up to 11% slower (the
                    # plain-control arm), which would count against every
                    # configuration run second.
                    order = ["plain", name] if rep % 2 == 0 else [name, "plain"]
                    pair = {n: asyncio.run(wave(procs[n][1], prompts, c, caps)) for n in order}
                    runs["plain"].append(pair["plain"])
                    runs[name].append(pair[name])
                    ratios[name].append(pair[name]["tok_s"] / pair["plain"]["tok_s"])
            for name in names:
                row = {
                    "clients": c,
                    "config": name,
                    "tok_s": median([r["tok_s"] for r in runs[name]]),
                    "vs_plain": median(ratios[name]) if name != "plain" else 1.0,
                    "ratios": ratios.get(name),
                    "tau": median([r["tau"] for r in runs[name]]),
                    "plain_share": median([r["plain_share"] for r in runs[name]]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        stop_servers(procs)
    print(f"\n{'clients':>7} " + " ".join(f"{n:>20}" for n in names))
    for c in args.concurrency:
        cells = []
        for name in names:
            r = next(r for r in rows if r["clients"] == c and r["config"] == name)
            tau = f" t{r['tau']:.2f}" if r["tau"] else ""
            cells.append(f"{r['tok_s']:8.1f} {r['vs_plain']:5.2f}x{tau:>6}")
        print(f"{c:>7} " + " ".join(f"{s:>20}" for s in cells))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:

        def draw(ax: Any) -> None:
            for name in names:
                pts = [(r["clients"], r["tok_s"]) for r in rows if r["config"] == name]
                ax.plot(*zip(*pts), marker="o", label=name)

        plot_against_clients(draw, "concurrent clients", "output tokens/s", args.plot)
    return 0


def plot_against_clients(draw: Any, xlabel: str, ylabel: str, path: str) -> None:
    """A figure of ``draw(ax)``'s lines against a log2 axis of clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
