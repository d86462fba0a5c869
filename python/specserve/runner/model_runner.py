"""Owns the target model and its KV pool; runs one forward per ScheduledBatch."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.cache.block_pool import CacheGroup, cache_groups
from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig, ModelConfig
from specserve.core import BatchEntry, ScheduledBatch, ScoreRows
from specserve.distributed import SINGLE, DistributedError, RankGroup
from specserve.distributed.plan import PlanChannel
from specserve.kernels.logprobs import RowLogprobs
from specserve.layers.attention import (
    AttentionBackend,
    TritonAttentionBackend,
    make_attention_backend,
)
from specserve.layers.compressed_attention import (
    GATHER_BUDGET,
    CompressedAttentionBackend,
    CompressedPool,
    bytes_per_page,
    describe_kv,
)
from specserve.layers.linear import cpu_matmul_path
from specserve.layers.parallel import HeadSplit
from specserve.models.loader import load_model
from specserve.runner.cuda_graph_runner import Capture, CudaGraphRunner, cuda_graph_capture
from specserve.runner.input_builder import build_inputs
from specserve.sampling.vocab_parallel import score_on_shards

logger = logging.getLogger(__name__)


class DraftContext(Protocol):
    """A drafter whose context K/V every rank stores in the target's forward
    (``speculative.draft_shard.DraftShard``)."""

    def store_context(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None: ...

    def serve(self, values: list[int]) -> None:
        """A worker: runs a drafter plan of rank 0's."""


@dataclass
class ForwardOutput:
    # [R, V] float32: the entries' logit rows, in entry order (None on the
    # worker ranks of a tensor-parallel group: rank 0 samples).
    logits: torch.Tensor | None
    row_offsets: list[int]  # first logits row of each entry; len(entries) + 1 values
    # Outputs of batch.capture_layer_ids, concatenated per token: [T, m * d].
    captured: torch.Tensor | None = None
    # The forward's ``ScoreRows``, decided and scored on the shards (their
    # rows of ``logits`` are left unset: they never left the shards): the
    # greedy token and the peak of each ``argmax`` row ([A] int64, [A]
    # float32), the logprobs of the scored rows.
    argmax: tuple[torch.Tensor, torch.Tensor] | None = None
    scores: RowLogprobs | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        extra_kv_bytes_per_page: int = 0,
        allocate_kv: bool = True,
        group: RankGroup = SINGLE,
    ) -> None:
        """``extra_kv_bytes_per_page``: what a page costs elsewhere (a drafter's
        KV pool of the same page count), counted in the memory budget. With
        ``allocate_kv`` False only the model loads; ``allocate_kv()`` sizes
        the pool later, once every other model is loaded too. ``group``:
        the tensor-parallel group this runner is one rank of (its shard of
        the model, its heads' KV); rank 0 sends each forward's plan to the
        others (``serve_plans``)."""
        self.config = config
        self.group = group
        self.plans = PlanChannel(group)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model_config = model_config or ModelConfig.from_path(config.model_path)
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        start = time.perf_counter()
        self.model = load_model(
            config.model_path,
            self.model_config,
            self.dtype,
            self.device,
            self.context_length,
            group,
            expert_parallel=config.parallel.ep_size > 1,
        )
        mc = self.model_config
        # This rank's attention heads (all of them at one rank), and each
        # layer's (KV heads, head dim) in the pool.
        self.heads = HeadSplit.of(mc.num_attention_heads, mc.num_key_value_heads, group)
        self.kv_shapes = [
            (HeadSplit.of(mc.num_attention_heads, kv, group).kv_count, d)
            for kv, d in mc.kv_layers()
        ]
        if self.device.type == "cpu":
            logger.info("CPU linears: %s", cpu_matmul_path(self.dtype))
        if config.enable_torch_compile:
            self.model.compile_dense()  # compiles on the first forward of each shape class
        self.load_seconds = time.perf_counter() - start
        self.page_size = config.cache.page_size
        self.cache_groups: tuple[CacheGroup, ...] = cache_groups(self.model_config)
        self.graphs: CudaGraphRunner | None = None  # set by capture_graphs
        # A drafter in the group (set by the proposer, or a worker's start-up).
        self.draft_shard: DraftContext | None = None
        if allocate_kv:
            self.allocate_kv(extra_kv_bytes_per_page)

    def allocate_kv(self, extra_bytes_per_page: int = 0, reserve_bytes: int = 0) -> None:
        """Sizes and allocates the KV pool. ``reserve_bytes``: memory left free
        for the activations of the largest step (besides this model's own)."""
        mc = self.model_config
        reserve = reserve_bytes + activation_bytes(self.config, mc, self.context_length)
        if mc.deepseek_v4 is not None:
            self._allocate_compressed(extra_bytes_per_page, reserve)
            return
        # Every rank sizes its pool from its own memory; they all take the smallest.
        self.num_pages = self.group.agree_min(
            self._kv_capacity_pages(extra_bytes_per_page, reserve)
        )
        self.group_pages = [self.num_pages]
        self.page_bytes = [self._page_bytes()]
        self.capacity_tokens = self.num_pages * self.page_size
        # One page past the allocator's: where a captured step's padding
        # tokens write their K/V (no request owns it).
        self.kv_pool = KVPool(
            mc.num_hidden_layers,
            self.num_pages + 1,
            self.page_size,
            self.heads.kv_count,
            mc.head_dim,
            self.dtype,
            self.device,
            self.kv_shapes,
        )
        self.attn_backend: AttentionBackend = make_attention_backend(
            self.config.attention_backend,
            self.kv_pool,
            self.heads.q_count,
            self.device,
            getattr(self.model, "attention_layers", ()),
        )

    def graphs_apply(self) -> bool:
        """Whether ``capture_graphs`` captures CUDA graphs: on CUDA with the
        Triton attention backend, unless ``disable_cuda_graph``; not yet under
        tensor parallelism (its collectives run eagerly)."""
        return (
            not self.config.disable_cuda_graph
            and self.group.size == 1
            and self.device.type == "cuda"
            and isinstance(self.attn_backend, TritonAttentionBackend)
        )

    def capture_graphs(
        self,
        chain: int,
        capture_layer_ids: tuple[int, ...] = (),
        capture: Capture | None = None,
    ) -> bool:
        """Captures the DECODE and VERIFY forwards (``chain``: the longest
        verify chain, 1 without speculation; ``capture_layer_ids``: the layers
        every forward captures for a proposer) for batches up to
        ``cuda_graph_max_bs``. On CUDA with the Triton attention backend
        unless ``disable_cuda_graph``; ``capture`` (tests) captures anywhere.
        Returns whether graphs were captured."""
        cfg = self.config
        if capture is None:
            if not self.graphs_apply():
                if self.device.type == "cuda" and not cfg.disable_cuda_graph:
                    logger.info("CUDA graphs: off (they need the Triton attention backend)")
                return False
            capture = cuda_graph_capture(self.device)
        if not isinstance(self.attn_backend, TritonAttentionBackend):
            return False
        max_bs = min(cfg.cuda_graph_max_bs or 64, cfg.scheduler.max_running_requests)
        start = time.perf_counter()
        self.graphs = CudaGraphRunner(
            self.model,
            self.attn_backend,
            self.page_size,
            self.context_length,
            self.num_pages * self.page_size,
            chain,
            capture_layer_ids,
            max_bs,
            capture,
        )
        logger.info(
            "captured %d forwards (batch buckets %s, longest chain %d) in %.1fs",
            len(self.graphs.graphs), self.graphs.buckets, chain, time.perf_counter() - start,
        )  # fmt: skip
        return True

    def describe_kv(self) -> str:
        """DeepSeek-V4's KV bytes per token of each layer kind."""
        return describe_kv(self.model_config, self.dtype)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _kv_budget(self, reserve_bytes: int) -> float:
        """Bytes the KV pools may take on this device."""
        cache = self.config.cache
        if self.device.type == "cuda":
            # Blocks the allocator keeps cached (from loading) are free memory too.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            return cuda_kv_budget(total, free, cache.fraction("cuda"), reserve_bytes)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return available * cache.fraction("cpu")

    def _page_bytes(self) -> int:
        """A page of this rank's KV pool, every layer's (KV heads, head dim)."""
        return KVPool.layers_bytes_per_page(self.kv_shapes, self.page_size, self.dtype)

    def _kv_capacity_pages(self, extra_bytes_per_page: int, reserve_bytes: int) -> int:
        cache = self.config.cache
        if cache.max_total_tokens is not None:
            return cache.max_total_tokens // self.page_size
        per_page = extra_bytes_per_page + self._page_bytes()
        budget = self._kv_budget(reserve_bytes)
        if self.device.type != "cuda":
            # More than every running request at full context is never used.
            most = self.config.scheduler.max_running_requests * self.context_length
            budget = min(budget, -(-most // self.page_size) * per_page)
        return _at_least_one(int(budget // per_page))

    def _allocate_compressed(self, extra_bytes_per_page: int, reserve_bytes: int) -> None:
        """DeepSeek-V4's pools: a bounded group 0 (every running request's
        retained window and its largest step) and entry groups sized for as
        many tokens as the memory left allows (or ``max_total_tokens``)."""
        mc, ps = self.model_config, self.page_size
        if self.config.attention_backend == "triton":
            raise ValueError(
                "attention_backend: triton has no kernel for DeepseekV4ForCausalLM's "
                "compressed attention yet; use torch_native (the default for it)"
            )
        self.page_bytes = bytes_per_page(mc, ps, self.dtype)  # this model's, by group
        per_page = [self.page_bytes[0] + extra_bytes_per_page, *self.page_bytes[1:]]
        sched = self.config.scheduler
        running, groups = sched.max_running_requests, self.cache_groups

        retain, chain = groups[0].retain, verify_chain(self.config)
        step = -(-sched.chunked_prefill_size // ps) + running * (2 + chain // ps)
        # What one request of any length needs in group 0 to take a step: its
        # retained window, a whole prefill chunk or verify chain, a partial
        # page at each end. Fewer pages would leave a long request waiting.
        alone = -(-(retain + max(sched.chunked_prefill_size, chain)) // ps) + 2

        def pages(tokens: int) -> list[int]:
            window = min(-(-tokens // ps), running * (2 + retain // ps) + step)
            return [max(window, alone)] + [
                -(-tokens // (g.rate * ps)) + running for g in groups[1:]
            ]

        def cost(tokens: int) -> int:
            return sum(n * b for n, b in zip(pages(tokens), per_page))

        tokens = self.config.cache.max_total_tokens
        if tokens is None:
            budget = self._kv_budget(reserve_bytes)
            lo, hi = ps, max(ps, running * self.context_length)
            if cost(lo) > budget:
                _at_least_one(0)
            while lo < hi:  # the most tokens whose pools fit
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
            tokens = lo
        # Every rank sizes its pools from its own memory; they all take the smallest.
        tokens = self.group.agree_min(tokens)
        self.group_pages = pages(tokens)
        self.num_pages = self.group_pages[0]
        # One request may grow until an entry group is full.
        self.capacity_tokens = min(
            [n * g.rate * ps for n, g in zip(self.group_pages[1:], groups[1:])] or [tokens]
        )
        self.kv_pool = CompressedPool(mc, self.group_pages, ps, self.dtype, self.device)
        self.attn_backend = CompressedAttentionBackend(mc, self.kv_pool, groups)

    @property
    def scores_on_shards(self) -> bool:
        """Whether ``forward`` takes ``ScoreRows`` (tensor parallelism: the
        rows' logits then stay on the shards)."""
        return self.group.size > 1

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, score: ScoreRows | None = None) -> ForwardOutput:
        """The batch's forward (on every rank of the group: its plan goes
        out first), and ``score``'s rows decided and scored
        (``scores_on_shards`` only).
        Under tensor parallelism a forward that fails here fails the group
        (``DistributedError``): the other ranks may be waiting in one of its
        collectives, and the next forward's would meet theirs."""
        self.plans.send(batch, score)
        if self.group.size == 1:
            assert score is None, "rows are scored on shards only"
            return self._forward(batch)
        try:
            return self._forward(batch, score)
        except DistributedError:
            raise
        except Exception as e:
            raise DistributedError(f"rank 0 failed in a tensor-parallel forward: {e!r}") from e

    def serve_plans(self) -> None:
        """A worker rank: runs rank 0's forwards until it stops."""
        while (plan := self.plans.recv()) is not None:
            if isinstance(plan, list):  # a drafter block's plan
                assert self.draft_shard is not None, "a draft plan for a rank without a drafter"
                self.draft_shard.serve(plan)
            else:
                self._forward(*plan)

    @torch.inference_mode()
    def _forward(self, batch: ScheduledBatch, score: ScoreRows | None = None) -> ForwardOutput:
        offsets = batch.row_offsets
        shape = self.graphs.shape_for(batch) if self.graphs is not None else None
        if shape is not None:
            assert self.graphs is not None
            logits, cap = self.graphs.replay(batch, shape)
            return ForwardOutput(logits=logits, row_offsets=offsets, captured=cap)
        inputs = build_inputs(batch, self.page_size, self.device)
        self.attn_backend.prepare(inputs.meta)
        hidden, captured = self.model(
            inputs.input_ids, inputs.meta, self.attn_backend, batch.capture_layer_ids
        )
        # Rank 0's proposer reads the captured layers; a split drafter's
        # context comes from them on every rank.
        keep = self.group.is_first or inputs.draft_context is not None
        cap = torch.cat(captured, dim=-1) if captured and keep else None  # [T, m * d]
        if inputs.draft_context is not None:
            assert cap is not None and self.draft_shard is not None
            rows, positions, slots = inputs.draft_context
            self.draft_shard.store_context(cap[rows], positions, slots)
        if not self.group.is_first:
            cap = None  # only rank 0's proposer reads the captured layers
        if self.group.size == 1:
            logits = self.model.compute_logits(hidden[inputs.logit_index])
            return ForwardOutput(logits=logits, row_offsets=offsets, captured=cap)
        logits, argmax, scores = score_on_shards(
            self.model.logits_head, hidden[inputs.logit_index], score, self.config.kernel_backend
        )
        return ForwardOutput(logits, offsets, cap, argmax, scores)

    @torch.inference_mode()
    def verify_forward(
        self, num_tokens: int, chain: int, prefix: int, capture_layer_ids: tuple[int, ...] = ()
    ) -> None:
        """One forward shaped like a verify round, for timing it: chains of
        ``chain`` tokens (the last may be shorter) over ``prefix`` cached
        positions each, on whatever pages (their contents do not matter),
        capturing the layers a proposer reads (replayed when real rounds
        would be); returns once the device is done."""
        ps, entries, page = self.page_size, [], 0
        for start in range(0, num_tokens, chain):
            n = min(chain, num_tokens - start)
            count = -(-(prefix + n) // ps)
            pages = [(page + k) % self.num_pages for k in range(count)]
            page += count
            tables = [
                [k % g_pages for k in range(-(-((prefix + n) // g.rate) // ps))]
                for g, g_pages in zip(self.cache_groups[1:], self.group_pages[1:])
            ]
            entries.append(BatchEntry([0] * n, prefix, pages, list(range(n)), tables))
        self.forward(ScheduledBatch(entries, [], capture_layer_ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _at_least_one(pages: int) -> int:
    if pages < 1:
        raise ValueError(
            "mem_fraction_static: no memory left for a single KV page after the weights "
            "and the activation reserve; raise it, or lower the model size, dtype, "
            "max_running_requests or chunked_prefill_size"
        )
    return pages


def verify_chain(config: EngineConfig) -> int:
    """Tokens of one verify chain: the anchor and its drafts (an unknown
    block size: 16); 1 without speculation."""
    spec = config.spec
    return 1 if not spec.enabled else spec.num_draft_tokens or (spec.block_size or 16) + 1


def cuda_kv_budget(total: int, free: int, fraction: float, reserve: int) -> float:
    """Bytes for KV on a GPU, as SGLang means ``mem_fraction_static``: the share
    of the device's whole memory that weights and KV (the static part)
    take. What is in use now (every model's weights, the CUDA context) comes
    off it, and so does the reserve for the largest step's activations,
    which must also fit in what is left outside the static share."""
    static_left = total * fraction - (total - free)
    return max(0.0, min(static_left, free - reserve))


def activation_bytes(config: EngineConfig, mc: ModelConfig, context_length: int) -> int:
    """An upper estimate of the target's activations in the largest step: the
    most tokens one forward can carry (a prefill chunk with every decode
    riding along, or every request verifying a whole chain), their hidden
    states and MLP, and their float32 logits with the copies the sampler,
    the verifier and the scorer make."""
    sched = config.scheduler
    chain = verify_chain(config)
    tokens = max(
        sched.chunked_prefill_size + sched.max_running_requests,
        sched.max_running_requests * chain,
    )
    elem = config.torch_dtype.itemsize
    qkv = max((mc.num_attention_heads + 2 * kv) * d for kv, d in mc.kv_layers())
    per_token = elem * (6 * mc.hidden_size + 3 * mc.intermediate_size + 2 * qkv)
    logits = 4 * 4 * mc.vocab_size  # float32: logits, processed, probabilities, scoring
    attention = 0
    if mc.deepseek_v4 is not None:
        # mHC's streams (and their mixes) per token; the compressed attention's
        # gathers, scores and probabilities, each bounded by its budget.
        per_token += elem * 3 * mc.deepseek_v4.hc_mult * mc.hidden_size
        attention = 4 * 4 * GATHER_BUDGET
    elif config.attention_backend == "torch_native":
        # That backend gathers each request's pages (one layer at a time).
        attention = (
            2 * sched.max_running_requests * context_length
            * mc.num_key_value_heads * mc.head_dim * elem
        )  # fmt: skip
    return int(1.25 * (tokens * (per_token + logits) + attention))
