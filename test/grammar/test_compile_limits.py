"""Grammar compile limits, offline: the grammar's length, the compile's time
and memory (a worker process that is killed past them) and a worker crash.
Checked against what the operating system says about the processes, the
threads that exist, the error each case names, and ``re.fullmatch`` on the
outputs compiled afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from models_zoo import model_path
from process_helpers import HAS_PROC, alive, children, wait_busy, wait_exited
from specserve import Engine
from specserve.grammar.base import GrammarSpec

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")

TIMEOUT = 2.0
MAX_LENGTH = 20_000
# 2000 optional properties of any type, 18922 characters: xgrammar 0.2.9
# compiles it for ~100 s on the test models' 528-token vocabulary (a loaded
# 2-core machine; the time grows about as n**3.5, so 1000 take ~6 s).
EXPLODING = json.dumps(
    {"type": "object", "properties": {str(i): {} for i in range(2000)}}, separators=(",", ":")
)
# A JSON schema that compiles in milliseconds.
SIMPLE = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def padded_schema(length: int) -> str:
    """A JSON schema of exactly ``length`` characters that accepts ``"ok"``."""
    pad = length - len(json.dumps({"const": "ok", "description": ""}))
    return json.dumps({"const": "ok", "description": "d" * pad})


class Call(threading.Thread):
    """Runs ``fn`` on a thread; its result or exception and when it ended."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error, self.ended = fn, None, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:
            self.error = e
        self.ended = time.monotonic()


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        max_total_tokens=1024,
        grammar_compile_timeout=TIMEOUT,
        max_grammar_length=MAX_LENGTH,
    )
    yield eng
    eng.shutdown()


def test_a_grammar_over_the_length_limit_names_its_field(engine) -> None:
    over = MAX_LENGTH + 1
    for field, text in (
        ("json_schema", padded_schema(over)),
        ("regex", "a" * over),
        ("ebnf", 'root ::= "' + "a" * (over - 11) + '"'),
    ):
        assert len(text) == over
        with pytest.raises(ValueError) as e:
            engine.generate("x", {field: text, "max_new_tokens": 2})
        assert str(e.value) == (
            f"{field}: the grammar is {over} characters, over the limit of {MAX_LENGTH} "
            "(--max-grammar-length)"
        )
    # At the limit it compiles and constrains.
    schema = padded_schema(MAX_LENGTH)
    assert len(schema) == MAX_LENGTH
    out = engine.generate("x", {"json_schema": schema, "max_new_tokens": 8})
    assert json.loads(out["text"]) == "ok"


def test_an_exploding_grammar_is_killed_at_the_timeout(engine) -> None:
    threads = set(threading.enumerate())
    engine.generate("x", {"regex": "[ab]{2}", "max_new_tokens": 4})  # starts a worker
    backend = engine.grammar_backend()
    (worker,) = backend.pool.worker_pids()
    assert children(os.getpid()) >= {worker}
    start = time.monotonic()
    call = Call(lambda: engine.generate("x", {"json_schema": EXPLODING, "max_new_tokens": 4}))
    wait_busy(worker, call.is_alive)
    call.join(timeout=TIMEOUT + 60)
    assert isinstance(call.error, ValueError), (call.result, call.error)
    assert str(call.error) == (
        f"json_schema: the grammar did not compile within {TIMEOUT:g} s (--grammar-compile-timeout)"
    )
    assert TIMEOUT <= call.ended - start < TIMEOUT + 30
    # The compile did not go on: its process is killed and reaped; nothing
    # else was left behind.
    assert not alive(worker) and worker not in children(os.getpid())
    assert backend.pool.worker_pids() == []
    assert set(threading.enumerate()) - threads == set()
    # New grammars still compile (in a fresh worker) and constrain.
    out = engine.generate("x", {"regex": "(yes|no)", "max_new_tokens": 4})
    assert re.fullmatch("yes|no", out["text"]), out
    (fresh,) = backend.pool.worker_pids()
    assert fresh != worker and alive(fresh)


def test_concurrent_requests_for_one_new_grammar_compile_it_once(engine, monkeypatch) -> None:
    backend = engine.grammar_backend()
    callers = 4
    entered = []
    checks = []
    compile_, check = backend.compile, backend.pool.check

    def counted_compile(spec):
        entered.append(spec)
        return compile_(spec)

    def held_check(spec):
        # Holds the first compile until every caller has asked for the grammar.
        deadline = time.monotonic() + 30
        while len(entered) < callers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        checks.append(spec)
        return check(spec)

    monkeypatch.setattr(backend, "compile", counted_compile)
    monkeypatch.setattr(backend.pool, "check", held_check)
    spec = GrammarSpec("regex", "[0-9]{3}")
    calls = [Call(lambda: backend.compile(spec)) for _ in range(callers)]
    for c in calls:
        c.join(timeout=120)
    assert [c.error for c in calls] == [None] * callers
    assert checks == [spec]
    assert all(c.result is calls[0].result for c in calls)


def test_a_worker_killed_while_idle_is_replaced(engine) -> None:
    backend = engine.grammar_backend()
    engine.generate("x", {"regex": "[xy]", "max_new_tokens": 2})
    (worker,) = backend.pool.worker_pids()
    os.kill(worker, signal.SIGKILL)
    wait_exited(worker)
    out = engine.generate("x", {"regex": "[0-9]{2}", "max_new_tokens": 4})
    assert re.fullmatch("[0-9]{2}", out["text"]), out
    (fresh,) = backend.pool.worker_pids()
    assert fresh != worker and not alive(worker)


def test_a_crash_fails_its_grammar_alone_and_shutdown_ends_a_compile_in_flight() -> None:
    eng = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=1024)
    threads = set(threading.enumerate())
    try:
        eng.generate("x", {"regex": "a", "max_new_tokens": 2})
        pool = eng.grammar_backend().pool
        (worker,) = pool.worker_pids()
        call = Call(lambda: eng.generate("x", {"json_schema": EXPLODING}))
        wait_busy(worker, call.is_alive)
        os.kill(worker, signal.SIGKILL)  # as the kernel's OOM killer would
        call.join(timeout=30)
        assert str(call.error) == (
            "json_schema: the grammar compiler crashed on this grammar (exit status -9)"
        )
        assert not alive(worker) and pool.worker_pids() == []
        out = eng.generate("x", {"regex": "(on|off)", "max_new_tokens": 4})
        assert re.fullmatch("on|off", out["text"]), out
        (worker,) = pool.worker_pids()
        call = Call(lambda: eng.generate("x", {"json_schema": EXPLODING}))
        wait_busy(worker, call.is_alive)
    finally:
        eng.shutdown()
    call.join(timeout=30)
    assert isinstance(call.error, RuntimeError), (call.result, call.error)
    assert not alive(worker) and children(os.getpid()).isdisjoint({worker})
    assert pool.worker_pids() == []
    assert set(threading.enumerate()) - threads == set()


def test_a_busy_worker_exits_when_its_parent_dies() -> None:
    script = f"""
import sys
from specserve.grammar.base import GrammarSpec
from specserve.grammar.xgrammar_backend import XGrammarBackend
from specserve.tokenizer.tokenizer import Tokenizer
tok = Tokenizer({model_path("qwen3")!r})
backend = XGrammarBackend(tok.hf, len(tok.hf) + 16, [0], compile_timeout=600)
backend.compile(GrammarSpec("regex", "a"))
print(backend.pool.worker_pids()[0], flush=True)
backend.compile(GrammarSpec("json_schema", sys.stdin.readline()))
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(parent.stdout.readline())
        parent.stdin.write(EXPLODING + "\n")
        parent.stdin.flush()
        wait_busy(worker, lambda: parent.poll() is None)
    finally:
        parent.kill()  # no shutdown, no finaliser: only the worker's watchdog is left
        parent.wait()
    wait_exited(worker)


def test_a_compile_over_its_memory_limit_is_a_400_naming_the_field() -> None:
    from specserve.grammar.xgrammar_backend import XGrammarBackend
    from specserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(model_path("qwen3"))
    backend = XGrammarBackend(tok.hf, len(tok.hf) + 16, [0], max_memory_mb=4)
    try:
        backend.compile(GrammarSpec("json_schema", SIMPLE))  # 4 MiB is enough for it
        (worker,) = backend.pool.worker_pids()
        big = json.dumps({"enum": [f"value_{i}" for i in range(2000)]})
        with pytest.raises(ValueError) as e:
            backend.compile(GrammarSpec("json_schema", big))
        assert str(e.value) == (
            "json_schema: compiling the grammar needs more than 4 MiB "
            "(--grammar-compile-max-memory)"
        )
        assert not alive(worker) and backend.pool.worker_pids() == []
    finally:
        backend.close()


def test_a_worker_that_cannot_start_is_an_internal_error(monkeypatch) -> None:
    from specserve.grammar import compile_pool

    monkeypatch.setattr(compile_pool, "_WORKER", [sys.executable, "-c", "raise SystemExit(3)"])
    pool = compile_pool.CompilePool("{}", timeout=5, max_memory_mb=None, max_workers=2)
    try:
        for _ in range(3):  # each check tries a fresh worker: no slot is lost
            call = Call(lambda: pool.check(GrammarSpec("regex", "a")))
            call.join(timeout=60)
            assert isinstance(call.error, RuntimeError), (call.result, call.error)
            assert re.search("did not start .*exit status 3", str(call.error)), call.error
            assert pool.worker_pids() == []
    finally:
        pool.close()
