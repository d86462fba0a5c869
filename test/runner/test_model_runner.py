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
    assert r.num_pages == 12 and r.kv_pool.k[0].shape[0] == 96


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
