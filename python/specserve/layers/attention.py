"""Paged attention behind one interface.

The runner describes a ragged batch once per forward (``AttentionMetadata``);
every layer then calls ``backend.forward``. A query token at position ``p``
attends to the keys at positions ``<= p`` of its own request, which covers
EXTEND (a prefill chunk after a cached prefix), DECODE (one token) and VERIFY
(a chain that is causal inside itself and sees the cached prefix). A
non-causal batch (``causal=False``: the DSpark drafter's blocks, which see
themselves whole) attends to every key of its request. The target and the
drafter read their pools through these same backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.cache.kv_pool import KVPool
from specserve.host import upload
from specserve.kernels.dispatch import HAS_TRITON
from specserve.kernels.paged_attention import PagedLayout, paged_attention_triton, plan_layout


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    q_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # cached prefix + new tokens per request
    page_tables: list[list[int]]  # pages of each request, covering kv_lens
    page_size: int
    causal: bool = True  # False: every query sees all kv_len keys of its request
    # Pages of each request's further cache groups (compressed entries), by group.
    entry_tables: list[list[list[int]]] = field(default_factory=list)
    # Whatever the backend precomputes once per forward for all layers.
    plan: object = field(default=None)
    # The same for the sliding-window layers, by window (the torch backend).
    window_plans: dict[int, object] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerAttention:
    """What sets one attention layer apart from its model's others."""

    window: int = 0  # > 0: a query sees the last ``window`` positions, its own included
    scale: float | None = None  # None: 1 / sqrt(head_dim)


FULL_LAYER = LayerAttention()


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, layers: Sequence[LayerAttention] = ()) -> None:
        """``layers``: each layer's window and scale (empty: every layer
        causal over its whole prefix at 1 / sqrt(head_dim))."""
        self.kv_pool = kv_pool
        self.layers = tuple(layers)
        self.windows = sorted({spec.window for spec in self.layers if spec.window})

    def layer(self, i: int) -> LayerAttention:
        return self.layers[i] if self.layers else FULL_LAYER

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-forward state into ``meta.plan``."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` of the new tokens -> ``[T, H, D]``.

        Stores ``k``/``v`` into the pool before attending.
        """


def padding_bias(past: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An additive mask (0, or -inf where ``past`` is set) in the queries'
    dtype, on their device: SDPA refuses (or on cuDNN misreads) a bias whose
    dtype differs from the query's."""
    bias = torch.zeros(past.shape, dtype=dtype).masked_fill_(past, float("-inf"))
    return bias.to(device, non_blocking=True)


def page_tensor(page_table: list[int], length: int, page_size: int) -> list[int]:
    """The pages holding positions ``[0, length)``."""
    return page_table[: -(-length // page_size)]


def past_kv_len(kv_lens: list[int], width: int) -> torch.Tensor:
    """``[B, width]`` bool, on the host: which slots of a gather of ``width``
    slots per request lie past the request's ``kv_len`` (the rest of its last
    page, and the padding pages)."""
    return torch.arange(width)[None, :] >= torch.tensor(kv_lens)[:, None]


def tail_slots(past: torch.Tensor) -> torch.Tensor:
    """The flat indices of ``past_kv_len``'s slots. Their keys and values are
    whatever the pool holds there (another request's, a freed one's), so the
    gather zeroes them: masking alone would let a NaN through (NaN + -inf is
    NaN, and 0 x NaN is NaN), and one request's NaN would poison another."""
    return past.flatten().nonzero().flatten()


@dataclass
class _TorchPlan:
    # Requests with one query token, batched: whole pages gathered, tails masked.
    single_rows: torch.Tensor | None  # [Bs] token rows (None: the batch is rows 0..Bs-1)
    single_pages: torch.Tensor | None  # [Bs, P] page ids, padded with page 0
    single_bias: torch.Tensor | None  # [Bs, 1, 1, P * page_size]: 0 or -inf past kv_len
    single_tail: torch.Tensor | None  # [n] gathered slots past kv_len (``tail_slots``)
    # Requests with several query tokens, one SDPA call each: (first token row,
    # q_len, kv_len, pages to gather or None when nothing was cached before).
    multi: list[tuple[int, int, int, torch.Tensor | None]]
    causal: bool = True
    # Short chains over a cached prefix (speculative verify), batched with padding.
    chain_index: torch.Tensor | None = None  # [Bc, Qmax] token rows (padding repeats a row)
    chain_valid: torch.Tensor | None = None  # [Bc, Qmax] bool: a real query; None: all are
    chain_rows: torch.Tensor | None = None  # [n] token rows of the real queries, in order
    chain_pages: torch.Tensor | None = None  # [Bc, P]
    chain_bias: torch.Tensor | None = None  # [Bc, 1, Qmax, P * page_size]: 0 or -inf
    chain_tail: torch.Tensor | None = None  # [n] gathered slots past kv_len
    # The batch is exactly its chains, all of one length: q and the output are
    # views, no gather or scatter.
    chain_whole: bool = False
    window: int = 0  # the sliding window these masks apply (0: none)


@dataclass
class _LonePlan:
    """One request: its ``kv_len`` keys and values exactly (no padding to
    mask), the pool's slots ``[start, stop)`` read as a view when its pages
    are one ascending run, else its pages gathered and cut to ``kv_len``.
    Either way SDPA sees the same tensors, so a request's logprobs do not
    depend on which pages it was given."""

    start: int
    stop: int
    pages: torch.Tensor | None  # [P] to gather; None: the run's view
    # The queries' mask: None when each sees every key (one query, or a
    # non-causal block), or when ``is_causal`` says it (a fresh prefill);
    # else 0 / -inf ``[q_len, kv_len]`` (a chain over a cached prefix).
    bias: torch.Tensor | None
    is_causal: bool = False


# Chains up to this long share one padded SDPA call; longer chunks go one by one.
CHAIN_MAX = 16


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch (any device): gathers each request's pages
    and attends with grouped matmuls (one query per request) or SDPA (chunks).

    Pages are gathered whole (``index_select`` of contiguous page rows), which
    copies far faster than gathering token slots one by one.
    """

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = self._plan(meta, 0)
        longest = max(meta.kv_lens, default=0)
        # A window no key falls out of masks nothing: the full plan serves.
        meta.window_plans = {
            w: meta.plan if longest <= w or not meta.causal else self._plan(meta, w)
            for w in self.windows
        }

    def _plan(self, meta: AttentionMetadata, window: int) -> _TorchPlan | _LonePlan:
        if len(meta.q_lens) == 1:
            lone = self._plan_lone(meta, window)
            if lone is not None:
                return lone
        device = meta.positions.device
        ps = meta.page_size
        single_ids: list[int] = []
        chain_ids: list[int] = []
        multi: list[tuple[int, int, int, torch.Tensor | None]] = []
        row = 0
        starts = []
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            starts.append(row)
            if q_len == 1:
                single_ids.append(i)
            elif q_len <= CHAIN_MAX and kv_len > q_len:
                chain_ids.append(i)
            else:
                pages = None
                if kv_len > q_len:
                    table = page_tensor(meta.page_tables[i], kv_len, ps)
                    pages = upload(table, device)
                multi.append((row, q_len, kv_len, pages))
            row += q_len
        single_rows = single_pages = single_bias = single_tail = None
        if single_ids:
            lens = [meta.kv_lens[i] for i in single_ids]
            tables = [page_tensor(meta.page_tables[i], n, ps) for i, n in zip(single_ids, lens)]
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            single_pages = upload(padded, device)
            past = past_kv_len(lens, width * ps)  # [Bs, P * ps]
            single_tail = tail_slots(past).to(device, non_blocking=True)
            if window:  # and the keys the window has left behind
                past |= torch.arange(width * ps)[None, :] < torch.tensor(lens)[:, None] - window
            single_bias = padding_bias(past, self.kv_pool.dtype, device)[:, None, None, :]
            if len(single_ids) != len(meta.q_lens):
                single_rows = torch.tensor([starts[i] for i in single_ids], device=device)
        plan = _TorchPlan(
            single_rows, single_pages, single_bias, single_tail, multi, meta.causal, window=window
        )
        if chain_ids:
            self._plan_chains(plan, meta, chain_ids, starts)
        return plan

    def _plan_lone(self, meta: AttentionMetadata, window: int = 0) -> _LonePlan | None:
        """A lone request's plan (None when a page slid out of a window): a
        batch of one is the common case of a quiet server, and this plan
        costs a few host ops where the general one builds index tensors."""
        q_len, kv_len, ps = meta.q_lens[0], meta.kv_lens[0], meta.page_size
        table = page_tensor(meta.page_tables[0], kv_len, ps)
        if not table or min(table) < 0:  # (-1: a page slid out of a window)
            return None
        first = _run_start(table)
        if first is None:
            plan = _LonePlan(0, kv_len, upload(table, meta.positions.device), None)
        else:
            plan = _LonePlan(first * ps, first * ps + kv_len, None, None)
        if window and kv_len > window:
            # Query i at kv_len - q_len + i sees the ``window`` keys up to it.
            qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
            key = torch.arange(kv_len)[None, :]
            hidden = (key > qpos) | (key <= qpos - window)  # [q_len, kv_len]
            plan.bias = padding_bias(hidden, self.kv_pool.dtype, meta.positions.device)
        elif meta.causal and q_len > 1:
            if q_len == kv_len:
                plan.is_causal = True
            else:  # query i sits at kv_len - q_len + i and sees keys up to there
                device, dtype = meta.positions.device, self.kv_pool.dtype
                bias = torch.full((q_len, kv_len), float("-inf"), dtype=dtype, device=device)
                plan.bias = bias.triu_(kv_len - q_len + 1)
        return plan

    def _plan_chains(
        self, plan: _TorchPlan, meta: AttentionMetadata, ids: list[int], starts: list[int]
    ) -> None:
        device = meta.positions.device
        ps = meta.page_size
        q_lens = [meta.q_lens[i] for i in ids]
        kv_lens = [meta.kv_lens[i] for i in ids]
        qmax = max(q_lens)
        tables = [page_tensor(meta.page_tables[i], n, ps) for i, n in zip(ids, kv_lens)]
        width = max(len(t) for t in tables)
        pages = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        offs = torch.arange(qmax)
        q_len_t = torch.tensor(q_lens)
        valid = offs[None, :] < q_len_t[:, None]  # [Bc, Qmax]
        first = torch.tensor([starts[i] for i in ids])
        index = first[:, None] + torch.minimum(offs[None, :], q_len_t[:, None] - 1)
        # Query i of a chain sits at kv_len - q_len + i and sees keys up to there
        # (all of them when not causal); padding queries repeat the last real one
        # (their output is dropped).
        last = torch.tensor(kv_lens)[:, None] - 1
        qpos = last - q_len_t[:, None] + 1 + torch.minimum(offs[None, :], q_len_t[:, None] - 1)
        if not meta.causal:
            qpos = last.expand(-1, qmax)
        key = torch.arange(width * ps)[None, None, :]
        past = key > qpos[:, :, None]  # [Bc, Qmax, P*ps]
        if plan.window:
            past |= key <= qpos[:, :, None] - plan.window
        padded = not bool(valid.all())
        plan.chain_whole = not padded and len(ids) == len(meta.q_lens)
        plan.chain_index = None if plan.chain_whole else index.to(device)
        plan.chain_valid = valid.to(device) if padded else None
        plan.chain_rows = index[valid].to(device)
        plan.chain_pages = pages.to(device)
        plan.chain_tail = tail_slots(past_kv_len(kv_lens, width * ps)).to(device, non_blocking=True)
        # An additive bias in the queries' dtype, built once for every layer
        # (SDPA would turn a boolean mask into one in each call).
        plan.chain_bias = padding_bias(past, self.kv_pool.dtype, device)[:, None]

    def _gather(
        self,
        cache: torch.Tensor,
        pages: torch.Tensor,
        page_size: int,
        tail: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[..., P]`` page ids -> ``[..., P * page_size, Hkv, D]`` keys or
        values, the ``tail`` slots (flat, ``tail_slots``) zeroed."""
        paged = cache.view(-1, page_size, *cache.shape[1:])  # [num_pages, ps, Hkv, D]
        rows = paged.index_select(0, pages.flatten())  # a copy
        if tail is not None:
            rows.view(-1, *cache.shape[1:]).index_fill_(0, tail, 0)
        return rows.view(*pages.shape[:-1], pages.shape[-1] * page_size, *cache.shape[1:])

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        spec = self.layer(layer)
        plan = meta.window_plans[spec.window] if spec.window else meta.plan
        scale = spec.scale
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        self.kv_pool.store(layer, meta.slot_mapping, k, v)
        gqa = q.shape[1] != k.shape[1]
        if isinstance(plan, _LonePlan):
            if plan.pages is None:
                keys, values = k_cache[plan.start : plan.stop], v_cache[plan.start : plan.stop]
            else:  # cut to kv_len: nothing past it is read
                keys = self._gather(k_cache, plan.pages, meta.page_size)[: plan.stop]
                values = self._gather(v_cache, plan.pages, meta.page_size)[: plan.stop]
            if q.shape[0] == 1:
                bias = None if plan.bias is None else plan.bias[None, None]  # [1, 1, 1, L]
                return _decode_attention(q, keys[None], values[None], bias, scale)
            # Batched 4-D: CPU SDPA takes a 3-D call at about 3x the time.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=plan.bias, is_causal=plan.is_causal, enable_gqa=gqa, scale=scale,
            )  # fmt: skip
            return o[0].transpose(0, 1)  # [T, H, D]
        assert isinstance(plan, _TorchPlan), "prepare() must run before forward()"
        ps = meta.page_size
        out = torch.empty_like(q)
        if plan.single_pages is not None:
            qs = q if plan.single_rows is None else q[plan.single_rows]  # [Bs, H, D]
            ks = self._gather(k_cache, plan.single_pages, ps, plan.single_tail)  # [Bs, L, Hkv, D]
            vs = self._gather(v_cache, plan.single_pages, ps, plan.single_tail)
            o = _decode_attention(qs, ks, vs, plan.single_bias, scale)  # [Bs, H, D]
            if plan.single_rows is None:
                out = o
            else:
                out[plan.single_rows] = o
        if plan.chain_pages is not None:
            bc = plan.chain_pages.shape[0]
            whole = plan.chain_whole
            qc = q.view(bc, -1, *q.shape[1:]) if whole else q[plan.chain_index]  # [Bc, Qmax, H, D]
            kc = self._gather(k_cache, plan.chain_pages, ps, plan.chain_tail)  # [Bc, L, Hkv, D]
            vc = self._gather(v_cache, plan.chain_pages, ps, plan.chain_tail)
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [Bc, Hkv, L, D]
            o = F.scaled_dot_product_attention(
                qc.transpose(1, 2), kc, vc, attn_mask=plan.chain_bias, enable_gqa=gqa, scale=scale
            ).transpose(1, 2)  # [Bc, Qmax, H, D]
            if plan.chain_whole:
                return o.reshape(q.shape)
            o = o.reshape(-1, *q.shape[1:]) if plan.chain_valid is None else o[plan.chain_valid]
            out[plan.chain_rows] = o
        for start, q_len, kv_len, pages in plan.multi:
            # Batched 4-D, as SDPA runs fastest on the CPU.
            qm = q[start : start + q_len].transpose(0, 1)[None]  # [1, H, q_len, D]
            if pages is None and not (plan.window and q_len > plan.window):
                km = k[start : start + q_len].transpose(0, 1)[None]  # [1, Hkv, q_len, D]
                vm = v[start : start + q_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(
                    qm, km, vm, is_causal=plan.causal, enable_gqa=gqa, scale=scale
                )
            elif pages is None:  # a fresh prefill longer than the window
                km = k[start : start + q_len].transpose(0, 1)[None]
                vm = v[start : start + q_len].transpose(0, 1)[None]
                mask = window_mask(q_len, q_len, plan.window, q.device)
                o = F.scaled_dot_product_attention(
                    qm, km, vm, attn_mask=mask, enable_gqa=gqa, scale=scale
                )
            else:
                # Cut to kv_len: what the pool holds past it is never read.
                km = self._gather(k_cache, pages, ps)[:kv_len].transpose(0, 1)[None]
                vm = self._gather(v_cache, pages, ps)[:kv_len].transpose(0, 1)[None]
                # [1, Hkv, kv_len, D]. Bottom-right aligned causal mask: query
                # i sits at kv_len - q_len + i.
                if plan.causal:
                    mask = window_mask(q_len, kv_len, plan.window, q.device)
                else:
                    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
                o = F.scaled_dot_product_attention(
                    qm, km, vm, attn_mask=mask, enable_gqa=gqa, scale=scale
                )
            out[start : start + q_len] = o[0].transpose(0, 1)
        return out


def _run_start(pages: list[int]) -> int | None:
    """The first of ``pages`` if they are one ascending run."""
    first = pages[0]
    if any(p != first + i for i, p in enumerate(pages)):
        return None
    return first


def window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: the keys each of the last ``q_len`` positions
    sees, causally, and within ``window`` of it (0: no window)."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None, :]
    seen = key <= qpos
    return seen & (key > qpos - window) if window else seen


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    bias: torch.Tensor | None,  # [B, 1, 1, L]; None: every key counts
    scale: float | None = None,
) -> torch.Tensor:
    """One query per request. The query heads sharing a KV head are laid out as
    that head's query rows, so SDPA sees plain multi-head attention with G
    queries and no GQA expansion; the additive bias masks each request's tail."""
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )
    return o.reshape(b, h, d)  # [B, Hkv, G, D] -> [B, H, D]


class TritonAttentionBackend(AttentionBackend):
    """Paged attention read straight from the pool by one Triton kernel
    (``kernels/paged_attention.py``): the default on CUDA."""

    def __init__(
        self, kv_pool: KVPool, num_heads: int, layers: Sequence[LayerAttention] = ()
    ) -> None:
        super().__init__(kv_pool, layers)
        # Tiles sized for the largest query-head group of any layer fit every layer.
        kv_heads = min((k.shape[1] for k in kv_pool.k), default=1)
        self.group = num_heads // kv_heads

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = plan_layout(
            meta.q_lens,
            meta.kv_lens,
            meta.page_tables,
            meta.page_size,
            meta.positions.device,
            self.group,
            meta.causal,
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(meta.plan, PagedLayout), "prepare() must run before forward()"
        self.kv_pool.store(layer, meta.slot_mapping, k, v)
        spec = self.layer(layer)
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        return paged_attention_triton(
            q, k_cache, v_cache, meta.plan, scale=spec.scale, window=spec.window
        )


ATTENTION_BACKENDS = ("triton", "torch_native")


def attention_backend_name(name: str | None, device: torch.device) -> str:
    """``name`` None: Triton on CUDA (when installed), torch elsewhere."""
    if name is None:
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch_native"
    return name


def make_attention_backend(
    name: str | None,
    kv_pool: KVPool,
    num_heads: int,
    device: torch.device,
    layers: Sequence[LayerAttention] = (),
) -> AttentionBackend:
    name = attention_backend_name(name, device)
    if name == "triton":
        if not HAS_TRITON:
            raise ValueError("attention_backend: triton is not installed")
        return TritonAttentionBackend(kv_pool, num_heads, layers)
    if name == "torch_native":
        return TorchAttentionBackend(kv_pool, layers)
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
