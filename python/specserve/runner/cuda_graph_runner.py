"""Captured target forwards: DECODE and VERIFY steps replayed from CUDA graphs.

A step whose entries all feed a chain ``[anchor, drafts]`` of at most
``chain`` tokens and want every row's logits (DECODE is the chain of one)
is padded to a batch bucket, and each chain to one width (1 when every
entry decodes, else ``chain``), then run as one replay of the graph
captured for that (width, bucket): one launch for the whole forward
instead of dozens of kernels per layer (the lm_head then runs eagerly on
the real rows). Everything a graph reads sits in static buffers that a
replay refills: token ids, positions, KV slots, and the paged-attention
layout's KV lengths and page tables; the layout's tiles depend only on
the shape, so they are fixed at capture. Padding
tokens (the tail of a short chain, the entries past the batch) write their
K/V to a scratch slot past the pool's pages and their rows are dropped;
the real rows read exactly what they read eagerly (a padding row comes
after them in its chain and a padding entry is a request of its own).
Prefill chunks and mixed batches run eagerly.

Only the Triton attention backend qualifies: its plan lives on the device,
while the torch backend plans each forward on the host. ``capture`` turns a
zero-argument forward into its replay: CUDA graphs on a GPU
(``cuda_graph_capture``); the CPU tests use ``simulated_graph_capture``,
which reruns the same function on the same buffers and plan but keeps what
the engine can tell of a graph (outputs written in place at every replay,
other graphs' outputs clobbered, no host syncs inside), so everything here
but the graph itself is checked without a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.cache.block_pool import page_slots
from specserve.core import ScheduledBatch
from specserve.kernels.paged_attention import plan_layout
from specserve.layers.attention import AttentionMetadata, TritonAttentionBackend

# (final hidden states [N, d], captured layers [N, m * d] or None) of a padded forward.
Outputs = tuple[torch.Tensor, torch.Tensor | None]
Forward = Callable[[], Outputs]
Capture = Callable[[Forward], Forward]


def batch_buckets(max_bs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8th,
    and ``max_bs`` itself (a batch pads to the next one)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    return sizes if sizes[-1] == max_bs else [*sizes, max_bs]


class HostSyncError(RuntimeError):
    """A captured forward read the device back to the host."""


# Ops that read device values to the host (a CUDA graph capture fails on
# them): scalars, and ops whose output shape depends on the data. By name:
# under inference mode composite ops (item, where) reach the dispatcher whole.
_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # item, int(t), bool(t), float(t)
        "item",
        "is_nonzero",
        "equal",
        "nonzero",
        "nonzero_numpy",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "bincount",
    }
)
# Tensor methods that read to the host without an op on a CPU tensor (the
# dispatcher sees nothing, but on a GPU they would sync).
_SYNC_METHODS = frozenset({torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy})


def _is_host_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return True
    if name == "where":  # torch.where(cond): the indices of cond
        return len(args) + len(kwargs) == 1
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean masks
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "repeat_interleave":  # tensor repeats: their sum, unless output_size says
        repeats = args[0] if len(args) == 1 else args[1]
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("_to_copy", "copy_"):  # a copy to the host
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device")
        return dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu"
    return False


class _OpGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_sync(func, args, kwargs):
            raise HostSyncError(f"{func} reads the device inside a captured forward")
        return func(*args, **kwargs)


class _MethodGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_METHODS:
            raise HostSyncError(f"Tensor.{func.__name__} inside a captured forward")
        return func(*args, **(kwargs or {}))


@contextmanager
def host_sync_guard() -> Iterator[None]:
    """Raises ``HostSyncError`` on any host sync inside: what a CUDA graph
    capture cannot record (the CPU's simulated capture runs under it)."""
    with _MethodGuard(), _OpGuard():
        yield


def _poison(t: torch.Tensor | None) -> None:
    if t is not None:
        t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def simulated_graph_capture() -> Capture:
    """What the engine can tell of CUDA graphs sharing one memory pool, on
    any device: a capture runs ``forward`` once and keeps its output tensors;
    each replay runs it again, copies the results into those same tensors
    (a later replay overwrites what an earlier one returned) and fills every
    other captured forward's outputs with NaN (another graph in the pool may
    reuse their memory). Forwards run under ``host_sync_guard``."""
    captured: list[Outputs] = []  # every graph's outputs: the pool

    def capture(forward: Forward) -> Forward:
        with host_sync_guard():
            out = forward()
        captured.append(out)

        def replay() -> Outputs:
            with torch.inference_mode(), host_sync_guard():
                fresh = forward()
            with torch.inference_mode():
                for other in captured:
                    if other is not out:
                        for t in other:
                            _poison(t)
                for t, f in zip(out, fresh, strict=True):
                    if t is not None:
                        t.copy_(f)
            return out

        return replay

    return capture


def cuda_graph_capture(device: torch.device) -> Capture:
    """CUDA graphs sharing one memory pool (captured largest first, the
    smaller ones reuse its blocks). Each forward runs twice on a side stream
    first, so that kernels compile and allocations settle before capture."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Forward) -> Forward:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> Outputs:
            graph.replay()
            return out

        return replay

    return capture


@dataclass(frozen=True)
class GraphShape:
    width: int  # tokens per entry: 1 (decode) or the verify chain
    batch: int  # entries, a bucket


class StaticTables:
    """The KV lengths and page tables a captured paged-attention batch reads,
    for up to ``rows`` requests: a replay refills them (``fill``), the
    metadata built at capture keeps views of them (``metadata``)."""

    def __init__(
        self, rows: int, max_pages: int, page_size: int, backend: TritonAttentionBackend
    ) -> None:
        device = backend.kv_pool.k[0].device
        self.kv_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.max_pages, self.page_size, self.group = max_pages, page_size, backend.group

    def metadata(
        self, q_len: int, batch: int, positions: torch.Tensor, slots: torch.Tensor, causal: bool
    ) -> AttentionMetadata:
        """``batch`` requests of ``q_len`` queries each over the buffers; the
        host-side lists are placeholders, never read again. Until the first
        fill, every request is a chain from position 0."""
        q_lens = [q_len] * batch
        self.kv_lens[:batch].fill_(q_len)
        fixed = plan_layout(
            q_lens, q_lens, [[0]] * batch, self.page_size, positions.device, self.group, causal
        )
        return AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            q_lens=q_lens,
            kv_lens=q_lens,
            page_tables=[[0]] * batch,
            page_size=self.page_size,
            causal=causal,
            plan=replace(fixed, kv_lens=self.kv_lens[:batch], page_table=self.page_table[:batch]),
        )

    def fill(self, kv_lens: list[int], tables: list[list[int]]) -> None:
        """The KV lengths of every request of the padded batch and the page
        tables of the real ones (a padding request's stale row holds valid
        pages, and only the columns its KV length reaches are read)."""
        width = max(len(t) for t in tables)
        assert width <= self.max_pages and max(kv_lens) <= self.max_pages * self.page_size, (
            "a request past the page-table buffer"
        )
        padded = [t + [0] * (width - len(t)) for t in tables]
        self.kv_lens[: len(kv_lens)].copy_(
            torch.tensor(kv_lens, dtype=torch.int32), non_blocking=True
        )
        self.page_table[: len(tables), :width].copy_(
            torch.tensor(padded, dtype=torch.int32), non_blocking=True
        )


class CudaGraphRunner:
    """The captured forwards of one target model over its KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: TritonAttentionBackend,
        page_size: int,
        context_length: int,
        scratch_slot: int,
        chain: int,
        capture_layer_ids: tuple[int, ...],
        max_bs: int,
        capture: Capture,
    ) -> None:
        """``scratch_slot``: a KV slot no request owns (padding writes there);
        ``chain``: the longest verify chain (1: decoding only)."""
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.chain = chain
        self.capture_layer_ids = capture_layer_ids
        self.scratch_slot = scratch_slot
        self.buckets = batch_buckets(max_bs)
        device = next(model.parameters()).device
        self.device = device
        most = self.buckets[-1] * chain
        # ids | positions | slots, one upload per replay.
        self.tokens = torch.zeros(3, most, dtype=torch.int64, device=device)
        self.tokens[2].fill_(scratch_slot)
        # A padded chain reaches ``chain`` positions past the context's last page.
        max_pages = -(-(context_length + chain) // page_size)
        self.tables = StaticTables(self.buckets[-1], max_pages, page_size, backend)
        self.capture = capture  # proposers capture their forwards with it too
        self.graphs: dict[GraphShape, Forward] = {}
        self.replays: Counter[GraphShape] = Counter()  # by shape, over the runner's life
        widths = [1] if chain == 1 else [chain, 1]  # the largest forward first
        with torch.inference_mode():
            for width in widths:
                for bs in reversed(self.buckets):
                    shape = GraphShape(width, bs)
                    self.graphs[shape] = capture(self._forward(shape))

    def _forward(self, shape: GraphShape) -> Forward:
        """The padded forward of ``shape`` over the static buffers, its
        metadata built once."""
        n = shape.batch * shape.width
        ids, positions, slots = self.tokens[0, :n], self.tokens[1, :n], self.tokens[2, :n]
        meta = self.tables.metadata(shape.width, shape.batch, positions, slots, causal=True)

        def forward() -> Outputs:
            hidden, captured = self.model(ids, meta, self.backend, self.capture_layer_ids)
            return hidden, torch.cat(captured, dim=-1) if captured else None

        return forward

    def shape_for(self, batch: ScheduledBatch) -> GraphShape | None:
        """The captured shape ``batch`` replays in, or None (run it eagerly)."""
        entries = batch.entries
        if not entries or len(entries) > self.buckets[-1]:
            return None
        if batch.capture_layer_ids != self.capture_layer_ids:
            return None
        width = 1
        for e in entries:
            n = len(e.token_ids)
            if n > self.chain or e.entry_tables or len(e.logit_rows) != n:
                return None
            if e.logit_rows != list(range(n)):
                return None
            width = max(width, n)
        width = 1 if width == 1 else self.chain
        bs = next(b for b in self.buckets if b >= len(entries))
        return GraphShape(width, bs)

    def replay(
        self, batch: ScheduledBatch, shape: GraphShape
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[R, V]`` of the entries' logit rows, in entry order, and the
        captured layers ``[T, m * d]`` of the fed tokens: both copies, not
        views of the graph's buffers (proposers keep the features)."""
        w, ps, entries = shape.width, self.page_size, batch.entries
        n = shape.batch * w
        # Padding entries: token 0 at positions 0.., K/V to the scratch slot.
        ids, positions, slots = [0] * n, [0] * n, [self.scratch_slot] * n
        kv_lens = [w] * shape.batch
        rows: list[int] = []  # the real tokens' rows of the padded batch
        for b, e in enumerate(entries):
            k, at, p = len(e.token_ids), b * w, e.prefix_len
            ids[at : at + k] = e.token_ids
            # A chain's padding rows take its last position: one inside the
            # RoPE table (p + w may pass the context's end); the kernel places
            # queries by the KV length, not by these.
            positions[at : at + w] = [*range(p, p + k), *[p + k - 1] * (w - k)]
            slots[at : at + k] = page_slots(e.page_table, p, p + k, ps)
            kv_lens[b] = p + w
            rows.extend(range(at, at + k))
        self.tokens[:, :n].copy_(torch.tensor([ids, positions, slots]), non_blocking=True)
        self.tables.fill(kv_lens, [e.page_table for e in entries])
        hidden, captured = self.graphs[shape]()
        self.replays[shape] += 1
        if len(rows) == rows[-1] + 1:  # every row real up to the last: a prefix
            hidden = hidden[: len(rows)]
            captured = None if captured is None else captured[: len(rows)].clone()
        else:
            index = torch.tensor(rows, device=self.device)
            hidden = hidden.index_select(0, index)
            captured = None if captured is None else captured.index_select(0, index)
        # The lm_head outside the graph: one GEMM over the real rows only, and
        # no [N, V] output kept per captured graph.
        return self.model.compute_logits(hidden), captured
