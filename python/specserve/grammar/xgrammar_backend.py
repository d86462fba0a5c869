"""xgrammar: JSON schema, any JSON object, regex and EBNF grammars."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch

from specserve.grammar.base import GrammarBackend, GrammarMatcher, GrammarSpec
from specserve.grammar.compile_pool import CompilePool
from specserve.grammar.compile_worker import compile_spec, compiler_message, does_not_compile

logger = logging.getLogger(__name__)


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


class _Flight:
    """One grammar being compiled: callers that ask for it meanwhile wait for
    its result instead of compiling it again."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            kind = ValueError if isinstance(self.error, ValueError) else RuntimeError
            raise kind(str(self.error))
        return self.result


class XGrammarBackend(GrammarBackend):
    """Compiles with xgrammar (``compile_spec`` says how), each new grammar
    first in a ``CompilePool`` worker under the time and memory limits.
    Compiled grammars are cached in-process (least recently used, bounded in
    entries and in bytes); a cache hit never touches a worker."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout: float = 30.0,
        max_memory_mb: int | None = 4096,
        cache_size: int = 256,
        cache_bytes: int = 1 << 30,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # xgrammar's own cache would keep every grammar ever compiled: ours is bounded.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.pool = CompilePool(info.serialize_json(), compile_timeout, max_memory_mb)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._compiling: dict[GrammarSpec, _Flight] = {}
        self._lock = threading.Lock()  # guards the cache and _compiling

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            flight = self._compiling.get(spec)
            if flight is None:
                flight = self._compiling[spec] = _Flight()
                leader = True
            else:
                leader = False
        if not leader:
            return flight.wait()
        try:
            compiled = self._compile(spec)
        except BaseException as e:
            flight.error = e
            raise
        else:
            flight.result = compiled
            self._store(spec, compiled)
        finally:
            with self._lock:
                del self._compiling[spec]
            flight.done.set()
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        # The worker proves the compile fits the limits (it is killed if not);
        # only then does this process run the same compile, which cannot be
        # interrupted but now takes what the worker took.
        seconds = self.pool.check(spec)
        logger.debug("a %s compiled in %.3f s in a worker; compiling it here", spec.kind, seconds)
        try:
            return compile_spec(self._compiler, spec.kind, spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise does_not_compile(spec, compiler_message(e)) from None

    def _store(self, spec: GrammarSpec, compiled: Any) -> None:
        with self._lock:
            self._cache[spec] = compiled
            self._cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (
                len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes
            ):
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def close(self) -> None:
        self.pool.close()
