"""What every endpoint shares: the engine, the server config, metrics, and
the helpers that run a request on the engine from the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specserve.config import ServerConfig
from specserve.engine.data_parallel import DataParallelEngine
from specserve.engine.engine import Engine, EngineStopped
from specserve.engine.engine_core import RequestOutput
from specserve.engine.request_factory import GenerateRequest
from specserve.engine.result import ResultCollector
from specserve.server.errors import APIError, error_body, from_value_error
from specserve.server.metrics import Histogram, Registry, Sampled, SampledHistogram

logger = logging.getLogger(__name__)

# Bounds of the drafts-per-step histogram.
DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class ServerContext:
    engine: Engine | DataParallelEngine
    config: ServerConfig
    model_name: str
    metrics: Registry = field(default_factory=Registry)
    # OpenAI requests' ``rid`` -> the engine ids of their sequences.
    groups: dict[str, list[str]] = field(default_factory=dict)

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
            for name, help, key in (
                ("specserve_spec_verified_drafts_total",
                 "Drafts verified, by position in the chain (0: the first).",
                 "spec_verified_per_position"),
                ("specserve_spec_accepted_drafts_total",
                 "Drafts accepted, by position in the chain (0: the first).",
                 "spec_accepted_per_position"),
            ):  # fmt: skip
                m.add(Sampled(name, help, "counter", _per_position(stats, key), label="position"))
        if "spec_steps" in stats():  # the cost model decides the verify lengths
            self._add_planner_metrics(stats)
        m.add(
            Sampled(
                "specserve_requests_total",
                "Finished requests by finish reason.",
                "counter",
                _reader(stats, "finished"),
                label="finish_reason",
            )
        )

    def _add_planner_metrics(self, stats: Callable[[], dict[str, Any]]) -> None:
        m = self.metrics
        m.add(
            SampledHistogram(
                "specserve_spec_drafts_per_step",
                "Drafts verified per decode step, as the cost model chose (0: a plain step).",
                _reader(stats, "spec_drafts_per_step"),
                DRAFT_BUCKETS,
            )
        )
        for name, help, key in (
            ("specserve_spec_plain_steps_total", "Decode steps verifying no drafts.",
             "spec_plain_steps"),
            ("specserve_spec_forced_plain_steps_total",
             "Decode steps the safety net made plain.", "spec_forced_plain_steps"),
            ("specserve_spec_predicted_step_seconds_total",
             "The cost model's predicted seconds of the measured steps.",
             "spec_predicted_step_seconds"),
            ("specserve_spec_measured_step_seconds_total",
             "Measured seconds of the same steps.", "spec_measured_step_seconds"),
        ):  # fmt: skip
            m.add(Sampled(name, help, "counter", _reader(stats, key)))

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
        except EngineStopped as e:  # shut down while the request was built
            raise APIError(str(e), None, 503, "server_error") from None
        taken = next((g.rid for g in greqs if self._live(self.groups.get(g.rid, ()))), None)
        if taken is not None:
            raise APIError(f"rid: {taken!r} is already in use", "rid")
        return greqs, batched

    def claim(self, rid: str | None, greqs: list[GenerateRequest]) -> None:
        """Lets ``/abort_request`` with ``rid`` (an OpenAI request's ``rid``)
        abort every sequence of the request, until ``release``."""
        if rid is None:
            return
        live = self._live(self.groups.get(rid, ())) or self.engine.rid_in_use(rid)
        if live:
            raise APIError(f"rid: {rid!r} is already in use", "rid")
        self.groups[rid] = [g.rid for g in greqs]

    def release(self, rid: str | None) -> None:
        if rid is not None:
            self.groups.pop(rid, None)

    def _live(self, rids: Any) -> bool:
        return any(self.engine.rid_in_use(r) for r in rids)

    def abort(self, rid: str) -> int:
        """Aborts the request(s) of ``rid``; how many were in flight."""
        rids = self.groups.get(rid) or [rid]
        live = set(self.engine.active_rids())
        hits = [r for r in rids if r in live]
        for r in hits:
            self.engine.abort(r, "aborted by /abort_request")
        return len(hits)

    async def stream(self, greq: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The engine's deltas for one request, timed into the latency histograms."""
        start = last = time.monotonic()
        first = True
        try:
            async with aclosing(self.engine.stream(greq)) as deltas:
                async for out in deltas:
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
        except EngineStopped as e:  # shut down, or stopped on a device error
            raise APIError(str(e), None, 503, "server_error") from None
        except ValueError as e:  # submission: a rid taken since build() checked it
            raise from_value_error(e) from None

    async def stream_all(
        self, greqs: list[GenerateRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The deltas of several requests as they come, tagged with their index.
        A request that failed in the engine ends them all with its error (an
        ``APIError``: 400 for its own bad input, 500 for an internal error),
        after its last delta. Leaving early (a client that disconnected, or
        that error) aborts every request still running."""
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, greq: GenerateRequest) -> None:
            try:
                async for out in self.stream(greq):
                    await merged.put((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the reader, never left unretrieved
                await merged.put(e)
                return
            await merged.put(None)

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(greqs)]
        try:
            running = len(tasks)
            while running:
                item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
                    failed = _failure(item[1])
                    if failed is not None:
                        raise failed
        finally:
            for t in tasks:
                t.cancel()  # a request still running is aborted (Engine.stream)

    @asynccontextmanager
    async def streaming(
        self, group: str | None, greqs: list[GenerateRequest]
    ) -> AsyncIterator[AsyncIterator[tuple[int, RequestOutput]]]:
        """``stream_all`` for a streamed answer (see ``event_stream`` for its
        errors); the group of ``claim`` is released at the end."""
        try:
            async with aclosing(self.stream_all(greqs)) as items:
                yield items
        finally:
            self.release(group)

    def event_stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        """A server-sent-event response that never breaks off mid-stream: an
        error after the 200 is sent as an OpenAI error event, then ``[DONE]``."""

        async def guarded() -> AsyncIterator[str]:
            try:
                async with aclosing(events) as it:
                    async for event in it:
                        yield event
            except APIError as e:
                yield sse(error_body(e.message, e.type, e.param, e.status))
                yield sse("[DONE]")
            except Exception as e:
                logger.exception("a streamed response failed")
                yield sse(error_body(f"internal error: {e!r}", "server_error", None, 500))
                yield sse("[DONE]")

        return StreamingResponse(guarded(), media_type="text/event-stream")

    async def collect(self, greqs: list[GenerateRequest], request: Request) -> list[RequestOutput]:
        """Runs requests to completion; aborts them all if the client goes away.
        A request that failed in the engine fails the whole answer."""
        cols = [ResultCollector() for _ in greqs]

        async def run() -> None:
            async with aclosing(self.stream_all(greqs)) as deltas:
                async for i, out in deltas:
                    cols[i].add(out)

        work = asyncio.create_task(run())
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                logger.info("client disconnected; aborting %d request(s)", len(greqs))
                raise APIError("client disconnected", status=499)
            work.result()
            return [c.as_output(g.rid) for c, g in zip(cols, greqs)]
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # disconnect or our own cancellation: abort the requests


def _failure(out: RequestOutput) -> APIError | None:
    reason = out.finish_reason
    if not out.finished or reason is None or reason.status is None:
        return None
    kind = "invalid_request_error" if reason.status < 500 else "server_error"
    return APIError(reason.message or "the request failed", None, reason.status, kind)


def _reader(stats: Callable[[], dict[str, Any]], key: str) -> Callable[[], Any]:
    return lambda: stats()[key]


def _per_position(stats: Callable[[], dict[str, Any]], key: str) -> Callable[[], dict]:
    """A list of counts read as ``{position: count}``."""
    return lambda: dict(enumerate(stats()[key]))


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
