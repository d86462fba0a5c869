"""Training data: token sequences from text files or pre-tokenised JSONL."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import torch


def read_token_stream(paths: Sequence[str], encode, eos_id: int) -> list[int]:
    """All documents as one token stream, each followed by ``eos_id``.

    ``.jsonl`` lines hold ``{"input_ids": [...]}`` (used as given) or
    ``{"text": "..."}``; any other file is one text document.
    """
    stream: list[int] = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"data: {path!r} is not a file")
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"data: {path}:{n}: {e}") from None
                    ids = row.get("input_ids") or encode(row.get("text", ""))
                    stream.extend(int(t) for t in ids)
                    stream.append(eos_id)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                stream.extend(encode(f.read()))
            stream.append(eos_id)
    return stream


def chunk(stream: Sequence[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping ``[N, seq_len]`` windows of the stream (the tail dropped)."""
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"data: {len(stream)} tokens are fewer than one sequence of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def hot_tokens(stream: Iterable[int], size: int, vocab_size: int) -> list[int]:
    """The ``size`` most frequent token ids of ``stream`` (ties: the lower
    id), ascending: a token map for ``--speculative-token-map``."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"size must be in [1, {vocab_size}], got {size}")
    ids = torch.tensor(list(stream), dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"data: token ids must be in [0, {vocab_size})")
    counts = torch.bincount(ids, minlength=vocab_size)
    # Stable descending order by count: equal counts keep ascending ids.
    order = torch.sort(counts, descending=True, stable=True).indices
    return sorted(order[:size].tolist())


def write_jsonl(path: str, sequences: Iterable[Sequence[int]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for ids in sequences:
            f.write(json.dumps({"input_ids": list(ids)}) + "\n")
