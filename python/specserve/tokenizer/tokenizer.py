"""HF tokenizers from a local path, plus chat templates."""

from __future__ import annotations

import json
import os
from typing import Any


class Tokenizer:
    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer_path: {path!r} is not a directory")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many kinds; one clear line instead
            raise ValueError(
                f"tokenizer_path: cannot load a tokenizer from {path!r}: {e}"
            ) from None
        self.eos_token_ids = frozenset(self._eos_ids(path))
        # transformers' decode wraps the Rust tokenizer's and only adds an optional
        # space clean-up; calling the Rust one directly saves most of the cost.
        backend = getattr(self.hf, "_tokenizer", None)
        plain = not getattr(self.hf, "clean_up_tokenization_spaces", False)
        self._fast_decode = backend.decode if backend is not None and plain else None
        self._byte_level = backend is not None and '"ByteLevel"' in backend.to_str()
        self._unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}

    def _eos_ids(self, path: str) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        # generation_config.json often lists more (e.g. chat end-of-turn tokens).
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def eos_token(self) -> str | None:
        return self.hf.eos_token

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprob entries)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token, also when it holds part of a character."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._unicode_to_byte for c in piece):
            return bytes(self._unicode_to_byte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.hf.chat_template:
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE vocabularies:
    printable Latin-1 bytes map to themselves, the rest to code points 256+."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
