"""End to end through the offline Engine: greedy output, logprobs and
re-scoring against transformers, seeded sampling, preemption, aborts."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from models_zoo import hf_greedy, hf_logits, model_path, random_prompts
from specserve import Engine, SamplingParams

TOL = 1e-4


def make_engine(name: str = "qwen3", **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 4096)
    return Engine(model_path=model_path(name), device="cpu", **kw)


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(chunked_prefill_size=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def processed_engine():
    eng = make_engine(logprobs_mode="processed")
    yield eng
    eng.shutdown()


def wait_idle(eng: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while eng.num_active_requests() or eng.free_pages() != eng.total_pages():
        assert time.monotonic() < deadline, "engine did not release everything"
        time.sleep(0.01)


GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.mark.parametrize("name", ["qwen3", "llama-sharded"])
def test_greedy_batch_equals_hf_generate(name: str) -> None:
    eng = make_engine(name, chunked_prefill_size=16)
    try:
        prompts = random_prompts(5, [3, 30, 9, 17, 1], seed=11)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        for p, o in zip(prompts, outs):
            assert o["output_ids"] == hf_greedy(name, p, 12)
            assert o["meta_info"]["prompt_tokens"] == len(p)
            assert o["meta_info"]["completion_tokens"] == len(o["output_ids"])
        wait_idle(eng)
    finally:
        eng.shutdown()


def check_entry(entry, logprobs: torch.Tensor, token: int, k: int, ids) -> None:
    """One (logprob, top, ids) entry against a log-softmax row of the oracle."""
    assert entry[0] == pytest.approx(float(logprobs[token]), abs=TOL)


def test_output_and_input_logprobs_equal_hf_log_softmax(engine: Engine) -> None:
    prompts = random_prompts(3, [21, 8, 13], seed=12)
    ragged_ids = [[5, 9, 300], None, [7]]
    starts = [0, 4, 12]  # from the start, mid-prompt, the last prompt position
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=starts,
        top_logprobs_num=[5, 0, 1],
        token_ids_logprob=ragged_ids,
    )
    for p, o, start, ids, k in zip(prompts, outs, starts, ragged_ids, [5, 0, 1]):
        meta = o["meta_info"]
        seq = p + o["output_ids"]
        ref = torch.log_softmax(hf_logits("qwen3", seq), dim=-1)  # row t scores token t+1
        # Input: positions start..P-1; the first prompt position has no logprob.
        inp = meta["input_token_logprobs"]
        assert len(inp) == len(p) - start
        for j, (lp, tid, text) in enumerate(inp):
            pos = start + j
            assert tid == p[pos] and text is None
            if pos == 0:
                assert lp is None
            else:
                assert lp == pytest.approx(float(ref[pos - 1, tid]), abs=TOL)
        out = meta["output_token_logprobs"]
        assert len(out) == meta["completion_tokens"] == len(o["output_ids"])
        for j, (lp, tid, _) in enumerate(out):
            row = ref[len(p) - 1 + j]
            assert tid == o["output_ids"][j]
            assert lp == pytest.approx(float(row[tid]), abs=TOL)
        if k:
            tops = meta["output_top_logprobs"]
            assert len(tops) == len(out)
            for j, top in enumerate(tops):
                row = ref[len(p) - 1 + j]
                vals, idx = row.topk(k)
                assert [t[0] for t in top] == pytest.approx(vals.tolist(), abs=TOL)
                assert [t[1] for t in top] == idx.tolist()
                # Greedy: the top-1 entry is the sampled token, with the same number.
                assert top[0][1] == out[j][1] and top[0][0] == out[j][0]
            in_tops = meta["input_top_logprobs"]
            assert len(in_tops) == len(inp)
            for j, top in enumerate(in_tops):
                pos = start + j
                if pos == 0:
                    assert top is None
                    continue
                vals, idx = ref[pos - 1].topk(k)
                assert [t[1] for t in top] == idx.tolist()
        else:
            assert meta["output_top_logprobs"] is None
        if ids is None:
            assert meta["output_token_ids_logprobs"] is None
        else:
            for j, entry in enumerate(meta["output_token_ids_logprobs"]):
                row = ref[len(p) - 1 + j]
                assert [t[1] for t in entry] == ids
                assert [t[0] for t in entry] == pytest.approx(row[ids].tolist(), abs=TOL)
            for j, entry in enumerate(meta["input_token_ids_logprobs"]):
                pos = start + j
                if pos > 0:
                    assert [t[0] for t in entry] == pytest.approx(
                        ref[pos - 1, ids].tolist(), abs=TOL
                    )


def test_decode_logprobs_equal_prefill_rescoring(engine: Engine) -> None:
    prompts = random_prompts(2, [10, 25], seed=13)
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 10, "temperature": 0.8, "seed": 3},
        return_logprob=True,
        top_logprobs_num=3,
    )
    for p, o in zip(prompts, outs):
        seq = p + o["output_ids"]
        rescored = engine.generate(
            input_ids=seq,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=len(p),
            top_logprobs_num=3,
        )
        assert (
            rescored["output_ids"] == []
            and rescored["meta_info"]["finish_reason"]["type"] == "length"
        )
        dec = o["meta_info"]["output_token_logprobs"]
        res = rescored["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in res] == o["output_ids"]
        assert [t[0] for t in res] == pytest.approx([t[0] for t in dec], abs=TOL)
        dec_top = o["meta_info"]["output_top_logprobs"]
        res_top = rescored["meta_info"]["input_top_logprobs"]
        for a, b in zip(dec_top, res_top):
            assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=TOL)


def test_processed_mode_scores_the_sampled_distribution(processed_engine: Engine) -> None:
    p = random_prompts(1, [12], seed=14)[0]
    temp = 0.6
    bias = {7: 3.0, 11: -2.5}
    o = processed_engine.generate(
        input_ids=p,
        sampling_params={"max_new_tokens": 8, "temperature": temp, "seed": 5, "logit_bias": bias},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=4,
        token_ids_logprob=[7, 11],
    )
    seq = p + o["output_ids"]
    logits = hf_logits("qwen3", seq)
    logits[:, 7] += 3.0
    logits[:, 11] -= 2.5
    ref = torch.log_softmax(logits / temp, dim=-1)
    meta = o["meta_info"]
    for j, (lp, tid, _) in enumerate(meta["output_token_logprobs"]):
        assert lp == pytest.approx(float(ref[len(p) - 1 + j, tid]), abs=TOL)
        got_ids = meta["output_token_ids_logprobs"][j]
        assert [t[0] for t in got_ids] == pytest.approx(
            ref[len(p) - 1 + j, [7, 11]].tolist(), abs=TOL
        )
    for j, (lp, tid, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert lp == pytest.approx(float(ref[j - 1, tid]), abs=TOL)
    for j, top in enumerate(meta["output_top_logprobs"]):
        vals, idx = ref[len(p) - 1 + j].topk(4)
        assert [t[1] for t in top] == idx.tolist()
        assert [t[0] for t in top] == pytest.approx(vals.tolist(), abs=TOL)
    # Re-scoring the same sequence in processed mode gives the same numbers.
    res = processed_engine.generate(
        input_ids=seq,
        sampling_params={"max_new_tokens": 0, "temperature": temp, "logit_bias": bias},
        return_logprob=True,
        logprob_start_len=len(p),
    )
    assert [t[0] for t in res["meta_info"]["input_token_logprobs"]] == pytest.approx(
        [t[0] for t in meta["output_token_logprobs"]], abs=TOL
    )
    # Greedy requests score at temperature 1 in processed mode.
    g = processed_engine.generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
    ref1 = torch.log_softmax(hf_logits("qwen3", p + g["output_ids"]), dim=-1)
    for j, (lp, tid, _) in enumerate(g["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(float(ref1[len(p) - 1 + j, tid]), abs=TOL)


def test_seeded_sampling_is_independent_of_batch_composition(engine: Engine) -> None:
    p = random_prompts(1, [9], seed=15)[0]
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234}
    alone = engine.generate(input_ids=p, sampling_params=sp)
    others = random_prompts(4, [5, 33, 2, 14], seed=16)
    mixed = engine.generate(
        input_ids=[others[0], p, others[1], others[2], others[3]],
        sampling_params=[
            {"max_new_tokens": 20, "temperature": 0.7},
            sp,
            {"max_new_tokens": 3, "temperature": 0},
            {"max_new_tokens": 20, "temperature": 1.3, "seed": 9},
            {"max_new_tokens": 7, "temperature": 1.0, "repetition_penalty": 1.3},
        ],
        return_logprob=[False, True, True, False, True],
        top_logprobs_num=[0, 2, 0, 0, 5],
    )
    assert mixed[1]["output_ids"] == alone["output_ids"]
    # A different seed gives a different continuation (16 tokens over ~500 ids).
    other_seed = engine.generate(input_ids=p, sampling_params={**sp, "seed": 4321})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_preemption_keeps_every_request_and_its_output() -> None:
    prompts = random_prompts(6, [10, 14, 7, 12], seed=17)
    sp = {"temperature": 0, "max_new_tokens": 20}
    big = make_engine()
    try:
        expected = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        big.shutdown()
    # 16 pages of 4 tokens: at most two requests fit at once.
    small = make_engine(max_total_tokens=64, chunked_prefill_size=8)
    try:
        outs = small.generate(input_ids=prompts, sampling_params=sp)
        assert [o["output_ids"] for o in outs] == expected
        assert small.core.scheduler.num_preemptions > 0
        wait_idle(small)
        assert small.free_pages() == small.total_pages()
    finally:
        small.shutdown()


def test_abort_frees_pages_of_running_and_queued_requests() -> None:
    eng = make_engine(max_running_requests=1)
    try:
        p = random_prompts(2, [10], seed=18)
        sp = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}
        greqs, _ = eng.requests.build(input_ids=p, sampling_params=sp)
        from specserve.engine.result import ResultCollector

        cols = [ResultCollector() for _ in greqs]
        for g, c in zip(greqs, cols):
            eng.submit(g, c.add)
        deadline = time.monotonic() + 10
        while not cols[0].token_ids:  # the first one is running, the second queued
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert eng.free_pages() < eng.total_pages()
        for g in greqs:
            eng.abort(g.rid)
        for c in cols:
            assert c.done.wait(10)
            assert c.finish_reason.type == "abort"
        assert cols[1].token_ids == []
        wait_idle(eng)
    finally:
        eng.shutdown()


def test_a_drafters_pages_count_among_the_engines_pages(tmp_path) -> None:
    """The free and total pages the engine reports (``/get_server_info``,
    the idle checks) include the DSpark drafter's own KV pool: a draft page
    left allocated shows."""
    from specserve.tools.tiny_model import make_tiny_dspark

    target = model_path("qwen3")
    drafter = make_tiny_dspark(str(tmp_path / "dspark"), target, block_size=4)
    eng = Engine(
        model_path=target, device="cpu", max_total_tokens=512, page_size=4,
        speculative_algorithm="DSPARK", speculative_draft_model_path=drafter,
    )  # fmt: skip
    try:
        (pool,) = eng.proposer.pools
        assert eng.total_pages() == eng.core.block_pool.total_pages() + pool.total_pages()
        out = eng.generate(
            input_ids=random_prompts(1, [9], seed=3)[0],
            sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        )
        assert out["meta_info"]["spec_verify_ct"] > 0 and pool.free_pages() == pool.total_pages()
        leaked = pool.allocate(1)
        stats = eng.stats()
        assert stats["free_pages"] == stats["total_pages"] - 1 == eng.total_pages() - 1
        pool.release(leaked)
    finally:
        eng.shutdown()


def test_stop_string_across_token_boundary_and_stop_tokens(engine: Engine) -> None:
    tok = engine.tokenizer
    p = random_prompts(1, [6], seed=19)[0]
    base = engine.generate(
        input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    )
    ids = base["output_ids"]
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # Find a token boundary i where a 2+2 character window straddles it.
    for i in range(3, len(ids) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(left) >= 2 and len(right) >= len(left) + 2 and right.startswith(left):
            stop = left[-2:] + right[len(left) : len(left) + 2]
            if stop not in pieces[i]:
                break
    else:
        pytest.skip("no suitable boundary in this random continuation")
    out = engine.generate(
        input_ids=p,
        sampling_params={
            "temperature": 0,
            "max_new_tokens": 30,
            "ignore_eos": True,
            "stop": [stop],
        },
        return_logprob=True,
    )
    full = base["text"]
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Tokens up to the one that completed the stop string are kept and scored.
    n = len(out["output_ids"])
    assert (
        out["output_ids"] == ids[:n]
        and stop in tok.decode(ids[:n])
        and stop not in tok.decode(ids[: n - 1])
    )
    assert len(out["meta_info"]["output_token_logprobs"]) == n

    # A stop token id: generation ends on it, its text is not part of the output.
    stop_id = ids[5]
    out = engine.generate(
        input_ids=p,
        sampling_params={"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [stop_id]},
    )
    first = ids.index(stop_id)
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tok.decode(ids[:first])


def test_eos_min_new_tokens_and_ignore_eos(engine: Engine) -> None:
    eos = next(iter(engine.eos_ids))
    p = random_prompts(1, [5], seed=20)[0]
    sp = {"temperature": 0, "max_new_tokens": 10, "logit_bias": {eos: 100.0}}
    out = engine.generate(input_ids=p, sampling_params=sp)
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"]["type"] == "stop"
    out = engine.generate(input_ids=p, sampling_params={**sp, "min_new_tokens": 3})
    assert len(out["output_ids"]) == 4 and eos not in out["output_ids"][:3]
    out = engine.generate(input_ids=p, sampling_params={**sp, "ignore_eos": True})
    assert out["output_ids"] == [eos] * 10 and out["meta_info"]["finish_reason"] == {
        "type": "length"
    }


def test_text_prompts_and_text_in_logprobs(engine: Engine) -> None:
    out = engine.generate(
        ["def add(a, b):", "The quick brown fox"],
        SamplingParams(temperature=0, max_new_tokens=5),
        return_logprob=True,
        return_text_in_logprobs=True,
        top_logprobs_num=2,
    )
    tok = engine.tokenizer
    for o in out:
        assert o["text"] == tok.decode(o["output_ids"])
        for lp, tid, text in o["meta_info"]["output_token_logprobs"]:
            assert text == tok.token_text(tid) and math.isfinite(lp)
        for top in o["meta_info"]["output_top_logprobs"]:
            assert all(text == tok.token_text(tid) for _, tid, text in top)


def test_streaming_deltas_concatenate_to_the_blocking_result(engine: Engine) -> None:
    p = random_prompts(1, [8], seed=21)[0]
    kwargs = dict(input_ids=p, return_logprob=True, top_logprobs_num=2)
    sp = {"temperature": 0, "max_new_tokens": 15, "stop": ["zz"]}
    blocking = engine.generate(sampling_params=sp, **kwargs)

    async def collect():
        return [d async for d in engine.generate_stream(sampling_params=sp, **kwargs)]

    deltas = asyncio.run(collect())
    assert "".join(d["text"] for d in deltas) == blocking["text"]
    assert sum((d["output_ids"] for d in deltas), []) == blocking["output_ids"]
    lps = sum((d["meta_info"]["output_token_logprobs"] for d in deltas), [])
    assert lps == blocking["meta_info"]["output_token_logprobs"]
    assert deltas[-1]["meta_info"]["finish_reason"] == blocking["meta_info"]["finish_reason"]
    assert all(d["meta_info"]["finish_reason"] is None for d in deltas[:-1])


def test_async_consumer_leaving_aborts_the_request(engine: Engine) -> None:
    p = random_prompts(1, [8], seed=22)[0]

    async def leave_early():
        agen = engine.generate_stream(
            input_ids=p, sampling_params={"max_new_tokens": 2000, "ignore_eos": True}
        )
        async for _ in agen:
            break
        await agen.aclose()

    asyncio.run(leave_early())
    wait_idle(engine)


def test_concurrent_blocking_callers(engine: Engine) -> None:
    prompts = random_prompts(6, [4, 9, 15], seed=23)
    expected = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    results: list = [None] * len(prompts)

    def call(i: int) -> None:
        results[i] = engine.generate(input_ids=prompts[i], sampling_params=GREEDY)["output_ids"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sampling_params": {"temperature": -1}}, "temperature"),
        ({"sampling_params": {"top_p": 0}}, "top_p"),
        ({"sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"sampling_params": {"top_k": -2}}, "top_k"),
        ({"sampling_params": {"min_p": 2}}, "min_p"),
        ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
        ({"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
        ({"sampling_params": {"logit_bias": {"10000": 1}}}, "logit_bias"),
        ({"sampling_params": {"stop": [""]}}, "stop"),
        ({"sampling_params": {"bogus": 1}}, "bogus"),
        ({"logprob_start_len": 5}, "logprob_start_len"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"token_ids_logprob": [10**6]}, "token_ids_logprob"),
        ({"input_ids": [1, 2, 10**6]}, "input_ids"),
        ({"input_ids": []}, "prompt"),
        # Types are checked, never coerced.
        ({"input_ids": [5, True]}, "input_ids"),
        ({"input_ids": [5, [6]]}, "input_ids"),
        ({"sampling_params": {"stop": {"a": 1}}}, "stop"),
        ({"sampling_params": {"stop_token_ids": {"5": 1}}}, "stop_token_ids"),
        ({"sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
        ({"sampling_params": {"skip_special_tokens": 1}}, "skip_special_tokens"),
        ({"sampling_params": {"logit_bias": {True: 1}}}, "logit_bias"),
        ({"sampling_params": {"logit_bias": {" 5": 1}}}, "logit_bias"),
        ({"sampling_params": {"top_k": 2.0}}, "top_k"),
        ({"return_logprob": 1}, "return_logprob"),
        ({"return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
        # Ranges that torch would refuse inside a step.
        ({"sampling_params": {"seed": 2**64}}, "seed"),
        ({"sampling_params": {"seed": -(2**63) - 1}}, "seed"),
        ({"sampling_params": {"repetition_penalty": 1e-300}}, "repetition_penalty"),
        # Limits.
        ({"sampling_params": {"stop": ["s"] * 33}}, "stop"),
        ({"sampling_params": {"stop": "s" * 257}}, "stop"),
        ({"token_ids_logprob": list(range(257))}, "token_ids_logprob"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
    ],
)
def test_invalid_input_raises_value_error_naming_the_field(engine: Engine, kwargs, field) -> None:
    kwargs = {"input_ids": [5, 6, 7, 8, 9], **kwargs}
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    # The engine keeps serving.
    assert (
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["meta_info"][
            "completion_tokens"
        ]
        == 2
    )


def test_building_an_engine_leaves_the_garbage_collector_alone() -> None:
    """gc.freeze is the server's start-up business, not a library's."""
    import gc

    before = gc.get_freeze_count()
    make_engine(max_total_tokens=256).shutdown()
    assert gc.get_freeze_count() == before


def test_text_that_is_not_utf8_is_a_value_error(engine: Engine) -> None:
    lone = "a\ud800b"
    for prompt in (lone, ["ok", lone]):
        with pytest.raises(ValueError, match="prompt"):
            engine.generate(prompt, {"max_new_tokens": 1})
    with pytest.raises(ValueError, match="rid"):
        engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 1}, rid=lone)


def test_edge_values_mean_what_they_say(engine: Engine) -> None:
    """top_k past the vocabulary is no cut, a temperature too small to divide
    by is greedy, a seed over the whole 64-bit range is taken mod 2**64."""
    p = [5, 6, 7, 8]
    sp = {"max_new_tokens": 8, "ignore_eos": True, "seed": 9}

    def ids(**kw):
        return engine.generate(input_ids=p, sampling_params={**sp, **kw})["output_ids"]

    assert ids(top_k=2**70) == ids(top_k=-1)
    assert ids(temperature=1e-30) == ids(temperature=0)
    assert ids(seed=-1) == ids(seed=2**64 - 1)
    two = engine.generate(input_ids=p, sampling_params={**sp, "seed": 2**64 - 1}, n=2)
    assert [o["output_ids"] for o in two] == [ids(seed=2**64 - 1), ids(seed=0)]


def test_repetition_penalty_greedy_equals_hf_generate(engine: Engine) -> None:
    from models_zoo import hf_model

    p = random_prompts(1, [10], seed=24)[0]
    out = engine.generate(
        input_ids=p,
        sampling_params={"temperature": 0, "max_new_tokens": 16, "repetition_penalty": 1.5},
    )
    with torch.no_grad():
        ref = (
            hf_model("qwen3")
            .generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.5,
            )[0, len(p) :]
            .tolist()
        )
    assert out["output_ids"] == ref


def test_triton_kernel_backend_gives_the_same_logprobs() -> None:
    """The Triton row-logprob kernel (interpreted on the CPU) inside the engine."""
    p = random_prompts(1, [6], seed=25)[0]
    kwargs = dict(
        input_ids=p,
        sampling_params={"temperature": 0, "max_new_tokens": 3},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=3,
        token_ids_logprob=[4, 9],
    )
    results = []
    for backend in ("torch", "triton"):
        eng = make_engine(kernel_backend=backend)
        try:
            results.append(eng.generate(**kwargs))
        finally:
            eng.shutdown()
    ref, got = (r["meta_info"] for r in results)
    assert results[0]["output_ids"] == results[1]["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t[1] for t in got[key]] == [t[1] for t in ref[key]]
        assert [t[0] for t in got[key][1:]] == pytest.approx([t[0] for t in ref[key][1:]], abs=1e-5)
    for a, b in zip(got["output_top_logprobs"], ref["output_top_logprobs"]):
        assert [t[1] for t in a] == [t[1] for t in b]
        assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=1e-5)
    for a, b in zip(got["output_token_ids_logprobs"], ref["output_token_ids_logprobs"]):
        assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=1e-5)


def test_a_failing_step_aborts_its_requests_and_the_engine_keeps_serving() -> None:
    eng = make_engine()
    try:
        real = eng.runner.forward
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected fault")
            return real(batch)

        eng.runner.forward = flaky
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 5})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "injected fault" in out["meta_info"]["finish_reason"]["message"]
        wait_idle(eng)
        again = eng.generate(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 5, "ignore_eos": True}
        )
        assert again["meta_info"]["completion_tokens"] == 5
    finally:
        eng.shutdown()


def test_bfloat16_on_cpu_stays_close_to_float32() -> None:
    eng = make_engine(dtype="bfloat16")
    try:
        p = random_prompts(1, [12], seed=26)[0]
        o = eng.generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
        ref = torch.log_softmax(hf_logits("qwen3", p + o["output_ids"]), dim=-1)
        for j, (lp, tid, _) in enumerate(o["meta_info"]["output_token_logprobs"]):
            assert lp == pytest.approx(float(ref[len(p) - 1 + j, tid]), abs=0.1)
    finally:
        eng.shutdown()


def test_the_core_steps_with_the_engines_device_current() -> None:
    from specserve.engine.engine import device_scope

    assert device_scope(torch.device("cuda:1")).idx == 1  # torch.cuda.device(1)
    with device_scope(torch.device("cpu")):
        pass


@pytest.mark.gpu
def test_a_second_gpu_is_current_on_the_engine_thread() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    eng = make_engine(device="cuda:1", max_total_tokens=256)
    try:
        seen = []
        step = eng.core.step
        eng.core.step = lambda: (seen.append(torch.cuda.current_device()), step())[1]
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert seen and set(seen) == {1}
    finally:
        eng.shutdown()


def test_warm_up_runs_every_kind_of_step_and_leaves_no_trace() -> None:
    """What CUDA start-up runs to compile the kernels (here on the CPU)."""
    eng = make_engine(speculative_algorithm="NGRAM", max_total_tokens=512)
    try:
        steps: list[str] = []
        real = eng.runner.forward

        def forward(batch):
            kinds = {
                "verify" if s.verify else "decode" if s.decoding else "extend" for s in batch.steps
            }
            steps.extend(kinds)
            return real(batch)

        eng.runner.forward = forward
        eng.warm_up()
        assert {"extend", "verify"} <= set(steps)
        st = eng.stats()
        assert st["prompt_tokens"] == st["generated_tokens"] == st["spec_verify_rounds"] == 0
        assert eng.free_pages() == eng.total_pages() and eng.num_active_requests() == 0
    finally:
        eng.shutdown()
