"""DeepSeek-V4's paged attention: a sliding window plus compressed entries.

Every layer attends to the last ``sliding_window`` positions of its request
(one shared K=V head, per-head sinks). Compressed layers also attend to
entries that each summarise ``m`` positions: all of them (HCA) or the
``index_topk`` an indexer picks (CSA). Query ``p`` sees entry ``w`` once its
window is closed, ``w < (p + 1) // m``; the token that closes a window emits
its entry in the same forward, before anyone attends.

Storage is paged in cache groups (``cache_groups``), each with its own
pages and page table per request:

- group 0, one slot per position: each layer's K=V, and each compressed
  layer's compressor sources (its K/V and gate projections, float32). Only
  the last ``retain`` positions are ever read, so the scheduler frees the
  pages behind them.
- one group per compression rate, one slot per entry: the entries (and, for
  CSA, the indexer's keys).

A compressor's partial-window state is therefore nothing but the sources in
the request's own slots: entries are a function of the positions computed,
so chunked prefill splitting a window, preemption and recompute, and
trimming rejected drafts (which un-emits the entries they closed) all keep
it exact without any state to save or restore.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.block_pool import CacheGroup, table_slots
from specserve.config import ModelConfig
from specserve.layers.attention import AttentionMetadata
from specserve.models.deepseek_v4_config import CSA, SLIDING


def bytes_per_page(mc: ModelConfig, page_size: int, dtype: torch.dtype) -> list[int]:
    """What one page of each cache group costs, over all layers."""
    v4 = mc.deepseek_v4
    elem = dtype.itemsize
    per_slot = [mc.num_hidden_layers * mc.head_dim * elem] + [0] * len(v4.compressed_kinds)
    for kind in v4.layer_types:
        if kind == SLIDING:
            continue
        g = 1 + v4.compressed_kinds.index(kind)
        sources = 2 * mc.head_dim if kind == CSA else mc.head_dim
        per_slot[g] += mc.head_dim * elem
        if kind == CSA:
            sources += 2 * v4.index_head_dim
            per_slot[g] += v4.index_head_dim * elem
        per_slot[0] += 2 * sources * 4  # K/V and gate projections, float32
    return [page_size * b for b in per_slot]


def describe_kv(mc: ModelConfig, dtype: torch.dtype) -> str:
    """KV bytes per token of each layer kind, for the start-up log."""
    v4, elem = mc.deepseek_v4, dtype.itemsize
    window = mc.head_dim * elem
    parts = []
    for kind in (SLIDING, *v4.compressed_kinds):
        n = v4.layer_types.count(kind)
        text = f"{kind} x{n}: {window} B/token within the {v4.sliding_window}-token window"
        if kind != SLIDING:
            entry = (mc.head_dim + (v4.index_head_dim if kind == CSA else 0)) * elem
            text += f" + {entry / v4.rate(kind):g} B/token of entries (1 per {v4.rate(kind)})"
        parts.append(text)
    return "; ".join(parts)


class CompressedPool:
    """The tensors of every cache group (see the module docstring)."""

    def __init__(
        self,
        mc: ModelConfig,
        num_pages: list[int],
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        v4 = mc.deepseek_v4
        self.page_size, self.dtype = page_size, dtype
        d, di = mc.head_dim, v4.index_head_dim
        tokens = num_pages[0] * page_size

        def zeros(rows: int, cols: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(rows, cols, dtype=dt, device=device)

        self.window = [zeros(tokens, d) for _ in v4.layer_types]
        self.sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for layer, kind in enumerate(v4.layer_types):
            if kind == SLIDING:
                continue
            slots = num_pages[1 + v4.compressed_kinds.index(kind)] * page_size
            width = 2 * d if kind == CSA else d
            self.sources[layer] = (
                zeros(tokens, width, torch.float32),
                zeros(tokens, width, torch.float32),
            )
            self.entries[layer] = zeros(slots, d)
            if kind == CSA:
                self.index_sources[layer] = (
                    zeros(tokens, 2 * di, torch.float32),
                    zeros(tokens, 2 * di, torch.float32),
                )
                self.index_keys[layer] = zeros(slots, di)


@dataclass
class Closing:
    """The windows of one rate that this forward's tokens close."""

    sources: torch.Tensor  # [E, S] group-0 slots of each window's sources (S = 2m or m)
    valid: torch.Tensor  # [E, S] bool: CSA's first window has no previous one
    dest: torch.Tensor  # [E] entry slots
    positions: torch.Tensor  # [E] w * m: where each entry's RoPE puts it


@dataclass
class Visible:
    """The entries of one rate each query may see: ``w < (p + 1) // m``,
    kept per request (every query of a request sees a prefix of the same
    entries) and expanded per query only for the rows being computed."""

    slots: torch.Tensor  # [B, N] each request's entry slots
    req: torch.Tensor  # [T] each query's request
    count: torch.Tensor  # [T] entries each query sees
    closing: Closing | None  # None: no window closes in this forward

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[t, N]`` (0 where not visible) and visibility of query ``rows``."""
        valid = torch.arange(self.width, device=self.count.device)[None, :] < self.count[rows, None]
        return torch.where(valid, self.slots[self.req[rows]], 0), valid


@dataclass
class CompressedPlan:
    window_slots: torch.Tensor  # [T, W] group-0 slots of each query's window
    window_bias: torch.Tensor  # [T, W] 0, or -inf before position 0
    visible: dict[int, Visible]  # by rate


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int64)


def plan_compressed(
    meta: AttentionMetadata, groups: tuple[CacheGroup, ...], window: int, csa_rate: int
) -> CompressedPlan:
    """The gather indices of one forward, shared by every layer."""
    ps, device = meta.page_size, meta.positions.device
    req = torch.repeat_interleave(torch.arange(len(meta.q_lens)), torch.tensor(meta.q_lens))
    pos = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(meta.q_lens, meta.kv_lens)])  # [T]
    tables = _padded(meta.page_tables)
    wpos = pos[:, None] - (window - 1) + torch.arange(window)[None, :]  # [T, W]
    wslots = table_slots(tables, req[:, None], wpos, ps)
    assert bool((wslots[wpos >= 0] >= 0).all()), "a window reads a freed page"
    bias = torch.zeros(wpos.shape).masked_fill_(wpos < 0, float("-inf"))
    visible = {}
    for g, group in enumerate(groups[1:]):
        m = group.rate
        etables = _padded([t[g] for t in meta.entry_tables])
        counts = (pos + 1) // m  # [T]
        n = int(counts.max()) if len(counts) else 0
        per_req = torch.arange(len(meta.q_lens))[:, None]
        slots = table_slots(etables, per_req, torch.arange(n)[None, :], ps)  # [B, N]
        closing = None
        rows = torch.nonzero((pos + 1) % m == 0).flatten()
        if len(rows):
            cw = (pos[rows] + 1) // m - 1  # [E] the entries closed
            overlap = m == csa_rate
            span = 2 * m if overlap else m
            first = (cw - 1) * m if overlap else cw * m
            spos = first[:, None] + torch.arange(span)[None, :]  # [E, S]
            closing = Closing(
                sources=table_slots(tables, req[rows, None], spos, ps).to(device),
                valid=(spos >= 0).to(device),
                dest=table_slots(etables, req[rows], cw, ps).to(device),
                positions=(cw * m).to(device),
            )
        visible[m] = Visible(
            slots.clamp(min=0).to(device), req.to(device), counts.to(device), closing
        )
    return CompressedPlan(wslots.to(device), bias.to(device), visible)


def compress_windows(
    kv: torch.Tensor,  # [E, S, C] float32 source projections
    gate: torch.Tensor,  # [E, S, C]
    valid: torch.Tensor,  # [E, S]
    ape: torch.Tensor,  # [m, C] per-offset gate bias
    overlap: bool,
) -> torch.Tensor:
    """One entry per window: a per-channel softmax over the window's slots.
    With ``overlap`` (CSA) a window of 2m slots takes the first half of the
    channels from the previous m positions and the second half from its own."""
    m = ape.shape[0]
    if overlap:
        d = kv.shape[-1] // 2
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)  # [E, 2m, d]
        gate = torch.cat([gate[:, :m, :d] + ape[:, :d], gate[:, m:, d:] + ape[:, d:]], dim=1)
    else:
        gate = gate + ape
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    kv = kv.masked_fill(~valid[..., None], 0.0)
    return (kv * gate.softmax(dim=1, dtype=torch.float32)).sum(dim=1)  # [E, d]


# Elements one per-query gather or score tensor may hold: query rows go in
# chunks below it, so a long prompt's prefill never materialises a
# [T, N, D] gather of every visible entry for every query at once.
GATHER_BUDGET = 1 << 24


def row_chunks(rows: int, per_row: int, budget: int) -> list[slice]:
    step = max(1, budget // max(1, per_row))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def select_entries(
    q: torch.Tensor,  # [T, Hi, Di] the indexer's queries
    head_weights: torch.Tensor,  # [T, Hi] float32
    keys: torch.Tensor,  # [S, Di] the indexer's key pool
    visible: Visible,
    top_k: int,
    budget: int = GATHER_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's ``top_k`` entries per query (slots ``[T, k]`` and
    validity): score ``sum_h w_h relu(q_h . k)``. Ties go to the earlier
    entry, so a query picks the same entries whether its prefix was computed
    in one forward or many (ReLU makes exact-zero ties common)."""
    n = visible.width
    k = min(top_k, n)
    picked, ok = [], []
    for rows in row_chunks(q.shape[0], n * max(q.shape[1], q.shape[2]), budget):
        slots, valid = visible.rows(rows)
        ks = keys[slots].float()  # [t, N, Di]
        s = torch.relu(torch.einsum("thd,tnd->thn", q[rows].float(), ks)) * q.shape[-1] ** -0.5
        s = (s * head_weights[rows, :, None]).sum(dim=1).masked_fill(~valid, float("-inf"))
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
        picked.append(slots.gather(1, order))
        ok.append(valid.gather(1, order))
    return torch.cat(picked), torch.cat(ok)


def sink_attention(
    q: torch.Tensor,  # [T, H, D]
    keys: torch.Tensor,  # [T, K, D] (K = V)
    bias: torch.Tensor,  # [T, K] 0 or -inf
    sinks: torch.Tensor,  # [H] float32
    scale: float,
) -> torch.Tensor:
    """Each query over its own keys, a per-head sink logit in the softmax
    that takes probability mass and gives no value."""
    t, h, _ = q.shape
    scores = torch.einsum("thd,tkd->thk", q, keys).float() * scale + bias[:, None, :].float()
    logits = torch.cat([scores, sinks.float()[None, :, None].expand(t, h, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs.to(keys.dtype), keys)


class CompressedAttentionBackend:
    """Owns the pools and the per-forward plan; the model's layers call
    ``store_*`` / ``emit`` / ``attend`` on it."""

    def __init__(self, mc: ModelConfig, pool: CompressedPool, groups: tuple[CacheGroup, ...]):
        self.pool, self.groups = pool, groups
        self.budget = GATHER_BUDGET  # elements per gather (tests shrink it)
        self.window = mc.deepseek_v4.sliding_window
        self.csa_rate = mc.deepseek_v4.rate(CSA) if CSA in mc.deepseek_v4.layer_types else 0

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = plan_compressed(meta, self.groups, self.window, self.csa_rate)

    def store_window(self, layer: int, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        self.pool.window[layer].index_copy_(0, meta.slot_mapping, kv.to(self.pool.dtype))

    def emit(
        self,
        layer: int,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ape: torch.Tensor,
        rate: int,
        meta: AttentionMetadata,
        index: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stores this forward's source projections and returns the windows
        they close, compressed but not yet normed or rotated (with the entry
        positions), or None."""
        src_kv, src_gate = (self.pool.index_sources if index else self.pool.sources)[layer]
        src_kv.index_copy_(0, meta.slot_mapping, kv.float())
        src_gate.index_copy_(0, meta.slot_mapping, gate.float())
        closing = meta.plan.visible[rate].closing
        if closing is None:
            return None
        out = compress_windows(
            src_kv[closing.sources], src_gate[closing.sources], closing.valid, ape.float(),
            overlap=rate == self.csa_rate,
        )  # fmt: skip
        return out, closing.positions

    def store_entries(
        self,
        layer: int,
        entries: torch.Tensor,
        rate: int,
        meta: AttentionMetadata,
        index: bool = False,
    ) -> None:
        dest = (self.pool.index_keys if index else self.pool.entries)[layer]
        dest.index_copy_(0, meta.plan.visible[rate].closing.dest, entries.to(dest.dtype))

    def select(
        self, layer: int, q: torch.Tensor, head_weights: torch.Tensor, rate: int, top_k: int, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_entries(
            q, head_weights, self.pool.index_keys[layer], meta.plan.visible[rate], top_k,
            self.budget,
        )  # fmt: skip

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        meta: AttentionMetadata,
        entries: Visible | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``q [T, H, D]`` over its window and, when given, entries: every
        visible one (``Visible``) or chosen slots with their validity
        ``([T, k], [T, k])`` -> ``[T, H, D]``."""
        plan = meta.plan
        window, pool = self.pool.window[layer], self.pool.entries.get(layer)
        n = (
            0
            if entries is None
            else (entries.width if isinstance(entries, Visible) else entries[0].shape[1])
        )
        width = plan.window_slots.shape[1] + n
        out = []
        for rows in row_chunks(q.shape[0], width * max(q.shape[1], q.shape[2]), self.budget):
            keys = window[plan.window_slots[rows]]  # [t, W, D]
            bias = plan.window_bias[rows]
            if n:
                if isinstance(entries, Visible):
                    slots, valid = entries.rows(rows)
                else:
                    slots, valid = entries[0][rows], entries[1][rows]
                keys = torch.cat([keys, pool[slots]], dim=1)  # [t, W + N, D]
                hidden = torch.zeros(valid.shape, device=valid.device)
                bias = torch.cat([bias, hidden.masked_fill_(~valid, float("-inf"))], dim=1)
            # A masked slot holds another request's keys, or a freed page's:
            # zeroed (the gather is a copy), since a masked NaN would still
            # poison the softmax (NaN + -inf) and the sum (0 x NaN).
            keys.masked_fill_((bias == float("-inf"))[..., None], 0)
            out.append(sink_attention(q[rows], keys.to(q.dtype), bias, sinks, scale))
        return torch.cat(out)
