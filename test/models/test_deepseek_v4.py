"""DeepSeek-V4 on the paged engine against transformers' ``DeepseekV4ForCausalLM``.

The oracle breaks the indexer's top-k ties toward the earlier entry, as we
do: with few index heads, ReLU scores of exactly 0 tie often, and a top-k
over ties is unspecified (transformers' own one-forward and cached paths pick
differently; see docs/models.md). The perturbation is far below any real
score gap, so it changes nothing but the order of exact ties.
"""

from __future__ import annotations

import pytest
import torch

from models_zoo import hf_sequence_logprobs, random_prompts
from specserve import Engine
from specserve.cache.block_pool import cache_groups
from specserve.layers.compressed_attention import bytes_per_page
from specserve.tools.tiny_model import make_tiny_model

TOL = 1e-4
PAGE = 4


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    # Window 8, CSA rate 4 (top-2 of its entries), HCA rate 16: 200 tokens
    # cross the window 25 times and close 50 CSA and 12 HCA windows.
    return make_tiny_model(
        str(tmp_path_factory.mktemp("v4") / "v4"), arch="deepseek_v4", num_layers=5
    )


@pytest.fixture(scope="module")
def reference(v4_path):
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf_v4
    from transformers import AutoModelForCausalLM

    scorer = hf_v4.DeepseekV4IndexerScorer
    original = scorer.forward

    def earlier_entry_wins(self, q, keys, hidden):
        scores = original(self, q, keys, hidden)
        return scores - torch.arange(scores.shape[-1], dtype=scores.dtype) * 1e-30

    scorer.forward = earlier_entry_wins
    try:
        yield AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32).eval()
    finally:
        scorer.forward = original


def engine(path: str, **kw) -> Engine:
    args = dict(dtype="float32", page_size=PAGE, max_running_requests=4, chunked_prefill_size=64)
    return Engine(model_path=path, **{**args, **kw})


def run(eng: Engine, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and the logprob of every token after the first."""
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    got = []
    for out in outs:
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
        got.append((out["output_ids"], [x[0] for x in entries]))
    return got


def check(reference, prompt: list[int], ids: list[int], logprobs: list[float]) -> None:
    """Our greedy ids are the reference's argmax after every prefix, and our
    logprobs its logprobs of the same sequence (one forward)."""
    seq = prompt + ids
    want, logp = hf_sequence_logprobs(reference, seq)
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < TOL
    argmax = logp[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    # The reference's own greedy choice, where it is not a near-tie.
    top2 = logp[len(prompt) - 1 : -1].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-4).tolist()
    assert all(a == b for a, b, c in zip(ids, argmax, clear) if c)


def test_prefill_chunked_decode_and_ragged_batch(v4_path, reference) -> None:
    """A ragged batch (prompts of 1 to 57 tokens, decoding 200 tokens, so past
    the window and many compression windows of both rates) in 16-token chunks."""
    prompts = random_prompts(4, [1, 13, 40, 57], seed=3)
    eng = engine(v4_path, chunked_prefill_size=16)
    for prompt, (ids, lps) in zip(prompts, run(eng, prompts, 200)):
        assert len(ids) == 200
        check(reference, prompt, ids, lps)


@pytest.mark.parametrize("chunk", range(1, 41))
def test_every_split_of_a_40_token_prompt(v4_path, reference, chunk) -> None:
    """Chunked prefill may split a window (of the window, CSA or HCA) anywhere."""
    prompt = random_prompts(1, [40], seed=5)[0]
    eng = engine(v4_path, chunked_prefill_size=chunk)
    ((ids, lps),) = run(eng, [prompt], 3)
    check(reference, prompt, ids, lps)


def test_preemption_and_recompute(v4_path, reference) -> None:
    """Pools too small for every request: some are preempted and recomputed."""
    prompts = random_prompts(4, [30, 45], seed=7)
    eng = engine(v4_path, max_total_tokens=260)
    results = run(eng, prompts, 70)
    assert eng.core.scheduler.num_preemptions > 0
    for prompt, (ids, lps) in zip(prompts, results):
        check(reference, prompt, ids, lps)


def test_ngram_speculation_equals_plain(v4_path) -> None:
    """Rejected drafts trim the compressed state too (windows they closed
    are un-emitted): NGRAM output is plain output, ids and logprobs."""
    base = random_prompts(3, [6, 9, 11], seed=11)
    prompts = [p * 5 for p in base]  # repetitive: NGRAM drafts, some rejected
    plain = run(engine(v4_path), prompts, 90)
    spec_eng = engine(v4_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    spec = run(spec_eng, prompts, 90)
    stats = spec_eng.core.spec.stats
    assert stats.rounds > 0 and stats.accept_length < 5  # drafts were both kept and rejected
    for (a_ids, a_lps), (b_ids, b_lps) in zip(plain, spec):
        assert a_ids == b_ids
        assert max(abs(x - y) for x, y in zip(a_lps, b_lps)) < 1e-5


def test_window_pages_are_freed_and_pools_match_accounting(v4_path) -> None:
    eng = engine(v4_path)
    runner, core = eng.runner, eng.core
    window_pages = core.block_pool.total_pages()
    used = []
    schedule = core.scheduler.schedule

    def watch():
        batch = schedule()
        used.append(window_pages - core.block_pool.free_pages())
        return batch

    core.scheduler.schedule = watch
    run(eng, random_prompts(1, [20], seed=1), 240)
    retain = cache_groups(runner.model_config)[0].retain
    # After the prompt's step: the retained positions, the step's own token,
    # and a partial page at each end.
    assert max(used[1:]) <= -(-(retain + 1) // PAGE) + 1
    assert core.block_pool.free_pages() == window_pages
    assert all(pool.free_pages() == pool.total_pages() for pool, _ in core.entry_pools)
    # Every pool tensor is what the budget paid for, group by group.
    pool = runner.kv_pool
    mc = runner.model_config
    v4 = mc.deepseek_v4
    group0 = pool.window + [t for pair in pool.sources.values() for t in pair]
    group0 += [t for pair in pool.index_sources.values() for t in pair]
    paid = bytes_per_page(mc, PAGE, torch.float32)
    assert sum(t.nbytes for t in group0) == runner.group_pages[0] * paid[0]
    for g, kind in enumerate(v4.compressed_kinds, start=1):
        layers = [i for i, k in enumerate(v4.layer_types) if k == kind]
        tensors = [pool.entries[i] for i in layers] + [
            pool.index_keys[i] for i in layers if i in pool.index_keys
        ]
        assert sum(t.nbytes for t in tensors) == runner.group_pages[g] * paid[g]
