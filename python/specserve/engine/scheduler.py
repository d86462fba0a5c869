"""Continuous batching with chunked prefill and recompute preemption.

Each step every running request gets its share: a decoding request feeds its
last token, a request still prefilling (or recomputing after preemption)
feeds a chunk of at most ``chunked_prefill_size`` prompt tokens across the
batch. Waiting requests join while slots, prefill budget and KV pages last.
When a running request needs a page and none is free, the newest running
request is preempted: its pages are freed and it returns to the front of the
queue with its generated tokens, to be recomputed later. No request is lost.

A model may keep further cache groups (``entry_pools``: DeepSeek-V4's
compressed entries, one slot per ``rate`` positions), allocated, trimmed and
freed together with the main pages; and with ``retain`` set, only the last
``retain`` positions before a step's first new token are ever read again, so
the main pages behind them go back to the pool (a sliding window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from specserve.cache.block_pool import BlockPool, release_behind
from specserve.config import SchedulerConfig
from specserve.core import BatchEntry, FinishReason, Req, ReqStatus, ReqStep, ScheduledBatch


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        lookahead: int = 0,
        on_release: Callable[[Req], None] | None = None,
        capture_layer_ids: tuple[int, ...] = (),
        entry_pools: Sequence[tuple[BlockPool, int]] = (),
        retain: int | None = None,
        context_pages: Callable[[Req, int, int], list[int]] | None = None,
    ) -> None:
        self.config = config
        self.block_pool = block_pool
        self.entry_pools = tuple(entry_pools)  # (pool, positions per slot)
        self.retain = retain
        # Speculation (lookahead > 0): a decoding request with drafts steps as
        # a verify chain, its drafts scheduled as tokens after the anchor.
        self.lookahead = lookahead
        self.on_release = on_release  # drops per-request state kept elsewhere (drafts)
        self.capture_layer_ids = capture_layer_ids  # target layers every forward captures
        # A drafter's pages for a request's positions [0, end), the context
        # K/V of [start, end) stored by the forward (``Proposer.context_pages``).
        self.context_pages = context_pages
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def max_drafts(self, req: Req) -> int:
        """Drafts a round may verify for ``req``: never past its token limit."""
        left = req.sampling.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(self.lookahead, left))

    def next_load(self) -> tuple[int, int]:
        """What the next step will likely hold, for the cost model: its
        requests (the running ones) and their tokens other than one per
        decoding request (the prefill chunks, within the step's budget)."""
        live = [r for r in self.running if not r.finished]
        pending = sum(n for r in live if (n := r.seq_len - r.num_computed) > 1)
        return len(live), min(pending, self.config.chunked_prefill_size)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid:
                return req
        for req in self.waiting:
            if req.rid == rid:
                return req
        return None

    def abort(self, rid: str, reason: FinishReason | None = None) -> Req | None:
        """Finishes ``rid`` (with ``reason``, by default a plain ``abort``) and
        frees what it held; None if unknown."""
        req = self.find(rid)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        req.finish(reason or FinishReason("abort"))
        return req

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.chunked_prefill_size
        planned: list[tuple[Req, int]] = []
        preempted = False
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                continue  # preempted earlier in this loop
            self._slide(req)
            pending = req.seq_len - req.num_computed
            n = pending if pending == 1 else min(pending, budget)
            if n == 0:
                continue
            room = n + len(req.spec_token_ids) if pending == 1 else n
            if not self._reserve(req, room):
                preempted = True
                continue
            if pending > 1:
                budget -= n
            planned.append((req, n))
        # Admitting right after a preemption would only thrash the pool.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running_requests
        ):
            req = self.waiting[0]
            n = min(req.seq_len - req.num_computed, budget)
            if not self._allocate(req, req.num_computed + n):
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            budget -= n
            planned.append((req, n))
        if not planned:
            return None
        return self._build_batch(planned)

    def _reserve(self, req: Req, n: int) -> bool:
        """Pages for ``n`` more tokens of a running request, preempting newer
        requests (and finally ``req`` itself) until they fit."""
        while not self._allocate(req, req.num_computed + n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _allocate(self, req: Req, num_tokens: int) -> bool:
        """Pages for the first ``num_tokens`` positions in every group, or
        nothing (and False) when one group lacks them."""
        if len(req.entry_tables) < len(self.entry_pools):
            req.entry_tables = [[] for _ in self.entry_pools]
        wants = [(self.block_pool, self.block_pool.pages_for(num_tokens), req.page_table)]
        for (pool, rate), table in zip(self.entry_pools, req.entry_tables):
            wants.append((pool, pool.pages_for(num_tokens // rate), table))
        if any(n - len(table) > pool.free_pages() for pool, n, table in wants):
            return False
        for pool, n, table in wants:
            if n > len(table):
                table.extend(pool.allocate(n - len(table)))
        return True

    def _slide(self, req: Req) -> None:
        """Returns the main pages wholly behind the last ``retain`` positions
        before the next one to compute."""
        if self.retain is not None:
            release_behind(req.page_table, req.num_computed - self.retain, self.block_pool)

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        self.block_pool.release([p for p in req.page_table if p >= 0])
        req.page_table = []
        for (pool, _), table in zip(self.entry_pools, req.entry_tables):
            pool.release(table)
        req.entry_tables = []
        req.num_computed = 0
        req.set_drafts([])
        if self.on_release is not None:
            self.on_release(req)

    def trim(self, req: Req, num_tokens: int) -> None:
        """Keeps the K/V of the first ``num_tokens`` positions only (a verify
        round's rejected drafts go) and returns the pages past them."""
        assert num_tokens <= req.num_computed
        req.num_computed = num_tokens
        keep = self.block_pool.pages_for(num_tokens)
        if keep < len(req.page_table):
            self.block_pool.release([p for p in req.page_table[keep:] if p >= 0])
            req.page_table = req.page_table[:keep]
        for i, (pool, rate) in enumerate(self.entry_pools):
            # The entries of windows the kept positions no longer close go too.
            keep = pool.pages_for(num_tokens // rate)
            pool.release(req.entry_tables[i][keep:])
            req.entry_tables[i] = req.entry_tables[i][:keep]

    def _build_batch(self, planned: list[tuple[Req, int]]) -> ScheduledBatch:
        entries: list[BatchEntry] = []
        steps: list[ReqStep] = []
        for req, n in planned:
            start, end = req.num_computed, req.num_computed + n
            # Prompt tokens scored in this chunk: q with row q - 1 in [start, end).
            q_lo = max(req.next_input_logprob, start + 1, 1)
            q_hi = min(end + 1, req.prompt_len)
            num_in = max(0, q_hi - q_lo)
            sample = end == req.seq_len and req.sampling.max_new_tokens > 0
            rows = list(range(q_lo - 1 - start, q_hi - 1 - start)) if num_in else []
            if sample:
                rows.append(n - 1)
            decoding = n == 1 and sample and num_in == 0 and bool(req.output_ids)
            tokens = req.tokens_from(start, end)
            if decoding and req.spec_token_ids:
                # A verify chain: the anchor, then the drafts proposed last step
                # (consumed here; the pages for them were reserved above). With
                # none, the step is a plain one, exactly as without speculation.
                drafts, q = req.spec_token_ids, req.spec_draft_q
                req.set_drafts([])
                chain = list(range(1 + len(drafts)))
                fed = tokens + drafts
                entries.append(
                    BatchEntry(
                        fed,
                        start,
                        req.page_table,
                        chain,
                        req.entry_tables,
                        self._draft_pages(req, start, start + len(fed)),
                    )
                )
                steps.append(ReqStep(req, q_lo, 0, True, drafts, q, verify=True, decoding=True))
                continue
            entries.append(
                BatchEntry(
                    tokens,
                    start,
                    req.page_table,
                    rows,
                    req.entry_tables,
                    self._draft_pages(req, start, end),
                )
            )
            steps.append(ReqStep(req, q_lo, num_in, sample, decoding=decoding))
        return ScheduledBatch(entries, steps, self.capture_layer_ids)

    def _draft_pages(self, req: Req, start: int, end: int) -> list[int]:
        return [] if self.context_pages is None else self.context_pages(req, start, end)

    def reap_finished(self) -> list[Req]:
        """Drops finished requests from the running set and frees their pages."""
        done = [req for req in self.running if req.finished]
        for req in done:
            self.running.remove(req)
            self._release(req)
        return done
