"""Online serving load test against any OpenAI-compatible server.

Streams ``/v1/completions`` or ``/v1/chat/completions`` requests (specserve,
SGLang, vLLM, ...) at a sweep of fixed concurrencies, or as Poisson arrivals
at a request rate, and reports per level: requests ok/errors, request and
output-token throughput, TTFT / inter-token / end-to-end latency percentiles
(ms) and, where the server reports it, the mean accepted length tau.

    specserve serve --model-path M &
    python benchmark/bench_serving.py                            # concurrency 1 8 32
    python benchmark/bench_serving.py --request-rate 4 --max-concurrency 16
    python benchmark/bench_serving.py --endpoint chat --dataset demo --logprobs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import string
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

PROG = "bench_serving"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--dataset",
        choices=["random", "demo", "file"],
        default="random",
        help="random: random token ids (random text for chat); demo: windows of the Python "
        "standard library's sources; file: --dataset-path, one prompt per line",
    )
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random, demo)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="sweep (default: 1 8 32)"
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals, requests/s (inf: all)"
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="cap on in-flight requests with a rate"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="top-N logprobs")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="response_format schema")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed, before the first level")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH.png", help="tok/s and TTFT vs load")
    args = p.parse_args()
    if args.dataset == "file" and not args.dataset_path:
        p.error("--dataset file needs --dataset-path")
    if args.max_concurrency is not None and args.request_rate is None:
        p.error("--max-concurrency goes with --request-rate")
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = [1, 8, 32]
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.concurrency and min(args.concurrency) < 1:
        p.error("--concurrency values must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    return args


class Unreachable(Exception):
    pass


# ------------------------------------------------------------------------------ server


class Server:
    """The few non-generation endpoints the benchmark uses; each one is optional
    except /v1/models, so any OpenAI-compatible server works."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.can_tokenize = True
        self.can_detokenize = True

    async def models(self) -> list[str]:
        try:
            r = await self.client.get("/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            raise Unreachable(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
        if r.status_code != 200:
            raise Unreachable(f"GET /v1/models returned {r.status_code}: {r.text[:200]}")
        return [m["id"] for m in r.json().get("data", [])]

    async def get_json(self, path: str) -> dict[str, Any] | None:
        try:
            r = await self.client.get(path, timeout=10.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def tokenize(self, text: str, model: str) -> list[int] | None:
        if not self.can_tokenize:
            return None
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        try:
            r = await self.client.post("/tokenize", json=body, timeout=30.0)
            if r.status_code == 200:
                return list(r.json()["tokens"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        self.can_tokenize = False  # ask once; fall back to a chars/token estimate
        return None

    async def detokenize(self, ids: list[int], model: str) -> str | None:
        if not self.can_detokenize:
            return None
        try:
            r = await self.client.post(
                "/detokenize", json={"model": model, "tokens": ids}, timeout=30.0
            )
            if r.status_code == 200:
                return str(r.json()["prompt"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        self.can_detokenize = False
        return None

    async def spec_stats(self) -> tuple[float | None, int | None]:
        """(mean accepted length, verify rounds) since the server started, if reported."""
        info = await self.get_json("/get_server_info")
        stats = (info or {}).get("stats") or {}
        tau, rounds = stats.get("spec_accept_length"), stats.get("spec_verify_rounds")
        return (
            float(tau) if isinstance(tau, (int, float)) else None,
            int(rounds) if isinstance(rounds, int) else None,
        )


# ----------------------------------------------------------------------------- prompts

CHARS_PER_TOKEN = 4  # rough ratio for English / code when the server cannot tokenize


async def build_prompts(
    args: argparse.Namespace, server: Server, model: str
) -> tuple[list[str | list[int]], str]:
    """Returns the prompts and a note on how their length was set."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "file":
        with open(args.dataset_path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"no prompts in {args.dataset_path}")
        return [lines[i % len(lines)] for i in range(n)], "file prompts as given"
    if args.dataset == "random":
        return await random_prompts(args, server, model, rng)
    return await demo_prompts(args, server, model, rng)


async def random_prompts(
    args: argparse.Namespace, server: Server, model: str, rng: random.Random
) -> tuple[list[str | list[int]], str]:
    info = await server.get_json("/tokenizer_info") or {}
    vocab = info.get("vocab_size")
    note = ""
    if not isinstance(vocab, int) or vocab < 2:
        vocab = 10_000  # below every real LLM vocab, so every id is valid
        note = " (vocab unknown: ids < 10000)"
    # Keep the special ids out, so no prompt holds a stray end-of-turn marker.
    special = {info.get(k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    special |= set(info.get("eos_token_ids") or [])
    allowed = [i for i in range(min(vocab, 1 << 20)) if i not in special]

    def ids() -> list[int]:
        return [rng.choice(allowed) for _ in range(args.input_len)]

    if args.endpoint == "completions":
        # Token-id prompts are used as given, so the prompt length is exact.
        return [ids() for _ in range(args.num_prompts)], f"random token ids{note}"
    # Chat takes text: decode random ids when the server can, else random letter words.
    out: list[str | list[int]] = []
    for _ in range(args.num_prompts):
        text = await server.detokenize(ids(), model)
        if text is None:
            words, size = [], 0
            while size < args.input_len * CHARS_PER_TOKEN:
                w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
                words.append(w)
                size += len(w) + 1
            text = " ".join(words)
        out.append(text)
    how = "decoded random ids" if server.can_detokenize else "random letters, ~4 chars/token"
    return out, f"random text ({how})"


def stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
        files += [os.path.join(d, x) for x in sorted(names) if x.endswith(".py")]
    return files


async def demo_prompts(
    args: argparse.Namespace, server: Server, model: str, rng: random.Random
) -> tuple[list[str | list[int]], str]:
    files = stdlib_sources()
    if not files:
        raise ValueError(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    # Read generously, then cut to the token budget once it is measured.
    want_chars = args.input_len * CHARS_PER_TOKEN * 2
    out: list[str | list[int]] = []
    for _ in range(args.num_prompts):
        text = ""
        while len(text) < want_chars:  # small files: append another one
            with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
                src = f.read()
            start = rng.randrange(max(1, len(src) - want_chars))
            start = src.rfind("\n", 0, start) + 1  # begin at a line start
            text += src[start : start + want_chars - len(text)]
        out.append(await cut_to_tokens(text, args.input_len, server, model))
    how = "cut with /tokenize" if server.can_tokenize else "~4 chars/token"
    return out, f"stdlib source windows ({how})"


async def cut_to_tokens(text: str, n: int, server: Server, model: str) -> str:
    ids = await server.tokenize(text, model)
    if ids is None:
        return text[: n * CHARS_PER_TOKEN]
    if len(ids) <= n:
        return text
    decoded = await server.detokenize(ids[:n], model)
    if decoded is not None:
        return decoded
    return text[: int(len(text) * n / len(ids))]  # proportional cut


# ---------------------------------------------------------------------------- requests


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # s, to the first chunk with text
    itl: list[float] = field(default_factory=list)  # s, per token (or per chunk)
    itl_per_token: bool = True
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None


def make_payload(args: argparse.Namespace, model: str, prompt: str | list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,  # fixed output length; servers without the field ignore it
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "completions":
        body["prompt"] = prompt
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        if args.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = args.logprobs
    if args.schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": args.schema_name, "schema": args.schema, "strict": True},
        }
    return body


def chunk_content(choice: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """(new text, tokens in the chunk if its logprobs tell)."""
    lp = choice.get("logprobs")
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
        n = len(lp["content"]) if isinstance(lp, dict) and lp.get("content") is not None else None
    else:
        text = choice.get("text") or ""
        n = len(lp["tokens"]) if isinstance(lp, dict) and lp.get("tokens") is not None else None
    return text, n


async def send(
    client: httpx.AsyncClient, args: argparse.Namespace, path: str, body: dict[str, Any]
) -> Result:
    res = Result()
    chat = args.endpoint == "chat"
    start = time.perf_counter()
    last: float | None = None
    pending = 0  # tokens of chunks with no text yet, credited to the next text chunk
    counted = 0  # tokens known from chunk logprobs
    chunks = 0
    done = False
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {error_message(raw)}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {error_message(json.dumps(obj))}"
                    return res
                if obj.get("usage"):
                    res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                    res.prompt_tokens = obj["usage"].get("prompt_tokens")
                for choice in obj.get("choices") or []:
                    if choice.get("finish_reason") == "abort":
                        res.error = "the server aborted the request"
                        return res
                    text, n = chunk_content(choice, chat)
                    if n is not None:
                        counted += n
                    if not text:
                        pending += n or 0
                        continue
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        gap = now - last
                        k = (n or 0) + pending
                        if n is not None and k > 0:
                            # A chunk of k tokens (say, a speculative round) splits its gap.
                            res.itl.extend([gap / k] * k)
                        else:
                            res.itl.append(gap)
                            res.itl_per_token = False
                    pending = 0
                    last = now
    except httpx.TimeoutException:
        res.error = f"timed out after {args.request_timeout:g} s"
        return res
    except Exception as e:  # any failure is this request's error; the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    if not done:
        res.error = "the stream ended without [DONE]"
        return res
    if res.output_tokens == 0:
        res.output_tokens = counted or chunks  # no usage chunk: best estimate
    res.ok = True
    return res


def error_message(raw: str) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        raw = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        pass
    return raw.strip()[:300]


async def run_level(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    path: str,
    bodies: list[dict[str, Any]],
    concurrency: int | None,
    desc: str,
) -> tuple[list[Result], float]:
    """All requests at one load level; returns results and the level's wall time."""
    limit = concurrency if concurrency is not None else args.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    bar = tqdm(total=len(bodies), desc=desc, leave=False, disable=args.no_progress)

    async def one(body: dict[str, Any]) -> Result:
        if sem is None:
            res = await send(client, args, path, body)
        else:
            async with sem:
                res = await send(client, args, path, body)
        bar.update(1)
        return res

    start = time.perf_counter()
    if concurrency is not None:
        results = await asyncio.gather(*(one(b) for b in bodies))
    else:
        arrivals = random.Random(args.seed + 1)
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bar.close()
    return list(results), elapsed


# ------------------------------------------------------------------------------ report


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def summarize(
    label: str, x: float, results: list[Result], elapsed: float, tau: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [v for r in ok for v in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    return {
        "level": label,
        "x": x,
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": elapsed,
        "req_s": len(ok) / elapsed,
        "out_tok_s": out_tokens / elapsed,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "itl_per_token": all(r.itl_per_token for r in ok),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p99_ms": pct(e2e, 99),
        "tau": tau,
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }


def level_tau(
    before: tuple[float | None, int | None], after: tuple[float | None, int | None]
) -> float | None:
    """The level's own tau from the server's running mean, when verify rounds are reported."""
    (t0, n0), (t1, n1) = before, after
    if t1 is None:
        return None
    if t0 is not None and n0 is not None and n1 is not None and n1 > n0:
        return (t1 * n1 - t0 * n0) / (n1 - n0)
    return t1


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(v: float | None, spec: str = "8.1f") -> str:
        return f"{'-':>{spec.split('.')[0]}}" if v is None else f"{v:{spec}}"

    print(
        f"{'load':>10} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'E2E p50':>8} {'E2E p99':>8} {'tau':>5}"
    )
    for r in rows:
        print(
            f"{r['level']:>10} {r['ok']:>5} {r['errors']:>4} {r['req_s']:>7.2f} "
            f"{r['out_tok_s']:>10.1f} {f(r['ttft_p50_ms'])} {f(r['ttft_p99_ms'])} "
            f"{f(r['itl_p50_ms'])} {f(r['itl_p99_ms'])} {f(r['e2e_p50_ms'])} "
            f"{f(r['e2e_p99_ms'])} {f(r['tau'], '5.2f')}"
        )
    print("latencies in ms; tau: mean accepted tokens per verify round, '-' if not reported")
    if not all(r["itl_per_token"] for r in rows if r["ok"]):
        print("ITL: per chunk where chunks carry no token counts (use --logprobs for per token)")


def plot(rows: list[dict[str, Any]], path: str, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["x"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["out_tok_s"] for r in rows], marker="o")
    a.set(xlabel=xlabel, ylabel="output tok/s", title="throughput")
    b.plot(xs, [r["ttft_p50_ms"] or float("nan") for r in rows], marker="o")
    b.set(xlabel=xlabel, ylabel="ms", title="TTFT p50")
    for ax in (a, b):
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the levels run, not powers of 2
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(args.request_timeout, connect=10.0),
        # Never let the pool, rather than the benchmark, cap the load.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )
    async with client:
        server = Server(client)
        try:
            models = await server.models()
        except Unreachable as e:
            print(f"{PROG}: cannot reach {args.base_url}: {e}", file=sys.stderr)
            return 1
        model = args.model or (models[0] if models else None)
        if model is None:
            print(f"{PROG}: {args.base_url} lists no models; pass --model", file=sys.stderr)
            return 1
        try:
            prompts, prompt_note = await build_prompts(args, server, model)
        except (OSError, ValueError) as e:
            print(f"{PROG}: cannot build prompts: {e}", file=sys.stderr)
            return 1
        path = "/v1/completions" if args.endpoint == "completions" else "/v1/chat/completions"
        bodies = [make_payload(args, model, p) for p in prompts]

        print(
            f"{args.base_url}{path}, model {model}, {args.dataset}: "
            f"{prompt_note}, input {args.input_len}, output {args.output_len}, "
            f"{args.num_prompts} requests per level",
            flush=True,
        )
        for i in range(args.warmup_requests):
            warm = dict(bodies[i % len(bodies)], max_tokens=min(8, args.output_len))
            res = await send(client, args, path, warm)
            if not res.ok:
                print(f"{PROG}: warm-up request failed: {res.error}", file=sys.stderr)

        levels: list[tuple[str, float, int | None]]
        if args.request_rate is not None:
            cap = f", max {args.max_concurrency}" if args.max_concurrency else ""
            levels = [(f"rate {args.request_rate:g}", args.request_rate, None)]
            xlabel = "request rate (req/s)"
            print(f"Poisson arrivals at {args.request_rate:g} req/s{cap}", flush=True)
        else:
            levels = [(f"c={c}", c, c) for c in args.concurrency]
            xlabel = "concurrency"

        rows = []
        for label, x, conc in levels:
            before = await server.spec_stats()
            results, elapsed = await run_level(client, args, path, bodies, conc, label)
            after = await server.spec_stats()
            rows.append(summarize(label, x, results, elapsed, level_tau(before, after)))

    print_table(rows)
    errors = sorted({e for r in rows for e in r["error_samples"]})
    for e in errors[:5]:
        print(f"{PROG}: error: {e}", file=sys.stderr)
    if args.output_json:
        meta = {k: v for k, v in vars(args).items() if k != "schema"}
        with open(args.output_json, "w") as f:
            json.dump({"args": meta, "model": model, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot, xlabel)
        print(f"plot written to {args.plot}")
    if not any(r["ok"] for r in rows):
        print(f"{PROG}: every request failed", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    args = parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PROG}: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    args.schema, args.schema_name = None, None
    if args.json_schema:
        try:
            with open(args.json_schema) as f:
                args.schema = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{PROG}: cannot read --json-schema {args.json_schema}: {e}", file=sys.stderr)
            return 2
        # OpenAI's schema names allow [a-zA-Z0-9_-] only.
        stem = os.path.splitext(os.path.basename(args.json_schema))[0]
        args.schema_name = "".join(c if c.isalnum() or c in "_-" else "_" for c in stem)[:64]
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
