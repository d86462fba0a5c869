"""One place assembles what the sampler sees: ``processed_logits`` (bias,
penalties, min-token suppression, grammar) and ``target_probs`` (temperature,
top-k / top-p / min-p), both in ``sampling/metadata.py``. The sampler, greedy and
rejection verification and processed-mode scoring must all go through them:
losslessness rests on it."""

from __future__ import annotations

import ast
import pathlib

import specserve

ROOT = pathlib.Path(specserve.__file__).parent
# The pieces of "the distribution the sampler sees" and the modules that may call them.
PIECES = {
    "process_logits": {"sampling/metadata.py"},
    "apply_bitmask": {"sampling/metadata.py"},
    "fill_chain_masks": {"sampling/metadata.py"},
    "filter_probs": {"sampling/metadata.py"},
    "processed_logits": {"engine/engine_core.py"},
    "target_probs": {"sampling/sampler.py", "speculative/verify.py"},
}


def calls(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return names


def test_only_the_metadata_module_assembles_the_distribution() -> None:
    found: dict[str, set[str]] = {name: set() for name in PIECES}
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for name in calls(path) & set(PIECES):
            found[name].add(rel)
    for name, allowed in PIECES.items():
        assert found[name] <= allowed, f"{name} called from {sorted(found[name] - allowed)}"
        assert found[name], f"{name} is never called"


def test_a_sampled_speculative_step_reads_the_one_function(tmp_path, monkeypatch) -> None:
    """Sampling, rejection verification and processed scoring, spied on where
    they call in: one processing per step, covering every sampled and verified row."""
    from models_zoo import model_path
    from specserve import Engine
    from specserve.engine import engine_core
    from specserve.sampling import metadata, sampler
    from specserve.speculative import verify
    from specserve.tools.tiny_model import make_tiny_dspark

    seen = {"processed": [], "sampler": 0, "verify": 0}

    def spy_processed(logits, meta):
        seen["processed"].append(logits.shape[0])
        return metadata.processed_logits(logits, meta)

    def counting(key):
        def spy(processed, params):
            seen[key] += 1
            return metadata.target_probs(processed, params)

        return spy

    monkeypatch.setattr(engine_core, "processed_logits", spy_processed)
    monkeypatch.setattr(sampler, "target_probs", counting("sampler"))
    monkeypatch.setattr(verify, "target_probs", counting("verify"))
    drafter = make_tiny_dspark(str(tmp_path / "d"), model_path("qwen3"))
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        max_total_tokens=512,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
        logprobs_mode="processed",
    )
    try:
        steps = []
        step = eng.core.step
        eng.core.step = lambda: (steps.append(1), step())[1]
        sp = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "seed": 3,
              "logit_bias": {"5": 1.0}, "ignore_eos": True}  # fmt: skip
        out = eng.generate(
            input_ids=[[4, 5, 6, 7], [8, 9]], sampling_params=sp, return_logprob=True
        )
    finally:
        eng.shutdown()
    assert all(len(o["output_ids"]) == 12 for o in out)
    assert len(seen["processed"]) == len(steps)  # once per step, for all its rows
    assert seen["sampler"] >= 1 and seen["verify"] >= 1
    assert max(seen["processed"]) > 2  # verify chains' rows went through it too
