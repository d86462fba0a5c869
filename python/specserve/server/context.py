"""What every endpoint shares: the engine, the server config, metrics, and
the helpers that run a request on the engine from the event loop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from specserve.config import ServerConfig
from specserve.engine.engine import Engine
from specserve.engine.engine_core import RequestOutput
from specserve.engine.request_factory import GenerateRequest
from specserve.engine.result import ResultCollector
from specserve.server.errors import APIError, from_value_error
from specserve.server.metrics import Histogram, Registry, Sampled


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class ServerContext:
    engine: Engine
    config: ServerConfig
    model_name: str
    metrics: Registry = field(default_factory=Registry)

    def __post_init__(self) -> None:
        m = self.metrics
        self.ttft = m.add(
            Histogram("specserve_time_to_first_token_seconds", "Time to first token.")
        )
        self.itl = m.add(
            Histogram("specserve_inter_token_latency_seconds", "Time between output tokens.")
        )
        self.e2e = m.add(Histogram("specserve_e2e_request_latency_seconds", "Request latency."))
        stats = self.engine.stats
        for name, kind, help, key in (
            (
                "specserve_prompt_tokens_total",
                "counter",
                "Prompt tokens admitted.",
                "prompt_tokens",
            ),
            (
                "specserve_generation_tokens_total",
                "counter",
                "Tokens generated.",
                "generated_tokens",
            ),
            ("specserve_num_preemptions_total", "counter", "Requests preempted.", "preemptions"),
            ("specserve_num_requests_running", "gauge", "Requests running.", "running"),
            ("specserve_num_requests_waiting", "gauge", "Requests queued.", "queued"),
            ("specserve_kv_cache_usage_ratio", "gauge", "Share of KV pages in use.", "kv_usage"),
        ):
            m.add(Sampled(name, help, kind, _reader(stats, key)))
        if self.engine.proposer is not None:
            m.add(
                Sampled(
                    "specserve_spec_accept_length",
                    "Mean tokens committed per verify round (bonus included).",
                    "gauge",
                    _reader(stats, "spec_accept_length"),
                )
            )
            m.add(
                Sampled(
                    "specserve_spec_verify_rounds_total",
                    "Verify rounds, per request.",
                    "counter",
                    _reader(stats, "spec_verify_rounds"),
                )
            )
        m.add(
            Sampled(
                "specserve_requests_total",
                "Finished requests by finish reason.",
                "counter",
                _reader(stats, "finished"),
                label="finish_reason",
            )
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"model: {model!r} is not served here; available: {self.model_name!r}", "model", 404
            )

    async def build(
        self, renames: dict[str, str] | None = None, **kwargs: Any
    ) -> tuple[list[GenerateRequest], bool]:
        """Tokenizes and validates off the event loop; errors become 400s."""
        try:
            greqs, batched = await asyncio.to_thread(self.engine.requests.build, **kwargs)
            self.engine.check_new_rids(greqs)
        except ValueError as e:
            raise from_value_error(e, renames) from None
        return greqs, batched

    async def stream(self, greq: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The engine's deltas for one request, timed into the latency histograms."""
        start = last = time.monotonic()
        first = True
        async for out in self.engine.stream(greq):
            now = time.monotonic()
            if out.token_ids:
                if first:
                    self.ttft.observe(now - start)
                    first = False
                else:
                    # Several tokens in one delta share the gap since the last one.
                    gap = (now - last) / len(out.token_ids)
                    for _ in out.token_ids:
                        self.itl.observe(gap)
                last = now
            if out.finished:
                self.e2e.observe(now - start)
            yield out

    async def stream_all(
        self, greqs: list[GenerateRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The deltas of several requests as they come, tagged with their index.
        Leaving early (a client that disconnected) aborts every request."""
        merged: asyncio.Queue[tuple[int, RequestOutput] | None] = asyncio.Queue()

        async def pump(i: int, greq: GenerateRequest) -> None:
            async for out in self.stream(greq):
                await merged.put((i, out))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(greqs)]
        done = asyncio.gather(*tasks)
        done.add_done_callback(lambda _: merged.put_nowait(None))
        try:
            while (item := await merged.get()) is not None:
                yield item
            await done  # surfaces a failure instead of ending the stream silently
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, greqs: list[GenerateRequest], request: Request) -> list[RequestOutput]:
        """Runs requests to completion; aborts them all if the client goes away."""

        async def one(greq: GenerateRequest) -> RequestOutput:
            col = ResultCollector()
            async for out in self.stream(greq):
                col.add(out)
            return col.as_output(greq.rid)

        work = asyncio.gather(*(one(g) for g in greqs))
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise APIError("client disconnected", status=499)
            return work.result()
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # disconnect or our own cancellation: abort the requests


def _reader(stats: Callable[[], dict[str, Any]], key: str) -> Callable[[], Any]:
    return lambda: stats()[key]


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
