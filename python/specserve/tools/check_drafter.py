"""``specserve check-drafter TARGET DRAFTER``: does a downloaded DSpark
drafter fit its target? The format it is written in, its settings as the
engine reads them, its shapes against the target; then a short run of
speculative against plain decoding on a few prompts: greedy ids and
logprobs, seeded sampling alone and batched, tau and each draft
position's acceptance, and the speed at batch 1."""

from __future__ import annotations

import json
import statistics
import time
from typing import TYPE_CHECKING, Any

from specserve.config import ModelConfig

if TYPE_CHECKING:
    from specserve.speculative.dspark_config import DSparkConfig

PROMPTS = (
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\n",
    "Once upon a time, in a small village,",
)


def check_drafter(
    target: str,
    drafter: str,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    algorithm: str = "DSPARK",
    num_draft_tokens: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    logprob_tol: float | None = None,
    speed_repeats: int = 3,
) -> dict[str, Any]:
    """The report (``ok``: no problem found; ``problems``: what is wrong, one line each)."""
    report: dict[str, Any] = {"target": target, "drafter": drafter, "problems": []}
    problems: list[str] = report["problems"]
    try:
        tcfg = ModelConfig.from_path(target)
        settings, dcfg = _settings(tcfg, drafter, num_draft_tokens)
        report.update(settings)
        if dcfg is not None:  # (a V4 drafter's reader checks it against the target)
            from specserve.speculative.drafter_loader import check_compatible

            check_compatible(dcfg, tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers)
            report["shapes_fit"] = True
    except ValueError as e:  # an unknown or unsupported format, a shape that does not fit
        problems.append(str(e))
    if not problems:
        engine_kw: dict[str, Any] = {"device": device, "speculative_adaptive": "off"}
        if dtype:
            engine_kw["dtype"] = dtype
        spec_kw = {
            "speculative_algorithm": algorithm,
            "speculative_draft_model_path": drafter,
            **({"speculative_num_draft_tokens": num_draft_tokens} if num_draft_tokens else {}),
        }
        try:
            _run(report, target, list(prompts or PROMPTS), max_new_tokens, engine_kw, spec_kw,
                 logprob_tol, speed_repeats)  # fmt: skip
        except ValueError as e:  # the weights do not load (a tensor of the wrong shape, ...)
            problems.append(str(e))
    report["ok"] = not problems
    return report


def _settings(
    tcfg: ModelConfig, drafter: str, num_draft_tokens: int | None
) -> tuple[dict[str, Any], DSparkConfig | None]:
    """The format and settings as the engine reads them, and the drafter's
    config where it is still to be checked against the target."""
    from specserve.speculative.drafter_loader import dspark_block_size

    if tcfg.deepseek_v4 is not None:
        from specserve.speculative.dspark_v4_model import DSparkV4Config

        v4 = DSparkV4Config.from_path(drafter, tcfg)
        return {
            "shapes_fit": True,
            "format": "deepseek_v4",
            "settings": {
                "target_layer_ids": list(v4.target_layer_ids),
                "block_size": v4.block_size,
                "slot_layout": "slot k predicts anchor + k + 1",
                "markov_head": f"{v4.markov_head_type}, rank {v4.markov_rank}",
                "confidence_head": "yes",
                "vocabulary": "the target's",
                "lm_head": "the target's (shared)",
                "stages": v4.num_stages,
            },
            "choices": [],
        }, None
    from specserve.speculative.drafter_formats import read_drafter

    hint = dspark_block_size(None, num_draft_tokens, None)
    ckpt = read_drafter(drafter, hint)
    d = ckpt.config
    markov = f"{d.markov_head_type}, rank {d.markov_rank}" if d.markov_rank else "none (DFlash)"
    conf = "none"
    if d.enable_confidence_head:
        conf = "yes, with the Markov embedding" if d.confidence_head_with_markov else "yes"
    reduced = d.draft_vocab_size is not None
    return {
        "format": ckpt.format,
        "settings": {
            "target_layer_ids": list(d.target_layer_ids),
            "block_size": d.block_size,
            "slot_layout": (
                "slot k predicts anchor + k + 1 (DeepSpec's)"
                if d.sample_from_anchor
                else "slot 0 the bonus token, slot k predicts anchor + k (1 + N)"
            ),
            "markov_head": markov,
            "confidence_head": conf,
            "vocabulary": (
                f"reduced: {d.draft_vocab_size} draft ids mapped to target ids (d2t)"
                if reduced
                else f"the target's ({d.vocab_size})"
            ),
            "lm_head": "its own, over the draft vocabulary" if reduced else "the target's (shared)",
            "draft_layers": d.num_hidden_layers,
            "backbone": (
                f"Gemma 4 (heads {d.num_attention_heads} x {d.head_dim}, "
                f"{d.num_key_value_heads} KV{', keys as values' if d.keys_are_values else ''}, "
                f"logits capped at {d.logit_softcap})"
                if d.gemma4
                else f"Qwen3 (heads {d.num_attention_heads} x {d.head_dim}, {d.num_key_value_heads} KV)"
            ),
        },
        "choices": list(ckpt.choices),
    }, d


def _run(
    report: dict[str, Any],
    target: str,
    prompts: list[str],
    max_new_tokens: int,
    engine_kw: dict[str, Any],
    spec_kw: dict[str, Any],
    logprob_tol: float | None,
    speed_repeats: int,
) -> None:
    from specserve import Engine

    problems: list[str] = report["problems"]
    greedy = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    seeded = [{**greedy, "temperature": 0.8, "seed": 1000 + i} for i in range(len(prompts))]
    with Engine(model_path=target, **engine_kw) as plain:
        want = plain.generate(prompts, greedy, return_logprob=True)
        tol = logprob_tol if logprob_tol is not None else (1e-4 if _fp32(plain) else 5e-2)
        with Engine(model_path=target, **engine_kw, **spec_kw) as spec:
            got = spec.generate(prompts, greedy, return_logprob=True)
            stats = spec.stats()
            alone = [spec.generate(p, s) for p, s in zip(prompts, seeded)]
            batched = spec.generate(prompts, seeded)
            speed = _speed(plain, spec, prompts[0], greedy, speed_repeats)
    same_ids = [a["output_ids"] == b["output_ids"] for a, b in zip(want, got)]
    diffs = [
        abs(x[0] - y[0])
        for a, b in zip(want, got)
        for x, y in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
    ]  # fmt: skip
    worst = max(diffs, default=0.0)
    verified, accepted = stats["spec_verified_per_position"], stats["spec_accepted_per_position"]
    report["greedy"] = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "ids_equal": all(same_ids),
        "max_logprob_diff": worst,
        "logprob_tol": tol,
    }
    report["seeded"] = {
        "alone_equals_batched": [o["output_ids"] for o in alone]
        == [o["output_ids"] for o in batched]
    }
    report["tau"] = stats["spec_accept_length"]
    report["accept_rate_per_position"] = [a / v if v else 0.0 for a, v in zip(accepted, verified)]
    report["speed_batch1"] = speed
    if not all(same_ids):
        bad = [i for i, ok in enumerate(same_ids) if not ok]
        problems.append(f"greedy: speculative ids differ from plain decoding's on prompts {bad}")
    if worst > tol:
        problems.append(f"greedy: logprobs differ from plain decoding's by {worst:.3g} (> {tol:g})")
    if not report["seeded"]["alone_equals_batched"]:
        problems.append("seeded: a seeded request drew other tokens alone than in a batch")
    if not verified:
        problems.append("no verify round ran: the drafter proposed nothing")


def _fp32(engine: Any) -> bool:
    import torch

    return engine.runner.dtype == torch.float32


def _speed(plain: Any, spec: Any, prompt: str, sp: dict, repeats: int) -> dict[str, float]:
    """Tokens per second at batch 1, plain and speculative interleaved; the
    median of their ratios."""
    ratios, rates = [], {"plain": [], "speculative": []}
    for _ in range(repeats):
        pair = {}
        for name, eng in (("plain", plain), ("speculative", spec)):
            t = time.perf_counter()
            out = eng.generate(prompt, sp)
            pair[name] = out["meta_info"]["completion_tokens"] / (time.perf_counter() - t)
            rates[name].append(pair[name])
        ratios.append(pair["speculative"] / pair["plain"])
    return {
        "plain_tok_s": statistics.median(rates["plain"]),
        "speculative_tok_s": statistics.median(rates["speculative"]),
        "ratio": statistics.median(ratios),
    }


def render(report: dict[str, Any]) -> str:
    """The report as a person reads it."""
    lines = [f"drafter  {report['drafter']}", f"target   {report['target']}"]
    if "format" in report:
        lines.append(f"format   {report['format']}")
        for key, value in report["settings"].items():
            lines.append(f"  {key.replace('_', ' '):<18} {value}")
        for choice in report["choices"]:
            lines.append(f"  taken: {choice}")
    if report.get("shapes_fit"):
        lines.append("shapes   fit the target")
    if "greedy" in report:
        g = report["greedy"]
        same = "equal to plain decoding's" if g["ids_equal"] else "DIFFERENT from plain decoding's"
        lines.append(f"greedy   {g['prompts']} prompts x {g['max_new_tokens']} tokens: ids {same}")
        lines.append(
            f"         largest logprob difference {g['max_logprob_diff']:.3g} (tolerance {g['logprob_tol']:g})"
        )
        s = "equal" if report["seeded"]["alone_equals_batched"] else "DIFFERENT"
        lines.append(f"seeded   alone and batched: {s}")
        rates = " ".join(f"{r:.2f}" for r in report["accept_rate_per_position"])
        lines.append(f"tau      {report['tau']:.2f}; acceptance by draft position: {rates}")
        sp = report["speed_batch1"]
        lines.append(
            f"speed    batch 1: {sp['ratio']:.2f}x plain ({sp['speculative_tok_s']:.1f} against "
            f"{sp['plain_tok_s']:.1f} tok/s, median of interleaved runs)"
        )
    for p in report["problems"]:
        lines.append(f"problem  {p}")
    lines.append("verdict  " + ("OK" if report["ok"] else "MISMATCH"))
    return "\n".join(lines)


def read_prompts(path: str) -> list[str]:
    """One prompt per line of a text file, or ``{"text": ...}`` per line of a .jsonl."""
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if path.endswith(".jsonl"):
        return [json.loads(line)["text"] for line in lines]
    return lines
