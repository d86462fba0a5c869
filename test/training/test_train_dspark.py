"""A short drafter training run on a tiny target: the loss goes down and the
checkpoint it writes is one the engine and the server load."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer

from models_zoo import model_path
from server_harness import running_server
from specserve import Engine
from specserve.cli import main
from specserve.speculative.drafter_loader import load_token_map
from specserve.training.data import chunk, hot_tokens, read_token_stream, write_jsonl
from specserve.training.train_dspark import DSparkTrainConfig, DSparkTrainer, default_layer_ids


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = model_path("qwen3")
    # The target's own greedy continuations: what a drafter should learn to predict.
    eng = Engine(model_path=target, device="cpu", max_total_tokens=4096)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(4, 500, (24, 8), generator=g).tolist()
        outs = eng.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 56, "ignore_eos": True},
        )
    finally:
        eng.shutdown()
    data = str(root / "data.jsonl")
    write_jsonl(data, (p + o["output_ids"] for p, o in zip(prompts, outs)))
    cfg = DSparkTrainConfig(
        target=target, data=(data,), out=str(root / "drafter"), block_size=4, markov_rank=8,
        steps=20, batch_size=4, seq_len=64, anchors=8, lr=5e-3, warmup=2, save_every=10, seed=1,
    )  # fmt: skip
    trainer = DSparkTrainer(cfg)
    # The same fixed batches scored before and after training: no batch-to-batch noise.
    held = [trainer.batch(10_000 + i) for i in range(4)]

    def held_loss() -> float:
        with torch.no_grad():
            return sum(trainer.loss(ids, 10_000 + i)[0].item() for i, ids in enumerate(held)) / 4

    before = held_loss()
    history = trainer.train(progress=False)
    return cfg, history, before, held_loss()


def test_loss_goes_down_and_a_checkpoint_is_written(trained) -> None:
    cfg, history, before, after = trained
    assert len(history) == 20
    assert after < before * 0.95, (before, after)
    files = set(os.listdir(cfg.out))
    assert {"config.json", "model.safetensors", "train_state.pt"} <= files
    with open(os.path.join(cfg.out, "config.json")) as f:
        conf = json.load(f)
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["block_size"] == 4
    assert conf["markov_rank"] == 8 and conf["enable_confidence_head"]


def test_the_server_serves_with_the_trained_drafter(trained, tmp_path) -> None:
    cfg = trained[0]
    flags = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", cfg.out)
    plain = Engine(model_path=cfg.target, device="cpu", max_total_tokens=1024)
    try:
        want = plain.generate(
            input_ids=[5, 6, 7],
            sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        )
    finally:
        plain.shutdown()
    with running_server(cfg.target, *flags, log_dir=str(tmp_path)) as s:
        got = s.http.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            },
        ).json()
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["spec_verify_ct"] > 0


def test_resuming_continues_from_the_saved_step(trained, tmp_path) -> None:
    cfg = trained[0]
    import shutil

    out = str(tmp_path / "resumed")
    shutil.copytree(cfg.out, out)
    more = DSparkTrainer(DSparkTrainConfig(**{**cfg.__dict__, "out": out, "steps": 22}))
    assert more.step == 20
    assert len(more.train(progress=False)) == 2 and more.step == 22


def test_data_helpers_and_layer_choice(tmp_path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("hello world")
    rows = tmp_path / "b.jsonl"
    write_jsonl(str(rows), [[1, 2, 3]])
    stream = read_token_stream([str(text), str(rows)], lambda t: [ord(c) for c in t], eos_id=0)
    assert stream == [ord(c) for c in "hello world"] + [0, 1, 2, 3, 0]
    assert chunk(stream, 4).shape == (4, 4)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        chunk([1, 2], 4)
    assert (
        default_layer_ids(2) == (0,)
        and default_layer_ids(6) == (0, 2, 4)
        and default_layer_ids(36) == (0, 17, 34)
    )


def test_features_are_the_layer_outputs_the_engine_captures(trained, tmp_path) -> None:
    """Embedding (-1), a middle layer and the last one, before the final norm:
    against transformers' own hidden states (whose last entry is normed)."""
    cfg = trained[0]
    with open(os.path.join(cfg.target, "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    ids = (-1, 0, n - 1)
    trainer = DSparkTrainer(
        DSparkTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "d"), "target_layer_ids": ids})
    )
    batch = trainer.batch(0)[:2]
    feats, logits = trainer.features(batch)
    with torch.no_grad():
        out = trainer.target(batch, output_hidden_states=True)
    hs, d = out.hidden_states, feats.shape[-1] // 3
    torch.testing.assert_close(feats[..., :d], hs[0])
    torch.testing.assert_close(feats[..., d : 2 * d], hs[1])
    torch.testing.assert_close(trainer.target.model.norm(feats[..., 2 * d :]), hs[n])
    torch.testing.assert_close(logits, out.logits.float())
    assert trainer.draft_json["target_layer_ids"] == list(ids)


def test_a_token_map_keeps_the_most_frequent_tokens(tmp_path) -> None:
    """``hot_tokens`` against ``collections.Counter``; ``make-token-map`` writes
    a map the engine's loader reads back."""
    g = torch.Generator().manual_seed(3)
    stream = (torch.randint(0, 40, (500,), generator=g) ** 2 // 40).tolist()  # skewed
    counts = Counter(stream)
    expect = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:6])
    assert hot_tokens(stream, 6, 528) == expect
    with pytest.raises(ValueError, match="size must be in"):
        hot_tokens(stream, 0, 528)
    data = tmp_path / "d.jsonl"
    write_jsonl(str(data), [stream])
    out = tmp_path / "map.pt"
    argv = ["make-token-map", "--model-path", model_path("qwen3"), "--data", str(data)]
    assert main([*argv, "--size", "6", "--out", str(out)]) == 0
    eos = AutoTokenizer.from_pretrained(model_path("qwen3")).eos_token_id
    want = hot_tokens([*stream, eos], 6, 528)  # each document ends with EOS
    assert load_token_map(str(out), 528, torch.device("cpu")).tolist() == want


@pytest.mark.gpu
def test_training_runs_on_cuda_and_saves_cpu_weights(trained, tmp_path) -> None:
    cfg = trained[0]
    on_gpu = DSparkTrainConfig(
        **{**cfg.__dict__, "out": str(tmp_path / "gpu"), "steps": 3, "device": "cuda"}
    )
    trainer = DSparkTrainer(on_gpu)
    assert next(trainer.model.parameters()).is_cuda
    history = trainer.train(progress=False)
    assert len(history) == 3 and all(m.loss == m.loss for m in history)  # finite, no NaN
    resumed = DSparkTrainer(DSparkTrainConfig(**{**on_gpu.__dict__, "steps": 4, "device": "cpu"}))
    assert resumed.step == 3  # a CUDA run resumes on the CPU
