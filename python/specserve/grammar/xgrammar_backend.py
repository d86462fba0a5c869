"""xgrammar: JSON schema, any JSON object, regex and EBNF grammars."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from specserve.grammar.base import GrammarBackend, GrammarMatcher, GrammarSpec

# xgrammar prefixes its errors with a timestamp and the C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(GrammarBackend):
    """Compiles with xgrammar; JSON output is compact-spaced (``", "``, ``": "``)
    without free whitespace, so a weak model cannot loop on blanks forever."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _LOCATION.sub("", str(e).strip()).strip()
            raise ValueError(f"{spec.field}: the grammar does not compile: {message}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        schema = json.dumps({"type": "object"}) if spec.kind == "json_object" else spec.text
        return c.compile_json_schema(
            schema,
            any_whitespace=False,
            separators=(", ", ": "),
            strict_mode=spec.kind == "json_schema",
        )

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))
