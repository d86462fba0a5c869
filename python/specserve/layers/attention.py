"""Paged attention behind one interface.

The runner describes a ragged batch once per forward (``AttentionMetadata``);
every layer then calls ``backend.forward``. A query token at position ``p``
attends to the keys at positions ``<= p`` of its own request, which covers
EXTEND (a prefill chunk after a cached prefix), DECODE (one token) and VERIFY
(a chain that is causal inside itself and sees the cached prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.cache.kv_pool import KVPool


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    q_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # cached prefix + new tokens per request
    page_tables: list[list[int]]  # pages of each request, covering kv_lens
    page_size: int
    # Whatever the backend precomputes once per forward for all layers.
    plan: object = field(default=None)


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool

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


def slots_of(
    page_table: list[int], length: int, page_size: int, device: torch.device
) -> torch.Tensor:
    """KV slots of positions ``[0, length)`` for one request, ``[length]`` int64."""
    pages = torch.tensor(page_table[: -(-length // page_size)], dtype=torch.int64)
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:length]
    return slots.to(device)


@dataclass
class _SDPAPlan:
    # Requests with one query token, batched with padding.
    single_rows: torch.Tensor | None  # [Bs] token rows (None: the batch is rows 0..Bs-1)
    single_slots: torch.Tensor | None  # [Bs, Lmax] KV slots, padded with slot 0
    single_mask: torch.Tensor | None  # [Bs, 1, 1, Lmax] bool
    # Requests with several query tokens, one SDPA call each:
    # (first token row, q_len, cached slots or None when nothing is cached).
    multi: list[tuple[int, int, torch.Tensor | None]]


class TorchSDPABackend(AttentionBackend):
    """Gathers each request's pages and runs torch SDPA (any device)."""

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.positions.device
        single_ids: list[int] = []
        multi: list[tuple[int, int, torch.Tensor | None]] = []
        row = 0
        starts = []
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            starts.append(row)
            if q_len == 1:
                single_ids.append(i)
            else:
                cached = kv_len > q_len
                slots = (
                    slots_of(meta.page_tables[i], kv_len, meta.page_size, device)
                    if cached
                    else None
                )
                multi.append((row, q_len, slots))
            row += q_len
        single_rows = single_slots = single_mask = None
        if single_ids:
            lmax = max(meta.kv_lens[i] for i in single_ids)
            slot_table = torch.zeros(len(single_ids), lmax, dtype=torch.int64)
            lens = torch.tensor([meta.kv_lens[i] for i in single_ids])
            for j, i in enumerate(single_ids):
                slot_table[j, : meta.kv_lens[i]] = slots_of(
                    meta.page_tables[i], meta.kv_lens[i], meta.page_size, torch.device("cpu")
                )
            single_slots = slot_table.to(device)
            single_mask = (torch.arange(lmax)[None, :] < lens[:, None]).to(device)[:, None, None, :]
            if len(single_ids) != len(meta.q_lens):
                single_rows = torch.tensor([starts[i] for i in single_ids], device=device)
        meta.plan = _SDPAPlan(single_rows, single_slots, single_mask, multi)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        plan = meta.plan
        assert isinstance(plan, _SDPAPlan), "prepare() must run before forward()"
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        self.kv_pool.store(layer, meta.slot_mapping, k, v)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        if plan.single_slots is not None:
            qs = q if plan.single_rows is None else q[plan.single_rows]  # [Bs, H, D]
            ks = k_cache[plan.single_slots].transpose(1, 2)  # [Bs, Hkv, Lmax, D]
            vs = v_cache[plan.single_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(2), ks, vs, attn_mask=plan.single_mask, enable_gqa=gqa
            )  # [Bs, H, 1, D]
            if plan.single_rows is None:
                out = o.squeeze(2)
            else:
                out[plan.single_rows] = o.squeeze(2)
        for start, q_len, slots in plan.multi:
            qm = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            if slots is None:
                km = k[start : start + q_len].transpose(0, 1)  # [Hkv, q_len, D]
                vm = v[start : start + q_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(qm, km, vm, is_causal=True, enable_gqa=gqa)
            else:
                km = k_cache[slots].transpose(0, 1)  # [Hkv, kv_len, D]
                vm = v_cache[slots].transpose(0, 1)
                kv_len = slots.numel()
                # Bottom-right aligned causal mask: query i sits at kv_len - q_len + i.
                qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)
                mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qm, km, vm, attn_mask=mask, enable_gqa=gqa)
            out[start : start + q_len] = o.transpose(0, 1)
        return out
