"""DeepSeek-V4 on the paged engine against transformers' ``DeepseekV4ForCausalLM``.

The oracle breaks the indexer's top-k ties toward the earlier entry, as we
do: with few index heads, ReLU scores of exactly 0 tie often, and a top-k
over ties is unspecified (transformers' own one-forward and cached paths pick
differently; see docs/models.md). The perturbation is far below any real
score gap, so it changes nothing but the order of exact ties.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from models_zoo import check_greedy, earlier_entry_wins, fp8_v4_copy, greedy_runs, random_prompts
from specserve import Engine
from specserve.cache.block_pool import cache_groups
from specserve.config import ModelConfig
from specserve.layers.compressed_attention import bytes_per_page
from specserve.models.deepseek_v4_config import CSA, HCA, SLIDING
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
    from transformers import AutoModelForCausalLM

    with earlier_entry_wins():
        yield AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32).eval()


def engine(path: str, **kw) -> Engine:
    args = dict(dtype="float32", page_size=PAGE, max_running_requests=4, chunked_prefill_size=64)
    return Engine(model_path=path, **{**args, **kw})


def test_prefill_chunked_decode_and_ragged_batch(v4_path, reference) -> None:
    """A ragged batch (prompts of 1 to 57 tokens, decoding 200 tokens, so past
    the window and many compression windows of both rates) in 16-token chunks."""
    prompts = random_prompts(4, [1, 13, 40, 57], seed=3)
    eng = engine(v4_path, chunked_prefill_size=16)
    for prompt, (ids, lps) in zip(prompts, greedy_runs(eng, prompts, 200)):
        assert len(ids) == 200
        check_greedy(reference, prompt, ids, lps, TOL)


@pytest.mark.parametrize("chunk", range(1, 41))
def test_every_split_of_a_40_token_prompt(v4_path, reference, chunk) -> None:
    """Chunked prefill may split a window (of the window, CSA or HCA) anywhere."""
    prompt = random_prompts(1, [40], seed=5)[0]
    eng = engine(v4_path, chunked_prefill_size=chunk)
    ((ids, lps),) = greedy_runs(eng, [prompt], 3)
    check_greedy(reference, prompt, ids, lps, TOL)


def test_sharded_checkpoint(v4_path, reference, tmp_path) -> None:
    """The same weights (same seed) in several safetensors files."""
    sharded = make_tiny_model(
        str(tmp_path / "sharded"), arch="deepseek_v4", num_layers=5, max_shard_size="60KB"
    )
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    prompt = random_prompts(1, [21], seed=2)[0]
    ((ids, lps),) = greedy_runs(engine(sharded), [prompt], 30)
    check_greedy(reference, prompt, ids, lps, TOL)


def test_queries_in_chunks_attend_as_in_one(v4_path, reference) -> None:
    """A prefill's queries gathered a few rows at a time (as a long prompt's
    are, under the gather budget) give the same result."""
    eng = engine(v4_path)
    eng.runner.attn_backend.budget = 300  # a handful of query rows per gather
    prompt = random_prompts(1, [50], seed=19)[0]
    ((ids, lps),) = greedy_runs(eng, [prompt], 12)
    check_greedy(reference, prompt, ids, lps, TOL)


def test_preemption_and_recompute(v4_path, reference) -> None:
    """Pools too small for every request: some are preempted and recomputed."""
    prompts = random_prompts(4, [30, 45], seed=7)
    eng = engine(v4_path, max_total_tokens=260)
    results = greedy_runs(eng, prompts, 70)
    assert eng.core.scheduler.num_preemptions > 0
    for prompt, (ids, lps) in zip(prompts, results):
        check_greedy(reference, prompt, ids, lps, TOL)


def test_a_tiny_budget_still_serves_long_requests(v4_path, reference) -> None:
    """``max_total_tokens`` below one prefill chunk: the window group still
    holds one request's step, so a long prompt runs (to the entry pools'
    capacity) instead of waiting forever."""
    eng = engine(v4_path, max_total_tokens=16)
    prompt = random_prompts(1, [60], seed=17)[0]
    assert eng.core.capacity_tokens >= 75
    ((ids, lps),) = greedy_runs(eng, [prompt], 15)
    check_greedy(reference, prompt, ids, lps, TOL)


def test_ngram_speculation_equals_plain(v4_path) -> None:
    """Rejected drafts trim the compressed state too (windows they closed
    are un-emitted): NGRAM output is plain output, ids and logprobs."""
    base = random_prompts(3, [6, 9, 11], seed=11)
    prompts = [p * 5 for p in base]  # repetitive: NGRAM drafts, some rejected
    plain = greedy_runs(engine(v4_path), prompts, 90)
    spec_eng = engine(v4_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    trimmed: list[range] = []  # the positions each trim dropped
    trim = spec_eng.core.scheduler.trim

    def watch(req, num_tokens):
        trimmed.append(range(num_tokens, req.num_computed))
        trim(req, num_tokens)

    spec_eng.core.scheduler.trim = watch
    spec = greedy_runs(spec_eng, prompts, 90)
    stats = spec_eng.core.spec.stats
    assert stats.rounds > 0 and stats.accept_length < 5  # drafts were both kept and rejected
    # Some rejected drafts had closed a CSA window and an HCA window (rates 4, 16).
    for rate in (4, 16):
        assert any((p + 1) % rate == 0 for r in trimmed for p in r)
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
    greedy_runs(eng, random_prompts(1, [20], seed=1), 240)
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


def test_fp8_block_scaled_v4_serves_like_its_dequantised_source(v4_path, tmp_path) -> None:
    """DeepSeek's projections FP8 block-scaled (experts included): served
    within fp8 rounding of the source, and exactly like transformers on the
    dequantised weights."""
    from transformers import AutoModelForCausalLM

    state = load_file(os.path.join(v4_path, "model.safetensors"))
    fp8, plain = str(tmp_path / "fp8"), str(tmp_path / "dequantised")
    dequantised = fp8_v4_copy(v4_path, fp8, plain)

    eng = engine(fp8)
    w = dict(eng.runner.model.named_parameters())["layers.1.attn.wq_b.weight"]
    src = state["model.layers.1.attn.wq_b.weight"]
    assert torch.equal(w, dequantised["model.layers.1.attn.wq_b.weight"])
    assert ((w - src).abs() <= src.abs() / 16 + 1e-6).all() and not torch.equal(w, src)
    ref = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    prompt = random_prompts(1, [37], seed=9)[0]
    ((ids, lps),) = greedy_runs(eng, [prompt], 20)
    with earlier_entry_wins():
        check_greedy(ref, prompt, ids, lps, TOL)


def test_legacy_deepseek_config_fields() -> None:
    """DeepSeek's own config spelling reads as transformers' does (its
    ``compress_ratios`` run past the layers: the tail is the MTP layers')."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "compress_ratios": [128, 128, 4, 0, 4, 0], "num_hash_layers": 1, "qk_rope_head_dim": 4,
        "o_groups": 2, "rope_scaling": {"type": "yarn", "factor": 16,
                                        "original_max_position_embeddings": 65536},
    }  # fmt: skip
    v4 = ModelConfig.from_dict(cfg).deepseek_v4
    assert v4.layer_types == (HCA, HCA, CSA, SLIDING)
    assert v4.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert v4.rope_head_dim == 4 and v4.main_rope.rope_type == "default"
    assert v4.compress_rope.rope_type == "yarn" and v4.compress_rope.theta == 160000.0
    assert v4.compress_rope.get("attention_factor") == 1.0  # cos/sin not rescaled
    assert v4.retain == 127  # an HCA window of 128 positions


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must list"),
        ({"compress_ratios": [0, 8], "layer_types": None}, r"compress_ratios has \[8\]"),
        ({"scoring_func": "tanh"}, "scoring_func 'tanh' is not supported"),
        ({"compress_rates": {"heavily_compressed_attention": 4}}, "compress_rates must be"),
        ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
        ({"o_groups": 3}, r"o_groups \(3\) must divide"),
        ({"moe_intermediate_size": None}, "missing required field 'moe_intermediate_size'"),
    ],
)
def test_bad_configs_are_named(change, match) -> None:
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "layer_types": ["sliding_attention", "compressed_sparse_attention"], "o_groups": 2,
    }  # fmt: skip
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(cfg)


def test_what_v4_does_not_serve_yet_is_named(v4_path) -> None:
    with pytest.raises(ValueError, match="attention_backend: triton has no kernel"):
        engine(v4_path, attention_backend="triton")
    with pytest.raises(ValueError, match="enable_torch_compile: not supported"):
        engine(v4_path, enable_torch_compile=True)


@pytest.mark.gpu
def test_cuda_equals_cpu(request) -> None:
    """The same engine on CUDA (float32: ids and logprobs as on the CPU; bf16:
    it runs, finite), on the torch path V4 takes on every device."""
    pytest.importorskip("transformers")
    path = request.getfixturevalue("v4_path")
    prompts = random_prompts(4, [7, 30, 41], seed=13)
    cpu = greedy_runs(engine(path), prompts, 64)
    cuda = greedy_runs(engine(path, device="cuda", grammar_backend="none"), prompts, 64)
    for prompt, (a_ids, a_lps), (b_ids, b_lps) in zip(prompts, cpu, cuda):
        n = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y), len(a_ids))
        assert n >= 8  # a near-tie may flip a later token; the prefix agrees
        m = len(prompt) - 1 + n  # logprobs of the prompt and the common prefix
        assert max(abs(x - y) for x, y in zip(a_lps[:m], b_lps[:m])) < 1e-3
    bf16 = greedy_runs(
        engine(path, device="cuda", dtype="bfloat16", grammar_backend="none"), prompts, 64
    )
    assert all(len(ids) == 64 and all(map(math.isfinite, lps)) for ids, lps in bf16)
