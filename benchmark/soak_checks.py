"""The soak run's requests and how their answers are checked (benchmark/soak.py).

A case is one prompt with its output settings; a client sends it greedy
(compared with the reference taken at the start), or sampled, unary or
streamed, with n choices. Whatever the endpoint and whether streamed, an
answer is brought to one shape (``Answer``) and checked: equal to the
reference (text, tokens, logprobs within ``TOL``), one logprob entry per
token, top-k lists of the asked size, grammars honoured (``jsonschema``,
``re.fullmatch``), and greedy tokens the top-1 of the model's own logprobs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sysconfig
from dataclasses import dataclass, field
from typing import Any

# Logprobs of one greedy answer, across batches, streams and n. float32
# logits computed in different batches round differently (another matmul
# blocking, a decode step or a verify chain): on the demo, the same 16
# greedy answers differ by up to 7.6e-6 between one batch and one at a time
# under plain decoding, and by up to 1.3e-5 between plain and DSPARK.
TOL = 2e-5

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
                items = (lp.get("content") or []) if chat else None
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
