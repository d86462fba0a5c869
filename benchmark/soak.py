"""Soak run: a bounded, mixed load against one live server, watching for leaks
and wrong answers.

Starts ``python -m specserve.launch_server`` on a free loopback port (or uses
``--base-url``), takes a greedy reference answer for every case alone, then
lets several clients send, for ``--minutes``: unary and streamed completions,
chat completions and ``/generate`` requests, greedy and sampled, with top-k
logprobs, echo / prompt logprobs, grammars (json_schema, json_object, regex),
n > 1 (``/generate``: a batch), client disconnects mid-stream,
``/abort_request`` aborts and bad requests. Every few seconds it samples the
server process's RSS, open file descriptors and threads (/proc/PID) and the KV
pages in use (``/get_server_info``). Every valid answer is checked: greedy
answers equal their reference (text, token ids or texts, logprobs within
2e-5), JSON validates against its schema, regex answers fullmatch, every
logprob list has one entry per token. When the load ends it waits for the
server to go idle, then judges the run:

- no lost request (timeout, dropped connection, a stream without [DONE], an
  abort nobody asked for), no wrong answer, no 5xx, no 4xx to a valid request;
- every KV page free at the end;
- no RSS growth after the warm-up, judged when at least ``--rss-judge-minutes``
  of samples follow it (a shorter run reports RSS but cannot tell a leak from
  the allocator filling up): the RSS at the end (under load and idle) at most
  ``--max-rss-growth`` MB above the RSS just after the warm-up, and the
  least-squares slope of RSS at most ``--max-rss-slope`` MB/hour;
- file descriptors and threads back near their post-warm-up count.

It exits 1 when the run fails (or the server cannot be started or reached).

    python benchmark/soak.py --minutes 10                                   # plain demo
    python benchmark/soak.py --speculative-algorithm DSPARK --out s.json --plot s.png
    python benchmark/soak.py --base-url http://127.0.0.1:30000 --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx

from soak_checks import (
    BAD,
    Answer,
    Case,
    Reply,
    answers_of,
    greedy_top1_errors,
    make_cases,
    mismatch,
    prefix_mismatch,
    request_body,
    shape_errors,
)
from soak_report import figures, plot, print_report, verdict
from soak_server import Launched, cpu_model, pid_listening_on, proc_sample

PROG = "soak"
# A small cache with chunked prefill, so pages churn, prompts split and
# requests are preempted under load.
SERVER_ARGS = "--page-size 4 --max-total-tokens 6144 --chunked-prefill-size 64"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument(
        "--server-pid", type=int, default=None, help="with --base-url (default: by port)"
    )
    p.add_argument("--model-path", default=None, help="the started server's (default: the demo)")
    p.add_argument("--speculative-algorithm", default=None, help="the started server's (DSPARK..)")
    p.add_argument("--server-args", default=SERVER_ARGS, help=f"more flags ({SERVER_ARGS!r})")
    p.add_argument(
        "--server-log", default=None, help="the started server's log (default: a tmp file)"
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--minutes", type=float, default=10.0, help="load duration (fractions allowed)")
    p.add_argument(
        "--warmup-minutes",
        type=float,
        default=None,
        help="left out of the RSS figures (default: a quarter of the run, at most 5)",
    )
    p.add_argument(
        "--clients", type=int, default=6, help="concurrent clients (the first 6 start with "
        "one request of each kind: greedy, sampled, disconnect, abort, bad, misc)",
    )  # fmt: skip
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=64.0, help="MB after the warm-up")
    p.add_argument("--max-rss-slope", type=float, default=64.0, help="MB/hour after the warm-up")
    p.add_argument(
        "--rss-judge-minutes",
        type=float,
        default=5.0,
        help="judge RSS only with at least this many minutes of samples after the warm-up",
    )
    p.add_argument("--label", default=None, help="names the run (default: plain or the algorithm)")
    p.add_argument("--out", default=None, help="JSON of the samples and figures")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="RSS and pages over time")
    args = p.parse_args()
    if not args.minutes > 0:
        p.error("--minutes must be > 0")
    if args.clients < 1:
        p.error("--clients must be >= 1")
    if not args.sample_interval > 0:
        p.error("--sample-interval must be > 0")
    if args.warmup_minutes is None:
        args.warmup_minutes = min(3.0, args.minutes / 4)
    if not 0 <= args.warmup_minutes < args.minutes:
        p.error("--warmup-minutes must be in [0, --minutes)")
    if args.base_url and (args.model_path or args.speculative_algorithm):
        p.error("--model-path and --speculative-algorithm are for the server soak.py starts")
    if args.label is None:
        args.label = args.speculative_algorithm or ("plain" if not args.base_url else "server")
    return args


# -------------------------------------------------------------------------------- soak


class Soak:
    def __init__(
        self, args: argparse.Namespace, client: httpx.AsyncClient, pid: int | None
    ) -> None:
        self.args, self.client, self.pid = args, client, pid
        self.cases: list[Case] = []
        self.refs: dict[str, Answer] = {}
        self.served: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.error_samples: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.deadline = math.inf
        self.phase = "start"
        self.counter = 0
        self.misc_count = 0
        self.before: dict[str, Any] = {}  # a sample before the references
        self.references_s = self.load_s = self.drain_s = 0.0
        self.idle: dict[str, Any] | None = None  # the stats once idle at the end

    # --- bookkeeping

    def ok(self, *tags: str) -> None:
        self.served["total"] += 1
        for t in tags:
            self.served[t] += 1

    def fail(self, cls: str, what: str, detail: str) -> None:
        self.errors[cls] += 1
        if len(self.error_samples) < 100:
            self.error_samples.append(
                {
                    "class": cls,
                    "request": what,
                    "detail": detail[:500],
                    "t_s": round(time.monotonic() - self.t0, 1),
                }
            )
        print(f"{PROG}: {cls}: {what}: {detail[:300]}", file=sys.stderr, flush=True)

    def rid(self) -> str:
        self.counter += 1
        return f"soak-{self.counter}"

    # --- HTTP

    async def post(
        self,
        path: str,
        body: Any,
        stream: bool = False,
        stop_after: int | None = None,
        on_first: Any = None,
    ) -> Reply:
        reply = Reply()
        kw: dict[str, Any] = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        try:
            if not stream:
                r = await self.client.post(path, **kw)
                reply.status = r.status_code
                try:
                    reply.body = r.json()
                except ValueError:
                    reply.body = r.text
                return reply
            async with self.client.stream("POST", path, **kw) as r:
                reply.status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        reply.body = json.loads(raw)
                    except ValueError:
                        reply.body = raw.decode(errors="replace")
                    return reply
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        reply.done = True
                        break
                    reply.events.append(json.loads(data))
                    if len(reply.events) == 1 and on_first is not None:
                        await on_first()
                    if stop_after is not None and len(reply.events) >= stop_after:
                        break  # leaving the block closes the connection mid-stream
        except httpx.TimeoutException:
            reply.failure = f"timed out after {self.args.request_timeout:g} s"
        except (httpx.HTTPError, OSError) as e:
            reply.failure = f"{type(e).__name__}: {e}"
        except ValueError as e:
            reply.failure = f"an event that is not JSON: {e}"
        return reply

    def transport_class(self, reply: Reply, stream: bool) -> tuple[str, str] | None:
        """The error class of a reply to a valid request, before its content is read."""
        if reply.failure is not None:
            return "lost", reply.failure
        assert reply.status is not None
        if reply.status >= 500:
            return "5xx", f"HTTP {reply.status}: {str(reply.body)[:300]}"
        if reply.status >= 400:
            return "unexpected_4xx", f"HTTP {reply.status}: {str(reply.body)[:300]}"
        for ev in reply.events:
            if isinstance(ev, dict) and ev.get("error"):
                return "5xx", f"error event in the stream: {ev['error']}"
        if stream and not reply.done:
            return "lost", "the stream ended without [DONE]"
        return None

    # --- the request kinds

    async def send_case(
        self,
        case: Case,
        *,
        stream: bool,
        n: int = 1,
        sampling: dict[str, Any] | None = None,
        tags: tuple[str, ...] = (),
        ref: bool = False,
    ) -> Answer | None:
        """One valid request, checked; returns its first answer when it passed."""
        body = request_body(case, stream=stream, n=n, sampling=sampling)
        what = f"{case.name} {'stream' if stream else 'unary'} n={n} " + (
            "greedy" if sampling is None else json.dumps(sampling)
        )
        reply = await self.post(case.path, body, stream=stream)
        bad = self.transport_class(reply, stream)
        if bad:
            self.fail(bad[0], what, bad[1])
            return None
        try:
            answers, usage = answers_of(case, reply)
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            self.fail("wrong", what, f"malformed answer ({type(e).__name__}: {e})")
            return None
        if any(a.finish == "abort" for a in answers):
            self.fail("lost", what, "finish_reason abort, not asked for")
            return None
        errs = shape_errors(case, answers, usage, n)
        if sampling is None:
            errs += greedy_top1_errors(case, answers)
            reference = self.refs.get(case.name)
            for j, a in enumerate(answers if reference is not None else []):
                why = mismatch(a, reference)
                if why:
                    errs.append(f"choice {j}: {why}")
        if errs:
            self.fail("wrong", what, "; ".join(errs[:3]))
            return None
        style = f"{case.endpoint}{'-stream' if stream else ''}"
        extra = ["n>1"] if n > 1 else []
        extra += ["grammar"] if case.schema is not None or case.regex is not None else []
        extra += ["logprobs"] if case.has_logprobs else []
        extra += (
            ["prompt-logprobs"]
            if case.body.get("echo") or case.body.get("logprob_start_len", -1) >= 0
            else []
        )
        if not ref:
            self.ok(style, "greedy" if sampling is None else "sampled", *extra, *tags)
        return answers[0]

    def sampling(self, case: Case, rng: random.Random) -> dict[str, Any]:
        s: dict[str, Any] = {"temperature": round(rng.uniform(0.3, 1.3), 3)}
        if rng.random() < 0.5:
            s["top_p"] = rng.choice([0.5, 0.9, 0.99])
        if rng.random() < 0.3:
            s["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.5:
            s["seed"] = rng.randrange(2**31)
        return s

    async def greedy(self, rng: random.Random) -> None:
        case = rng.choice(self.cases)
        await self.send_case(case, stream=rng.random() < 0.5, n=rng.choice([1, 1, 1, 2]))

    async def sampled(self, rng: random.Random) -> None:
        case = rng.choice(self.cases)
        await self.send_case(
            case,
            stream=rng.random() < 0.5,
            n=rng.choice([1, 1, 2, 3]),
            sampling=self.sampling(case, rng),
        )

    async def disconnect(self, rng: random.Random) -> None:
        """Reads a few events of a long greedy stream, then hangs up; what came
        must be a prefix of the reference."""
        case = rng.choice([c for c in self.cases if c.long])
        body = request_body(case, stream=True, n=1, sampling=None)
        what = f"{case.name} disconnect"
        reply = await self.post(case.path, body, stream=True, stop_after=rng.randint(1, 4))
        bad = self.transport_class(reply, stream=False)  # [DONE] is not awaited
        if bad:
            self.fail(bad[0], what, bad[1])
            return
        self.check_partial(case, reply, what, "disconnect")

    async def abort(self, rng: random.Random) -> None:
        """A long greedy request aborted by rid, streamed (after its first
        event) or unary (after a random delay); it must end with [DONE] and
        finish_reason abort (or a normal finish if it won the race), holding a
        prefix of the reference."""
        case = rng.choice([c for c in self.cases if c.long])
        stream = rng.random() < 0.5
        rid = self.rid()
        body = request_body(case, stream=stream, n=1, sampling=None, rid=rid)
        what = f"{case.name} abort {'stream' if stream else 'unary'} rid={rid}"
        aborted: list[Reply] = []

        async def do_abort() -> None:
            aborted.append(await self.post("/abort_request", {"rid": rid}))

        if stream:
            reply = await self.post(case.path, body, stream=True, on_first=do_abort)
        else:
            task = asyncio.create_task(self.post(case.path, body))
            await asyncio.sleep(rng.uniform(0.0, 1.5))  # when to abort, not a synchronisation
            await do_abort()
            reply = await task
        bad = self.transport_class(reply, stream)
        if bad:
            self.fail(bad[0], what, bad[1])
            return
        a = aborted[0] if aborted else None
        if a is None or a.status != 200 or not isinstance((a.body or {}).get("aborted"), int):
            body_text = (a.failure or a.body) if a is not None else "never sent"
            self.fail(
                "5xx" if a and a.status and a.status >= 500 else "wrong",
                what,
                f"/abort_request answered {a.status if a else None}: {body_text}",
            )
            return
        self.check_partial(case, reply, what, "abort", aborted=a.body["aborted"])

    def check_partial(
        self, case: Case, reply: Reply, what: str, tag: str, aborted: int | None = None
    ) -> None:
        try:
            answers, _ = answers_of(case, reply)
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            self.fail("wrong", what, f"malformed answer ({type(e).__name__}: {e})")
            return
        ref = self.refs.get(case.name)
        errs = []
        for a in answers:
            if tag == "abort" and a.finish not in ("abort", "stop", "length"):
                errs.append(f"the stream ended with finish_reason {a.finish}")
            if aborted == 0 and a.finish == "abort":
                errs.append("finish_reason abort, but /abort_request aborted nothing")
            if ref is not None and (why := prefix_mismatch(a, ref)):
                errs.append(why)
            if a.logprobs is not None and len(a.logprobs) != len(a.tokens or []):
                errs.append(f"{len(a.logprobs)} logprobs for {len(a.tokens or [])} tokens")
        if errs:
            self.fail("wrong", what, "; ".join(errs[:3]))
            return
        self.ok(tag, f"{case.endpoint}-{tag}")

    async def bad(self, rng: random.Random) -> None:
        name, path, body = rng.choice(BAD)
        what = f"bad request: {name}"
        reply = await self.post(path, body)
        if reply.failure is not None:
            self.fail("lost", what, reply.failure)
            return
        assert reply.status is not None
        if reply.status >= 500:
            self.fail("5xx", what, f"HTTP {reply.status}: {str(reply.body)[:300]}")
            return
        err = reply.body.get("error") if isinstance(reply.body, dict) else None
        if not 400 <= reply.status < 500:
            self.fail("wrong", what, f"accepted with HTTP {reply.status}")
        elif (
            not isinstance(err, dict)
            or not isinstance(err.get("message"), str)
            or err.get("code") != reply.status
        ):
            self.fail("wrong", what, f"HTTP {reply.status} not in the OpenAI error shape")
        else:
            self.errors["expected_4xx"] += 1

    async def misc(self, rng: random.Random) -> None:
        """/tokenize and /detokenize round trip; every third time /health_generate."""
        self.misc_count += 1
        if self.misc_count % 3 == 0:
            r = await self.post_get("/health_generate")
            if r is not None:
                self.ok("health_generate")
            return
        text = rng.choice(self.cases).body.get("text") or "def f(x):\n    return x"
        tok = await self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        bad = self.transport_class(tok, False)
        if bad:
            self.fail(bad[0], "tokenize", bad[1])
            return
        back = await self.post("/detokenize", {"tokens": tok.body["tokens"]})
        bad = self.transport_class(back, False)
        if bad:
            self.fail(bad[0], "detokenize", bad[1])
            return
        if back.body.get("prompt") != text:
            self.fail("wrong", "tokenize round trip", f"{text!r} came back as {back.body}")
            return
        self.ok("tokenize")

    async def post_get(self, path: str) -> Any:
        try:
            r = await self.client.get(path)
        except httpx.HTTPError as e:
            self.fail("lost", f"GET {path}", f"{type(e).__name__}: {e}")
            return None
        if r.status_code != 200:
            cls = "5xx" if r.status_code >= 500 else "unexpected_4xx"
            self.fail(cls, f"GET {path}", f"HTTP {r.status_code}: {r.text[:300]}")
            return None
        return r.json()

    KINDS = (
        ("greedy", 8),
        ("sampled", 5),
        ("disconnect", 1),
        ("abort", 1),
        ("bad", 2),
        ("misc", 1),
    )

    async def client_loop(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        names, weights = zip(*self.KINDS)
        # Client i's first request is of kind i: a short run still has each kind.
        kind = names[i % len(names)]
        while time.monotonic() < self.deadline:
            try:
                await getattr(self, kind)(rng)
            except Exception as e:  # an answer the checks could not even read
                self.fail("wrong", kind, f"checking it raised {type(e).__name__}: {e}")
            kind = rng.choices(names, weights)[0]

    # --- samples

    async def stats(self) -> dict[str, Any] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            r = await self.client.get("/get_server_info", timeout=30.0)
            return r.json()["stats"]
        return None

    async def sample(self) -> dict[str, Any]:
        st = await self.stats() or {}
        s: dict[str, Any] = {
            "t_s": round(time.monotonic() - self.t0, 2),
            "phase": self.phase,
            **proc_sample(self.pid),
        }
        total, free = st.get("total_pages"), st.get("free_pages")
        s["pages_in_use"] = total - free if total is not None and free is not None else None
        s["total_pages"] = total
        s["running"], s["queued"] = st.get("running"), st.get("queued")
        s["preemptions"] = st.get("preemptions")
        s["served"] = self.served["total"]
        self.samples.append(s)
        return s

    async def sampler(self, stop: asyncio.Event) -> None:
        shown = 0.0
        while not stop.is_set():
            s = await self.sample()
            if s["t_s"] - shown >= 60:
                shown = s["t_s"]
                errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
                print(
                    f"{PROG}: {s['t_s'] / 60:.1f} min: {s['served']} served, errors: {errors}; "
                    f"RSS {s['rss_mb'] or 0:.1f} MB, {s['pages_in_use']} pages in use, "
                    f"{s['running']} running",
                    flush=True,
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.sample_interval)

    async def wait_idle(self, timeout: float) -> dict[str, Any] | None:
        """Polls until nothing runs or waits and every page is free (None: never)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = await self.stats()
            if (
                st
                and not st["running"]
                and not st["queued"]
                and st["free_pages"] == st["total_pages"]
            ):
                return st
            await asyncio.sleep(0.2)
        return None

    # --- the run

    async def references(self) -> bool:
        tok = await self.post(
            "/tokenize", {"prompt": "for i in range(10):\n", "add_special_tokens": False}
        )
        if self.transport_class(tok, False):
            print(f"{PROG}: /tokenize failed: {tok.failure or tok.body}", file=sys.stderr)
            return False
        self.cases = make_cases(tok.body["tokens"])
        for case in self.cases:
            ref = await self.send_case(case, stream=False, ref=True)
            if ref is None:
                print(f"{PROG}: the reference request of {case.name} failed", file=sys.stderr)
                return False
            self.refs[case.name] = ref
        return True

    async def run(self) -> bool:
        self.phase = "before"
        self.before = await self.sample()
        start = time.monotonic()
        if not await self.references():
            return False
        self.references_s = time.monotonic() - start
        print(f"{PROG}: {len(self.refs)} references in {self.references_s:.1f} s", flush=True)
        self.phase = "load"
        self.t0 = time.monotonic()
        self.samples = []
        self.deadline = self.t0 + self.args.minutes * 60
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        await asyncio.gather(*(self.client_loop(i) for i in range(self.args.clients)))
        self.phase = "drain"
        self.load_s = time.monotonic() - self.t0
        self.idle = await self.wait_idle(60.0)
        self.drain_s = time.monotonic() - self.t0 - self.load_s
        stop.set()
        await sampler
        self.phase = "idle"
        for _ in range(3):  # the end figures: idle samples a second apart
            await self.sample()
            await asyncio.sleep(1.0)
        return True


# -------------------------------------------------------------------------------- main


async def main_async(args: argparse.Namespace) -> int:
    launched = None if args.base_url else Launched(args)
    base = (args.base_url or launched.base).rstrip("/")  # type: ignore[union-attr]
    client = httpx.AsyncClient(
        base_url=base,
        timeout=httpx.Timeout(args.request_timeout, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )
    exit_status: int | None = None
    try:
        async with client:
            if launched is not None:
                why = await launched.wait_up(client, args.startup_timeout)
                if why:
                    print(f"{PROG}: {why}\n{launched.log_tail()}", file=sys.stderr)
                    return 1
                pid: int | None = launched.proc.pid
            else:
                try:
                    await client.get("/health", timeout=10.0)
                except httpx.HTTPError as e:
                    print(f"{PROG}: cannot reach {base}: {type(e).__name__}: {e}", file=sys.stderr)
                    return 1
                pid = args.server_pid or pid_listening_on(httpx.URL(base).port or 80)
                if pid is None:
                    print(
                        f"{PROG}: no server process found: RSS, fds and threads not sampled "
                        "(pass --server-pid)",
                        file=sys.stderr,
                    )
            soak = Soak(args, client, pid)
            print(
                f"{PROG}: {args.label} at {base} (pid {pid}), {args.clients} clients, "
                f"{args.minutes:g} minutes",
                flush=True,
            )
            if not await soak.run():
                return 1
            health = await soak.post_get("/health")
    finally:
        if launched is not None:
            exit_status = launched.stop()
    f = figures(soak, args)
    f["healthy_at_end"] = health is not None
    why = verdict(f, args)
    if health is None:
        why.append("/health failed at the end")
    if launched is not None:
        f["server_exit_status"] = exit_status
        if exit_status != 0:
            why.append(f"the server exited with status {exit_status} on SIGTERM")
    f["passed"], f["failures"] = not why, why
    print_report(f, args.label, why)
    if args.out:
        meta = {
            "args": vars(args),
            "machine": cpu_model(),
            "cpus": os.cpu_count(),
            "server_cmd": launched.cmd if launched else None,
            "server_log": launched.log_path if launched else None,
        }
        with open(args.out, "w") as fh:
            json.dump({**meta, "figures": f, "samples": soak.samples}, fh, indent=1)
    if args.plot:
        plot(soak.samples, f, args.label, args.plot)
        print(f"plot written to {args.plot}")
    if launched is not None and why:
        print(f"{PROG}: the server's log: {launched.log_path}", file=sys.stderr)
    elif launched is not None and not args.server_log:
        os.unlink(launched.log_path)
    return 0 if not why else 1


def main() -> int:
    args = parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PROG}: --plot needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
            return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
