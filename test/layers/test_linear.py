"""The linears: float32 logits accumulated in float32 for bf16 weights, and\nthe CPU's packed (oneDNN) serving matmuls against ``F.linear``."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import specserve.layers.linear as linear_mod
from specserve.layers.linear import FusedLinears, Linear, LogitsHead, MergedLinear


@pytest.mark.parametrize("serving", [True, False], ids=["packed", "training"])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 64)], ids=["rows", "blocks"])
def test_bf16_weights_give_unrounded_float32_logits(shape, serving) -> None:
    g = torch.Generator().manual_seed(0)
    head = LogitsHead(64, 1024).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1024, 64, generator=g) * 2)
    head.post_load()
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    mode = torch.inference_mode if serving else torch.enable_grad
    # (big enough to be packed, where oneDNN packs float32 at all)
    assert head.packed._of is not None or not linear_mod.onednn_packs(torch.float32)
    with mode():
        out = head(x)
    assert out.dtype == torch.float32 and out.shape == (*shape[:-1], 1024)
    exact = x.double() @ head.weight.double().t()
    assert (out.double() - exact).abs().max() < 1e-4
    # What a bf16 matmul then .float() gives is off by far more.
    rounded = torch.nn.functional.linear(x, head.weight).float()
    assert (rounded.double() - exact).abs().max() > 1e-2
    # Reloading the weight in place refreshes the float32 copy.
    with torch.no_grad():
        head.weight.mul_(2)
    with mode():
        torch.testing.assert_close(head(x), out * 2, atol=1e-4, rtol=0)


def test_post_load_keeps_a_tied_head_and_its_embedding_as_they_are() -> None:
    """Packing copies: the shared weight keeps its shape, layout and values (a
    tied embedding reads the same rows), and the logits equal a float64
    product, packed (serving) or not."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(1000, 64)
    head = LogitsHead(64, 1000)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(1000, 64, generator=g))
    head.weight = emb.weight  # tied
    before = emb.weight.detach().clone()
    head.post_load()
    assert head.weight.stride() == (64, 1) and torch.equal(emb.weight, before)
    ids = torch.tensor([3, 999, 0])
    assert torch.equal(emb(ids), before[ids])
    x = torch.randn(7, 64, generator=g)
    exact = x.double() @ before.double().t()
    with torch.inference_mode():
        served = head(x)
    assert (served.double() - exact).abs().max() < 1e-4
    assert (head(x).double() - exact).abs().max() < 1e-4


def _serving_calls(monkeypatch) -> list[int]:
    """Counts the matmuls that run over a packed weight."""
    calls: list[int] = []
    real = linear_mod.packed_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod, "packed_linear", counted)
    return calls


def force_packed(monkeypatch) -> None:
    """Makes the packed path the faster one at every row count, whatever this
    CPU timed (``packed_rows``)."""
    monkeypatch.setattr(linear_mod, "packed_rows", lambda *shape: (True,) * linear_mod.ROW_CLASSES)


def force_f_linear(monkeypatch) -> None:
    """Makes this CPU behave like one whose oneDNN packs nothing (an AVX2-only
    CPU refuses bfloat16): every linear must fall back to ``F.linear``."""
    monkeypatch.setattr(linear_mod, "onednn_packs", lambda dtype: False)


@pytest.mark.parametrize("path", ["packed", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (8, 256), (2, 7, 256)], ids=["row", "chain", "blocks"])
def test_serving_linears_run_packed_and_equal_f_linear(monkeypatch, path, dtype, shape) -> None:
    """Linear, MergedLinear, FusedLinears (whole and a row slice) and the
    logits head: in inference mode each runs over its packed weight and
    agrees with ``F.linear`` to float rounding; with gradients on, none does.
    Where oneDNN cannot pack the dtype (forced here: ``fallback``), nothing
    is packed, nothing fails, and every linear is ``F.linear`` itself."""
    if path == "packed" and not linear_mod.onednn_packs(dtype):
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} weights")
    force_packed(monkeypatch)
    if path == "fallback":
        force_f_linear(monkeypatch)
    g = torch.Generator().manual_seed(2)
    # every weight at least PACK_MIN_ELEMENTS
    lin = Linear(256, 256, bias=True)
    merged = MergedLinear(256, [128, 128], bias=False)
    parts = (torch.nn.Linear(256, 128), torch.nn.Linear(256, 256))
    head = LogitsHead(256, 300)
    with torch.no_grad():
        for p in (lin.weight, lin.bias, merged.weight, head.weight, *parts[0].parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    for m in (lin, merged, head, *parts):
        m.to(dtype)
    fused = FusedLinears(*parts)
    fused.fuse_()
    for m in (lin, merged, head):
        m.post_load()
    # a strided input, as an attention output reshaped
    x = torch.randn(*shape[:-1], 512, generator=g).to(dtype)[..., ::2]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    cases = [
        (lin.forward, lambda: F.linear(x, lin.weight, lin.bias)),
        (merged.forward, lambda: F.linear(x, merged.weight)),
        (fused, lambda: F.linear(x, fused.weight, fused.bias)),
        (
            lambda v: fused(v, slice(128, None)),
            lambda: F.linear(x, *(p for p in parts[1].parameters())),
        ),
        (head, lambda: F.linear(x.float(), head.weight.float())),
    ]
    if path == "fallback":
        tol = 0.0  # the very same F.linear
    calls = _serving_calls(monkeypatch)
    for run, reference in cases:
        with torch.inference_mode():
            got = run(x)
        want = reference()
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    assert len(calls) == (len(cases) if path == "packed" else 0)
    calls.clear()
    for run, _ in cases:
        run(x)
    assert not calls, "a matmul that records gradients must not take the packed path"


@pytest.mark.skipif(not linear_mod.onednn_packs(torch.float32), reason="oneDNN packs nothing here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_matmuls_run_at_a_few_row_counts_and_give_the_same_values(
    monkeypatch, dtype
) -> None:
    """oneDNN keeps a kernel per row count it meets: a packed matmul runs its
    rows as they come up to EXACT_ROWS, else padded to a bucket (in blocks
    past the largest), and each row's result is bit for bit the one a call
    of exactly its rows gives."""
    if not linear_mod.onednn_packs(dtype):
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} weights")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    real = torch.ops.mkldnn._linear_pointwise
    seen: list[int] = []

    def counted(x, *args):
        seen.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
    allowed = set(range(1, linear_mod.EXACT_ROWS + 1)) | set(linear_mod.ROW_BUCKETS)
    largest = linear_mod.ROW_BUCKETS[-1]
    with torch.inference_mode():
        for rows in (1, 7, 16, 17, 33, 100, 257, largest, largest + 5, 2 * largest + 300):
            x = torch.randn(rows, 64, generator=g).to(dtype)
            seen.clear()
            got = linear_mod.packed_linear(x, packed, b)
            assert seen and set(seen) <= allowed, (rows, seen)
            assert len(seen) == -(-rows // largest)  # blocks only past the largest
            want = real(x, packed, b, "none", [], "")
            assert got.shape == want.shape and torch.equal(got, want), rows
        blocks = torch.randn(3, 7, 64, generator=g).to(dtype)  # [blocks, rows, in]: 21 rows
        got = linear_mod.packed_linear(blocks, packed, b)
        assert got.shape == (3, 7, 96) and torch.equal(got, real(blocks, packed, b, "none", [], ""))


@pytest.mark.skipif(not linear_mod.onednn_packs(torch.float32), reason="oneDNN packs nothing here")
def test_each_row_count_takes_the_path_timed_faster_for_its_weight_shape(monkeypatch) -> None:
    """A serving matmul runs packed only where its weight shape's row class
    timed the packed path faster (here: 16 rows and more for one shape, 4-15
    for another, never for a third), else ``F.linear``; the values agree
    either way."""
    classes = range(linear_mod.ROW_CLASSES)
    choice = {
        (256, 256): tuple(c >= 4 for c in classes),
        (768, 256): tuple(c in (2, 3) for c in classes),
        (512, 256): (False,) * linear_mod.ROW_CLASSES,
    }
    monkeypatch.setattr(linear_mod, "packed_rows", lambda out, inp, dtype: choice[out, inp])
    g = torch.Generator().manual_seed(5)
    lin, mid, wide = Linear(256, 256), Linear(256, 768), Linear(256, 512)
    for m in (lin, mid, wide):
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        m.post_load()
    calls = _serving_calls(monkeypatch)
    for rows, packed, middle in (
        (1, 0, 0), (3, 0, 0), (4, 0, 1), (8, 0, 1), (15, 0, 1), (16, 1, 0), (40, 1, 0), (5000, 1, 0)
    ):  # fmt: skip
        x = torch.randn(rows, 256, generator=g)
        for m, runs in ((lin, packed), (mid, middle), (wide, 0)):
            calls.clear()
            with torch.inference_mode():
                got = m.forward(x)
            assert len(calls) == runs, (rows, m.weight.shape)
            want = F.linear(x, m.weight, m.bias)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not linear_mod.onednn_packs(torch.float32), reason="oneDNN packs nothing here")
def test_the_timing_keeps_whichever_path_ran_faster_per_row_class(monkeypatch) -> None:
    """``packed_rows`` times both paths: a packed matmul made slow from 16 rows
    on (and instant below) loses exactly the classes from 16 rows on."""
    instant = torch.zeros(1)

    def packed_matmul(x, packed):
        if x.shape[0] >= 16:
            time.sleep(0.002)  # F.linear of 16-256 rows by 256 x 256: well under 2 ms
        return instant

    monkeypatch.setattr(linear_mod, "packed_linear", packed_matmul)
    timed = linear_mod.packed_rows.__wrapped__(256, 256, torch.float32)  # uncached
    assert timed == tuple(c < 4 for c in range(linear_mod.ROW_CLASSES))
    assert [linear_mod.row_class(r) for r in (1, 2, 3, 4, 15, 16, 255, 256, 10**6)] == [
        0, 1, 1, 2, 3, 4, 7, 8, linear_mod.ROW_CLASSES - 1
    ]  # fmt: skip


def test_small_weights_stay_on_f_linear(monkeypatch) -> None:
    """Below PACK_MIN_ELEMENTS oneDNN's fixed cost outweighs the matmul:
    nothing is packed, and serving multiplies by the weight itself."""
    lin = Linear(64, 32)
    assert lin.weight.numel() < linear_mod.PACK_MIN_ELEMENTS
    lin.post_load()
    calls = _serving_calls(monkeypatch)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        out = lin.forward(x)
    assert not calls and lin.packed._of is None
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)


def test_packed_weight_follows_the_weight_and_gradients_flow() -> None:
    """An in-place change of the weight (a reload, a training step) repacks;
    with gradients on, the unpacked path trains the weight."""
    lin = Linear(256, 256, bias=False)
    lin.post_load()
    x = torch.randn(3, 256)
    with torch.inference_mode():
        first = lin.forward(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    with torch.inference_mode():
        torch.testing.assert_close(lin.forward(x), first * -2, atol=1e-5, rtol=1e-5)
    lin.forward(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(256, 256))


def test_a_cpu_whose_onednn_refuses_to_pack_serves_by_f_linear(monkeypatch) -> None:
    """The probe behind every packing decision: when oneDNN refuses a dtype
    (as an AVX2-only CPU refuses bfloat16, with a RuntimeError), the dtype
    counts as unpackable and the layers load and run by ``F.linear``."""

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    probe = linear_mod.onednn_packs.__wrapped__  # uncached
    assert not probe(torch.float32) and not probe(torch.bfloat16)
    monkeypatch.setattr(linear_mod, "onednn_packs", probe)
    lin = Linear(256, 256).to(torch.bfloat16)
    lin.post_load()  # refused, not raised
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(
            lin.forward(x), F.linear(x, lin.weight, lin.bias), atol=0, rtol=0
        )
    assert lin.packed._of is None
    assert "F.linear" in linear_mod.cpu_matmul_path(torch.bfloat16)


# What an AVX2-only x86 CPU offers, on any x86 CPU: oneDNN and ATen's own
# kernels capped at AVX2 (both read these at start-up).
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

SCORE_AND_GENERATE = """
import json, logging, sys
import torch
from specserve import Engine
from specserve.assets import demo_path, demo_token_map
from specserve.layers.linear import onednn_packs

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
eng = Engine(model_path=demo_path(), dtype=sys.argv[1], speculative_algorithm="DSPARK",
             speculative_draft_model_path=demo_path("dspark"),
             speculative_token_map=demo_token_map(), max_total_tokens=1024, skip_server_warmup=True)
scored = eng.generate(sys.argv[2], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
out = eng.generate(sys.argv[2], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
                   return_logprob=True)
eng.shutdown()
print(json.dumps({
    "packs_bf16": onednn_packs(torch.bfloat16),
    "prompt": [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]],
    "output": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA caps")
def test_bfloat16_starts_and_serves_on_a_cpu_without_avx512() -> None:
    """An engine in bfloat16 (target and DSpark drafter) starts and generates
    where oneDNN has no bfloat16 path; its prompt logprobs agree with the
    float32 engine's to bfloat16 rounding."""
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    runs = {}
    for dtype, env in (("bfloat16", AVX2_ONLY), ("float32", {})):
        proc = subprocess.run(
            [sys.executable, "-c", SCORE_AND_GENERATE, dtype, prompt],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
        if dtype == "bfloat16":
            assert "CPU linears: bfloat16 by F.linear" in proc.stderr
    bf16, fp32 = runs["bfloat16"], runs["float32"]
    assert not bf16["packs_bf16"]
    assert len(bf16["output"]) == 12 and all(math.isfinite(v) for v in bf16["output"])
    assert len(bf16["prompt"]) == len(fp32["prompt"]) > 10
    worst = max(abs(a - b) for a, b in zip(bf16["prompt"], fp32["prompt"]))
    assert worst < 0.15, worst  # measured: 0.031 (bfloat16's rounding)


@pytest.mark.gpu
def test_cuda_bf16_logits_are_float32_accumulated() -> None:
    g = torch.Generator().manual_seed(0)
    head = LogitsHead(256, 4096).to("cuda", torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_((torch.randn(4096, 256, generator=g) * 2).to("cuda"))
    x = torch.randn(7, 256, generator=g).to("cuda", torch.bfloat16)
    out = head(x)
    exact = x.double() @ head.weight.double().t()
    assert out.dtype == torch.float32 and (out.double() - exact).abs().max() < 1e-3
