"""The engine front: validates requests, runs the core on its own thread, and
hands results back to blocking callers and asyncio streams alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.core import FinishReason, Req
from specserve.distributed import SINGLE, DistributedError, RankGroup
from specserve.distributed.launcher import WorkerRanks
from specserve.engine.engine_core import EngineCore, RequestOutput, is_fatal
from specserve.engine.request_factory import GenerateRequest, Limits, RequestFactory
from specserve.engine.result import ResultCollector, format_output
from specserve.grammar.base import GrammarBackend
from specserve.runner.cuda_graph_runner import Capture
from specserve.runner.model_runner import ModelRunner
from specserve.runner.tp_worker import start_workers
from specserve.speculative.base import Proposer
from specserve.speculative.factory import build_proposer, load_drafter
from specserve.speculative.planner import build_planner
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current while the core steps: Triton kernels (and
    anything else that uses the current device) launch on ``cuda:N``, not on
    ``cuda:0``, from whichever thread drives the engine."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class EngineStopped(RuntimeError):
    """The engine takes no requests: it was shut down, or stopped on an error."""


class Engine:
    """Offline and async entry point: ``Engine(model_path=..., **engine_args)``.

    Engine arguments use SGLang's names (``max_total_tokens``, ``page_size``,
    ``chunked_prefill_size``, ``max_running_requests``, ``logprobs_mode``, ...).
    """

    def __init__(
        self, model_path: str | None = None, proposer: Proposer | None = None, **engine_args: Any
    ) -> None:
        """``proposer``: a custom draft proposer (instead of ``speculative_algorithm``)."""
        if model_path is None or not os.path.isdir(model_path):
            raise ValueError(f"model_path: {model_path!r} is not a directory")
        self.config = EngineConfig.from_kwargs(model_path, **engine_args)
        if self.config.parallel.dp_size > 1:
            raise ValueError(
                "dp_size: an Engine is one replica; DataParallelEngine runs dp_size of them"
            )
        self.tokenizer = Tokenizer(self.config.tokenizer_path or model_path)
        # Tensor parallelism: this process is rank 0; the others start first.
        self.ranks: WorkerRanks | None = None
        group = SINGLE
        if self.config.parallel.tp_size > 1:
            group, self.ranks = start_workers(self.config)
        try:
            self._build(proposer, group)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        mc = self.runner.model_config
        self.eos_ids = frozenset(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self._grammar: GrammarBackend | None = None
        self._grammar_from: Engine | None = None  # share_grammar's
        self._grammar_lock = threading.Lock()
        self.requests = RequestFactory(
            self.tokenizer,
            Limits(
                vocab_size=self.runner.vocab_size,
                context_length=self.runner.context_length,
                capacity_tokens=self.core.capacity_tokens,
                max_top_logprobs=self.config.max_top_logprobs,
                request=self.config.limits,
            ),
            self.grammar_backend,
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        # Health probes in flight (``probing``): not the clients' requests.
        self._probes: set[str] = set()
        self._lock = threading.Lock()  # guards _sinks, _probes, _thread, _stopped
        self._core_lock = threading.RLock()  # held by whoever steps the core
        self._stopped = False
        self._stopping = threading.Event()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first async caller
        # Set when the engine stopped on an error no request caused (a device
        # error, a scheduler bug): every request ends and no new one is taken.
        self.error: str | None = None
        if self.ranks is not None:  # a lost worker rank stops the engine, even idle
            self.ranks.on_loss(self._rank_lost)
        # Kernels compile on their first launch: on CUDA, and for compiled layers.
        compiles = self.runner.device.type == "cuda" or self.config.enable_torch_compile
        if compiles and not self.config.skip_server_warmup:
            self.warm_up()
        per_kind = f" ({self.runner.describe_kv()})" if mc.deepseek_v4 is not None else ""
        logger.info(
            "engine ready: %s (%s) on %s, %s, KV capacity %d tokens%s, loaded in %.1fs",
            model_path,
            mc.architecture,
            self.runner.device,
            self.runner.dtype,
            self.core.capacity_tokens,
            per_kind,
            self.runner.load_seconds,
        )

    def _build(self, proposer: Proposer | None, group: RankGroup) -> None:
        """The runner (this rank's shard), the proposer and the core."""
        # Every model loads before the KV pools are sized: all their weights,
        # and the largest step's activations, come off the memory budget.
        self.runner = ModelRunner(self.config, allocate_kv=False, group=group)
        drafter = load_drafter(self.config, self.runner) if proposer is None else None
        self.runner.allocate_kv(
            drafter.kv_bytes_per_page if drafter is not None else 0,
            drafter.activation_bytes if drafter is not None else 0,
        )
        self.proposer = proposer or build_proposer(self.config, self.runner, drafter)
        self.capture_graphs()
        planner = None
        if self.proposer is not None:  # profiled over the forwards as they will run
            planner = build_planner(self.config, self.runner, self.proposer)
        self.core = EngineCore(self.config, self.runner, self.tokenizer, self.proposer, planner)

    def _rank_lost(self, why: str) -> None:
        """A worker rank exited (from the launcher's watch thread): the engine
        stops on it at its next pump, even when idle."""
        self._inbox.put(("fail", DistributedError(why)))
        self._wakeup.set()

    def capture_graphs(self, capture: Capture | None = None) -> bool:
        """Captures the target's DECODE / VERIFY forwards and the proposer's
        block forward: CUDA graphs where ``ModelRunner.graphs_apply`` says
        so. ``capture``: another capture (tests replay eagerly on the CPU).
        Returns whether anything was captured."""
        p = self.proposer
        chain = p.max_drafts + 1 if p is not None else 1
        with device_scope(self.runner.device):
            try:
                if not self.runner.capture_graphs(chain, p.capture_layer_ids if p else (), capture):
                    return False
                if p is not None:
                    p.capture_graphs(self.runner)
            except Exception as e:
                # Serving eagerly beats not serving; the log says why.
                if capture is not None or is_fatal(e):
                    raise
                logger.warning("CUDA graph capture failed (%r): every step runs eagerly", e)
                self.runner.graphs = None
                return False
        return True

    def warm_up(self) -> None:
        """Runs tiny requests through every kind of step (prefill chunks of
        several widths, decode, verify; greedy and sampled; logprobs with and
        without top-k and token ids), so Triton compiles its kernels now and
        not on a user's first request. The counters start from zero after."""
        start = time.perf_counter()
        lim = self.requests.limits
        lengths = [
            n for n in (1, 7, 33, 100) if n + 4 <= min(lim.context_length, lim.capacity_tokens)
        ]
        prompts = [[i % lim.vocab_size for i in range(n)] for n in lengths]
        for sp, top in (
            ({"temperature": 0}, 0),
            ({"temperature": 0.8, "top_p": 0.9, "top_k": 20}, 5),
            ({"temperature": 0, "repetition_penalty": 1.1}, lim.max_top_logprobs),
        ):
            self.generate(
                input_ids=prompts,
                sampling_params={**sp, "max_new_tokens": 4, "ignore_eos": True},
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=min(top, lim.max_top_logprobs),
                token_ids_logprob=[0, 1] if top else None,
            )
        self.core.reset_stats()
        logger.info("warm-up: kernels compiled in %.1fs", time.perf_counter() - start)

    # ---- introspection ------------------------------------------------------

    def free_pages(self) -> int:
        """Free KV pages, over every cache group (DeepSeek-V4's entry pools too)
        and the drafter's own pool."""
        return sum(pool.free_pages() for pool in self.core.pools)

    def total_pages(self) -> int:
        return sum(pool.total_pages() for pool in self.core.pools)

    def num_active_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    def grammar_backend(self) -> GrammarBackend | None:
        """The grammar backend, built on first use (None when disabled)."""
        if self.config.grammar_backend == "none":
            return None
        if self._grammar_from is not None:
            return self._grammar_from.grammar_backend()
        with self._grammar_lock:
            if self._stopped:  # shutdown closed it; no worker may start after
                raise EngineStopped("the engine has been shut down")
            if self._grammar is None:
                try:
                    from specserve.grammar.xgrammar_backend import XGrammarBackend
                except ImportError:
                    raise ValueError("grammar_backend: xgrammar is not installed") from None
                self._grammar = XGrammarBackend(
                    self.tokenizer.hf,
                    self.runner.vocab_size,
                    sorted(self.eos_ids),
                    self.config.grammar_compile_timeout,
                    self.config.grammar_compile_max_memory,
                )
            return self._grammar

    def share_grammar(self, other: Engine) -> None:
        """Compiles grammars with ``other``'s backend (one compile pool for
        data-parallel replicas of one model)."""
        self._grammar_from = other

    # ---- submission ---------------------------------------------------------

    def submit(self, greq: GenerateRequest, sink: Sink) -> None:
        """Queues a validated request; ``sink`` receives its deltas on the engine thread."""
        self._ensure_loop()
        self._enqueue(greq, sink)

    def check_new_rids(self, greqs: list[GenerateRequest]) -> None:
        """Raises ValueError if a request id is already in flight."""
        with self._lock:
            taken = [g.rid for g in greqs if g.rid in self._sinks]
        if taken:
            raise ValueError(f"rid: {taken[0]!r} is already in use")

    def rid_in_use(self, rid: str) -> bool:
        with self._lock:
            return rid in self._sinks

    def _enqueue(self, greq: GenerateRequest, sink: Sink) -> None:
        with self._lock:
            self._check_running()
            if greq.rid in self._sinks:
                raise ValueError(f"rid: {greq.rid!r} is already in use")
            self._sinks[greq.rid] = sink
        req = Req(greq.rid, greq.input_ids, greq.sampling, greq.logprob, self.eos_ids)
        if greq.grammar is not None:
            backend = self.grammar_backend()
            assert backend is not None, "a compiled grammar implies a backend"
            req.grammar = backend.matcher(greq.grammar)
        self._inbox.put(("add", req))
        self._wakeup.set()

    def abort(self, rid: str, message: str | None = None) -> None:
        """Aborts a queued or running request; a no-op for unknown or finished ones."""
        self._inbox.put(("abort", (rid, FinishReason("abort", message=message))))
        self._wakeup.set()

    def abort_all(self, message: str | None = None) -> int:
        """Aborts every queued and running request but health probes; returns
        how many there were (``active_rids``)."""
        count = len(self.active_rids())
        self._inbox.put(("abort_all", FinishReason("abort", message=message)))
        self._wakeup.set()
        return count

    def active_rids(self) -> list[str]:
        """The requests in flight, health probes left out."""
        with self._lock:
            return [rid for rid in self._sinks if rid not in self._probes]

    @contextlib.contextmanager
    def probing(self, rid: str) -> Iterator[None]:
        """Marks ``rid`` as a health probe while the block runs (submit it
        inside): ``abort_all`` and ``active_rids`` leave it out. Shutting down,
        or stopping on an error, still ends it."""
        with self._lock:
            self._probes.add(rid)
        try:
            yield
        finally:
            with self._lock:
                self._probes.discard(rid)

    def _check_running(self) -> None:
        """Raises unless the engine takes requests (call with ``_lock`` held)."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped after an error: {self.error}")
        if self._stopped:
            raise EngineStopped("the engine has been shut down")

    # ---- blocking API -------------------------------------------------------

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        """One result dict per prompt (a list when the input is a list).

        Keyword arguments: ``input_ids``, ``return_logprob``, ``logprob_start_len``,
        ``top_logprobs_num``, ``token_ids_logprob``, ``return_text_in_logprobs``, ``rid``,
        ``n`` (samples per prompt: a list of results, prompt by prompt).
        """
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        collectors = [ResultCollector() for _ in greqs]
        for greq, col in zip(greqs, collectors):
            self._enqueue(greq, col.add)
        for col in collectors:
            while not col.done.is_set():
                if self._thread is not None:
                    col.done.wait(0.05)
                else:
                    self._pump()
        results = [self.format(g, c.as_output(g.rid)) for g, c in zip(greqs, collectors)]
        return results if batched or len(results) > 1 else results[0]  # n > 1: a list

    def format(self, greq: GenerateRequest, out: RequestOutput) -> dict[str, Any]:
        return format_output(greq, out, self.tokenizer.token_text)

    # ---- async API ----------------------------------------------------------

    async def async_generate(
        self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any
    ) -> Any:
        greqs, batched = self.requests.build(prompt, sampling_params, **kwargs)
        results = await asyncio.gather(*(self._collect(g) for g in greqs))
        return list(results) if batched or len(results) > 1 else results[0]

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
        if len(greqs) > 1:
            raise ValueError("generate_stream takes a single prompt (and n = 1)")
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
                logger.debug("request %s: its consumer stopped early; aborting it", greq.rid)
                self.abort(greq.rid)

    # ---- driving the core ------------------------------------------------------

    def _pump(self) -> None:
        """Takes in queued commands, runs one step if there is work, delivers.

        Whoever drives the core holds ``_core_lock``: the background thread
        once async callers exist, otherwise the blocking callers themselves.
        Blocking callers step inline because torch's CPU thread pool serves
        the main thread noticeably faster than any other thread.
        """
        with self._core_lock, device_scope(self.runner.device):
            try:
                self._pump_commands_only()
                if not self.core.has_work():
                    return
                outputs = self.core.step()  # a request's failure stays with it
            except Exception as e:  # the device, or the engine itself, is broken
                self._stop_on_error(e)
                return
            self._deliver(outputs)

    def _stop_on_error(self, error: Exception) -> None:
        """Ends every request and refuses new ones: after a device error (or a
        bug outside any request's part of a step) nothing can be trusted. A
        server reports unhealthy and exits non-zero."""
        logger.critical("the engine stopped: %s", error, exc_info=error)
        with self._lock:
            self.error = f"{type(error).__name__}: {error}"
        self._stopping.set()
        message = f"the engine stopped after an error: {self.error}"
        reason = FinishReason("abort", message=message, status=500)
        with self._core_lock:
            try:
                self._deliver(self._abort_all(reason))
            except Exception:
                logger.exception("could not end the requests in flight")
            # Whatever is left (still in the inbox, or the core is beyond use)
            # ends here: no caller may wait forever.
            with self._lock:
                left = list(self._sinks)
            self._deliver([RequestOutput.final(rid, reason) for rid in left])

    def start_loop(self) -> None:
        """Drives the engine from a background thread of its own (at once,
        not at the first async caller)."""
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        with self._lock:
            self._check_running()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="specserve-engine", daemon=True
                )
                self._thread.start()

    def claim_loop(self) -> None:
        """Makes the calling thread the one that will drive the engine (through
        ``run_loop``), so that no background thread is started meanwhile."""
        with self._lock:
            if self._thread is not None and self._thread is not threading.current_thread():
                raise RuntimeError("the engine is already being driven by another thread")
            self._thread = threading.current_thread()

    def run_loop(self, stop: threading.Event, log_interval: float = 0.0) -> None:
        """Drives the engine from the calling thread until ``stop`` is set.

        A server claims the loop on its main thread (torch's CPU thread pool is
        fastest there) before it starts serving HTTP from another thread; with
        ``log_interval`` > 0 a status line is logged that often under traffic.
        """
        self.claim_loop()
        self._loop(stop, log_interval)

    def _loop(self, stop: threading.Event | None = None, log_interval: float = 0.0) -> None:
        last_log, last_tokens = time.monotonic(), self.core.stats.generated_tokens
        while not self._stopping.is_set() and not (stop is not None and stop.is_set()):
            try:
                if log_interval > 0 and time.monotonic() - last_log >= log_interval:
                    last_log, last_tokens = self._log_status(last_log, last_tokens)
                if not self.core.has_work() and self._inbox.empty():
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                self._pump()
            except Exception as e:  # never a silent death: callers would wait forever
                self._stop_on_error(e)

    def _log_status(self, since: float, tokens_then: int) -> tuple[float, int]:
        now, st = time.monotonic(), self.stats()
        tokens = st["generated_tokens"]
        if tokens != tokens_then or st["running"] or st["queued"]:
            logger.info(
                "running %d, queued %d, KV usage %.1f%%, generation %.1f tok/s",
                st["running"],
                st["queued"],
                100 * st["kv_usage"],
                (tokens - tokens_then) / max(now - since, 1e-9),
            )
        return now, tokens

    def stats(self) -> dict[str, Any]:
        """A snapshot of load and counters (safe to call from any thread)."""
        sched = self.core.scheduler
        total, free = self.total_pages(), self.free_pages()
        st = self.core.stats
        spec = self.core.spec
        # Per draft position: the rounds that verified it, that accepted it.
        verified, accepted = spec.stats.per_position() if spec else ([], [])
        return {
            "running": len(sched.running),
            "queued": len(sched.waiting),
            "total_pages": total,
            "free_pages": free,
            "kv_usage": (total - free) / total,
            "prompt_tokens": st.prompt_tokens,
            "generated_tokens": st.generated_tokens,
            "preemptions": sched.num_preemptions,
            "finished": dict(st.finished),
            "grammar_matchers": sum(
                r.grammar is not None for r in [*sched.running, *sched.waiting]
            ),
            "spec_accept_length": spec.stats.accept_length if spec else None,
            "spec_verified_per_position": verified,
            "spec_accepted_per_position": accepted,
            "spec_verify_rounds": spec.stats.rounds if spec else 0,
            **(spec.planner.metrics() if spec and spec.planner else {}),
        }

    def _handle(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            out = self.core.add(arg)  # a finished delta if it could not be admitted
        elif kind == "abort":
            out = self.core.abort(*arg)
        elif kind == "fail":  # a lost rank: nothing can be computed any more
            if not self._stopping.is_set():
                raise arg
            return
        else:  # abort_all
            self._deliver(self._abort_all(arg, spare_probes=True))
            return
        if out is not None:
            self._deliver([out])

    def _abort_all(self, reason: FinishReason, spare_probes: bool = False) -> list[RequestOutput]:
        sched = self.core.scheduler
        with self._lock:
            spared = set(self._probes) if spare_probes else set()
        rids = [r.rid for r in [*sched.running, *sched.waiting] if r.rid not in spared]
        return [o for rid in rids if (o := self.core.abort(rid, reason)) is not None]

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
                    self.core.abort(out.rid, FinishReason("abort", message="consumer went away"))

    def shutdown(self) -> None:
        """Stops the engine; requests still in flight finish with ``abort``."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        self._stopping.set()
        self._wakeup.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        with self._core_lock:
            self._pump_commands_only()
            self._deliver(
                self._abort_all(FinishReason("abort", message="the engine was shut down"))
            )
        with self._grammar_lock:
            if self._grammar is not None:
                self._grammar.close()  # its compile workers
        if self.ranks is not None:
            # A healthy group stops on a plan; a broken one is terminated.
            stop = self.runner.plans.send if self.error is None else None
            self.ranks.close(stop)

    def _pump_commands_only(self) -> None:
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
