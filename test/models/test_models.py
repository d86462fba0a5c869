"""Our Qwen3/Llama forward (through the real loader and the paged KV cache)
against transformers on the same checkpoint, in every forward mode."""

from __future__ import annotations

import pytest
import torch

from models_zoo import ZOO, hf_logits, hf_model, model_path, random_prompts
from specserve.config import EngineConfig
from specserve.core import BatchEntry, ScheduledBatch
from specserve.runner.model_runner import ModelRunner

TOL = 1e-4
PAGE = 4


def make_runner(name: str, **kw) -> ModelRunner:
    return ModelRunner(
        EngineConfig.from_kwargs(
            model_path(name), device="cpu", page_size=PAGE, max_total_tokens=512, **kw
        )
    )


class Pages:
    """Hands out page ids to test requests (the scheduler's job in the engine)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // PAGE)
        pages = list(range(self.next, self.next + n))
        self.next += n
        return pages


def run(
    runner: ModelRunner,
    chunks: list[tuple[list[int], int, list[int]]],
    capture=(),
):
    """chunks: (tokens, prefix_len, page_table); returns per-chunk logits of every row."""
    entries = [BatchEntry(t, p, pt, list(range(len(t)))) for t, p, pt in chunks]
    out = runner.forward(ScheduledBatch(entries, [], tuple(capture)))
    rows = [out.logits[out.row_offsets[i] : out.row_offsets[i + 1]] for i in range(len(chunks))]
    return rows, out


@pytest.mark.parametrize("name", list(ZOO))
def test_prefill_chunked_decode_and_verify_match_hf(name: str) -> None:
    runner = make_runner(name)
    pages = Pages()
    prompts = random_prompts(3, [11, 6, 17], seed=hash(name) % 100)
    tables = [pages.take(len(p) + 8) for p in prompts]

    # Chunked prefill: chunk boundaries fall mid-request and mid-page.
    cuts = [5, 6, 9]
    first, _ = run(runner, [(p[:c], 0, t) for p, c, t in zip(prompts, cuts, tables)])
    second, _ = run(
        runner,
        [(p[c:], c, t) for p, c, t in zip(prompts, cuts, tables) if c < len(p)],
    )
    rest = iter(second)
    for p, c, a in zip(prompts, cuts, first):
        got = torch.cat([a, next(rest)]) if c < len(p) else a
        torch.testing.assert_close(got, hf_logits(name, p), atol=TOL, rtol=0)

    # Decode: one token per request after the prefill.
    nxt = [[7], [8], [9]]
    dec, _ = run(runner, [(n, len(p), t) for n, p, t in zip(nxt, prompts, tables)])
    for n, p, d in zip(nxt, prompts, dec):
        torch.testing.assert_close(d, hf_logits(name, p + n)[-1:], atol=TOL, rtol=0)

    # Verify: ragged chains [anchor, d_1..d_L], causal inside, over the cached prefix.
    chains = [[20, 21, 22, 23], [30], [40, 41]]
    ver, _ = run(runner, [(c, len(p) + 1, t) for c, p, t in zip(chains, prompts, tables)])
    for c, p, n, v in zip(chains, prompts, nxt, ver):
        torch.testing.assert_close(v, hf_logits(name, p + n + c)[-len(c) :], atol=TOL, rtol=0)


def test_prefill_of_one_request_in_one_chunk_and_single_token_prompt() -> None:
    runner = make_runner("qwen3")
    pages = Pages()
    prompts = [[5], random_prompts(1, [23], seed=3)[0]]
    rows, _ = run(runner, [(p, 0, pages.take(len(p))) for p in prompts])
    for p, r in zip(prompts, rows):
        torch.testing.assert_close(r, hf_logits("qwen3", p), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "llama-sharded"])
def test_captured_layers_equal_hf_hidden_states(name: str) -> None:
    runner = make_runner(name)
    prompt = random_prompts(1, [9], seed=5)[0]
    _, out = run(runner, [(prompt, 0, Pages().take(9))], capture=(0, 1))
    with torch.no_grad():
        hs = hf_model(name)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    d = runner.model_config.hidden_size
    assert out.captured is not None and out.captured.shape == (9, 2 * d)
    # HF returns the last layer's output already normed, so compare layer 0 fully
    # and layer 1 only as HF's un-normed input to the final norm would be.
    torch.testing.assert_close(out.captured[:, :d], hs[1][0], atol=TOL, rtol=0)
    final_norm = hf_model(name).model.norm
    torch.testing.assert_close(final_norm(out.captured[:, d:]), hs[2][0], atol=TOL, rtol=0)
