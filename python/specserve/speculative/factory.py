"""Builds the proposer an engine config asks for."""

from __future__ import annotations

from specserve.config import EngineConfig
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.base import Proposer

NGRAM_DEFAULT_DRAFT_TOKENS = 8


def build_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer | None:
    spec = config.spec
    if not spec.enabled:
        return None
    if spec.algorithm == "NGRAM":
        from specserve.speculative.ngram import NgramProposer

        chain = spec.num_draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
        return NgramProposer(chain - 1, spec.ngram_max_match, spec.ngram_min_match)
    from specserve.speculative.dspark import DSparkProposer

    return DSparkProposer.from_config(config, runner)
