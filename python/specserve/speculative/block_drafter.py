"""What every block drafter shares: the Markov head that makes a block's
drafting left to right, the confidence head, and the walk over a block's
slots that draws the drafts and keeps the distributions they came from."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed import SINGLE, RankGroup
from specserve.kernels.chain_verify import row_argmax
from specserve.layers.linear import LogitsHead, k_major_
from specserve.layers.parallel import VocabParallelHead, VocabParallelLinear, embedding_weight
from specserve.sampling.sampler import exponential_race


class HeadConfig(Protocol):
    """The config fields the heads read (DSpark's and DeepSeek-V4's alike)."""

    hidden_size: int
    vocab_size: int
    markov_rank: int
    markov_head_type: str
    confidence_head_with_markov: bool


class MarkovHead(nn.Module):
    """The bigram-style correction ``B_k(x_{k-1})`` added to slot k's logits.
    Under tensor parallelism ``W2`` is split by vocabulary like the logits it
    corrects; ``W1`` and the gates are whole on every rank."""

    def __init__(
        self, cfg: HeadConfig, group: RankGroup = SINGLE, out_vocab: int | None = None
    ) -> None:
        """``out_vocab``: ``W2``'s rows, a drafter's reduced vocabulary (default
        the target's); ``W1`` is indexed by target ids either way."""
        super().__init__()
        r, d = cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(
            cfg.vocab_size, r, _weight=embedding_weight(cfg.vocab_size, r)
        )
        self.markov_w2 = VocabParallelLinear(r, out_vocab or cfg.vocab_size, group)
        self.hot_w2: torch.Tensor | None = None  # [H, r]: W2's rows of a hot vocabulary
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def restrict(self, rows: torch.Tensor) -> None:
        """Corrections for ``W2``'s ``rows [H]`` only (see ``BlockDrafter.restrict_vocab``)."""
        self.hot_w2 = self.markov_w2.weight.detach()[rows]
        k_major_(self.hot_w2)

    def init_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(n, self.rank) if self.kind == "rnn" else None

    def step(
        self,
        prev: torch.Tensor,
        h: torch.Tensor,
        state: torch.Tensor | None,
        base: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``prev [n]`` token before the slot, ``h [n, d]`` the slot's output ->
        logit correction ``[n, V]`` (float32, added to ``base [n, V]`` when
        given: one matmul-add), the next state, and ``W1[prev] [n, r]``."""
        # F.* on the weights: module calls cost more than these small ops.
        e = F.embedding(prev, self.markov_w1.weight)  # [n, r]
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            z = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e
        else:
            assert state is not None
            gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
            keep = torch.sigmoid(gate)
            state = keep * state + (1 - keep) * torch.tanh(cand)
            z = torch.tanh(out)
        w2 = self.markov_w2.weight if self.hot_w2 is None else self.hot_w2  # [V or H, r]
        if base is not None and z.dtype == base.dtype:
            return torch.addmm(base, z, w2.t()), state, e
        bias = F.linear(z, w2).float()
        return (bias if base is None else base + bias), state, e


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).squeeze(-1).float())


class BlockDrafter(nn.Module):
    """What every block drafter shares: the Markov walk over a block's slots,
    the distributions it draws from, and the confidences. A drafter provides
    ``context_kv``, ``block_hidden``, ``base_logits`` and its heads
    (``markov_head``, ``confidence_head``, ``use_markov``, ``use_confidence``);
    ``window`` is None when a block sees its whole context."""

    window: int | None = None
    # Slots of a block before its first draft's: 1 in the 1 + N layout
    # (slot 0 the anchor's bonus token, slot k predicting anchor + k), 0 in
    # DeepSpec's (slot k predicting anchor + k + 1).
    lead: int = 0
    # The tokens drafts come from, ascending ([H]; None: the whole vocabulary).
    hot_ids: torch.Tensor | None = None
    # Under tensor parallelism: the ids of this rank's logit columns
    # ([C], ascending; its slice of the hot vocabulary), None without one.
    shard_hot_ids: torch.Tensor | None = None

    @property
    def vocab_head(self) -> LogitsHead:
        """The full vocabulary projection (the target's, shared; this rank's
        slice of it under tensor parallelism)."""
        raise NotImplementedError

    @property
    def drafting_head(self) -> LogitsHead:
        """The head drafts come from: the full vocabulary's, or a drafter's
        own over its reduced vocabulary (whose rows ``restrict_vocab`` maps)."""
        return self.vocab_head

    def restrict_vocab(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Drafts from the tokens ``ids [H]`` alone (SGLang's token map, as in
        FR-Spec; a drafter's own reduced vocabulary): the block's logits,
        Markov corrections and argmaxes cover ``H`` tokens instead of the
        vocabulary. Only which drafts are proposed changes: their
        distributions are zero off ``ids``, and verification against the
        target stays exact. ``rows [H]``: the rows of ``drafting_head`` (and
        of the Markov head's ``W2``) for ``ids``, by default ``ids`` themselves.
        Under tensor parallelism each rank keeps the hot ids of its
        vocabulary slice."""
        full = self.drafting_head
        rows, start = ids if rows is None else rows, getattr(full, "vocab_start", 0)
        if isinstance(full, VocabParallelHead) and full.group.size > 1:
            mine = (ids >= start) & (ids < start + full.vocab_real)
            self.shard_hot_ids = ids[mine]
            rows = rows[mine] - start
        with torch.device("meta"):
            head = LogitsHead(full.in_features, rows.numel())
        head.weight = nn.Parameter(full.weight.detach()[rows], requires_grad=False)
        head.softcap = full.softcap
        head.post_load()
        self.hot_head = head
        if self.markov_head is not None:
            self.markov_head.restrict(rows)
        self.hot_ids = ids

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` -> float32 logits over the drafting vocabulary."""
        return (self.vocab_head if self.hot_ids is None else self.hot_head)(hidden)

    @property
    def feature_weight(self) -> torch.Tensor:
        """The weight context features meet first: their device and dtype."""
        raise NotImplementedError

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, gamma, d]`` block outputs -> float32 logits before the Markov head."""
        raise NotImplementedError

    def draft(
        self,
        hidden: torch.Tensor,  # [R, gamma, d]
        anchors: torch.Tensor,  # [R]
        temperatures: torch.Tensor,  # [R]; 0 = greedy
        noise: list[torch.Generator | None] | None = None,
        shared: torch.Generator | None = None,
        with_confidence: bool = True,
        greedy_rows: list[bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Walks the block left to right: drafts ``[R, gamma]``, the (Markov
        corrected, temperature-scaled) probabilities they were drawn from
        ``[R, gamma, V]`` (one-hot for greedy rows; None when every row is
        greedy) and confidences ``[R, gamma]`` (None without the head).
        ``greedy_rows``: which rows are greedy, as the host knows it (read
        off ``temperatures`` otherwise, at the cost of a device sync)."""
        base = self.base_logits(hidden)  # [R, G, V] float32 (V: the hot vocabulary's H)
        r, g, vocab = base.shape
        hot = self.hot_ids
        prev = anchors
        state = self.markov_head.init_state(r, hidden) if self.use_markov else None
        tokens, probs, embeds = [], [], []
        greedy = temperatures <= 0
        if greedy_rows is None:
            greedy_rows = greedy.tolist()  # host read: for callers that do not say (tests)
        sampled_rows = [i for i, is_greedy in enumerate(greedy_rows) if not is_greedy]
        all_greedy = not sampled_rows
        for k in range(g):
            logits = base[:, k]
            if self.use_markov:
                logits, state, prev_embed = self.markov_head.step(prev, hidden[:, k], state, logits)
                embeds.append(prev_embed)
            if all_greedy:  # no distribution to keep: one-hot drafts
                choice = row_argmax(logits)
            else:
                p = torch.softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1)
                choice = _draw(p, logits, sampled_rows, noise, shared)
                probs.append(torch.where(greedy[:, None], F.one_hot(choice, vocab).float(), p))
            if hot is not None:
                choice = hot[choice]  # hot index -> token id
            tokens.append(choice)
            prev = choice
        conf = self._confidence(hidden, embeds) if with_confidence else None
        q = torch.stack(probs, dim=1) if probs else None
        if q is not None and hot is not None:  # zero off the hot vocabulary
            q = q.new_zeros(r, g, self.vocab_head.out_features).index_copy_(2, hot, q)
        return torch.stack(tokens, dim=1), q, conf

    def _confidence(self, hidden: torch.Tensor, embeds: list[torch.Tensor]) -> torch.Tensor | None:
        """Every slot's confidence at once ``[..., gamma]`` (None without the
        head): from the slot's output and, with ``confidence_head_with_markov``,
        ``W1[prev]`` of the token before it (``embeds``, one ``[..., r]`` per slot)."""
        if not self.use_confidence:
            return None
        feats = hidden
        if self.config.confidence_head_with_markov and embeds:
            feats = torch.cat([hidden, torch.stack(embeds, dim=-2)], dim=-1)
        return self.confidence_head(feats)

    def train_logits(
        self, hidden: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced draft logits ``[..., gamma, V]`` (Markov-corrected, with
        ``prev [..., gamma]`` the token before each slot) and confidences."""
        lead, g = hidden.shape[:-2], hidden.shape[-2]
        h = hidden.reshape(-1, g, hidden.shape[-1])
        p = prev.reshape(-1, g)
        logits = self.base_logits(h)  # [N, G, V] float32
        state = self.markov_head.init_state(h.shape[0], h) if self.use_markov else None
        corrections, embeds = [], []
        for k in range(g):
            if self.use_markov:
                bias, state, prev_embed = self.markov_head.step(p[:, k], h[:, k], state)
                corrections.append(bias)
                embeds.append(prev_embed)
        if corrections:
            logits = logits + torch.stack(corrections, dim=1)
        conf = self._confidence(h, embeds)
        return logits.view(*lead, g, -1), None if conf is None else conf.view(*lead, g)


def _draw(
    probs: torch.Tensor,
    logits: torch.Tensor,
    sampled: list[int],
    noise: list[torch.Generator | None] | None,
    shared: torch.Generator | None,
) -> torch.Tensor:
    """Argmax for greedy rows; the sampler's exponential race (seeded rows
    from their own generator) for the ``sampled`` ones."""
    out = row_argmax(logits)
    generators = [None if noise is None else noise[i] for i in sampled]
    out[sampled] = exponential_race(probs[sampled], generators, shared)
    return out
