"""Extreme but valid sampling values give a sample of the distribution asked
for, never an abort: every knob at its edges, alone and under a grammar, on
plain decoding and every speculative algorithm (verification reads the same
distribution). The oracles are computed here: the tokens a regex allows are
spelled out by hand from the tokenizer, the argmax comes from the raw
(model) logprobs, a temperature above float32's range is the uniform
distribution over the allowed tokens."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from specserve import Engine
from specserve.assets import DEMO_ROOT, demo_path, demo_token_map
from specserve.kernels.logprobs import row_logprobs_ref, row_logprobs_triton
from specserve.sampling.logprobs import MIN_LOGPROB
from specserve.sampling.metadata import target_probs
from specserve.sampling.params import GREEDY_BELOW, MAX_TEMPERATURE, SamplingParams

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)

HUGE = 1e308  # inf in float32
EDGE = GREEDY_BELOW * 1.0001  # the smallest temperatures that still sample
PROMPTS = ["def f(", "x = [", "import os\n"]
REGEX = "[ab]{1,3}"
MAX_NEW = 4  # room for the regex: three letters and an end of sequence
VOCAB = 8192  # the demo's


def test_temperatures_past_float32_are_the_uniform_distribution() -> None:
    """1e308 is inf in float32, and -inf / inf is NaN: the temperature is
    taken as float32's largest, where masked tokens stay impossible and the
    others are equally likely (the distribution and processed logprobs)."""
    assert SamplingParams(temperature=HUGE).temperature == MAX_TEMPERATURE
    assert torch.finfo(torch.float32).max == MAX_TEMPERATURE
    assert SamplingParams(temperature=EDGE).temperature == EDGE
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 30
    allowed = torch.rand(3, 40, generator=g) < 0.3
    allowed[:, 0] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    params = [SamplingParams(temperature=HUGE), SamplingParams(temperature=HUGE, top_k=50)]
    probs = target_probs(masked[:2], params)
    for row in range(2):
        n = int(allowed[row].sum())
        want = torch.where(allowed[row], 1.0 / n, 0.0)
        torch.testing.assert_close(probs[row], want)
    temps = torch.full((3,), SamplingParams(temperature=HUGE).temperature)
    ids = torch.zeros(3, dtype=torch.int64)
    for scorer in (row_logprobs_ref, row_logprobs_triton):
        out = scorer(masked, ids, temps, top_k=2)
        n = allowed.sum(dim=1).float()
        torch.testing.assert_close(out.token_logprobs, -n.log())
        assert torch.isfinite(out.top_values).all()


# ---- the sweep ---------------------------------------------------------------

# How a case's tokens are checked: "any" allowed token; "argmax": the
# allowed token of highest raw logprob (within ``tol``); "forced": token "a".
ANY, ARGMAX, FORCED = "any", "argmax", "forced"


def cases(a: int) -> dict[str, tuple[dict, str, float]]:
    """name -> (sampling params, oracle, argmax tolerance); ``a``: token "a"."""
    every = lambda bias: {t: bias for t in range(VOCAB)}  # noqa: E731
    return {
        "temperature-1e308": ({"temperature": HUGE}, ANY, 0),
        "temperature-1e308-top-p-frequency": (
            {"temperature": HUGE, "top_p": 0.9, "frequency_penalty": 1.0},
            ANY,
            0,
        ),
        "temperature-1e308-min-p-1": ({"temperature": HUGE, "min_p": 1.0}, ANY, 0),
        # Tokens further than ~104 t below the best underflow to probability 0.
        "temperature-above-greedy": ({"temperature": EDGE}, ARGMAX, 104 * EDGE),
        "top-p-1e-300": ({"top_p": 1e-300}, ARGMAX, 1e-4),  # 0 in float32
        "min-p-1": ({"min_p": 1.0}, ARGMAX, 1e-4),
        "repetition-100": ({"repetition_penalty": 100.0}, ANY, 0),
        "repetition-0.01": ({"repetition_penalty": 0.01}, ANY, 0),
        "penalties-max": ({"frequency_penalty": 2.0, "presence_penalty": 2.0}, ANY, 0),
        "penalties-min": ({"frequency_penalty": -2.0, "presence_penalty": -2.0}, ANY, 0),
        "bias+100-every-token-greedy": ({"temperature": 0, "logit_bias": every(100)}, ARGMAX, 1e-4),
        "bias-100-every-token": ({"logit_bias": every(-100)}, ANY, 0),
        "bias-100-every-token-1e308": ({"temperature": HUGE, "logit_bias": every(-100)}, ANY, 0),
        "bias+100-one-token": ({"logit_bias": {a: 100}}, FORCED, 0),
        "bias-100-all-others": ({"logit_bias": {**every(-100), a: 0}}, FORCED, 0),
        "seed-min": ({"seed": -(2**63)}, ANY, 0),
        "seed-2**63": ({"seed": 2**63}, ANY, 0),  # -2**63 modulo 2**64: the same stream
        "seed-max": ({"seed": 2**64 - 1}, ANY, 0),
        "seed-0-1e308": ({"seed": 0, "temperature": HUGE}, ANY, 0),
    }


GRAMMARS = {"none": {}, "regex": {"regex": REGEX}, "json_object": {"json_object": True}}
ENGINES = {
    "plain": {},
    "dspark": {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "dspark"},
    "dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash"},
    "ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    "ngram-first-token-map": {
        "speculative_algorithm": "DSPARK",
        "speculative_draft_model_path": "dspark",
        "speculative_ngram_first": True,
        "speculative_token_map": "token_map",
    },
}


def make_engine(name: str, **kw) -> Engine:
    spec = dict(ENGINES[name])
    if "speculative_draft_model_path" in spec:
        spec["speculative_draft_model_path"] = demo_path(spec["speculative_draft_model_path"])
    if "speculative_token_map" in spec:
        spec["speculative_token_map"] = demo_token_map()
    return Engine(model_path=demo_path("target"), device="cpu", max_total_tokens=8192, **spec, **kw)


class Alphabet:
    """The demo tokens a regex over ``[ab]`` can take, by their text."""

    def __init__(self, eng: Engine) -> None:
        tok = eng.tokenizer
        self.ab = {
            t: tok.decode([t]) for t in range(len(tok)) if re.fullmatch("[ab]+", tok.decode([t]))
        }
        self.a = tok.encode("a", add_special_tokens=False)[0]
        self.eos = set(eng.eos_ids)
        assert self.ab[self.a] == "a" and len(self.ab) >= 4 and self.eos

    def allowed(self, text: str) -> set[int]:
        """What ``[ab]{1,3}`` allows after ``text``: the pieces that keep it
        within 3 letters, and an end of sequence once it has one."""
        out = {t for t, s in self.ab.items() if len(text) + len(s) <= 3}
        return out | self.eos if text else out


@pytest.fixture(scope="module")
def sweep():
    """Every engine's outputs for every (case, grammar), one batch per engine, run once."""
    results: dict[str, dict] = {}
    alphabet: list[Alphabet] = []

    def run(engine_name: str) -> dict:
        if engine_name not in results:
            eng = make_engine(engine_name)
            try:
                if not alphabet:
                    alphabet.append(Alphabet(eng))
                ab = alphabet[0]
                keys, prompts, params = [], [], []
                for k, (case, (sp, _, _)) in enumerate(cases(ab.a).items()):
                    for grammar, g in GRAMMARS.items():
                        keys.append((case, grammar))
                        prompts.append(PROMPTS[len(keys) % len(PROMPTS)])
                        params.append(
                            {"seed": k, "temperature": 1.0, "max_new_tokens": MAX_NEW, **sp, **g}
                        )
                outs = eng.generate(
                    prompts,
                    params,
                    return_logprob=True,
                    top_logprobs_num=1,
                    token_ids_logprob=sorted(ab.ab) + sorted(ab.eos),
                )
                results[engine_name] = dict(zip(keys, outs))
                assert eng.free_pages() == eng.total_pages()
            finally:
                eng.shutdown()
        return results[engine_name]

    return run, alphabet


def check_sample(out: dict, grammar: str, oracle: str, tol: float, ab: Alphabet) -> None:
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    assert reason["type"] in ("stop", "length"), reason
    ids, text = out["output_ids"], out["text"]
    entries = meta["output_token_logprobs"]
    assert len(entries) == len(ids) > 0
    for lp, _, _ in entries:  # the model's logprob of a committed token: never a masked one
        assert math.isfinite(lp) and MIN_LOGPROB < lp <= 0, entries
    if grammar == "regex":
        prefix = ""
        for k, t in enumerate(ids):
            allowed = ab.allowed(prefix)
            assert t in allowed, (k, t, prefix)
            if oracle == ARGMAX:  # the best allowed token by the model's own logprobs
                scored = {tid: lp for lp, tid, _ in meta["output_token_ids_logprobs"][k]}
                assert scored[t] >= max(scored[u] for u in allowed) - tol, (k, t, scored)
            prefix += ab.ab.get(t, "")
        if reason["type"] == "stop":
            assert re.fullmatch(REGEX, text) and ids[-1] in ab.eos, (text, ids)
        if oracle == FORCED:
            assert text == "aaa" and reason["type"] == "stop", (text, ids)
    elif grammar == "json_object":
        assert text.startswith("{"), text
        if reason["type"] == "stop":
            assert isinstance(json.loads(text), dict), text
    else:
        assert all(0 <= t < VOCAB for t in ids)
        if oracle == ARGMAX:
            for (lp, t, _), top in zip(entries, meta["output_top_logprobs"]):
                assert lp >= top[0][0] - tol, (t, lp, top)
        if oracle == FORCED:
            assert ids == [ab.a] * MAX_NEW, ids


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("case", list(cases(0)))
@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_extreme_values_give_a_valid_sample(sweep, engine_name, case, grammar) -> None:
    run, alphabet = sweep
    outs = run(engine_name)
    ab = alphabet[0]
    _, oracle, tol = cases(ab.a)[case]
    if oracle == FORCED and grammar == "json_object":
        oracle = ANY  # "a" is no JSON
    check_sample(outs[(case, grammar)], grammar, oracle, tol, ab)
    if case == "seed-2**63":  # the same seed as -2**63, taken modulo 2**64
        assert outs[(case, grammar)]["output_ids"] == outs[("seed-min", grammar)]["output_ids"]


@pytest.mark.parametrize("engine_name", ["plain", "dspark"])
def test_processed_logprobs_at_an_infinite_temperature_are_uniform(engine_name) -> None:
    """In processed mode a token's logprob is that of the distribution sampled
    from: at temperature 1e308, minus the log of how many tokens are allowed
    (the whole vocabulary, or what the regex allows there)."""
    eng = make_engine(engine_name, logprobs_mode="processed")
    try:
        ab = Alphabet(eng)
        sp = {"temperature": HUGE, "max_new_tokens": 4, "seed": 5}
        free, regex = eng.generate(PROMPTS[:2], [sp, {**sp, "regex": REGEX}], return_logprob=True)
    finally:
        eng.shutdown()
    lps = [lp for lp, _, _ in free["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx([-math.log(VOCAB)] * 4, abs=1e-4)
    assert regex["meta_info"]["finish_reason"]["type"] == "stop", regex["meta_info"]
    assert re.fullmatch(REGEX, regex["text"])
    prefix, want = "", []
    for t in regex["output_ids"]:
        want.append(-math.log(len(ab.allowed(prefix))))
        prefix += ab.ab.get(t, "")
    got = [lp for lp, _, _ in regex["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)
