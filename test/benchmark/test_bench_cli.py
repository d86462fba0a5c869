"""Each benchmark says what is missing and exits non-zero, instead of a traceback."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "script", ["bench_spec.py", "bench_offline.py", "bench_growth.py", "bench_step.py"]
)
def test_a_missing_model_is_named(script, tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    done = run(script, "--model-path", missing)
    assert done.returncode == 1
    assert f"{script[:-3]}: no checkpoint at {missing}" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_round_profile_runs() -> None:
    """It wraps engine internals by name: a rename must not break it."""
    done = run("bench_spec.py", "--round-profile", "--num-prompts", "1", "--output-len", "8",
               "--input-len", "8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("draft layers", "lm_head + Markov steps", "planning the paged block attention"):
        assert line in done.stdout


def test_the_adaptive_ab_runs() -> None:
    """It reads the planner's state by name: a rename must not break it."""
    done = run("bench_spec_adaptive.py", "--prompts", "1", "--output-len", "8", "--input-len", "8")
    assert done.returncode == 0, done.stderr[-2000:]
    for key in ('"adaptive_vs_fixed"', '"spec_forced_plain_steps"', '"net_ratios"'):
        assert key in done.stdout


def test_the_lockstep_ab_runs(tmp_path) -> None:
    """It drives engine cores and reads the planner's counters by name: a
    rename must not break it. Every configuration's engine commits tokens,
    and the speculative one verifies rounds."""
    out = tmp_path / "lockstep.json"
    done = run("bench_spec_lockstep.py", "--concurrency", "2", "--configs", "plain-control",
               "DSPARK-fixed", "--windows", "2", "--window", "6", "--warm-up", "4",
               "--input-len", "8", "--output-len", "8", "--output-json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["clients"] == 2 and row["plain_tok_s"] > 0
    assert row["plain-control"]["vs_plain"] > 0 and row["plain-control"]["tau"] is None
    assert row["DSPARK-fixed"]["vs_plain"] > 0 and row["DSPARK-fixed"]["tau"] >= 1


def test_the_matmul_path_ab_runs_each_engine_on_its_policy() -> None:
    """It replaces ``layers.linear.PackedWeight.serves`` by name around each
    engine's step: a rename must not break it. Each policy decides as it
    says: ``dense`` never packs, ``packed`` wherever oneDNN can, ``timed``
    as serving does."""
    import torch

    path = os.path.join(ROOT, "benchmark", "bench_cpu_linear.py")
    spec = importlib.util.spec_from_file_location("bench_cpu_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from specserve.layers.linear import Linear, PackedWeight, onednn_packs

    assert callable(PackedWeight.serves)
    lin = Linear(256, 512)
    lin.post_load()  # packed where oneDNN can
    x = torch.randn(1, 256)
    asked = []
    with torch.inference_mode():
        assert not bench.policy_serves("dense", lambda *a: True)(lin.packed, x)
        assert bench.policy_serves("packed", lambda *a: False)(lin.packed, x) == onednn_packs(
            torch.float32
        )
        assert bench.policy_serves("timed", lambda *a: asked.append(a) or True)(lin.packed, x)
    assert len(asked) == 1
    done = run("bench_cpu_linear.py", "--concurrency", "1", "--windows", "1", "--window", "4",
               "--warm-up", "2", "--input-len", "8", "--output-len", "8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plain-timed" in done.stdout and "plain-dense" in done.stdout


def test_engines_sharing_the_targets_weights_decode_as_apart() -> None:
    """The lockstep's engines run on one model's weights: a speculative
    engine and a plain one that took the plain engine's model decode what
    engines built apart decode."""
    from models_zoo import model_path, random_prompts
    from specserve import Engine

    path = os.path.join(ROOT, "benchmark", "bench_spec_lockstep.py")
    spec = importlib.util.spec_from_file_location("bench_spec_lockstep", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = model_path("qwen3")
    kw = {"model_path": target, "device": "cpu", "max_total_tokens": 2048}
    ngram = {"speculative_algorithm": "NGRAM", "speculative_adaptive": "off"}
    prompts = random_prompts(3, [12, 7, 20], seed=5) + [[7, 8, 9, 10] * 4]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    def decode(engine: Engine) -> list[list[int]]:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [o["output_ids"] for o in outs]

    engines = [
        Engine(**kw),
        Engine(**kw, **ngram),
        Engine(**kw),
        Engine(**kw),
        Engine(**kw, **ngram),
    ]
    try:
        apart = [decode(e) for e in engines[:2]]
        shared = engines[2:]
        bench.share_target_weights(shared)
        assert all(e.runner.model is shared[0].runner.model for e in shared)
        assert [decode(e) for e in shared[1:]] == apart
    finally:
        for e in engines:
            e.shutdown()


def test_request_caps_are_spread_and_the_same_for_every_server() -> None:
    path = os.path.join(ROOT, "benchmark", "bench_spec_load.py")
    spec = importlib.util.spec_from_file_location("bench_spec_load", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    caps = bench.spread_lengths(200, 64)
    assert caps == bench.spread_lengths(200, 64)  # every server gets the same
    assert min(caps) == 32 and max(caps) == 64 and len(set(caps)) > 16


def test_a_missing_server_is_named() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run("bench_serving.py", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1")
    assert done.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_gpu_check_is_well_formed_and_skips_without_cuda(tmp_path) -> None:
    import torch

    script = os.path.join(ROOT, "benchmark", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script], timeout=30).returncode == 0
    dry = subprocess.run(
        ["bash", script, str(tmp_path / "dry"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    stages = [line.split()[1] for line in dry.stdout.splitlines() if line.startswith("== ")]
    assert stages == [
        "versions", "gpu-tests", "bench-kernels", "bench-cuda-graph", "bench-spec", "gpu"
    ]  # fmt: skip
    if torch.cuda.is_available():
        return
    # The real run, on a CPU machine: the gpu tests skip and nothing else runs.
    done = subprocess.run(
        ["bash", script, str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "needs a CUDA device" in done.stdout and "benchmarks are left out" in done.stdout
    assert "gpu stage skipped: TP=2 over NCCL needs 2 CUDA devices" in done.stdout
    assert os.path.isfile(tmp_path / "out" / "gpu_check.log")


def test_cuda_graph_benchmark_exits_0_without_cuda_and_runs_on_the_cpu() -> None:
    import torch

    if not torch.cuda.is_available():
        done = run("bench_cuda_graph.py")
        assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stderr
    small = ("--batch-sizes", "2", "--input-len", "8", "--output-len", "4", "--repeats", "1")
    done = run("bench_cuda_graph.py", "--device", "cpu", "--dtype", "float32", *small)
    assert done.returncode == 0, done.stderr
    assert "batch 2: tok/s plain graphs" in done.stdout


def test_llama_cpp_comparison_says_what_it_lacks_and_exits_0() -> None:
    """Without llama-cpp-python (hidden here if installed) or without a converter."""
    script = os.path.join(ROOT, "benchmark", "bench_llama_cpp.py")
    hide = "import sys, runpy; sys.modules['llama_cpp'] = None; sys.argv = [sys.argv[1]];"
    done = subprocess.run(
        [sys.executable, "-c", hide + " runpy.run_path(sys.argv[0], run_name='__main__')", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "llama-cpp-python is not installed" in done.stderr
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return
    done = run("bench_llama_cpp.py", "--converter", "/no/such/convert_hf_to_gguf.py")
    assert done.returncode == 0 and "--converter must name" in done.stderr


def test_the_collectives_bench_runs() -> None:
    """Two gloo ranks, one tiny size: a row per (vocab, rows) in its table."""
    done = run("bench_collectives.py", "--vocab", "64", "--rows", "1", "3", "--calls", "1",
               "--repeats", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| 64 | 1 |" in done.stdout and "| 64 | 3 |" in done.stdout
