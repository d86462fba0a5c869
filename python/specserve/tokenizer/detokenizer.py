"""Incremental detokenization that never emits half a character.

Byte-level tokenizers split multi-byte UTF-8 characters over several tokens;
decoding such a prefix yields U+FFFD. The state keeps a short window of ids
from the last complete character boundary and only releases text once the
window decodes cleanly. A few prompt ids seed the window so that tokenizers
that drop a leading space at the start of a string decode the first output
token as they would mid-sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

CONTEXT_IDS = 4


class Decoder(Protocol):
    def decode(self, ids: tuple[int, ...], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokState:
    window: tuple[int, ...]  # ids from the last boundary whose text was already released
    read: int  # window[:read] is released (context); window[read:] is pending
    # decode(window[:read]), or None until first computed (the prompt context).
    released: str | None = None

    @classmethod
    def start(cls, prompt_ids: list[int]) -> DetokState:
        ctx = tuple(prompt_ids[-CONTEXT_IDS:])
        return cls(ctx, len(ctx))

    def released_text(self, tok: Decoder, skip_special_tokens: bool) -> str:
        if self.released is not None:
            return self.released
        return tok.decode(self.window[: self.read], skip_special_tokens)


def detok_step(
    tok: Decoder, state: DetokState, token_id: int, skip_special_tokens: bool
) -> tuple[str, DetokState]:
    """Text released by appending ``token_id`` and the next state (pure)."""
    window = state.window + (token_id,)
    released = state.released_text(tok, skip_special_tokens)
    full = tok.decode(window, skip_special_tokens)
    if len(full) > len(released) and not full.endswith("\ufffd"):
        piece = full[len(released) :]
        # The released ids become the next context; their text is ``piece``.
        return piece, DetokState(window[state.read :], len(window) - state.read, piece)
    return "", DetokState(window, state.read, released)


def detok_flush(tok: Decoder, state: DetokState, skip_special_tokens: bool) -> str:
    """Whatever is pending, even an incomplete character (used when a request ends)."""
    released = state.released_text(tok, skip_special_tokens)
    full = tok.decode(state.window, skip_special_tokens)
    return full[len(released) :] if full.startswith(released) else ""
