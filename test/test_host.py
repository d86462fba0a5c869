"""Device-to-host reads on the hot path: one fetch for the drafts, one for
the results, whatever the batch size and the draft length; and no stray
reads anywhere else in the step's modules."""

from __future__ import annotations

import os
import re

import pytest
import torch

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.host import HostStaging

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "python", "specserve")
# Every module a step runs through (the kernels' torch references, the CPU
# path, and the grammar's host bitmasks read host memory by design).
HOT_PATH = ("engine", "sampling", "speculative", "layers", "models", "runner", "cache")
READS = re.compile(r"\.(tolist|item|cpu|numpy)\(\)")


def test_fetch_round_trips_every_dtype_exactly() -> None:
    ints = torch.tensor([[0, 151935], [2**40, -7]])
    floats = torch.tensor([-9999.0, float("-inf"), float("nan"), 1.2345678])
    flags = torch.tensor([True, False])
    got = HostStaging("cpu").fetch([ints, None, floats, flags])
    assert got[0] == ints.tolist() and got[1] is None and got[3] == [True, False]
    assert got[2][:2] == [-9999.0, float("-inf")] and got[2][2] != got[2][2]


def test_no_stray_device_reads_in_the_hot_path() -> None:
    strays = []
    for part in HOT_PATH:
        folder = os.path.join(PACKAGE, part)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(folder, name)) as f:
                for n, line in enumerate(f, 1):
                    if READS.search(line) and "# host read" not in line:
                        strays.append(f"{part}/{name}:{n}: {line.strip()}")
    assert not strays, "read the device through HostStaging.fetch:\n" + "\n".join(strays)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    from specserve.tools.tiny_model import make_tiny_dspark

    return make_tiny_dspark(str(tmp_path_factory.mktemp("d")), model_path("qwen3"), block_size=7)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("algorithm", [None, "NGRAM", "DSPARK"])
def test_at_most_two_fetches_per_step(drafter, monkeypatch, algorithm, batch) -> None:
    kw = {}
    if algorithm == "DSPARK":
        kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafter}
    elif algorithm == "NGRAM":
        kw = {"speculative_algorithm": "NGRAM"}
    eng = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=2048, **kw)
    fetches: list[int] = []
    per_step = [0]
    real_fetch, real_step = HostStaging.fetch, eng.core.step

    def fetch(self, tensors):
        per_step[0] += 1
        return real_fetch(self, tensors)

    def step():
        per_step[0] = 0
        out = real_step()
        fetches.append(per_step[0])
        return out

    monkeypatch.setattr(HostStaging, "fetch", fetch)
    monkeypatch.setattr(eng.core, "step", step)
    try:
        prompts = random_prompts(batch, [5, 9, 14], seed=3)
        params = [
            {"temperature": 0, "max_new_tokens": 12}
            if i % 2 == 0
            else {"temperature": 0.8, "seed": i, "max_new_tokens": 12, "repetition_penalty": 1.2}
            for i in range(batch)
        ]
        eng.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3
        )
    finally:
        eng.shutdown()
    most = 1 if algorithm is None else 2
    assert fetches and max(fetches) <= most, fetches
