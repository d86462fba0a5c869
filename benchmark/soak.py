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
1e-5), JSON validates against its schema, regex answers fullmatch, every
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
import copy
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

PROG = "soak"
TOL = 1e-5  # logprobs of one greedy answer, across batches, streams and n
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
    p.add_argument("--clients", type=int, default=6, help="concurrent clients")
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


# ------------------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """The server soak.py starts, and stops at the end (SIGTERM)."""

    def __init__(self, args: argparse.Namespace) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1"]
        self.cmd += ["--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
        if args.model_path:
            self.cmd += ["--model-path", args.model_path]
        if args.speculative_algorithm:
            self.cmd += ["--speculative-algorithm", args.speculative_algorithm]
        self.log_path = args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)

    async def wait_up(self, client: httpx.AsyncClient, timeout: float) -> str | None:
        """None once /health answers, else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"the server exited with status {self.proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health", timeout=2.0)).status_code == 200:
                    return None
            await asyncio.sleep(0.2)
        return f"the server did not answer /health within {timeout:g} s"

    def stop(self) -> int | None:
        """SIGTERM, then the exit status (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def pid_listening_on(port: int) -> int | None:
    """The process holding the listening TCP socket on ``port`` (same user's only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
    return None


def proc_sample(pid: int | None) -> dict[str, float | None]:
    """RSS (MB), threads and open file descriptors of ``pid`` from /proc."""
    out: dict[str, float | None] = {"rss_mb": None, "threads": None, "fds": None}
    if pid is None:
        return out
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


# ------------------------------------------------------------------------------- cases

PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["kind", "age", "name"],
}
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99},
        "y": {"type": "integer", "minimum": -99, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["x", "y", "ok"],
}
NUMBER = r"[0-9]{1,4}(\.[0-9]{1,3})?"
CONSTANT = r"(True|False|None)"


@dataclass
class Case:
    """One prompt with its output settings; greedy by default (a reference is
    taken for it), sampled when a client adds sampling fields."""

    name: str
    endpoint: str  # completions | chat | generate
    body: dict[str, Any]
    schema: dict[str, Any] | None = None  # the answer must validate (json_object: {})
    regex: str | None = None  # the answer must fullmatch
    long: bool = False  # long enough to be aborted or left mid-stream

    @property
    def path(self) -> str:
        return {"completions": "/v1/completions", "chat": "/v1/chat/completions"}.get(
            self.endpoint, "/generate"
        )

    @property
    def top_k(self) -> int:
        b = self.body
        if self.endpoint == "completions":
            return b.get("logprobs") or 0
        return b.get("top_logprobs") or b.get("top_logprobs_num") or 0

    @property
    def has_logprobs(self) -> bool:
        b = self.body
        return (
            b.get("logprobs") is not None
            if self.endpoint != "generate"
            else bool(b.get("return_logprob"))
        )


def long_prompts() -> list[str]:
    """Two windows of the standard library's sources (prompts that prefill in chunks)."""
    out = []
    for name in ("textwrap.py", "heapq.py"):
        with contextlib.suppress(OSError):
            with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
                src = f.read()
            start = src.find("\ndef ", 1000) + 1
            out.append(src[start : start + 700])
    while len(out) < 2:
        out.append("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12)))
    return out


def make_cases(ids_prompt: list[int]) -> list[Case]:
    long = long_prompts()
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    chat = lambda text, **kw: {"messages": [{"role": "user", "content": text}], **kw}  # noqa: E731
    return [
        Case("cmpl-logprobs", "completions",
             {"prompt": "def fibonacci(n):", "max_tokens": 24, "logprobs": 3}),
        Case("cmpl-echo", "completions",
             {"prompt": "class Stack:\n    def __init__(self):", "max_tokens": 16,
              "logprobs": 2, "echo": True}),
        Case("cmpl-long-prompt", "completions", {"prompt": long[0], "max_tokens": 12,
                                                 "logprobs": 1}),
        Case("cmpl-stop", "completions",
             {"prompt": "import os\n\n\ndef ", "max_tokens": 32, "stop": ["\n\n"], "logprobs": 0}),
        Case("cmpl-token-ids", "completions", {"prompt": ids_prompt, "max_tokens": 16}),
        Case("cmpl-regex", "completions",
             {"prompt": "    return ", "max_tokens": 8, "regex": CONSTANT, "logprobs": 1},
             regex=CONSTANT),
        Case("cmpl-json-object", "completions",
             {"prompt": "config = ", "max_tokens": 64, "logprobs": 1,
              "response_format": {"type": "json_object"}}, schema={"type": "object"}),
        Case("cmpl-long", "completions",
             {"prompt": "def main():\n", "max_tokens": 48, "ignore_eos": True, "logprobs": 1},
             long=True),
        Case("chat-logprobs", "chat",
             chat("Write a sorting function.", max_tokens=24, logprobs=True, top_logprobs=2)),
        Case("chat-json-schema", "chat",
             chat("Describe a pet as JSON.", max_tokens=64, logprobs=True, top_logprobs=1,
                  response_format=schema_fmt), schema=PET),
        Case("chat-text", "chat", chat("def parse(", max_tokens=16)),
        Case("gen-logprobs", "generate",
             {"text": "def main():", "sampling_params": {"max_new_tokens": 24},
              "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
              "token_ids_logprob": [13, 42]}),
        Case("gen-regex", "generate",
             {"text": "x = ", "sampling_params": {"max_new_tokens": 12, "regex": NUMBER},
              "return_logprob": True, "top_logprobs_num": 1}, regex=NUMBER),
        Case("gen-json-schema", "generate",
             {"text": "point = ", "return_logprob": True,
              "sampling_params": {"max_new_tokens": 48, "json_schema": json.dumps(POINT)}},
             schema=POINT),
        Case("gen-long", "generate",
             {"text": long[1], "return_logprob": True, "top_logprobs_num": 1,
              "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}, long=True),
    ]  # fmt: skip


def request_body(
    case: Case, *, stream: bool, n: int, sampling: dict[str, Any] | None, rid: str | None = None
) -> dict[str, Any]:
    """The case's body for one send: greedy unless ``sampling`` is given; n
    choices (``/generate``: a batch of n copies of the prompt)."""
    body = copy.deepcopy(case.body)
    if case.endpoint == "generate":
        sp = body["sampling_params"]
        sp.update(sampling or {"temperature": 0})
        if n > 1:
            body["text"] = [body["text"]] * n
            if rid:
                rid = [f"{rid}-{j}" for j in range(n)]  # type: ignore[assignment]
    else:
        body.update(sampling or {"temperature": 0})
        if n > 1:
            body["n"] = n
        if stream:
            body["stream_options"] = {"include_usage": True}
    if stream:
        body["stream"] = True
    if rid:
        body["rid"] = rid
    return body


# Invalid requests: each must get a 4xx in the OpenAI error shape.
BAD: list[tuple[str, str, Any]] = [
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}),
    ("max_tokens past the context", "/v1/completions", {"prompt": "x", "max_tokens": 10**7}),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("logprobs over the limit", "/v1/completions", {"prompt": "x", "logprobs": 1000}),
    ("token id past the vocab", "/v1/completions", {"prompt": [10**9]}),
    ("empty prompt", "/v1/completions", {"prompt": []}),
    ("stop as an object", "/v1/completions", {"prompt": "x", "stop": {"a": 1}}),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("not JSON", "/v1/completions", b"{not json"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("no messages", "/v1/chat/completions", {"messages": []}),
    ("schema that is no schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}}),
    ("regex that does not compile", "/generate",
     {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 4}}),
    ("unknown sampling param", "/generate", {"text": "x", "sampling_params": {"tempo": 1}}),
    ("text and input_ids", "/generate", {"text": "x", "input_ids": [1, 2]}),
    ("two constraints", "/generate",
     {"text": "x", "sampling_params": {"regex": "a", "json_object": True}}),
    ("abort without rid", "/abort_request", {}),
]  # fmt: skip


# ------------------------------------------------------------------------------ answers


@dataclass
class Reply:
    status: int | None = None  # None: no HTTP answer
    body: Any = None  # a unary answer's JSON (or text)
    events: list[Any] = field(default_factory=list)  # a stream's parsed events
    done: bool = False  # the stream ended with [DONE]
    failure: str | None = None  # transport error or timeout


@dataclass
class Answer:
    """One choice, whatever the endpoint and whether streamed."""

    text: str = ""
    tokens: list[Any] | None = None  # token texts (OpenAI) or ids (/generate)
    logprobs: list[float | None] | None = None  # one per token
    top: list[list[tuple[Any, float]] | None] | None = None  # per token, or None
    finish: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # /generate's other logprob lists


def top_pairs(entry: Any) -> list[tuple[Any, float]] | None:
    if entry is None:
        return None
    if isinstance(entry, dict):  # completions: {text: logprob}
        return list(entry.items())
    if entry and isinstance(entry[0], dict):  # chat: [{token, logprob}]
        return [(e["token"], e["logprob"]) for e in entry]
    return [(e[1], e[0]) for e in entry]  # /generate: [[logprob, id, text]]


def openai_answers(reply: Reply, chat: bool) -> tuple[list[Answer], dict[str, Any] | None]:
    """Per choice index, the answer assembled from a unary body or a stream's
    chunks; and the usage."""
    answers: dict[int, Answer] = {}
    chunks = reply.events if reply.events else [reply.body]
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            a = answers.setdefault(choice["index"], Answer())
            if chat:
                msg = choice.get("delta") if "delta" in choice else choice.get("message")
                a.text += (msg or {}).get("content") or ""
            else:
                a.text += choice.get("text") or ""
            lp = choice.get("logprobs")
            if lp is not None:
                items = lp.get("content") or [] if chat else None
                a.tokens = (a.tokens or []) + (
                    [i["token"] for i in items] if chat else lp["tokens"]
                )
                a.logprobs = (a.logprobs or []) + (
                    [i["logprob"] for i in items] if chat else lp["token_logprobs"]
                )
                tops = [i["top_logprobs"] for i in items] if chat else lp["top_logprobs"]
                a.top = (a.top or []) + [top_pairs(t) for t in tops]
                if not chat:
                    a.extra.setdefault("text_offset", []).extend(lp["text_offset"])
            a.finish = choice.get("finish_reason") or a.finish
    return [answers[i] for i in sorted(answers)], usage


def generate_answers(reply: Reply) -> list[Answer]:
    """Per prompt, the last (cumulative) event of a stream, or the unary answer."""
    if reply.events:
        last: dict[int, Any] = {}
        for ev in reply.events:
            last[ev.get("index", 0)] = ev
        results = [last[i] for i in sorted(last)]
    else:
        results = reply.body if isinstance(reply.body, list) else [reply.body]
    out = []
    for r in results:
        meta = r["meta_info"]
        a = Answer(text=r["text"], tokens=list(r["output_ids"]))
        a.finish = (meta.get("finish_reason") or {}).get("type")
        a.extra["completion_tokens"] = meta["completion_tokens"]
        a.extra["prompt_tokens"] = meta["prompt_tokens"]
        if "output_token_logprobs" in meta:
            a.logprobs = [e[0] for e in meta["output_token_logprobs"]]
            a.extra["logprob_ids"] = [e[1] for e in meta["output_token_logprobs"]]
            tops = meta.get("output_top_logprobs")
            a.top = [top_pairs(t) for t in tops] if tops is not None else None
            a.extra["input"] = [
                None if e[0] is None else e[0] for e in meta.get("input_token_logprobs") or []
            ]
            a.extra["input_top"] = [top_pairs(t) for t in meta.get("input_top_logprobs") or []]
            a.extra["ids"] = [top_pairs(t) for t in meta.get("output_token_ids_logprobs") or []]
        out.append(a)
    return out


def answers_of(case: Case, reply: Reply) -> tuple[list[Answer], dict[str, Any] | None]:
    if case.endpoint == "generate":
        return generate_answers(reply), None
    return openai_answers(reply, case.endpoint == "chat")


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= TOL


def same_top(a: list[tuple[Any, float]] | None, b: list[tuple[Any, float]] | None) -> bool:
    """Equal top lists: values within TOL, keys equal except where a tie at the
    cut-off lets either token in."""
    if a is None or b is None:
        return a is b
    va, vb = sorted((v for _, v in a), reverse=True), sorted((v for _, v in b), reverse=True)
    if len(va) != len(vb) or not all(close(x, y) for x, y in zip(va, vb)):
        return False
    floor = min(va, default=0.0) + TOL
    return {k for k, v in a if v > floor} == {k for k, v in b if v > floor}


def prefix_mismatch(got: Answer, ref: Answer) -> str | None:
    """Where ``got`` leaves ``ref`` (None: ``got`` is ``ref`` or a prefix of it)."""
    if not ref.text.startswith(got.text) and not got.text.startswith(ref.text):
        return f"text {got.text[:80]!r} is no prefix of the reference {ref.text[:80]!r}"
    if got.tokens is not None and ref.tokens is not None:
        n = len(got.tokens)
        if got.tokens != ref.tokens[:n]:
            return f"tokens {got.tokens[:12]} != reference {ref.tokens[:12]}"
        if got.logprobs is not None and ref.logprobs is not None:
            for i, (x, y) in enumerate(zip(got.logprobs, ref.logprobs)):
                if not close(x, y):
                    return f"logprob {i}: {x} != reference {y}"
        if got.top is not None and ref.top is not None:
            for i, (x, y) in enumerate(zip(got.top, ref.top)):
                if not same_top(x, y):
                    return f"top logprobs {i}: {x} != reference {y}"
    return None


def mismatch(got: Answer, ref: Answer) -> str | None:
    """How a greedy answer differs from its reference (None: equal)."""
    if got.text != ref.text:
        return f"text {got.text[:80]!r} != reference {ref.text[:80]!r}"
    if got.finish != ref.finish:
        return f"finish_reason {got.finish} != reference {ref.finish}"
    if (got.tokens is None) != (ref.tokens is None) or (
        got.tokens is not None and len(got.tokens) != len(ref.tokens or [])
    ):
        return f"{len(got.tokens or [])} tokens != reference {len(ref.tokens or [])}"
    why = prefix_mismatch(got, ref)
    if why:
        return why
    for key in ("input", "input_top", "ids"):
        x, y = got.extra.get(key), ref.extra.get(key)
        if (x is None) != (y is None) or len(x or []) != len(y or []):
            return f"{key}: {len(x or [])} entries != reference {len(y or [])}"
        for i, (p, q) in enumerate(zip(x or [], y or [])):
            if not (close(p, q) if key == "input" else same_top(p, q)):
                return f"{key} {i}: {p} != reference {q}"
    return None


def shape_errors(
    case: Case, answers: list[Answer], usage: dict[str, Any] | None, n: int
) -> list[str]:
    """What is wrong with the answers' shape: the number of choices, one logprob
    entry per token, top-k sizes, grammars."""
    errs = []
    if len(answers) != n:
        errs.append(f"{len(answers)} choices, asked for {n}")
    k = case.top_k
    echo = bool(case.body.get("echo"))
    total = 0
    for j, a in enumerate(answers):
        if a.finish not in ("stop", "length"):
            errs.append(f"choice {j}: finish_reason {a.finish}")
        if case.has_logprobs:
            if a.tokens is None or a.logprobs is None:
                errs.append(f"choice {j}: no logprobs")
                continue
            lens = {len(a.tokens), len(a.logprobs)}
            if a.top is not None or k:
                lens.add(len(a.top or []))
            if "text_offset" in a.extra:
                lens.add(len(a.extra["text_offset"]))
            if len(lens) != 1:
                errs.append(f"choice {j}: logprob lists of lengths {sorted(lens)}")
            for t, top in enumerate(a.top or []):
                if top is None:
                    continue
                # completions: the sampled token is added; equal texts share a key
                want = (1, k + 1) if case.endpoint == "completions" else (k, k)
                if not want[0] <= len(top) <= want[1]:
                    errs.append(f"choice {j}: {len(top)} top logprobs at {t}, asked for {k}")
                    break
        if case.endpoint == "generate":
            if len(a.tokens or []) != a.extra["completion_tokens"]:
                errs.append(
                    f"choice {j}: {len(a.tokens or [])} ids, completion_tokens "
                    f"{a.extra['completion_tokens']}"
                )
            if a.logprobs is not None and a.extra["logprob_ids"] != a.tokens:
                errs.append(f"choice {j}: logprob ids differ from output_ids")
            start = case.body.get("logprob_start_len", -1)
            if a.logprobs is not None and start >= 0:
                n_in = a.extra["prompt_tokens"] - start
                if len(a.extra["input"]) != n_in or (
                    start == 0 and a.extra["input"][0] is not None
                ):
                    errs.append(
                        f"choice {j}: {len(a.extra['input'])} prompt logprobs, "
                        f"prompt {a.extra['prompt_tokens']} from {start}"
                    )
        elif a.tokens is not None:
            total += len(a.tokens) - (usage or {}).get("prompt_tokens", 0) * echo
        if a.finish == "stop" and (case.schema is not None or case.regex is not None):
            errs += grammar_errors(case, a.text, j)
    openai = case.endpoint != "generate"
    if usage is not None and case.has_logprobs and openai and total != usage["completion_tokens"]:
        errs.append(f"{total} tokens with logprobs, completion_tokens {usage}")
    return errs


def grammar_errors(case: Case, text: str, j: int) -> list[str]:
    if case.regex is not None:
        return [] if re.fullmatch(case.regex, text) else [f"choice {j}: {text!r} !~ {case.regex}"]
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), case.schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return [f"choice {j}: {text[:120]!r} fails its schema: {str(e)[:160]}"]
    return []


def greedy_top1_errors(case: Case, answers: list[Answer]) -> list[str]:
    """Greedy, unconstrained: every token is the top-1 of the model's own
    (raw) distribution, so its logprob is the largest of its top list."""
    b = case.body
    sp = b.get("sampling_params") or b
    if case.schema is not None or case.regex is not None or case.top_k < 1:
        return []
    if b.get("echo") or sp.get("ignore_eos"):
        return []  # prompt positions hold the prompt's tokens; EOS is masked, not the model's
    for j, a in enumerate(answers):
        for t, (lp, top) in enumerate(zip(a.logprobs or [], a.top or [])):
            best = max((v for _, v in top or []), default=None)
            if best is not None and lp is not None and lp < best - TOL:
                return [f"choice {j}: greedy token {t} has logprob {lp} below the top {best}"]
    return []


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
        """/tokenize and /detokenize round trip; /health_generate."""
        if rng.random() < 0.3:
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
        while time.monotonic() < self.deadline:
            kind = rng.choices(names, weights)[0]
            try:
                await getattr(self, kind)(rng)
            except Exception as e:  # an answer the checks could not even read
                self.fail("wrong", kind, f"checking it raised {type(e).__name__}: {e}")

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


# ------------------------------------------------------------------------------ report


def median_of(samples: list[dict[str, Any]], key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def line_fit(samples: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Least squares ``key`` = slope * hours + intercept (None: too few samples)."""
    pts = [(s["t_s"] / 3600, s[key]) for s in samples if s.get(key) is not None]
    mt = sum(t for t, _ in pts) / max(1, len(pts))
    var = sum((t - mt) ** 2 for t, _ in pts)
    if len(pts) < 3 or var == 0:
        return None
    mv = sum(v for _, v in pts) / len(pts)
    slope = sum((t - mt) * (v - mv) for t, v in pts) / var
    return slope, mv - slope * mt


def slope_per_hour(samples: list[dict[str, Any]], key: str) -> float | None:
    fit = line_fit(samples, key)
    return None if fit is None else fit[0]


def figures(soak: Soak, args: argparse.Namespace) -> dict[str, Any]:
    warm = args.warmup_minutes * 60
    load = [s for s in soak.samples if s["phase"] == "load"]
    after = [s for s in load if s["t_s"] >= warm]
    idle = [s for s in soak.samples if s["phase"] == "idle"]
    first, last = after[:3], after[-3:]
    f: dict[str, Any] = {
        "references_s": round(soak.references_s, 1),
        "load_minutes": round(soak.load_s / 60, 2),
        "drain_s": round(soak.drain_s, 1),
        "warmup_minutes": args.warmup_minutes,
        "served": dict(sorted(soak.served.items())),
        "errors": {
            c: soak.errors[c] for c in ("expected_4xx", "unexpected_4xx", "5xx", "lost", "wrong")
        },
        "error_samples": soak.error_samples,
        "rss_mb_start": soak.before.get("rss_mb"),
        "rss_mb_warmup_end": median_of(first, "rss_mb"),
        "rss_mb_last_load": median_of(last, "rss_mb"),
        "rss_mb_end": median_of(idle, "rss_mb"),
        "rss_mb_max": max((s["rss_mb"] for s in soak.samples if s["rss_mb"]), default=None),
        "rss_slope_mb_per_hour": slope_per_hour(after, "rss_mb"),
        "pages_slope_per_hour": slope_per_hour(after, "pages_in_use"),
        "pages_in_use_max": max((s["pages_in_use"] or 0 for s in soak.samples), default=None),
        "pages_in_use_end": idle[-1]["pages_in_use"] if idle else None,
        "total_pages": next((s["total_pages"] for s in soak.samples if s["total_pages"]), None),
        "drained": soak.idle is not None,
        "preemptions": idle[-1]["preemptions"] if idle else None,
        "slope_window_minutes": round((after[-1]["t_s"] - after[0]["t_s"]) / 60, 2)
        if len(after) > 1
        else 0.0,
    }
    f["rss_judged"] = (
        f["rss_mb_warmup_end"] is not None and f["slope_window_minutes"] >= args.rss_judge_minutes
    )
    for key in ("fds", "threads"):
        f[f"{key}_warmup_end"] = median_of(first, key)
        f[f"{key}_end"] = median_of(idle, key)
        f[f"{key}_max"] = max((s[key] for s in soak.samples if s[key] is not None), default=None)
    return f


FD_SLACK, THREAD_SLACK = 16, 8  # sockets closing, a worker pool's threads come and go


def verdict(f: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why the run fails (empty: it passes)."""
    why = []
    e = f["errors"]
    for cls in ("lost", "wrong", "5xx", "unexpected_4xx"):
        if e[cls]:
            why.append(f"{e[cls]} {cls}")
    if not f["served"].get("total"):
        why.append("no request served")
    if not f["drained"] or f["pages_in_use_end"] != 0:
        why.append(f"{f['pages_in_use_end']} KV pages in use at the end (idle)")
    base = f["rss_mb_warmup_end"]
    if f["rss_judged"]:
        top = max(v for v in (f["rss_mb_last_load"], f["rss_mb_end"], base) if v is not None)
        if top - base > args.max_rss_growth:
            why.append(
                f"RSS grew {top - base:.1f} MB after the warm-up (limit {args.max_rss_growth:g})"
            )
        slope = f["rss_slope_mb_per_hour"]
        if slope is not None and slope > args.max_rss_slope:
            why.append(f"RSS slope {slope:.1f} MB/hour (limit {args.max_rss_slope:g})")
    for key, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
        b, end = f[f"{key}_warmup_end"], f[f"{key}_end"]
        if b is not None and end is not None and end > b + slack:
            why.append(f"{key}: {end:g} at the end, {b:g} after the warm-up")
    return why


def print_report(f: dict[str, Any], label: str, why: list[str]) -> None:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{label}: {f['load_minutes']} minutes of load, warm-up {f['warmup_minutes']:g}")
    print("served:  " + ", ".join(f"{k} {v}" for k, v in f["served"].items()))
    print("errors:  " + ", ".join(f"{k} {v}" for k, v in f["errors"].items()))
    print(
        f"RSS MB:  start {fmt(f['rss_mb_start'])}, after warm-up {fmt(f['rss_mb_warmup_end'])},"
        f" last load {fmt(f['rss_mb_last_load'])}, end (idle) {fmt(f['rss_mb_end'])}, max "
        f"{fmt(f['rss_mb_max'])}; slope {fmt(f['rss_slope_mb_per_hour'])} MB/hour over "
        f"{f['slope_window_minutes']} min" + ("" if f["rss_judged"] else " (not judged: too short)")
    )
    print(
        f"pages:   max {f['pages_in_use_max']} of {f['total_pages']}, end {f['pages_in_use_end']}"
        f", slope {fmt(f['pages_slope_per_hour'])}/hour; preemptions {f['preemptions']}"
    )
    print(
        f"fds:     after warm-up {fmt(f['fds_warmup_end'], 'g')}, end {fmt(f['fds_end'], 'g')}, "
        f"max {fmt(f['fds_max'], 'g')}; threads: {fmt(f['threads_warmup_end'], 'g')}, "
        f"{fmt(f['threads_end'], 'g')}, max {fmt(f['threads_max'], 'g')}"
    )
    print("PASS" if not why else "FAIL: " + "; ".join(why))


def plot(samples: list[dict[str, Any]], f: dict[str, Any], label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = samples
    t = [s["t_s"] / 60 for s in pts]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    rss, pages, misc = axes
    rss.plot(t, [s["rss_mb"] for s in pts], marker=".", lw=1)
    after = [s for s in pts if s["phase"] == "load" and s["t_s"] >= f["warmup_minutes"] * 60]
    fit = line_fit(after, "rss_mb")
    if fit is not None:
        ends = [after[0]["t_s"] / 3600, after[-1]["t_s"] / 3600]
        rss.plot(
            [h * 60 for h in ends],
            [fit[0] * h + fit[1] for h in ends],
            color="k",
            lw=1,
            ls=":",
            label="least squares after the warm-up",
        )
        rss.legend(loc="lower right")
    rss.set(
        ylabel="RSS (MB)",
        title=f"soak, {label}: {f['served'].get('total', 0)} requests, "
        f"RSS slope {f['rss_slope_mb_per_hour'] or 0:.1f} MB/hour after the warm-up",
    )
    pages.plot(t, [s["pages_in_use"] for s in pts], marker=".", lw=1, color="tab:orange")
    pages.set(ylabel=f"KV pages in use (of {f['total_pages']})")
    misc.plot(t, [s["fds"] for s in pts], marker=".", lw=1, label="open fds")
    misc.plot(t, [s["threads"] for s in pts], marker=".", lw=1, label="threads")
    misc.set(ylabel="count", xlabel="minutes since the load started")
    misc.legend(loc="upper left")
    for ax in axes:
        ax.axvspan(0, f["warmup_minutes"], color="0.9", label="warm-up")
        ax.axvline(f["load_minutes"], color="0.5", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
