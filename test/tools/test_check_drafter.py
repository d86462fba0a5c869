"""``specserve check-drafter``: a clear verdict on a matching pair and on
each kind of mismatch (layer ids, hidden size, vocabulary)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from models_zoo import model_path
from specserve.cli import main
from specserve.tools.drafter_layouts import write_speculators
from specserve.tools.tiny_model import make_tiny_dspark


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    deepspec = make_tiny_dspark(
        str(root / "deepspec"), model_path("qwen3"), markov_head_type="gated"
    )
    return write_speculators(deepspec, str(root / "speculators"), draft_ids=list(range(0, 528, 2)))


def _edited(src: str, dst, **changes) -> str:
    """A copy of the drafter at ``src`` whose config.json has ``changes``
    (``transformer_layer_config`` keys prefixed ``backbone_``)."""
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if key.startswith("backbone_"):
            cfg["transformer_layer_config"][key.removeprefix("backbone_")] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_a_matching_pair_passes(drafter, capsys) -> None:
    argv = ["check-drafter", model_path("qwen3"), drafter, "--max-new-tokens", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["format"] == "speculators" and not report["problems"]
    s = report["settings"]
    assert s["target_layer_ids"] == [0] and s["block_size"] == 4  # the aux id 1, less one
    assert s["vocabulary"].startswith("reduced: 264 draft ids")
    g = report["greedy"]
    assert g["ids_equal"] and g["max_logprob_diff"] <= 1e-4
    assert report["seeded"]["alone_equals_batched"]
    assert len(report["accept_rate_per_position"]) == 4
    assert all(0 <= r <= 1 for r in report["accept_rate_per_position"])
    assert report["speed_batch1"]["ratio"] > 0
    assert main(argv[:-1]) == 0  # the human report
    assert "verdict  OK" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"aux_hidden_state_layer_ids": [7]}, r"target_layer_ids \[6\] must be strictly increasing in \[-1, 1\]"),
        ({"backbone_hidden_size": 96}, r"the drafter \(hidden 96, vocab 528\) does not fit the target \(hidden 64"),
        ({"backbone_vocab_size": 600}, r"\(hidden 64, vocab 600\) does not fit the target \(hidden 64, vocab 528\)"),
    ],
)  # fmt: skip
def test_a_mismatch_is_named_and_fails(drafter, tmp_path, capsys, changes, says) -> None:
    bad = _edited(drafter, tmp_path / "bad", **changes)
    assert main(["check-drafter", model_path("qwen3"), bad]) == 1
    out = capsys.readouterr().out
    assert "verdict  MISMATCH" in out
    problem = next(line for line in out.splitlines() if line.startswith("problem"))
    assert re.search(says, problem), problem


def test_weights_that_do_not_fit_their_config_are_named(drafter, tmp_path, capsys) -> None:
    """The config fits, a tensor does not: the load's error is the verdict."""
    bad = _edited(drafter, tmp_path / "bad", markov_rank=6)
    assert main(["check-drafter", model_path("qwen3"), bad, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    # The first tensor of the wrong shape, named with both shapes.
    assert re.search(r"tensor '.*' has shape \(.*\), config\.json implies", report["problems"][0])


def test_a_deepseek_v4_bundle_is_checked_as_one(tmp_path) -> None:
    """A V4 checkpoint carrying its drafter (``mtp.*``): target and drafter
    are the same directory."""
    from specserve.tools.check_drafter import check_drafter
    from specserve.tools.tiny_model import make_tiny_dspark_v4, make_tiny_model

    target = make_tiny_model(str(tmp_path / "v4"), "deepseek_v4", num_layers=5)
    bundle = make_tiny_dspark_v4(str(tmp_path / "bundle"), target, bundle=True)
    report = check_drafter(bundle, bundle, max_new_tokens=6, speed_repeats=1)
    assert report["ok"], report["problems"]
    s = report["settings"]
    assert report["format"] == "deepseek_v4" and s["stages"] == len(s["target_layer_ids"]) > 0
    assert report["greedy"]["ids_equal"] and report["greedy"]["max_logprob_diff"] <= 1e-4


def test_a_gemma4_pair_names_its_backbone(tmp_path, capsys) -> None:
    from specserve.tools.tiny_model import make_tiny_model

    target = make_tiny_model(str(tmp_path / "gemma4"), arch="gemma4", num_layers=4)
    drafter = make_tiny_dspark(str(tmp_path / "drafter"), target, target_layer_ids=(0, 1, 2))
    assert main(["check-drafter", target, drafter, "--max-new-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["greedy"]["ids_equal"]
    assert report["settings"]["backbone"].startswith("Gemma 4 (heads 4 x 32, 1 KV, keys as values")
