"""The demo model recipe: everything from text every Python install carries.

1. Corpus: the standard library's own ``.py`` sources (test packages left
   out) and ``pydoc_data.topics``; files whose path hashes into one bucket
   of 20 are held out.
2. A byte-level BPE tokenizer (ChatML specials and a mask token).
3. A small Qwen3-architecture target pretrained from scratch.
4. Drafter training data: the target's own continuations of held-in
   windows (greedy and sampled), generated with the engine; its most
   frequent tokens are the drafters' token map (hot vocabulary).
5. A DSpark drafter and a DFlash drafter (same size, steps and seed; DFlash
   has no Markov or confidence head) trained against the target.
6. Greedy accepted length at block size 7 on held-in and held-out prompts.

``specserve build-demo --out DIR`` runs it (resumable: finished stages are
skipped) and writes a ``manifest.json`` with the settings, seeds and figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass

SEED = 20261129


@dataclass(frozen=True)
class DemoConfig:
    out: str  # final assets: target/, dspark/, dflash/, manifest.json
    work: str  # intermediate files
    vocab_size: int = 8192
    pretrain_steps: int = 1300
    drafter_steps: int = 4000
    drafter_layers: int = 2
    drafter_layer_ids: tuple[int, ...] = (1, 3, 5)  # the target layers the drafters read
    drafter_anchors: int = 16
    markov_rank: int = 32
    block_size: int = 7
    gen_prompts: int = 8192
    gen_prompt_len: int = 64
    gen_new_tokens: int = 192
    token_map_size: int = 2048  # the drafters' hot vocabulary (--speculative-token-map)
    eval_prompts: int = 32
    eval_new_tokens: int = 128
    seed: int = SEED


def drafter_train_config(cfg: DemoConfig, name: str, rank: int):
    """The ``train-dspark`` settings of the demo's drafter ``name`` (``rank`` 0:
    DFlash); the two drafters differ only in the heads."""
    from specserve.training.train_dspark import DSparkTrainConfig

    return DSparkTrainConfig(
        target=os.path.join(cfg.work, "target"), data=(os.path.join(cfg.work, "drafter_data.jsonl"),),
        out=os.path.join(cfg.work, name), block_size=cfg.block_size, num_layers=cfg.drafter_layers,
        markov_rank=rank, confidence_head=rank > 0, target_layer_ids=cfg.drafter_layer_ids,
        steps=cfg.drafter_steps, seq_len=256, batch_size=8, anchors=cfg.drafter_anchors, lr=2e-3,
        seed=cfg.seed, save_every=100, save_embeddings=False, dtype="float16",
    )  # fmt: skip


def corpus_files() -> tuple[list[str], list[str]]:
    """(held-in, held-out) standard library sources."""
    root = sysconfig.get_paths()["stdlib"]
    held_in, held_out = [], []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = rel.split(os.sep)
        dirs.sort()
        if "site-packages" in parts or any(p in ("test", "tests", "idle_test") for p in parts):
            dirs[:] = []
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                bucket = int(hashlib.sha256(os.path.join(rel, f).encode()).hexdigest(), 16) % 20
                (held_out if bucket == 0 else held_in).append(path)
    return held_in, held_out


def _read(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    return out


def build_demo(cfg: DemoConfig, log=print) -> dict:
    import torch

    from specserve.tools.tiny_model import save_tokenizer, stdlib_corpus, train_bpe
    from specserve.training.data import write_jsonl
    from specserve.training.pretrain import PretrainConfig, pretrain
    from specserve.training.train_dspark import DSparkTrainer

    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.work, exist_ok=True)
    manifest_path = os.path.join(cfg.work, "manifest.json")
    manifest: dict = {"config": asdict(cfg), "stages": {}}
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        manifest["config"] = asdict(cfg)  # finished stages are kept; the config is this run's

    def stage(name: str, fn):
        if name in manifest["stages"]:
            log(f"[{name}] done already")
            return manifest["stages"][name]
        log(f"[{name}] ...")
        t = time.time()
        result = fn() or {}
        result["minutes"] = round((time.time() - t) / 60, 2)
        manifest["stages"][name] = result
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=2)
        log(f"[{name}] {result}")
        return result

    held_in, held_out = corpus_files()
    tok_dir = os.path.join(cfg.work, "tokenizer")
    target_dir = os.path.join(cfg.work, "target")

    def make_tokenizer() -> dict:
        texts = _read(held_in) + stdlib_corpus()
        save_tokenizer(
            tok_dir, tokenizer_json=train_bpe(texts, cfg.vocab_size), eos="<|endoftext|>"
        )
        return {"files_held_in": len(held_in), "files_held_out": len(held_out)}

    stage("tokenizer", make_tokenizer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")

    def encode_all(texts: list[str]) -> list[int]:
        stream: list[int] = []
        for text in texts:
            stream.extend(tok.encode(text, add_special_tokens=False))
            stream.append(eos)
        return stream

    def make_target() -> dict:
        stream = encode_all(_read(held_in) + stdlib_corpus())
        pcfg = PretrainConfig(out=target_dir, steps=cfg.pretrain_steps, seed=cfg.seed)
        summary = pretrain(pcfg, stream, tok)
        summary["corpus_tokens"] = len(stream)
        return summary

    stage("target", make_target)

    data_path = os.path.join(cfg.work, "drafter_data.jsonl")

    def make_data() -> dict:
        from specserve import Engine

        stream = encode_all(_read(held_in))
        g = torch.Generator().manual_seed(cfg.seed)
        starts = torch.randint(
            0, len(stream) - cfg.gen_prompt_len, (cfg.gen_prompts,), generator=g
        ).tolist()
        prompts = [stream[s : s + cfg.gen_prompt_len] for s in starts]
        engine = Engine(
            model_path=target_dir,
            device="cpu",
            dtype="float32",
            max_running_requests=64,
            max_total_tokens=64 * (cfg.gen_prompt_len + cfg.gen_new_tokens + 16),
        )
        try:
            params = [
                {
                    "max_new_tokens": cfg.gen_new_tokens,
                    "temperature": 0.0 if i % 2 == 0 else 0.8,
                    "seed": i,
                    "ignore_eos": True,
                }
                for i in range(len(prompts))
            ]
            outs = engine.generate(input_ids=prompts, sampling_params=params)
        finally:
            engine.shutdown()
        write_jsonl(data_path, (p + o["output_ids"] for p, o in zip(prompts, outs)))
        return {
            "sequences": len(prompts),
            "tokens": len(prompts) * (cfg.gen_prompt_len + cfg.gen_new_tokens),
        }

    stage("drafter_data", make_data)

    map_path = os.path.join(cfg.work, "token_map.pt")

    def make_token_map() -> dict:
        from specserve.training.data import hot_tokens, read_token_stream

        stream = read_token_stream([data_path], lambda t: [], eos)
        ids = hot_tokens(stream, cfg.token_map_size, cfg.vocab_size)
        torch.save(torch.tensor(ids), map_path)
        counts = torch.bincount(torch.tensor(stream), minlength=cfg.vocab_size)
        return {"size": len(ids), "coverage": round(float(counts[ids].sum() / len(stream)), 4)}

    stage("token_map", make_token_map)

    def make_drafter(name: str, rank: int) -> dict:
        dcfg = drafter_train_config(cfg, name, rank)
        history = DSparkTrainer(dcfg).train()
        last = history[-20:] or [None]
        return {
            "steps": dcfg.steps,
            "final_loss": sum(m.loss for m in last) / len(last) if history else None,
            "final_tau_proxy": sum(m.tau for m in last) / len(last) if history else None,
        }

    stage("dspark", lambda: make_drafter("dspark", cfg.markov_rank))
    stage("dflash", lambda: make_drafter("dflash", 0))

    def evaluate() -> dict:
        from specserve import Engine

        results = {}
        for split, files in (("held_in", held_in), ("held_out", held_out)):
            stream = encode_all(_read(files))
            g = torch.Generator().manual_seed(cfg.seed + 1)
            starts = torch.randint(0, len(stream) - 64, (cfg.eval_prompts,), generator=g).tolist()
            prompts = [stream[s : s + 64] for s in starts]
            # The drafters alone, then DSpark drafting from the token map.
            for alg, key, hot in (
                ("DSPARK", "dspark", None),
                ("DFLASH", "dflash", None),
                ("DSPARK", "dspark_token_map", map_path),
            ):
                engine = Engine(
                    model_path=target_dir,
                    device="cpu",
                    dtype="float32",
                    speculative_algorithm=alg,
                    speculative_draft_model_path=os.path.join(cfg.work, alg.lower()),
                    speculative_token_map=hot,
                    max_running_requests=cfg.eval_prompts,
                    max_total_tokens=cfg.eval_prompts * 256,
                )
                try:
                    outs = engine.generate(
                        input_ids=prompts,
                        sampling_params={
                            "temperature": 0,
                            "max_new_tokens": cfg.eval_new_tokens,
                            "ignore_eos": True,
                        },
                    )
                    results[f"{key}_tau_{split}"] = round(engine.stats()["spec_accept_length"], 3)
                finally:
                    engine.shutdown()
                del outs
        return results

    figures = stage("evaluate", evaluate)

    # Assets: the target, both drafters, the manifest.
    os.makedirs(cfg.out, exist_ok=True)
    for name, src in (
        ("target", target_dir),
        ("dspark", os.path.join(cfg.work, "dspark")),
        ("dflash", os.path.join(cfg.work, "dflash")),
    ):
        dst = os.path.join(cfg.out, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("train_state.pt", "pretrain.json"))
    shutil.copyfile(map_path, os.path.join(cfg.out, "token_map.pt"))
    shipped = {
        **manifest,
        "config": {k: v for k, v in manifest["config"].items() if k not in ("out", "work")},
    }
    with open(os.path.join(cfg.out, "manifest.json"), "w") as f:
        json.dump(shipped, f, indent=2)  # the recipe without this machine's paths
    return figures
