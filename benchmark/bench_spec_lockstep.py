"""Speculation against plain decoding under load, engines in lockstep.

One process holds a plain engine and one engine per configuration, each
with C requests in flight (closed loop: a finished request is replaced
by the next held-out prompt at once; greedy, natural stops, each prompt's
``max_tokens`` spread over half to all of ``--output-len``: see
``spread_lengths``). The engines take one step each in turn, the order
shuffled every round, so that they share the machine's state within a
few milliseconds of each other: on a 2-core machine whose speed drifts by
10-30% over seconds, the pair ratios of ``bench_spec_load.py``'s
seconds-long waves spread as wide as the effects measured, and these do
not. Each engine's tok/s is its committed tokens over its own steps'
time (the drafting for its next step included); a window is ``--window``
rounds, and its ratio is the engine's tok/s over plain's in the same
window. Reported per C and configuration: the median and quartiles of
the windows' ratios, the share of decode steps that verified no drafts
(and the share the safety net made plain), and tau. ``plain-control``,
a second plain engine, measures what is left of the engines' own bias
(its ratio should be 1). Every engine's target forward reads the plain
engine's weights (``share_target_weights``): built apart, identical plain
engines ran 1-2% apart for a whole run by where their weights landed, and
a control read 0.975-0.996 in one sweep and 0.982-1.064 in another.

No HTTP: what it measures is the engine (scheduler, forwards, drafting,
the cost model's decisions); ``bench_spec_load.py`` measures the server.

    python benchmark/bench_spec_lockstep.py                   # the demo, every config
    python benchmark/bench_spec_lockstep.py --concurrency 8 --configs DSPARK DSPARK-fixed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "plain-control": {},
    "DSPARK": {"speculative_algorithm": "DSPARK"},
    "DSPARK-fixed": {"speculative_algorithm": "DSPARK", "speculative_adaptive": "off"},
    "DFLASH": {"speculative_algorithm": "DFLASH"},
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "DSPARK-ngram-first": {"speculative_algorithm": "DSPARK", "speculative_ngram_first": True},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--windows", type=int, default=8, help="measured windows per concurrency")
    p.add_argument("--window", type=int, default=200, help="rounds (one step each) per window")
    p.add_argument("--warm-up", type=int, default=300, help="rounds before measuring, per C")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (held-out windows)")
    p.add_argument("--output-len", type=int, default=64, help="the most max_tokens of a request")
    p.add_argument(
        "--separate-weights",
        action="store_true",
        help="each engine's target on its own copy of the weights (as built)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH.png", help="ratios against clients")
    return p.parse_args()


class ClosedLoop:
    """``clients`` requests in flight on one engine's core, each replaced by
    the next prompt when it finishes; counts its tokens and step seconds."""

    def __init__(self, engine: Any, prompts: list[list[int]], max_tokens: list[int]) -> None:
        from specserve.core import Req

        self.engine, self.core, self.prompts, self._req = engine, engine.core, prompts, Req
        self.max_tokens = max_tokens  # by prompt
        self.next_prompt, self.in_flight = 0, 0
        self.tokens, self.seconds = 0, 0.0

    def fill(self, clients: int) -> None:
        while self.in_flight < clients:
            i = self.next_prompt % len(self.prompts)
            self.next_prompt += 1
            sampling = {"temperature": 0, "max_new_tokens": self.max_tokens[i]}
            greqs, _ = self.engine.requests.build(None, sampling, input_ids=self.prompts[i])
            g = greqs[0]
            req = self._req(g.rid, g.input_ids, g.sampling, g.logprob, self.engine.eos_ids)
            assert self.core.add(req) is None, "a benchmark request failed at admission"
            self.in_flight += 1

    def step(self, clients: int) -> None:
        self.core.idle()  # the other engines' steps since its last are not its cost
        start = time.perf_counter()
        outputs = self.core.step()
        self.seconds += time.perf_counter() - start
        for out in outputs:
            self.tokens += len(out.token_ids)
            if out.finished:
                assert out.finish_reason is not None and out.finish_reason.type != "abort", out
                self.in_flight -= 1
        self.fill(clients)

    def drain(self) -> None:
        while self.core.has_work():
            self.step(0)

    def take(self) -> tuple[int, float]:
        out, self.tokens, self.seconds = (self.tokens, self.seconds), 0, 0.0
        return out


def counters(engine: Any) -> tuple[int, ...]:
    """Decode steps decided, of them plain and those the safety net made
    plain, verify rounds and their tokens."""
    spec = engine.core.spec
    if spec is None:
        return 0, 0, 0, 0, 0
    st = spec.planner.stats if spec.planner else None
    decided = (st.steps, st.plain_steps, st.forced_plain) if st else (0, 0, 0)
    return *decided, spec.stats.rounds, spec.stats.committed


def share_target_weights(engines: list[Any]) -> None:
    """Every engine's target forward runs on the first engine's model (the
    forward is the model's alone: the KV pool and the attention backend are
    the runner's, passed in), so that configurations differ by what they
    do, not by where their weights landed (four plain engines built apart:
    the first ran 1-2% behind the others at 1 and 8 requests, a whole run
    long; sharing: within 0.7%). An engine with captured CUDA graphs keeps
    its own (its graphs hold them); a drafter keeps the target's embedding
    and head it was built with (equal values)."""
    model = engines[0].runner.model
    for engine in engines[1:]:
        if engine.runner.graphs is None:
            engine.runner.model = model


def rounds(loops: dict[str, ClosedLoop], count: int, clients: int, rng: random.Random) -> None:
    """``count`` rounds of one step per engine, in an order shuffled per round:
    an engine that steps after another finds the caches as that one left
    them (the target's weights warm after a plain engine, partly evicted
    after a drafter), so none may always follow the same one (rotated,
    the control always stepped after plain, on its weights: 1.026x)."""
    order = list(loops.values())
    for _ in range(count):
        rng.shuffle(order)
        for loop in order:
            loop.step(clients)


def measure(loops: dict[str, ClosedLoop], clients: int, args: argparse.Namespace) -> dict:
    """One concurrency's row: every engine filled to ``clients`` requests,
    warmed up, measured over ``args.windows`` windows, then drained."""
    names = list(loops)
    rng = random.Random(clients)  # the same orders run after run
    for loop in loops.values():
        loop.fill(clients)
    rounds(loops, args.warm_up, clients, rng)
    for loop in loops.values():
        loop.take()
    before = {n: counters(loop.engine) for n, loop in loops.items()}
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.windows):
        rounds(loops, args.window, clients, rng)
        for n, loop in loops.items():
            tokens, seconds = loop.take()
            rates[n].append(tokens / max(seconds, 1e-12))
    row: dict[str, Any] = {"clients": clients, "plain_tok_s": statistics.median(rates["plain"])}
    for n in names[1:]:
        steps, plain, forced, rnds, committed = (
            a - b for a, b in zip(counters(loops[n].engine), before[n])
        )
        ratios = [a / b for a, b in zip(rates[n], rates["plain"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        row[n] = {
            "tok_s": statistics.median(rates[n]),
            "vs_plain": statistics.median(ratios),
            "quartiles": [q[0], q[2]],
            "plain_share": plain / steps if steps else None,
            "forced_share": forced / steps if steps else None,
            "tau": committed / rnds if rnds else None,
        }
    for loop in loops.values():  # the next concurrency starts from empty engines
        loop.drain()
        loop.take()
    return row


def demo_loops(
    runs: list[tuple[str, str]], args: argparse.Namespace, share: bool = True
) -> dict[str, ClosedLoop]:
    """A closed loop per ``(name, config)`` (a CONFIGS key, else plain) on
    its own engine on the demo, sized for ``args``' most requests, every
    loop over the same held-out prompts and caps; ``share``: every target
    forward on the first engine's weights (``share_target_weights``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_spec_load import held_out_prompts, spread_lengths
    from specserve import Engine
    from specserve.assets import demo_path

    most = max(args.concurrency)
    prompts = held_out_prompts(max(4 * most, 64), args.input_len, None)
    max_tokens = spread_lengths(len(prompts), args.output_len)
    # Every engine's pool holds its most requests with room to spare (the
    # default pool would take gigabytes per engine).
    common = {
        "model_path": demo_path("target"),
        "device": "cpu",
        "max_running_requests": most,
        "max_total_tokens": most * (args.input_len + args.output_len + 64),
    }
    engines = {}
    for name, config in runs:
        kw = dict(CONFIGS.get(config, {}))
        alg = kw.get("speculative_algorithm")
        if alg in ("DSPARK", "DFLASH"):
            kw["speculative_draft_model_path"] = demo_path(alg.lower())
        engines[name] = Engine(**common, **kw)
    if share:
        share_target_weights(list(engines.values()))
    return {n: ClosedLoop(e, prompts, max_tokens) for n, e in engines.items()}


def main() -> int:
    args = parse_args()
    from specserve.engine.engine import device_scope

    names = ["plain", *args.configs]
    loops = demo_loops([(n, n) for n in names], args, share=not args.separate_weights)
    results: list[dict] = []
    try:
        with device_scope(loops["plain"].engine.runner.device):
            for c in args.concurrency:
                results.append(measure(loops, c, args))
                print(format_row(results[-1], names[1:]), flush=True)
    finally:
        for loop in loops.values():
            loop.engine.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"configs": names[1:], "rows": results}, f, indent=1)
    if args.plot:
        plot(results, names[1:], args.plot)
    return 0


def plot(rows: list[dict], names: list[str], path: str) -> None:
    """Each configuration's tok/s over plain's against clients, its windows'
    quartiles as error bars."""
    from bench_spec_load import plot_against_clients

    def draw(ax: Any) -> None:
        clients = [r["clients"] for r in rows]
        for n in names:
            mid = [r[n]["vs_plain"] for r in rows]
            lo = [m - r[n]["quartiles"][0] for m, r in zip(mid, rows)]
            hi = [r[n]["quartiles"][1] - m for m, r in zip(mid, rows)]
            ax.errorbar(clients, mid, yerr=[lo, hi], marker="o", capsize=3, label=n)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.98, color="grey", linewidth=0.8, linestyle="--")

    ylabel = "tok/s over plain's (engines in lockstep)"
    plot_against_clients(draw, "requests in flight", ylabel, path)


def format_row(row: dict, names: list[str]) -> str:
    parts = [f"C={row['clients']:<3} plain {row['plain_tok_s']:7.1f} tok/s"]
    for n in names:
        r = row[n]
        extra = ""
        if r["plain_share"] is not None:
            extra = (
                f", {100 * r['plain_share']:.0f}% plain ({100 * r['forced_share']:.0f}% by the net)"
            )
        tau = "" if r["tau"] is None else f" t{r['tau']:.2f}"
        lo, hi = r["quartiles"]
        parts.append(f"{n} {r['vs_plain']:.3f}x ({lo:.3f}-{hi:.3f}){tau}{extra}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
