from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN (mkldnn) linears over a pre-packed weight: what torch.compile's CPU
# weight prepacking builds, without compiling anything.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Smaller weights stay on F.linear: below this oneDNN's fixed cost per call
# (~15 us here, against ~5 us for F.linear on a 256 x 256 weight at one row)
# outweighs the matmul. Every projection of the demo target is this big.
PACK_MIN_ELEMENTS = 1 << 16
# Which of the two is faster depends on the CPU and the rows: on an AMD
# Zen 5 the packed matmul ran 1.5-4x faster than F.linear (MKL) at 2-16
# rows; on an Intel Xeon, F.linear ran 2-3x faster at 1-8 rows and the
# packed one about 2x faster at 16-32 (the demo's plain decoding 1.2-1.5x
# faster at one request by F.linear, a little slower at 16). So each
# weight shape is timed both ways once per process (``packed_rows``), at
# 1, 2, 4, .. 2**(ROW_CLASSES - 1) rows, and a matmul takes its row
# class's faster path (past the largest class, the largest's).
ROW_CLASSES = 9
# Each path's time is its fastest of this many calls, interleaved (the
# first one also builds oneDNN's kernel for the row count).
TIMING_ROUNDS = 7


class PackedWeight:
    """oneDNN's pre-packed copy of a CPU linear weight, made once and rebuilt
    when the weight changes (a reload, a training step). Where it is the
    faster path (``packed_rows``: on some CPUs 1.5-4x faster than
    ``F.linear`` at the 2-16 rows of verify chains, draft blocks and batched
    decode, on others slower at a few rows), a serving matmul runs over it;
    float32 stays float32 throughout. The checkpoint-layout weight stays the
    parameter (the loader, a tied embedding, gradients, other devices and
    ``F.linear`` use it), so CPU linear weights are held twice."""

    __slots__ = ("_packed", "_of", "_wins", "_dtype", "_dense_below")

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._of: tuple[int, int, torch.dtype] | None = None  # (data_ptr, version, dtype)
        # Per row class, whether a serving matmul runs packed (``pack``'s
        # ``packed_rows``), and in which input dtype; None: never.
        self._wins: tuple[bool, ...] | None = None
        self._dtype: torch.dtype | None = None
        # An input of fewer elements runs ``F.linear``: its rows are fewer
        # than the first row class timed faster packed.
        self._dense_below: float = math.inf

    def get(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The packed ``weight`` (converted to ``dtype`` first when given)."""
        dtype = dtype or weight.dtype
        # Inference tensors keep no version counter (and cannot change outside it).
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, dtype)
        if self._of != key:
            dense = weight.detach().to(dtype).contiguous()
            self._packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
            self._of = key
        assert self._packed is not None
        return self._packed

    def pack(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Packs now (after loading), where serving will use the packed copy,
        and takes the row classes its shape timed faster packed
        (``packed_rows``, timed now if not yet)."""
        dtype = dtype or weight.dtype
        if _packable(weight.device, dtype, weight):
            self.get(weight, dtype)
            self._wins = wins = packed_rows(weight.shape[0], weight.shape[1], dtype)
            self._dtype = dtype
            first = next((c for c, packed in enumerate(wins) if packed), None)
            self._dense_below = math.inf if first is None else (1 << first) * weight.shape[1]

    def serves(self, x: torch.Tensor) -> bool:
        """Whether ``x`` times the weight runs over the packed copy: packed at
        load (``pack``) for ``x``'s dtype, at a row count whose class timed
        faster so, on the CPU, eager, with nothing recording gradients
        (serving). A weight ``pack`` never packed (another device, a small
        weight, training) runs ``F.linear``. Below the first such class
        one comparison decides: in a decode step each matmul's decision
        from scratch (the checks, the row class, its shape's timing looked
        up: 9 us a call there) cost a plain step at one request 4-5% of its
        time; the row class from what ``pack`` kept, 2%; the comparison
        alone, nothing measurable."""
        if x.numel() < self._dense_below:
            return False
        wins = self._wins
        return wins is not None and wins[row_class(_rows(x))] and serving(x, self._dtype)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs linears over packed ``dtype`` weights.

    float32 packs wherever torch has oneDNN; bfloat16 only where oneDNN has a
    bfloat16 path (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX on x86: an
    AVX2-only CPU refuses to pack it). Asked of torch, then tried once on a
    tiny weight and checked against ``F.linear``, so a CPU (or an
    ``ONEDNN_MAX_CPU_ISA`` cap) that refuses or miscomputes falls back to
    ``F.linear`` instead of failing at start-up. A fact of the machine, hence
    cached for the process."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    # Exactly representable in bfloat16, so both products are exact.
    w = (torch.arange(16 * 32) % 7 - 3).reshape(16, 32).to(dtype)
    x = (torch.arange(3 * 32) % 5 - 2).reshape(3, 32).to(dtype)
    try:
        with torch.no_grad():
            got = packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None))
    except RuntimeError:
        return False
    return torch.equal(got.float(), F.linear(x.float(), w.float()))


def cpu_matmul_path(dtype: torch.dtype) -> str:
    """How CPU linears in ``dtype`` run here (for the start-up log)."""
    name = str(dtype).removeprefix("torch.")
    if onednn_packs(dtype):
        return f"{name} over oneDNN-packed weights or by F.linear, as timed per shape and rows"
    return f"{name} by F.linear (this CPU's oneDNN cannot pack {name} weights)"


def _packable(device: torch.device, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """oneDNN takes a matmul in ``dtype`` on ``device`` by ``weight``."""
    return device.type == "cpu" and weight.numel() >= PACK_MIN_ELEMENTS and onednn_packs(dtype)


def serving(x: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether a matmul of ``x`` by a weight packed for ``dtype`` is a serving
    one: ``x`` in ``dtype`` on the CPU, eager, with nothing recording
    gradients."""
    return (
        x.dtype == dtype
        and x.is_cpu
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def _rows(x: torch.Tensor) -> int:
    """The rows of a matmul's input ``[..., in]``."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def row_class(rows: int) -> int:
    """The row class (``packed_rows``) of a matmul of ``rows`` rows:
    rows 1, 2-3, 4-7, ..., the last class everything past it."""
    return min(max(rows, 1).bit_length() - 1, ROW_CLASSES - 1)


@functools.cache
def packed_rows(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[bool, ...]:
    """Per row class (``row_class``), whether a packed matmul by a weight of
    this shape runs at least as fast here as ``F.linear``, timed at the
    class's fewest rows on random values: like ``onednn_packs``, a fact of
    the machine, hence cached for the process (every weight of the shape,
    every engine in it, alike). Both paths agree to float rounding, so a
    near tie timed one way in one run and the other way in the next
    changes no more than that. (With F.linear taking a class only when
    15% faster, plain decoding on the demo at one request ran 8% behind
    F.linear throughout; without that margin, 5%.)"""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    paths = ((packed_linear, packed), (F.linear, w))
    wins = []
    with torch.no_grad():
        for c in range(ROW_CLASSES):
            x = torch.randn(1 << c, in_features, generator=g).to(dtype)
            best = [math.inf] * len(paths)
            for _ in range(TIMING_ROUNDS):
                for i, (matmul, weight) in enumerate(paths):
                    start = time.perf_counter()
                    matmul(x, weight)
                    best[i] = min(best[i], time.perf_counter() - start)
            wins.append(best[0] <= best[1])
    return tuple(wins)


# oneDNN builds and caches a JIT-compiled kernel, about 0.5 MB, for every
# (row count, weight shape) it multiplies, in two caches of 1,024 entries
# each: a server meeting every row count a step can have (decode rows,
# verify chains, prefill chunks) grew by hundreds of MB before they filled.
# A packed matmul therefore runs at a few row counts only: up to
# ``EXACT_ROWS`` as it comes (decode batches, verify chains: the hot path,
# untouched), else its rows padded up to the next of ``ROW_BUCKETS`` (four
# per octave: at most a quarter more rows, an eighth on average), a longer
# call in blocks of the largest. oneDNN computes every row alone (a row's
# result does not depend on the rows beside it; tested), so neither the
# padding nor the blocks change a value. 48 row counts per weight shape.
EXACT_ROWS = 16
ROW_BUCKETS = tuple(
    EXACT_ROWS * 2**octave * (4 + i) // 4 for octave in range(8) for i in range(1, 5)
)  # 20, 24, 28, 32, 40, ..., 3584, 4096


def packed_linear(
    x: torch.Tensor,  # [..., in]
    packed: torch.Tensor,  # PackedWeight.get's
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., out]
    m = _rows(x)
    if m <= EXACT_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.reshape(m, x.shape[-1])
    block = ROW_BUCKETS[-1]
    parts = [_bucketed(flat[i : i + block], packed, bias) for i in range(0, m, block)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [m, out]
    return out.view(*x.shape[:-1], out.shape[-1])


def row_bucket(rows: int) -> int:
    """The row count a packed matmul of ``rows`` rows (at most the largest
    bucket) runs at."""
    if rows <= EXACT_ROWS:
        return rows
    return next(b for b in ROW_BUCKETS if b >= rows)


def _bucketed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [m, in]`` (m at most the largest bucket) times the packed weight,
    run at ``row_bucket(m)`` rows."""
    m = x.shape[0]
    pad = row_bucket(m) - m
    out = torch.ops.mkldnn._linear_pointwise(
        F.pad(x, (0, 0, 0, pad)) if pad else x, packed, bias, "none", [], ""
    )
    return out[:m] if pad else out


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,
    packed: PackedWeight,
) -> torch.Tensor:  # [..., out]
    """``F.linear``, over ``packed`` where it serves (``PackedWeight.serves``;
    the values agree to float rounding); ``F.linear`` itself when training,
    compiling, or elsewhere."""
    if packed.serves(x):
        return packed_linear(x, packed.get(weight), bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose serving forward on the CPU runs over a pre-packed
    weight (``PackedWeight``), packed by ``post_load`` once the weights are
    in. Hot paths call ``forward`` directly: a module call costs more than
    the matmul of a small model at decode sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()

    def post_load(self) -> None:
        self.packed.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank loads (tensor parallelism):
    ``length`` entries from ``start`` along ``dim``, of the ``full`` the
    checkpoint must have."""

    dim: int
    start: int
    length: int
    full: int


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up).

    The checkpoint stores each projection separately; the loader copies one
    of them into its row range of the fused weight (``checkpoint_part``).
    Column-parallel under tensor parallelism: ``sources`` says which rows of
    each checkpoint projection this rank holds.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        sources: list[Shard] | None = None,
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.sources = sources

    def checkpoint_part(self, param_name: str, part: int) -> tuple[torch.Tensor, Shard | None]:
        """The rows of the fused ``param_name`` that checkpoint projection
        ``part`` fills, and the slice of it they take (None: all of it)."""
        param = self.weight if param_name == "weight" else self.bias
        view = param.data.narrow(0, self.offsets[part], self.out_sizes[part])
        return view, None if self.sources is None else self.sources[part]


class FusedLinears:
    """Linears that share an input, run as one matmul over their weights side
    by side. ``fuse_()`` (once the weights are loaded; serving) moves the
    weights into one tensor, re-points each linear to its rows, so nothing
    is copied twice, and packs it (``PackedWeight``); until then (training)
    the concatenation is made per call, through which gradients reach each
    linear."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.packed = PackedWeight()

    def fuse_(self) -> None:
        self.weight, self.bias = self._joined()
        offset = 0
        for lin in self.linears:
            rows = slice(offset, offset + lin.weight.shape[0])
            lin.weight.data = self.weight[rows]
            if self.bias is not None:
                lin.bias.data = self.bias[rows]
            offset = rows.stop
        self.packed.pack(self.weight)

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.cat([lin.weight for lin in self.linears])
        has_bias = self.linears[0].bias is not None
        return w, torch.cat([lin.bias for lin in self.linears]) if has_bias else None

    def __call__(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., sum(out)]`` (or the output ``rows`` only)."""
        w = self.weight
        if w is not None and self.packed.serves(x):
            # The packed weight is the whole one: every row, then the slice.
            return packed_linear(x, self.packed.get(w), self.bias)[..., rows]
        w, b = (w, self.bias) if w is not None else self._joined()
        return F.linear(x, w[rows], None if b is None else b[rows])


def k_major_(weight: torch.Tensor) -> None:
    """Re-lays a CPU weight ``[out, in]`` in place so that ``in`` is the outer
    dimension (the shape and values stay; the strides become ``(1, out)``):
    for wide outputs MKL's matmul runs about 2x faster on that layout at a
    few rows. For the matmuls that stay on MKL (the Markov head's small-rank
    ``addmm``). A no-op on other devices and on weights laid out so."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(0) == 1:
        return
    weight.data = weight.data.t().contiguous().t()


class LogitsHead(nn.Linear):
    """``lm_head``: float32 logits accumulated in float32, whatever the weight's
    dtype. A bf16 matmul rounds its output to bf16 (about ±0.06 at typical
    logit magnitudes), which no later ``.float()`` can undo; logprobs and the
    sampler's distribution need the unrounded values.

    CUDA: one GEMM with bf16/fp16 inputs and a float32 output. CPU (which has
    no such GEMM): a float32 weight; serving packs it (``PackedWeight``, a
    float32 copy of a bf16 weight), training multiplies by the weight itself
    or a float32 copy made once.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        # ``c``: logits become ``c * tanh(logits / c)`` (Gemma's final soft cap).
        self.softcap: float | None = None
        self.packed = PackedWeight()
        self._fp32: torch.Tensor | None = None
        self._fp32_of: tuple[int, int] | None = None  # (data_ptr, version) it copies

    def post_load(self) -> None:
        """After the weights are in."""
        self.packed.pack(self.weight, torch.float32)

    def cpu_weight(self) -> torch.Tensor:
        """The float32 weight the unpacked CPU path multiplies by: the weight
        itself, or its float32 copy (made once, refreshed when the weight changes)."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._fp32_of != key:
            self._fp32, self._fp32_of = w.detach().float(), key
        assert self._fp32 is not None
        return self._fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V] float32
        logits = self._linear(x)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap).mul_(self.softcap)
        return logits

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.is_cuda and w.dtype != torch.float32:
            flat = x.reshape(-1, x.shape[-1])
            out = torch.mm(flat, w.t(), out_dtype=torch.float32)
            return out.view(*x.shape[:-1], w.shape[0])
        xf = x.float()
        if self.packed.serves(xf):
            return packed_linear(xf, self.packed.get(w, torch.float32))
        return F.linear(xf, w if w.dtype == torch.float32 else self.cpu_weight())
