"""The engine front: validates requests, runs the core on its own thread, and
hands results back to blocking callers and asyncio streams alike."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from specserve.config import EngineConfig
from specserve.engine.engine_core import EngineCore, RequestOutput
from specserve.engine.request import Req
from specserve.engine.request_factory import GenerateRequest, Limits, RequestFactory
from specserve.engine.result import ResultCollector, format_output
from specserve.runner.model_runner import ModelRunner
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


class Engine:
    """Offline and async entry point: ``Engine(model_path=..., **engine_args)``.

    Engine arguments use SGLang's names (``max_total_tokens``, ``page_size``,
    ``chunked_prefill_size``, ``max_running_requests``, ``logprobs_mode``, ...).
    """

    def __init__(self, model_path: str | None = None, **engine_args: Any) -> None:
        if model_path is None:
            raise ValueError("model_path is required")
        self.config = EngineConfig.from_kwargs(model_path, **engine_args)
        self.tokenizer = Tokenizer(self.config.tokenizer_path or model_path)
        self.runner = ModelRunner(self.config)
        self.core = EngineCore(self.config, self.runner, self.tokenizer)
        self.requests = RequestFactory(
            self.tokenizer,
            Limits(
                vocab_size=self.runner.vocab_size,
                context_length=self.runner.context_length,
                capacity_tokens=self.core.capacity_tokens,
                max_top_logprobs=self.config.max_top_logprobs,
            ),
        )
        mc = self.runner.model_config
        self.eos_ids = frozenset(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()
        logger.info(
            "engine ready: %s (%s) on %s, %s, KV capacity %d tokens, loaded in %.1fs",
            model_path,
            mc.architecture,
            self.runner.device,
            self.runner.dtype,
            self.core.capacity_tokens,
            self.runner.load_seconds,
        )

    # ---- introspection ------------------------------------------------------

    def free_pages(self) -> int:
        return self.core.block_pool.free_pages()

    def total_pages(self) -> int:
        return self.core.block_pool.total_pages()

    def num_active_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    # ---- submission ---------------------------------------------------------

    def submit(self, greq: GenerateRequest, sink: Sink) -> None:
        """Queues a validated request; ``sink`` receives its deltas on the engine thread."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the engine has been shut down")
            if greq.rid in self._sinks:
                raise ValueError(f"rid: {greq.rid!r} is already in use")
            self._sinks[greq.rid] = sink
        self._inbox.put(
            ("add", Req(greq.rid, greq.input_ids, greq.sampling, greq.logprob, self.eos_ids))
        )

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    # ---- blocking API -------------------------------------------------------

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        """One result dict per prompt (a list when the input is a list).

        Keyword arguments: ``input_ids``, ``return_logprob``, ``logprob_start_len``,
        ``top_logprobs_num``, ``token_ids_logprob``, ``return_text_in_logprobs``, ``rid``.
        """
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        collectors = [ResultCollector() for _ in greqs]
        for greq, col in zip(greqs, collectors):
            self.submit(greq, col.add)
        for col in collectors:
            col.done.wait()
        results = [self.format(g, c.as_output(g.rid)) for g, c in zip(greqs, collectors)]
        return results if batched else results[0]

    def format(self, greq: GenerateRequest, out: RequestOutput) -> dict[str, Any]:
        return format_output(greq, out, self.tokenizer.token_text)

    # ---- async API ----------------------------------------------------------

    async def async_generate(
        self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any
    ) -> Any:
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        results = await asyncio.gather(*(self._collect(g) for g in greqs))
        return list(results) if batched else results[0]

    async def _collect(self, greq: GenerateRequest) -> dict[str, Any]:
        col = ResultCollector()
        async for out in self.stream(greq):
            col.add(out)
        return self.format(greq, col.as_output(greq.rid))

    async def generate_stream(
        self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Streams one prompt: each dict holds the new ``text`` / ``output_ids`` and
        a ``meta_info`` with running counts, the finish reason and the new logprobs."""
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        if batched:
            raise ValueError("generate_stream takes a single prompt")
        async for out in self.stream(greqs[0]):
            yield self.format(greqs[0], out)

    async def stream(self, greq: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Deltas of one validated request; aborts it if the consumer stops early."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            # Raises RuntimeError once the consumer's loop is closed; _deliver
            # then aborts the request.
            loop.call_soon_threadsafe(deltas.put_nowait, out)

        self.submit(greq, sink)
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(greq.rid)

    # ---- the engine thread ----------------------------------------------------

    def _loop(self) -> None:
        while True:
            # Block only when there is nothing to compute.
            wait = None if self.core.has_work() else 0.05
            try:
                cmd = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._deliver(self._abort_all("the engine was shut down"))
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.core.has_work():
                continue
            try:
                outputs = self.core.step()
            except Exception as e:  # a bug must not take the engine thread down
                logger.exception("engine step failed; aborting the affected requests")
                outputs = self._abort_all(f"internal error: {type(e).__name__}: {e}")
            self._deliver(outputs)

    def _handle(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            self.core.add(arg)
        elif kind == "abort":
            out = self.core.abort(arg)
            if out is not None:
                self._deliver([out])

    def _abort_all(self, message: str) -> list[RequestOutput]:
        sched = self.core.scheduler
        rids = [r.rid for r in [*sched.running, *sched.waiting]]
        return [o for rid in rids if (o := self.core.abort(rid, message)) is not None]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                sink = self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:  # nobody is listening any more: stop computing for it
                logger.debug("dropping request %s: its consumer is gone", out.rid, exc_info=True)
                if not out.finished:
                    with self._lock:
                        self._sinks.pop(out.rid, None)
                    self.core.abort(out.rid, "consumer went away")

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=60)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
