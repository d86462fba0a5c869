"""One grammar compile, and the worker process that runs them for ``CompilePool``.

``compile_spec`` is the single mapping from a ``GrammarSpec`` to an xgrammar
compile: the worker proves with it that a grammar compiles within the time
and memory limits, and the backend then compiles the same grammar with it
in-process.

The worker (``python -I compile_worker.py PARENT_PID``: run as a script, it
imports xgrammar and the standard library only) reads JSON lines on stdin
and answers JSON lines on its stdout:

- first ``{"sys_path": <the parent's sys.path>, "tokenizer_info":
  <TokenizerInfo.serialize_json()>, "max_memory_mb": int | null}``, answered
  ``{"ready": true}``;
- then ``{"kind", "text"}`` per grammar, answered ``{"ok": true, "seconds"}``,
  ``{"error": "compile", "message"}`` or ``{"error": "memory"}``.

It exits when stdin closes or its parent dies (a watchdog thread: xgrammar
releases the GIL while it compiles).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.grammar.base import GrammarSpec

# xgrammar prefixes its errors with a timestamp and the C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# What xgrammar raises where a compile cannot allocate (a C++ bad_alloc).
_OUT_OF_MEMORY = "bad_alloc"
# Seconds between the watchdog's looks at the parent.
_WATCH_INTERVAL = 0.5


def compile_spec(compiler: Any, kind: str, text: str) -> Any:
    """A grammar (a ``GrammarSpec``'s kind and text) compiled by an xgrammar
    ``GrammarCompiler``. JSON output is compact-spaced (``", "``, ``": "``)
    without free whitespace, so a weak model cannot loop on blanks forever."""
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    schema = json.dumps({"type": "object"}) if kind == "json_object" else text
    return compiler.compile_json_schema(
        schema,
        any_whitespace=False,
        separators=(", ", ": "),
        strict_mode=kind == "json_schema",
    )


def compiler_message(e: BaseException) -> str:
    """The compiler's own message, without xgrammar's location prefix."""
    return _LOCATION.sub("", str(e).strip()).strip()


def does_not_compile(spec: GrammarSpec, message: str) -> ValueError:
    """The error of a grammar the compiler refused, naming its field."""
    return ValueError(f"{spec.field}: the grammar does not compile: {message}")


def _answer(compiler: Any, request: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        compile_spec(compiler, request["kind"], request["text"])
    except MemoryError:
        return {"error": "memory"}
    except (RuntimeError, ValueError, TypeError) as e:
        if _OUT_OF_MEMORY in str(e):
            return {"error": "memory"}
        return {"error": "compile", "message": compiler_message(e)}
    return {"ok": True, "seconds": time.perf_counter() - start}


def _limit_memory(max_memory_mb: int | None) -> None:
    """Caps the address space at what it is now plus ``max_memory_mb``
    (Linux; elsewhere the limit is not enforced)."""
    if max_memory_mb is None or not os.path.exists("/proc/self/statm"):
        return
    import resource

    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = now + (max_memory_mb << 20)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL)
    os._exit(0)  # the parent is gone: nobody waits for this compile


def main(argv: list[str]) -> None:
    # Replies go to a private copy of stdout; whatever else prints (the
    # compiler's warnings) goes to stderr and never into a reply.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), daemon=True).start()
    hello = json.loads(sys.stdin.readline())
    # What the parent imports from (its site-packages, user site, PYTHONPATH),
    # which isolated mode left out.
    sys.path[:0] = [p for p in hello["sys_path"] if p not in sys.path]
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(hello["tokenizer_info"])
    # One thread: a compile takes at most one core.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _limit_memory(hello["max_memory_mb"])

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in sys.stdin:
        reply(_answer(compiler, json.loads(line)))


if __name__ == "__main__":
    main(sys.argv[1:])
