"""Scheduler policy without a model: chunking, admission, preemption, aborts."""

from __future__ import annotations

from specserve.cache.block_pool import BlockPool
from specserve.config import SchedulerConfig
from specserve.core import FinishReason, LogprobOptions, Req, ReqStatus
from specserve.engine.scheduler import Scheduler
from specserve.sampling.params import SamplingParams


def req(rid: str, prompt_len: int, max_new: int = 8, **logprob) -> Req:
    return Req(
        rid,
        list(range(10, 10 + prompt_len)),
        SamplingParams(max_new_tokens=max_new),
        LogprobOptions(**logprob),
    )


def step(s: Scheduler, tokens: dict[str, int] | None = None):
    """Schedules, marks computed, and appends one token to every sampling request."""
    batch = s.schedule()
    assert batch is not None
    for entry, st in zip(batch.entries, batch.steps):  # as the engine's commit does
        st.req.num_computed = entry.prefix_len + len(entry.token_ids)
    for st in batch.steps:
        if st.sample:
            st.req.output_ids.append((tokens or {}).get(st.req.rid, 1))
    return batch


def test_chunked_prefill_splits_within_budget_and_decodes_ride_along() -> None:
    s = Scheduler(SchedulerConfig(max_running_requests=8, chunked_prefill_size=6), BlockPool(64, 4))
    a, b = req("a", 3), req("b", 10)
    s.add(a)
    s.add(b)
    b1 = step(s)
    assert [len(e.token_ids) for e in b1.entries] == [3, 3]  # a whole, b's first chunk
    assert [st.sample for st in b1.steps] == [True, False]
    b2 = step(s)
    # a decodes one token outside the prefill budget; b gets the next 6.
    assert [(st.req.rid, len(e.token_ids)) for st, e in zip(b2.steps, b2.entries)] == [
        ("a", 1),
        ("b", 6),
    ]
    b3 = step(s)
    assert [len(e.token_ids) for e in b3.entries] == [1, 1]
    assert [st.sample for st in b3.steps] == [True, True]
    b4 = step(s)
    assert all(st.decoding for st in b4.steps)
    assert b4.entries[1].prefix_len == 10 and b4.entries[1].token_ids == b.output_ids[-1:]


def test_input_logprob_rows_cover_each_prompt_position_once() -> None:
    s = Scheduler(SchedulerConfig(chunked_prefill_size=4), BlockPool(64, 4))
    r = req("r", 10, return_logprob=True, logprob_start_len=0)
    s.add(r)
    scored: list[int] = []
    while not r.output_ids:
        batch = step(s)
        st, e = batch.steps[0], batch.entries[0]
        scored.extend(
            range(st.input_logprob_start, st.input_logprob_start + st.num_input_logprob_rows)
        )
        # Row of token q is its position q - 1 inside this chunk.
        rows = e.logit_rows[: st.num_input_logprob_rows]
        assert [e.prefix_len + row + 1 for row in rows] == list(
            range(st.input_logprob_start, st.input_logprob_start + len(rows))
        )
        r.next_input_logprob += st.num_input_logprob_rows + (1 if r.next_input_logprob == 0 else 0)
    assert scored == list(range(1, 10))


def test_admission_stops_at_max_running_and_when_pages_run_out() -> None:
    s = Scheduler(
        SchedulerConfig(max_running_requests=2, chunked_prefill_size=100), BlockPool(6, 4)
    )
    for i in range(4):
        s.add(req(str(i), 5))
    b = step(s)
    assert [st.req.rid for st in b.steps] == ["0", "1"]
    assert len(s.waiting) == 2 and s.block_pool.free_pages() == 2
    s2 = Scheduler(
        SchedulerConfig(max_running_requests=8, chunked_prefill_size=100), BlockPool(3, 4)
    )
    for i in range(3):
        s2.add(req(str(i), 5))
    b = step(s2)
    assert [st.req.rid for st in b.steps] == ["0"]  # the second needs 2 pages, 1 is free


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    s = Scheduler(
        SchedulerConfig(max_running_requests=8, chunked_prefill_size=100), BlockPool(4, 4)
    )
    a, b = req("a", 8, max_new=20), req("b", 8, max_new=20)
    s.add(a)
    s.add(b)
    step(s)  # a: 2 pages, b: 2 pages; both sampled their first token
    assert s.block_pool.free_pages() == 0
    batch = step(s)  # position 8 needs a third page for a: b is preempted
    assert [st.req.rid for st in batch.steps] == ["a"]
    assert (
        b.status is ReqStatus.WAITING
        and s.waiting[0] is b
        and b.num_computed == 0
        and not b.page_table
    )
    assert b.output_ids == [1] and s.num_preemptions == 1
    # Finishing a frees its pages; b is recomputed over prompt + its output and samples next.
    a.finish(FinishReason("length"))
    s.reap_finished()
    batch = step(s)
    assert batch.entries[0].token_ids == b.prompt_ids + [1] and batch.steps[0].sample
    assert len(b.output_ids) == 2


def test_a_lone_request_that_cannot_grow_preempts_itself_and_retries() -> None:
    s = Scheduler(SchedulerConfig(chunked_prefill_size=100), BlockPool(2, 4))
    a = req("a", 8)
    s.add(a)
    step(s)
    assert s.schedule() is None  # position 8 needs a third page: a goes back to the queue
    assert a.status is ReqStatus.WAITING and s.block_pool.free_pages() == 2


def test_abort_running_and_waiting_frees_pages() -> None:
    s = Scheduler(SchedulerConfig(max_running_requests=1), BlockPool(8, 4))
    a, b = req("a", 5), req("b", 5)
    s.add(a)
    s.add(b)
    step(s)
    assert s.abort("a") is a and a.finish_reason.type == "abort"
    assert s.abort("b") is b and s.abort("nope") is None
    assert s.block_pool.free_pages() == 8 and not s.has_work()


def test_drafts_are_scheduled_as_tokens_with_their_kv() -> None:
    """Drafts proposed at the end of a step are the next step's tokens after
    the anchor: pages reserved for them, every row's logits returned, consumed
    by that schedule; a preemption drops them."""
    s = Scheduler(SchedulerConfig(), BlockPool(16, 4), lookahead=4)
    r = req("r", 6)
    s.add(r)
    step(s)  # the prompt; its first token sampled
    r.set_drafts([7, 8, 9])
    b = s.schedule()
    (entry,), (st,) = b.entries, b.steps
    assert entry.token_ids == [r.output_ids[-1], 7, 8, 9] and entry.prefix_len == 6
    assert entry.logit_rows == [0, 1, 2, 3] and st.verify and st.drafts == [7, 8, 9]
    assert len(r.page_table) * 4 >= 6 + 4  # room for the anchor and its drafts
    assert r.spec_token_ids == []  # consumed
    # Without drafts a decoding step is a plain one: the anchor, sampled.
    r.num_computed = 7
    r.output_ids.append(5)
    b = s.schedule()
    assert b.entries[0].token_ids == [5] and not b.steps[0].verify and b.steps[0].drafts == []
    assert b.steps[0].decoding and b.steps[0].sample
    r.num_computed = 8
    r.output_ids.append(6)
    r.set_drafts([1, 2])
    s._preempt(r)
    assert r.spec_token_ids == [] and r.page_table == []
