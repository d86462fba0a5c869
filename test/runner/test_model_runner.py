"""KV capacity: from max_total_tokens, or from a memory fraction."""

from __future__ import annotations

import os

import pytest

from models_zoo import model_path
from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.runner.model_runner import ModelRunner


def runner(**kw) -> ModelRunner:
    return ModelRunner(EngineConfig.from_kwargs(model_path("qwen3"), device="cpu", **kw))


def test_capacity_from_max_total_tokens() -> None:
    r = runner(max_total_tokens=100, page_size=8)
    # 12 pages for requests and a scratch page (captured steps' padding).
    assert r.num_pages == 12 and r.kv_pool.k[0].shape[0] == 104


def test_capacity_from_memory_fraction() -> None:
    # Plenty of RAM for this model: capped at every running request at full context.
    r = runner(max_running_requests=3, context_length=50, page_size=16)
    assert r.num_pages == 10  # ceil(3 * 50 / 16)
    # A tiny fraction of RAM decides instead.
    mc = r.model_config
    per_page = KVPool.bytes_per_page(
        mc.num_hidden_layers, 16, mc.num_key_value_heads, mc.head_dim, r.dtype
    )
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fraction = 3 * per_page / available
    small = runner(mem_fraction_static=fraction, context_length=4096, page_size=16)
    assert 1 <= small.num_pages <= 4  # about 3 pages (free RAM moves a little)


def test_bad_cache_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="page_size"):
        runner(page_size=0)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        runner(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="unknown engine argument 'bogus'"):
        runner(bogus=1)


def test_cuda_budget_is_sglangs_static_share_of_the_whole_device() -> None:
    from specserve.runner.model_runner import cuda_kv_budget

    gib = 2**30
    # 100 GiB device, 40 in use (weights, context): 0.9 x 100 - 40 = 50 for KV,
    # unless the activation reserve does not fit beside it.
    assert cuda_kv_budget(100 * gib, 60 * gib, 0.9, 5 * gib) == 50 * gib
    assert cuda_kv_budget(100 * gib, 60 * gib, 0.9, 20 * gib) == 40 * gib
    assert cuda_kv_budget(100 * gib, 60 * gib, 0.3, 0) == 0  # weights exceed the share


def test_activation_reserve_grows_with_what_one_step_can_carry() -> None:
    from specserve.config import ModelConfig
    from specserve.runner.model_runner import activation_bytes

    mc = ModelConfig.from_path(model_path("qwen3"))

    def reserve(**kw) -> int:
        return activation_bytes(EngineConfig.from_kwargs(model_path("qwen3"), **kw), mc, 4096)

    assert reserve(max_running_requests=64) > reserve(max_running_requests=8)
    assert reserve(chunked_prefill_size=8192) > reserve(chunked_prefill_size=512)
    assert reserve(attention_backend="torch_native") > reserve(attention_backend="triton")


def test_every_model_is_loaded_before_the_kv_pools_are_sized(tmp_path, monkeypatch) -> None:
    from specserve import Engine
    from specserve.speculative import drafter_loader as dspark
    from specserve.tools.tiny_model import make_tiny_dspark

    drafter = make_tiny_dspark(str(tmp_path / "d"), model_path("qwen3"))
    events: list[str] = []
    load, size = dspark.load_draft_model, ModelRunner._kv_capacity_pages
    monkeypatch.setattr(
        dspark, "load_draft_model", lambda *a, **k: (events.append("drafter"), load(*a, **k))[1]
    )
    monkeypatch.setattr(
        ModelRunner,
        "_kv_capacity_pages",
        lambda self, *a: (events.append("size"), size(self, *a))[1],
    )
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
    )
    eng.shutdown()
    assert events == ["drafter", "size"]


def test_verify_profile_forward_takes_the_chain_path() -> None:
    """The budget scheduler's timing forward is shaped like a real verify round:
    chains over a cached prefix (the chain attention path), not fresh prefills."""
    r = runner(max_total_tokens=64, page_size=4)
    metas = []
    prepare = r.attn_backend.prepare
    r.attn_backend.prepare = lambda meta: (metas.append(meta), prepare(meta))[1]
    r.verify_forward(num_tokens=13, chain=5, prefix=40)  # more pages than the pool: they wrap
    (meta,) = metas
    assert meta.q_lens == [5, 5, 3] and meta.kv_lens == [45, 45, 43]
    assert meta.plan.chain_index is not None and not meta.plan.multi
