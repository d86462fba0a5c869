"""HF tokenizers from a local path, plus chat templates."""

from __future__ import annotations

import copy
import json
import os
import threading
from typing import Any


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be encoded (and so tokenized, logged and sent back):
    JSON's escapes can spell lone surrogates, which UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Tokenizer:
    """One tokenizer, safe to call from any thread.

    HF fast tokenizers are not safe to share between threads: a call that
    changes the Rust tokenizer's settings (padding, truncation, special-token
    splitting) while another thread encodes or decodes fails with "Already
    borrowed". HTTP workers encode on their threads while the engine thread
    decodes, so every thread gets its own copy of the loaded tokenizer.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer_path: {path!r} is not a directory")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many kinds; one clear line instead
            raise ValueError(
                f"tokenizer_path: cannot load a tokenizer from {path!r}: {e}"
            ) from None
        self._template = hf  # copied into every thread; never called itself
        self._local = threading.local()
        self.eos_token_ids = frozenset(self._eos_ids(path))
        backend = getattr(hf, "_tokenizer", None)
        self._byte_level = backend is not None and '"ByteLevel"' in backend.to_str()
        self._unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}

    @property
    def hf(self) -> Any:
        """This thread's HF tokenizer."""
        local = self._local
        hf = getattr(local, "hf", None)
        if hf is None:
            hf = local.hf = copy.deepcopy(self._template)
            # transformers' decode wraps the Rust tokenizer's and only adds an
            # optional space clean-up; calling the Rust one directly saves most
            # of the cost.
            backend = getattr(hf, "_tokenizer", None)
            plain = not getattr(hf, "clean_up_tokenization_spaces", False)
            local.fast_decode = backend.decode if backend is not None and plain else None
        return hf

    def _eos_ids(self, path: str) -> set[int]:
        ids: set[int] = set()
        if self._template.eos_token_id is not None:
            ids.add(int(self._template.eos_token_id))
        # generation_config.json often lists more (e.g. chat end-of-turn tokens).
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def eos_token(self) -> str | None:
        return self._template.eos_token

    def __len__(self) -> int:
        return len(self._template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        hf = self.hf
        fast = self._local.fast_decode
        if fast is not None:
            return fast(list(ids), skip_special_tokens=skip_special_tokens)
        return hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
