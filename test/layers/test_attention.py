"""The torch paged-attention backend against a dense per-request reference,
in float32 and bfloat16: decode rows, verify chains over a cached prefix and
prefill chunks in one batch, with GQA; and masks in the queries' dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.cache.kv_pool import KVPool
from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend, _LonePlan

H, HKV, D, PS = 4, 2, 8, 4


def dense_reference(q, keys, values, kv_len):
    """Queries ``[q_len, H, D]`` at the last q_len positions, causal, GQA."""
    q_len = q.shape[0]
    rep = H // HKV
    k = keys[:kv_len].repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, D]
    v = values[:kv_len].repeat_interleave(rep, dim=1).transpose(0, 1)
    qpos = torch.arange(kv_len - q_len, kv_len)
    mask = torch.arange(kv_len)[None, :] <= qpos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.float(), v.float(), mask)
    return o.transpose(0, 1)


BATCHES = {
    # (cached prefix, new tokens): two decodes, a verify chain, a prefill chunk
    # over a prefix and a fresh prefill.
    "mixed": [(9, 1), (2, 1), (6, 5), (5, 20), (0, 7)],
    "chains-only": [(9, 5), (3, 5), (12, 5)],  # the whole batch as views
    "ragged-chains": [(9, 5), (3, 2), (12, 8)],  # padded to the longest
    # One request: its pages in one ascending run are read as a view of the pool.
    "lone-decode": [(9, 1)],
    "lone-chain": [(9, 5)],
    "lone-chunk": [(5, 20)],
    "lone-prefill": [(0, 7)],
}


@pytest.mark.parametrize("stale", ["zeros", "nan"], ids=["clean-pool", "nan-pool"])
@pytest.mark.parametrize("in_order", [False, True], ids=["pages-reversed", "pages-in-order"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_batch_matches_dense_attention(dtype, batch, in_order, stale) -> None:
    """``nan-pool``: every slot no request of the batch wrote holds NaN (what a
    request whose model went NaN leaves in its freed pages, or in pages it
    still holds). The padding pages (page 0) and the tails of last pages are
    among them: no output may see them."""
    g = torch.Generator().manual_seed(0)
    shapes = BATCHES[batch]
    pool = KVPool(1, 64, PS, HKV, D, dtype, "cpu")
    if stale == "nan":
        pool.k[0].fill_(float("nan"))
        pool.v[0].fill_(float("nan"))
    backend = TorchAttentionBackend(pool)
    tables, page = [], 0
    full_k, full_v = [], []
    for prefix, n in shapes:
        pages = -(-(prefix + n) // PS)
        run = list(range(page + 1, page + 1 + pages))
        tables.append(run if in_order else run[::-1])
        page += pages
        full_k.append(torch.randn(prefix + n, HKV, D, generator=g).to(dtype))
        full_v.append(torch.randn(prefix + n, HKV, D, generator=g).to(dtype))
    # The cached prefixes are already in the pool.
    for (prefix, _), table, k, v in zip(shapes, tables, full_k, full_v):
        if prefix:
            slots = torch.tensor([table[p // PS] * PS + p % PS for p in range(prefix)])
            pool.store(0, slots, k[:prefix], v[:prefix])
    positions, slots = [], []
    for (prefix, n), table in zip(shapes, tables):
        pos = range(prefix, prefix + n)
        positions.extend(pos)
        slots.extend(table[p // PS] * PS + p % PS for p in pos)
    meta = AttentionMetadata(
        torch.tensor(positions),
        torch.tensor(slots),
        [n for _, n in shapes],
        [p + n for p, n in shapes],
        tables,
        PS,
    )
    backend.prepare(meta)
    plan = meta.plan
    lone = isinstance(plan, _LonePlan)
    assert lone == batch.startswith("lone")
    biases = [plan.bias] if lone else [plan.single_bias, plan.chain_bias]
    for bias in biases:  # masks in the queries' dtype
        assert bias is None or (bias.dtype == dtype and bias.device.type == "cpu")
    if not lone:
        assert plan.chain_whole == (batch in ("chains-only", "lone-chain"))
    q = torch.randn(len(positions), H, D, generator=g).to(dtype)
    new_k = torch.cat([k[p:] for (p, _), k in zip(shapes, full_k)])
    new_v = torch.cat([v[p:] for (p, _), v in zip(shapes, full_v)])
    out = backend.forward(0, q, new_k, new_v, meta)
    assert out.dtype == dtype
    row = 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for (prefix, n), k, v in zip(shapes, full_k, full_v):
        ref = dense_reference(q[row : row + n], k, v, prefix + n)
        torch.testing.assert_close(out[row : row + n].float(), ref, atol=tol, rtol=0)
        row += n


def lone_forward(table, prefix, q, k, v, causal):
    """One request on the pages ``table``: its first ``prefix`` keys and values
    cached, the rest ``q``'s; its plan and the attention output."""
    n = q.shape[0]
    pool = KVPool(1, 16, PS, HKV, D, k.dtype, "cpu")
    slots = torch.tensor([table[p // PS] * PS + p % PS for p in range(prefix + n)])
    pool.store(0, slots[:prefix], k[:prefix], v[:prefix])
    meta = AttentionMetadata(
        torch.arange(prefix, prefix + n), slots[prefix:], [n], [prefix + n], [table], PS,
        causal=causal,
    )  # fmt: skip
    backend = TorchAttentionBackend(pool)
    backend.prepare(meta)
    return meta.plan, backend.forward(0, q, k[prefix:], v[prefix:], meta)


@pytest.mark.parametrize("in_order", [False, True], ids=["pages-reversed", "pages-in-order"])
@pytest.mark.parametrize(("prefix", "n"), [(9, 4), (0, 4), (6, 1)], ids=["block", "fresh", "one"])
def test_lone_non_causal_block_sees_every_key(prefix, n, in_order) -> None:
    """A lone drafter block (non-causal): every query attends to all of its
    request's keys, on the view path (pages in order) and the gathered one."""
    g = torch.Generator().manual_seed(1)
    pages = -(-(prefix + n) // PS)
    table = list(range(2, 2 + pages))
    table = table if in_order else table[::-1]
    k = torch.randn(prefix + n, HKV, D, generator=g)
    v = torch.randn(prefix + n, HKV, D, generator=g)
    q = torch.randn(n, H, D, generator=g)
    plan, out = lone_forward(table, prefix, q, k, v, causal=False)
    assert isinstance(plan, _LonePlan)
    rep = H // HKV
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "block"])
@pytest.mark.parametrize("batch", [b for b in BATCHES if b.startswith("lone")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_lone_request_reads_the_same_whatever_its_pages(dtype, batch, causal) -> None:
    """The same request on pages in one run (a view of the pool), reversed or
    shuffled (gathered): bit for bit the same output, so a request's
    logprobs do not depend on which pages the pool handed it."""
    ((prefix, n),) = BATCHES[batch]
    g = torch.Generator().manual_seed(3)
    pages = -(-(prefix + n) // PS)
    k = torch.randn(prefix + n, HKV, D, generator=g).to(dtype)
    v = torch.randn(prefix + n, HKV, D, generator=g).to(dtype)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    run = list(range(3, 3 + pages))
    shuffled = [run[i] for i in torch.randperm(pages, generator=g).tolist()]
    outs = []
    for table in (run, run[::-1], shuffled):
        plan, out = lone_forward(table, prefix, q, k, v, causal)
        assert isinstance(plan, _LonePlan) and (plan.pages is None) == (table == run)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize(
    "spec", [None, "NGRAM", "DSPARK"], ids=["plain", "ngram-verify", "dspark-blocks"]
)
def test_engine_on_the_triton_backend_equals_the_torch_backend(spec, tmp_path) -> None:
    """Prefill chunks, decode rows and verify chains (and DSpark's non-causal
    draft blocks over the draft pool) through the paged kernel (the
    interpreter here): the same tokens and logprobs as the SDPA backend."""
    from models_zoo import model_path, random_prompts
    from specserve import Engine
    from specserve.kernels.dispatch import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    # The repeated pattern gives the n-gram proposer drafts: real verify chains.
    prompts = [*random_prompts(3, [5, 21, 9], seed=71), [5, 6, 7, 8] * 4]
    kw = {"speculative_algorithm": spec} if spec else {}
    if spec == "DSPARK":
        from specserve.tools.tiny_model import make_tiny_dspark

        kw["speculative_draft_model_path"] = make_tiny_dspark(
            str(tmp_path / "d"), model_path("qwen3"), num_layers=2
        )
    results = {}
    for backend in ("torch_native", "triton"):
        eng = Engine(
            model_path=model_path("qwen3"),
            device="cpu",
            page_size=4,
            max_total_tokens=512,
            chunked_prefill_size=16,
            attention_backend=backend,
            **kw,
        )
        try:
            want = "Triton" if backend == "triton" else "Torch"
            assert type(eng.runner.attn_backend).__name__.startswith(want)
            if spec == "DSPARK":
                assert type(eng.proposer.attn_backend).__name__.startswith(want)
            drafted: list[int] = []
            if spec:
                propose = eng.proposer.propose

                def counting(reqs, limits, propose=propose, drafted=drafted):
                    out = propose(reqs, limits)
                    drafted.extend(len(t) for t in out.tokens)
                    return out

                eng.proposer.propose = counting
            results[backend] = eng.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
                return_logprob=True,
                logprob_start_len=0,
            )
        finally:
            eng.shutdown()
        assert not spec or max(drafted) > 1  # chains of several drafts were verified
    for a, b in zip(results["torch_native"], results["triton"]):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la = [x[0] for x in a["meta_info"][key] if x[0] is not None]
            lb = [x[0] for x in b["meta_info"][key] if x[0] is not None]
            assert la == pytest.approx(lb, abs=1e-4)
