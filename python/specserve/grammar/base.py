"""The grammar interface the engine uses; backends implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: its kind and its text (the JSON schema, regex or EBNF)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")

    @property
    def field(self) -> str:
        """The request field the constraint came from (for error messages)."""
        return self.kind


class GrammarMatcher(ABC):
    """The state of one request inside its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advances over ``token_id``; False (and no change) if the grammar forbids it."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (int32 words, CPU)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""


class GrammarBackend(ABC):
    vocab_size: int  # the model's (bitmask width), padding ids always masked

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """A compiled grammar (cached); ``ValueError`` naming the field if it does not compile."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    @abstractmethod
    def close(self) -> None:
        """Stops what the backend runs besides this process (its workers)."""
