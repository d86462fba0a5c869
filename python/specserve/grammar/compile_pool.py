"""Bounded grammar compiles: each new grammar is first compiled in a worker
process that is killed when it runs past the time limit or out of memory.

A thread running xgrammar's C++ compiler cannot be interrupted, so a
timeout that only stopped waiting would leave the compile burning a core
and its memory growing. A process can be killed. The worker only proves
that the grammar compiles within the limits; the caller then compiles it
again in-process, which takes what the worker took, because a compiled
grammar's serialised form can be far larger and slower than the compile
itself (tens of MB and seconds for a schema that compiles in 0.1 s).

Workers start on first use (a fresh interpreter that imports xgrammar, a
few seconds), are reused, and at most ``max_workers`` run at once; a
caller that finds them all busy waits for one (each is busy for at most
the timeout). Nothing here starts a thread in the calling process.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from specserve.grammar.base import GrammarSpec
from specserve.grammar.compile_worker import does_not_compile

logger = logging.getLogger(__name__)

# Seconds a fresh worker may take to import xgrammar and answer ready.
START_TIMEOUT = 120.0
# Run as a script in isolated mode: no import of the specserve package (the
# engine, torch's kernels), nothing from the caller's directory; it imports
# xgrammar from the caller's sys.path.
_WORKER = [sys.executable, "-I", os.path.join(os.path.dirname(__file__), "compile_worker.py")]


class _Worker:
    """One worker process and its reply pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [*_WORKER, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._buffer = b""

    def send(self, message: dict[str, Any], deadline: float) -> bool:
        """Writes one line; False if ``deadline`` passes first. ``OSError`` if
        the worker is gone."""
        assert self.proc.stdin is not None
        data = memoryview((json.dumps(message) + "\n").encode())
        fd = self.proc.stdin.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while data:
                if not sel.select(max(deadline - time.monotonic(), 0)):
                    return False
                data = data[os.write(fd, data) :]
        return True

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The next reply; None if ``deadline`` passes first. ``EOFError`` if
        the worker exited."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                if not sel.select(max(deadline - time.monotonic(), 0)):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        _kill(self.proc)


def _kill(proc: subprocess.Popen) -> None:
    """Kills and reaps (no zombie); closes its pipes (only their user may)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _kill_all(procs: list[subprocess.Popen], lock: threading.Condition) -> None:
    """Kills and reaps every worker. Their pipes stay open: a busy worker's
    caller may be waiting on them (it sees end-of-file and drops the worker)."""
    with lock:
        doomed = list(procs)
    for proc in doomed:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class CompilePool:
    def __init__(
        self,
        tokenizer_info: str,
        timeout: float,
        max_memory_mb: int | None,
        max_workers: int = 2,
    ) -> None:
        """``tokenizer_info``: ``xgrammar.TokenizerInfo.serialize_json()``;
        ``timeout``: seconds one compile may take; ``max_memory_mb``: what it
        may allocate (None: no limit)."""
        self._hello = {
            "sys_path": [p for p in sys.path if p],  # not "" (the caller's directory)
            "tokenizer_info": tokenizer_info,
            "max_memory_mb": max_memory_mb,
        }
        self.timeout = timeout
        self.max_memory_mb = max_memory_mb
        self._max_workers = max_workers
        self._idle: list[_Worker] = []
        self._live = 0  # workers started or starting, idle or busy
        self._procs: list[subprocess.Popen] = []  # every live worker's process
        self._closed = False
        self._cond = threading.Condition()
        # Workers die with the pool even if close() is never called.
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._cond)

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [p.pid for p in self._procs]

    def check(self, spec: GrammarSpec) -> float:
        """Compiles ``spec`` in a worker; the seconds it took. ``ValueError``
        naming the field if it does not compile, runs past the timeout, runs
        out of memory or crashes the worker; ``RuntimeError`` if no worker
        can start or the pool is closed."""
        worker = self._acquire()
        healthy = False
        try:
            deadline = time.monotonic() + self.timeout
            try:
                sent = worker.send({"kind": spec.kind, "text": spec.text}, deadline)
                reply = worker.receive(deadline) if sent else None
            except (OSError, EOFError, ValueError):  # ValueError: a garbled reply
                self._check_open()
                worker.kill()
                logger.warning("a %s crashed its compile worker", spec.kind)
                raise ValueError(
                    f"{spec.field}: the grammar compiler crashed on this grammar "
                    f"(exit status {worker.proc.returncode})"
                ) from None
            if reply is None:
                logger.warning(
                    "a %s compiled past %g s: its worker is killed", spec.kind, self.timeout
                )
                raise ValueError(
                    f"{spec.field}: the grammar did not compile within {self.timeout:g} s "
                    "(--grammar-compile-timeout)"
                )
            if reply.get("error") == "memory":
                logger.warning("a %s compile ran out of memory: its worker is killed", spec.kind)
                raise ValueError(
                    f"{spec.field}: compiling the grammar needs more than "
                    f"{self.max_memory_mb} MiB (--grammar-compile-max-memory)"
                )
            healthy = True
            if reply.get("error") == "compile":
                raise does_not_compile(spec, reply["message"])
            return float(reply["seconds"])
        finally:
            self._release(worker, healthy)

    def close(self) -> None:
        """Kills every worker; a check in flight and later ones raise ``RuntimeError``."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        self._finalizer()
        for worker in idle:
            self._drop(worker)

    # ---- workers ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the grammar compiler was shut down")

    def _acquire(self) -> _Worker:
        dead: list[_Worker] = []  # died while idle (killed from outside): replaced
        try:
            with self._cond:
                while True:
                    self._check_open()
                    while self._idle:
                        worker = self._idle.pop()
                        if worker.proc.poll() is None:
                            return worker
                        dead.append(worker)
                        self._live -= 1
                    if self._live < self._max_workers:
                        self._live += 1
                        break
                    self._cond.wait()
        finally:
            for worker in dead:
                self._drop(worker)
        try:
            return self._start()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _start(self) -> _Worker:
        worker = _Worker()
        with self._cond:
            if self._closed:
                worker.kill()
                self._check_open()
            self._procs.append(worker.proc)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            ready = worker.send(self._hello, deadline) and worker.receive(deadline)
            if not ready:
                raise RuntimeError(f"did not answer within {START_TIMEOUT:g} s")
        except (OSError, EOFError, ValueError, RuntimeError) as e:
            self._drop(worker)
            self._check_open()
            raise RuntimeError(
                f"the grammar compile worker did not start ({e!r}; exit status "
                f"{worker.proc.returncode}; its stderr is in the log)"
            ) from None
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            if worker.proc in self._procs:
                self._procs.remove(worker.proc)

    def _release(self, worker: _Worker, healthy: bool) -> None:
        """Back to the idle list, or killed (past its time, out of memory,
        crashed, or the pool closed)."""
        with self._cond:
            keep = healthy and not self._closed
            if keep:
                self._idle.append(worker)
            else:
                self._live -= 1
            self._cond.notify()
        if not keep:
            self._drop(worker)
