"""Our decode against llama.cpp's on the same checkpoint, prompts and machine.

The target is converted to GGUF with llama.cpp's own converter
(``convert_hf_to_gguf.py`` of a llama.cpp checkout, or the copy under
``vendor/llama.cpp`` in llama-cpp-python's source distribution). The demo
tokenizer is a GPT-2-style byte-level BPE whose pre-tokenizer hash the
converter does not list, so the conversion maps it to llama.cpp's ``gpt-2``
pre-tokenizer. Then, interleaved ``--repeats`` times, each prompt is decoded
greedily for ``--output-len`` tokens by llama.cpp (llama-cpp-python, the
checkpoint's dtype), by our plain engine and by our DSPARK engine; the table
gives milliseconds per generated token (prompt included, the same on every
side) and how many prompts gave llama.cpp's tokens exactly.

    pip install llama-cpp-python   # optional: builds llama.cpp (cmake, ~6 min on 2 cores)
    python benchmark/bench_llama_cpp.py --converter PATH/convert_hf_to_gguf.py

Without llama-cpp-python, or without a converter, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Runs the converter with the GGUF package next to it and the demo's
# pre-tokenizer mapped to gpt-2 (argv: converter, checkpoint, outfile, outtype).
CONVERT = """
import runpy, sys
conv, src, out, outtype = sys.argv[1:5]
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(conv), "gguf-py"))
sys.argv = [conv, src, "--outfile", out, "--outtype", outtype]
module = runpy.run_path(conv, run_name="convert")
module["TextModel"].get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
module["main"]()
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", help="target checkpoint (default: the bundled demo)")
    p.add_argument("--draft-model-path", help="DSpark drafter (default: the demo's)")
    p.add_argument("--converter", help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16"))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument(
        "--dataset",
        choices=("random", "held-in", "held-out"),
        default="held-out",
        help="prompts: random ids, or windows of the demo corpus (as bench_spec.py)",
    )
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output-json")
    return p.parse_args(argv)


def convert(converter: str, model_path: str, out: str, outtype: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, converter, model_path, out, outtype],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the GGUF conversion failed:\n{done.stderr[-2000:]}")


def llama_decode(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        print(
            "bench_llama_cpp: llama-cpp-python is not installed; nothing to compare",
            file=sys.stderr,
        )
        return 0
    if not args.converter or not os.path.isfile(args.converter):
        print(
            "bench_llama_cpp: --converter must name llama.cpp's convert_hf_to_gguf.py "
            f"(got {args.converter!r}); nothing to compare",
            file=sys.stderr,
        )
        return 0
    import torch

    from specserve import Engine
    from specserve.assets import demo_path

    target = args.model_path or demo_path("target")
    drafter = args.draft_model_path or demo_path("dspark")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = os.path.join(tmp, f"target-{args.outtype}.gguf")
        start = time.perf_counter()
        convert(args.converter, target, gguf, args.outtype)
        print(f"converted to GGUF ({args.outtype}) in {time.perf_counter() - start:.1f}s")
        ctx = args.input_len + args.output_len + 16
        llm = Llama(model_path=gguf, n_ctx=ctx, n_threads=args.threads, verbose=False)
        common = dict(device="cpu", max_total_tokens=4 * ctx, max_running_requests=1)
        engines = {
            "specserve plain": Engine(model_path=target, **common),
            "specserve DSPARK": Engine(
                model_path=target,
                speculative_algorithm="DSPARK",
                speculative_draft_model_path=drafter,
                **common,
            ),
        }
        if args.dataset == "random":
            g = torch.Generator().manual_seed(0)
            shape = (args.num_prompts, args.input_len)
            prompts = torch.randint(4, 500, shape, generator=g).tolist()
        else:
            from bench_spec import source_windows

            tok = engines["specserve plain"].tokenizer
            prompts = source_windows(tok, args.dataset, args.num_prompts, args.input_len)
        sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
        names = ["llama.cpp", *engines]
        times: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(args.repeats + 1):  # the first pass warms up
            for name in names:
                start = time.perf_counter()
                if name == "llama.cpp":
                    outs = [llama_decode(llm, p, args.output_len) for p in prompts]
                else:
                    res = engines[name].generate(input_ids=prompts, sampling_params=sp)
                    outs = [r["output_ids"] for r in res]
                elapsed = time.perf_counter() - start
                if rep:
                    times[name].append(elapsed / sum(len(o) for o in outs))
                outputs[name] = outs
        for eng in engines.values():
            eng.shutdown()
    base = statistics.median(times["llama.cpp"])
    rows = []
    print(f"{args.num_prompts} prompts of {args.input_len}, {args.output_len} greedy tokens, "
          f"{args.threads} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'':18} {'ms/token':>9} {'vs llama.cpp':>13} {'same tokens':>12}")
    for name in names:
        ms = 1e3 * statistics.median(times[name])
        same = sum(a == b for a, b in zip(outputs[name], outputs["llama.cpp"]))
        rows.append({"method": name, "ms_per_token": ms, "ratio": ms / (1e3 * base), "same": same})
        print(f"{name:18} {ms:>9.3f} {ms / (1e3 * base):>12.2f}x {same:>8}/{len(prompts)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
