"""Tensor-parallel layers: each rank holds a slice of a weight and reads
only that slice from the checkpoint (``Shard``).

- column-parallel: a projection's output features split (``MergedLinear``
  with ``sources``: q/k/v by heads, gate/up by intermediate features;
  ``ColumnParallelLinear`` for one projection);
- ``RowParallelLinear``: input features split, partial outputs summed by an
  all-reduce (o_proj, down_proj; or by its caller, with others);
- ``VocabParallelEmbedding`` / ``VocabParallelHead``: the vocabulary split,
  padded to a multiple of the ranks (the padding rows are zero; their
  logits never leave the shard).

At one rank each is its plain counterpart: the whole weight, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed import RankGroup
from specserve.layers.linear import Linear, LogitsHead, Shard, linear


def split(n: int, group: RankGroup, what: str) -> tuple[int, int]:
    """This rank's (start, count) of ``n`` equal parts."""
    if n % group.size:
        raise ValueError(f"tp_size: {what} ({n}) must divide by tp_size ({group.size})")
    per = n // group.size
    return group.rank * per, per


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads: ``q_count`` query heads from
    ``q_start``, and the KV heads they read (``kv_count`` from
    ``kv_start``; one, replicated, where there are fewer KV heads than
    ranks)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, group: RankGroup) -> HeadSplit:
        q_start, q_count = split(num_heads, group, "num_attention_heads")
        if num_kv_heads >= group.size:
            kv_start, kv_count = split(num_kv_heads, group, "num_key_value_heads")
        elif group.size % num_kv_heads:
            raise ValueError(
                f"tp_size: {group.size} ranks cannot share num_key_value_heads "
                f"({num_kv_heads}) evenly"
            )
        else:  # each KV head serves the query heads of size / kv ranks
            kv_start, kv_count = group.rank * num_kv_heads // group.size, 1
        return cls(q_start, q_count, kv_start, kv_count)


class ColumnParallelLinear(Linear):
    """``y = x W^T + b`` with ``W``'s output features (and ``b``) split over
    the ranks (contiguous ``length`` rows from ``start``; by default an even
    split): each rank computes its slice of ``y``, no collective."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: RankGroup,
        what: str,
        rows: tuple[int, int] | None = None,
        bias: bool = False,
    ) -> None:
        start, count = rows or split(out_features, group, what)
        super().__init__(in_features, count, bias=bias)
        self.group = group
        self.shard = Shard(0, start, count, out_features)

    def checkpoint_part(self, attr: str) -> tuple[torch.Tensor, Shard | None]:
        return getattr(self, attr).data, self.shard if self.group.size > 1 else None


class RowParallelLinear(Linear):
    """``y = x W^T + b`` with ``W``'s input features split over the ranks:
    each multiplies its slice of ``x``, the all-reduce sums the parts (the
    bias is added once, by rank 0). ``reduce`` False: the caller sums the
    partial outputs itself (with others', in one all-reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: RankGroup,
        what: str,
        reduce: bool = True,
    ) -> None:
        start, count = split(in_features, group, what)
        super().__init__(count, out_features, bias=bias)
        self.group = group
        self.reduce = reduce
        self.shard = Shard(1, start, count, in_features)

    def checkpoint_part(self, attr: str) -> tuple[torch.Tensor, Shard | None]:
        param = getattr(self, attr)
        return param.data, self.shard if attr == "weight" and self.group.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(x)
        bias = self.bias if self.group.is_first else None
        out = linear(x, self.weight, bias, self.packed)
        return self.group.all_reduce(out) if self.reduce else out


def vocab_shard(vocab_size: int, group: RankGroup) -> tuple[int, int, int]:
    """(first id, rows held, rows of checkpoint vocabulary among them): the
    vocabulary padded to a multiple of the ranks, split evenly."""
    per = -(-vocab_size // group.size)
    start = group.rank * per
    return start, per, max(0, min(per, vocab_size - start))


class VocabRows:
    """What the embedding and the head share: a weight whose rows are this
    rank's slice of the (padded) vocabulary, ids ``vocab_start ..``, of
    which the first ``vocab_real`` are the checkpoint's."""

    weight: nn.Parameter
    group: RankGroup

    def split_vocab(self, vocab_size: int, group: RankGroup) -> int:
        """Records this rank's slice of ``vocab_size`` ids; its row count."""
        self.vocab_start, rows, self.vocab_real = vocab_shard(vocab_size, group)
        self.full_vocab = vocab_size
        return rows

    def checkpoint_part(self, attr: str) -> tuple[torch.Tensor, Shard | None]:
        """The rows the checkpoint fills, and the slice of it they are."""
        if self.group.size == 1:
            return self.weight.data, None
        shard = Shard(0, self.vocab_start, self.vocab_real, self.full_vocab)
        return self.weight.data.narrow(0, 0, self.vocab_real), shard

    def zero_padding(self) -> None:
        self.weight.data[self.vocab_real :].zero_()


def embedding_weight(rows: int, dim: int) -> torch.Tensor:
    """An embedding table ``[rows, dim]`` initialised as ``nn.Embedding``
    does, except on the meta device (a model built before its checkpoint
    loads), where there is nothing to initialise: meta's ``normal_`` goes
    through torch's reference ops, whose first call imports ``torch._dynamo``,
    2 s of every server's and rank's start-up."""
    weight = torch.empty(rows, dim)
    return weight if weight.is_meta else nn.init.normal_(weight)


class VocabParallelEmbedding(VocabRows, nn.Embedding):
    """An embedding whose rows (token ids) are split over the ranks: each
    looks up the ids it holds (zero for the others), the all-reduce adds the
    rows up."""

    def __init__(self, vocab_size: int, dim: int, group: RankGroup) -> None:
        rows = self.split_vocab(vocab_size, group)
        nn.Embedding.__init__(self, rows, dim, _weight=embedding_weight(rows, dim))
        self.group = group

    def post_load(self) -> None:
        self.zero_padding()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_real)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * held.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)


class VocabParallelLinear(VocabRows, nn.Linear):
    """A linear whose output features are the vocabulary, split over the
    ranks as ``VocabParallelHead``'s (the DSpark Markov head's ``W2``): each
    rank computes its ids' columns, no collective."""

    def __init__(self, in_features: int, vocab_size: int, group: RankGroup) -> None:
        nn.Linear.__init__(self, in_features, self.split_vocab(vocab_size, group), bias=False)
        self.group = group

    def post_load(self) -> None:
        self.zero_padding()


class VocabParallelHead(VocabRows, LogitsHead):
    """``lm_head`` over this rank's slice of the vocabulary: logits
    ``[..., V / N]`` (float32, as ``LogitsHead``), padding columns included."""

    def __init__(self, dim: int, vocab_size: int, group: RankGroup) -> None:
        LogitsHead.__init__(self, dim, self.split_vocab(vocab_size, group))
        self.group = group

    def post_load(self) -> None:
        self.zero_padding()
        LogitsHead.post_load(self)

    def gather(
        self, logits: torch.Tensor, keep: torch.Tensor | None = None, kept: int = 0
    ) -> torch.Tensor | None:
        """The full ``[R, V]`` logits on rank 0 (None on the others). With
        ``keep`` (a mask of the ``kept`` rows to send; the same on every
        rank) only those rows travel; the others are left unset."""
        if self.group.size == 1:
            return logits
        if keep is None:
            parts = self.group.gather_to_first(logits)
            return None if parts is None else torch.cat(parts, dim=-1)[..., : self.full_vocab]
        full = None
        if self.group.is_first:
            full = logits.new_empty(logits.shape[0], self.full_vocab)
        if kept:
            parts = self.group.gather_to_first(logits[keep])
            if full is not None:
                assert parts is not None
                full[keep] = torch.cat(parts, dim=-1)[:, : self.full_vocab]
        return full
