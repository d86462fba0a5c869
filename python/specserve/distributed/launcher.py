"""Starts the worker ranks of a tensor-parallel group, watches them, and
ends them: rank 0 (the engine's process) owns its workers' lives.

Workers are spawned (torch multiprocessing), never forked: a fork would
copy rank 0's threads and its half-initialised torch state. Each watches
its parent and exits when rank 0 is gone, so no worker outlives it; rank 0
watches every worker's sentinel and reports the first that exits.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

logger = logging.getLogger(__name__)


def free_addr() -> str:
    """A free TCP port on the loopback, as host:port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class WorkerRanks:
    """The worker ranks ``ranks`` of a group of ``size``, each
    ``target(rank, size, addr, *args)`` in a process of its own."""

    def __init__(
        self,
        target: Callable[..., None],
        ranks: range,
        size: int,
        addr: str,
        args: tuple[Any, ...],
    ) -> None:
        ctx = mp.get_context("spawn")
        self.procs = {
            r: ctx.Process(
                target=target,
                args=(r, size, addr, *args),
                name=f"specserve-rank-{r}",
                daemon=True,
            )
            for r in ranks
        }
        for p in self.procs.values():
            p.start()
        self._closing = threading.Event()
        self._lost: str | None = None
        self._on_loss: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._watch_loop, name="specserve-ranks", daemon=True)
        self._watch.start()

    def lost(self) -> str | None:
        """Which worker exited and how, once one has (while serving)."""
        with self._lock:
            return self._lost

    def on_loss(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` once, from the watch thread, when a worker exits
        before ``close`` (at once if one already has)."""
        with self._lock:
            self._on_loss.append(callback)
            lost = self._lost
        if lost is not None:
            callback(lost)

    def _watch_loop(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        if not sentinels:  # a node whose only rank is rank 0
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ready[0]]
        proc = self.procs[rank]
        proc.join(timeout=1)
        why = f"tensor-parallel rank {rank} exited (exit code {proc.exitcode})"
        logger.error("%s", why)
        with self._lock:
            self._lost = why
            callbacks = list(self._on_loss)
        for cb in callbacks:
            cb(why)

    def wait(self) -> str | None:
        """Blocks until every worker has exited, or one has failed: None when
        all exited with status 0 (after rank 0's stop), else which failed."""
        self._closing.set()  # this caller reports the exits, not the watch
        for p in self.procs.values():
            p.join()
            if p.exitcode != 0:
                return f"{p.name} exited (exit code {p.exitcode})"
        return None

    def close(self, stop: Callable[[None], None] | None = None, timeout: float = 10.0) -> None:
        """Ends the workers: ``stop(None)`` sends them the stop plan and they
        get up to ``timeout`` s to exit; what is left then (everything, when
        ``stop`` is None: the group is broken) is killed."""
        self._closing.set()
        if stop is None:
            timeout = 0.0
        else:
            try:
                stop(None)
            except Exception as e:
                logger.warning("could not stop the worker ranks (%s); killing them", e)
                timeout = 0.0
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        # Workers give SIGTERM a grace period (rank 0 ends them): a kill it is.
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()

    @property
    def pids(self) -> dict[int, int | None]:
        return {r: p.pid for r, p in self.procs.items()}


# Seconds a worker given SIGTERM waits for rank 0 to stop it in order.
TERM_GRACE = 5.0


def exit_with_parent(poll: float = 0.5) -> None:
    """In a worker (first thing, before any other thread starts): leaves its
    end to rank 0 and exits as soon as its parent is gone, even while a
    collective blocks the main thread. A Ctrl-C or SIGTERM to the server's
    process group stops rank 0, which stops its workers in order: they
    ignore SIGINT, and SIGTERM leaves them ``TERM_GRACE`` seconds for it
    (then they go: a parent exiting without stopping them terminates its
    daemon children and waits for them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM to a thread of its own: the main thread may sit in a collective
    # for as long as the server idles, where no Python handler runs.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    def on_sigterm() -> None:
        signal.sigwait({signal.SIGTERM})
        time.sleep(TERM_GRACE)
        os._exit(0)

    threading.Thread(target=watch_parent, name="specserve-parent-watch", daemon=True).start()
    threading.Thread(target=on_sigterm, name="specserve-sigterm", daemon=True).start()
