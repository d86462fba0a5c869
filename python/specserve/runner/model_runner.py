"""Owns the target model and its KV pool; runs one forward per ScheduledBatch."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig, ModelConfig
from specserve.engine.batch import ScheduledBatch
from specserve.layers.attention import AttentionBackend, make_attention_backend
from specserve.models.loader import load_model
from specserve.runner.input_builder import build_inputs

logger = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32: the entries' logit rows, in entry order
    row_offsets: list[int]  # first logits row of each entry; len(entries) + 1 values
    # Outputs of batch.capture_layer_ids, concatenated per token: [T, m * d].
    captured: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        extra_kv_bytes_per_page: int = 0,
    ) -> None:
        """``extra_kv_bytes_per_page``: what a page costs elsewhere (a drafter's
        KV pool of the same page count), counted in the memory budget."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model_config = model_config or ModelConfig.from_path(config.model_path)
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        start = time.perf_counter()
        self.model = load_model(
            config.model_path, self.model_config, self.dtype, self.device, self.context_length
        )
        self.load_seconds = time.perf_counter() - start
        self.page_size = config.cache.page_size
        self.num_pages = self._kv_capacity_pages(extra_kv_bytes_per_page)
        mc = self.model_config
        self.kv_pool = KVPool(
            mc.num_hidden_layers,
            self.num_pages,
            self.page_size,
            mc.num_key_value_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.attn_backend: AttentionBackend = make_attention_backend(
            config.attention_backend, self.kv_pool, mc.num_attention_heads, self.device
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _kv_capacity_pages(self, extra_bytes_per_page: int) -> int:
        cache = self.config.cache
        if cache.max_total_tokens is not None:
            return cache.max_total_tokens // self.page_size
        mc = self.model_config
        per_page = extra_bytes_per_page + KVPool.bytes_per_page(
            mc.num_hidden_layers, self.page_size, mc.num_key_value_heads, mc.head_dim, self.dtype
        )
        if self.device.type == "cuda":
            # Blocks the allocator keeps cached (from loading) are free memory too.
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cache.mem_fraction_static
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = available * cache.mem_fraction_static
            # More than every running request at full context is never used.
            most = self.config.scheduler.max_running_requests * self.context_length
            budget = min(budget, -(-most // self.page_size) * per_page)
        pages = int(budget // per_page)
        if pages < 1:
            raise ValueError(
                "not enough memory for a single KV page; lower the model size or dtype"
            )
        return pages

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        inputs = build_inputs(batch, self.page_size, self.device)
        self.attn_backend.prepare(inputs.meta)
        hidden, captured = self.model(
            inputs.input_ids, inputs.meta, self.attn_backend, batch.capture_layer_ids
        )
        logits = self.model.compute_logits(hidden[inputs.logit_index])
        offsets = [0]
        for e in batch.entries:
            offsets.append(offsets[-1] + len(e.logit_rows))
        cap = torch.cat(captured, dim=-1) if captured else None
        return ForwardOutput(logits=logits, row_offsets=offsets, captured=cap)
