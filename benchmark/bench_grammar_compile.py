"""What a bounded grammar compile costs: the worker process against compiling
in-process only, on the demo tokenizer.

Measured: the first grammar's latency (the compile worker starting: a fresh
interpreter importing xgrammar), then ``--repeats`` new JSON schemas (a
typical one: nested object, enum, pattern, bounded array, integer ranges;
each made new by its bounds, so none is cached) compiled by
``XGrammarBackend.compile`` (a worker compiles it under the limits, then
this process compiles it again) and by the same xgrammar compile alone
(``compile_spec``, what the backend did before the limits); and a cache hit.
Medians in milliseconds.

    python benchmark/bench_grammar_compile.py
    python benchmark/bench_grammar_compile.py --model-path PATH --repeats 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def schema(i: int) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 10, "maximum": 100 + i},
                "kind": {"enum": ["cat", "dog", "emu"]},
                "ok": {"type": "boolean"},
                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                "owner": {
                    "type": "object",
                    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                    "required": ["age"],
                },
            },
            "required": ["id", "kind", "ok", "code", "tags", "owner"],
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="default: the demo target")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    from specserve.assets import demo_path
    from specserve.grammar.base import GrammarSpec
    from specserve.grammar.compile_worker import compile_spec
    from specserve.grammar.xgrammar_backend import XGrammarBackend
    from specserve.tokenizer.tokenizer import Tokenizer

    path = args.model_path or demo_path("target")
    with open(f"{path}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    tok = Tokenizer(path)
    backend = XGrammarBackend(tok.hf, vocab, [tok.hf.eos_token_id or 0])
    try:
        start = time.perf_counter()
        backend.compile(GrammarSpec("regex", "[a-z]+"))
        first = time.perf_counter() - start

        def ms(fn) -> float:
            times = []
            for i in range(args.repeats):
                start = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - start)
            return 1e3 * statistics.median(times)

        compiler = backend._compiler
        alone = ms(lambda i: compile_spec(compiler, "json_schema", schema(i)))
        bounded = ms(lambda i: backend.compile(GrammarSpec("json_schema", schema(1000 + i))))
        hit = ms(lambda i: backend.compile(GrammarSpec("json_schema", schema(1000))))
    finally:
        backend.close()
    print(f"first grammar (worker start): {first:.2f} s")
    print(f"new typical JSON schema, in-process only: {alone:.2f} ms")
    print(f"new typical JSON schema, worker + in-process: {bounded:.2f} ms")
    print(f"cached: {hit:.4f} ms")


if __name__ == "__main__":
    main()
