"""``dp_size`` engine replicas behind one front (``--dp-size``): each its own
scheduler, KV pool and device (and its own tensor-parallel group with
``--tp-size``), every request routed to the least-loaded replica.

The front offers what the server and offline callers use of an ``Engine``:
submission and streaming, aborts, health probes, and statistics summed over
the replicas. Replica 0 runs on the thread that drives the front (a
server's main thread), the others each on a thread of their own. A replica
that stops on an error stops the front: the server reports unhealthy and
exits non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from specserve.config import EngineConfig
from specserve.engine.engine import Engine, Sink
from specserve.engine.engine_core import RequestOutput
from specserve.engine.request_factory import GenerateRequest
from specserve.engine.result import ResultCollector


class DataParallelEngine:
    def __init__(self, model_path: str, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path, **engine_args)
        par = self.config.parallel
        if par.nnodes > 1:
            raise ValueError("dp_size: data parallelism over several nodes is not supported yet")
        replica_args = {**engine_args, "dp_size": 1}
        self.replicas: list[Engine] = []
        try:
            for r in range(par.dp_size):
                device = replica_device(self.config, r)
                self.replicas.append(Engine(model_path, **{**replica_args, **device}))
        except BaseException:
            for eng in self.replicas:
                eng.shutdown()
            raise
        first = self.replicas[0]
        for eng in self.replicas[1:]:
            eng.share_grammar(first)  # one compile pool for every replica
        self.tokenizer = first.tokenizer
        self.eos_ids = first.eos_ids
        self.proposer = first.proposer
        # Requests are validated against the tightest replica's limits.
        self.requests = min(self.replicas, key=lambda e: e.core.capacity_tokens).requests
        self._owner: dict[str, Engine] = {}  # rid -> its replica, while in flight
        self._lock = threading.Lock()

    # ---- routing ------------------------------------------------------------

    def _route(self, rid: str) -> Engine:
        """The least-loaded replica (the fewest requests in flight; the lowest
        index among equals), now the owner of ``rid``."""
        with self._lock:
            eng = min(self.replicas, key=lambda e: e.num_active_requests())
            self._owner[rid] = eng
        return eng

    def _done(self, rid: str) -> None:
        with self._lock:
            self._owner.pop(rid, None)

    def submit(self, greq: GenerateRequest, sink: Sink) -> None:
        eng = self._route(greq.rid)

        def deliver(out: RequestOutput) -> None:
            if out.finished:
                self._done(out.rid)
            sink(out)

        try:
            eng.submit(greq, deliver)
        except BaseException:
            self._done(greq.rid)
            raise

    async def stream(self, greq: GenerateRequest) -> AsyncIterator[RequestOutput]:
        eng = self._route(greq.rid)
        try:
            async for out in eng.stream(greq):
                yield out
        finally:
            self._done(greq.rid)

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        """As ``Engine.generate``; the prompts spread over the replicas."""
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        collectors = [ResultCollector() for _ in greqs]
        for greq, col in zip(greqs, collectors):
            self.submit(greq, col.add)
        for col in collectors:
            col.done.wait()
        results = [self.format(g, c.as_output(g.rid)) for g, c in zip(greqs, collectors)]
        return results if batched or len(results) > 1 else results[0]

    def format(self, greq: GenerateRequest, out: RequestOutput) -> dict[str, Any]:
        return self.replicas[0].format(greq, out)

    def abort(self, rid: str, message: str | None = None) -> None:
        with self._lock:
            eng = self._owner.get(rid)
        if eng is not None:
            eng.abort(rid, message)

    def abort_all(self, message: str | None = None) -> int:
        return sum(eng.abort_all(message) for eng in self.replicas)

    def active_rids(self) -> list[str]:
        return [rid for eng in self.replicas for rid in eng.active_rids()]

    def rid_in_use(self, rid: str) -> bool:
        return any(eng.rid_in_use(rid) for eng in self.replicas)

    def check_new_rids(self, greqs: list[GenerateRequest]) -> None:
        for eng in self.replicas:
            eng.check_new_rids(greqs)

    @contextlib.contextmanager
    def probing(self, rid: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for eng in self.replicas:
                stack.enter_context(eng.probing(rid))
            yield

    # ---- state ----------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """The first replica's error, with which replica it was."""
        for r, eng in enumerate(self.replicas):
            if eng.error is not None:
                return f"data-parallel replica {r}: {eng.error}"
        return None

    def stats(self) -> dict[str, Any]:
        """Every replica's stats summed (``replicas``: each one's own)."""
        per = [eng.stats() for eng in self.replicas]
        out: dict[str, Any] = {}
        for key, value in per[0].items():
            if isinstance(value, dict):
                merged: dict[str, int] = {}
                for st in per:
                    for k, v in st[key].items():
                        merged[k] = merged.get(k, 0) + v
                out[key] = merged
            elif isinstance(value, (int, float)):
                out[key] = sum(st[key] for st in per)
            elif isinstance(value, list):  # counts per position
                counts = [0] * max(len(st[key]) for st in per)
                for st in per:
                    for i, v in enumerate(st[key]):
                        counts[i] += v
                out[key] = counts
        out["kv_usage"] = (out["total_pages"] - out["free_pages"]) / out["total_pages"]
        rounds = out["spec_verify_rounds"]
        accept = [st["spec_accept_length"] for st in per]
        out["spec_accept_length"] = (
            None
            if accept[0] is None
            else sum(a * st["spec_verify_rounds"] for a, st in zip(accept, per)) / rounds
            if rounds
            else 0.0
        )
        out["replicas"] = per
        return out

    def free_pages(self) -> int:
        return sum(eng.free_pages() for eng in self.replicas)

    def total_pages(self) -> int:
        return sum(eng.total_pages() for eng in self.replicas)

    def num_active_requests(self) -> int:
        return sum(eng.num_active_requests() for eng in self.replicas)

    # ---- driving ----------------------------------------------------------------

    def claim_loop(self) -> None:
        self.replicas[0].claim_loop()

    def run_loop(self, stop: threading.Event, log_interval: float = 0.0) -> None:
        """Replica 0 on the calling thread, the others on their own, until
        ``stop`` is set or any replica stops on an error."""
        for eng in self.replicas[1:]:
            eng.start_loop()
        self.replicas[0].run_loop(_AnyStop(stop, self.replicas), log_interval)

    def shutdown(self) -> None:
        for eng in self.replicas:
            eng.shutdown()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def replica_device(config: EngineConfig, replica: int) -> dict[str, str]:
    """The ``device`` engine argument of replica ``replica``: CUDA devices in
    blocks of ``tp_size`` from the configured one; none on the CPU (every
    replica shares it)."""
    if not config.device.startswith("cuda"):
        return {}
    first = int(config.device.partition(":")[2] or 0)
    return {"device": f"cuda:{first + replica * config.parallel.tp_size}"}


@dataclasses.dataclass
class _AnyStop:
    """Set once ``stop`` is, or any replica has stopped on an error."""

    stop: threading.Event
    replicas: list[Engine]

    def is_set(self) -> bool:
        return self.stop.is_set() or any(eng.error is not None for eng in self.replicas)
