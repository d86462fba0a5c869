"""Per-layer paged K/V storage."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVPool:
    """K and V of every layer as ``[num_pages * page_size, num_kv_heads, head_dim]``.

    A token's slot is ``page * page_size + offset``; page tables live with the
    requests, this class only stores. ``layer_shapes``: each layer's own
    (KV heads, head dim) where layers differ (Gemma 4's global layers), in
    place of ``num_kv_heads`` and ``head_dim``.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        slots = num_pages * page_size
        shapes = layer_shapes or [(num_kv_heads, head_dim)] * num_layers
        assert len(shapes) == num_layers, f"{len(shapes)} layer shapes for {num_layers} layers"
        self.k = [torch.zeros(slots, h, d, dtype=dtype, device=device) for h, d in shapes]
        self.v = [torch.zeros(slots, h, d, dtype=dtype, device=device) for h, d in shapes]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return KVPool.layers_bytes_per_page(
            [(num_kv_heads, head_dim)] * num_layers, page_size, dtype
        )

    @staticmethod
    def layers_bytes_per_page(
        layer_shapes: Sequence[tuple[int, int]], page_size: int, dtype: torch.dtype
    ) -> int:
        """A page's K and V over layers of these (KV heads, head dim)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * page_size * sum(h * d for h, d in layer_shapes) * elem

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v [T, Hkv, D]`` into ``slots [T]``."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
