"""Shared test setup.

Triton's interpreter must be chosen before triton is imported, so it is set
here, before any test module imports the package's kernels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def fixed_verify_lengths() -> Iterator[None]:
    """Engines built in tests verify what their proposer drafted, every
    round (``speculative_adaptive="off"``), unless a test passes the flag:
    the speculative suites test the rounds themselves, which the cost model
    (timed, so not repeatable) would otherwise skip on tiny models, and
    seeded outputs must not depend on the batch. Session-wide, so that
    module fixtures' engines get it too (servers started through
    server_harness.running_server get the flag there)."""
    from specserve.config import EngineConfig

    build = EngineConfig.from_kwargs.__func__  # type: ignore[attr-defined]

    def from_kwargs(cls, model_path, **kwargs):
        kwargs.setdefault("speculative_adaptive", "off")
        return build(cls, model_path, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineConfig, "from_kwargs", classmethod(from_kwargs))
        yield
