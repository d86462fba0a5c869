"""Builds the proposer an engine config asks for."""

from __future__ import annotations

import logging
from typing import Any

from specserve.config import EngineConfig, SpecConfig
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.base import Proposer

logger = logging.getLogger(__name__)

NGRAM_DEFAULT_DRAFT_TOKENS = 8
_DSPARK_ONLY = ("draft_model_path", "block_size", "draft_tp_size")


def warn_unused(spec: SpecConfig) -> None:
    """Flags that the chosen algorithm ignores are worth a line in the log."""
    default = SpecConfig()
    set_fields = [
        f
        for f in (
            *_DSPARK_ONLY,
            "sps_table_path",
            "confidence_threshold",
            "schedule",
            "ngram_max_match",
            "ngram_min_match",
        )
        if getattr(spec, f) != getattr(default, f)
    ]
    if spec.algorithm is None:
        unused = set_fields
    elif spec.algorithm == "NGRAM":
        unused = [f for f in set_fields if not f.startswith("ngram")]
    elif spec.ngram_first:  # a drafter network and the n-gram lookup
        unused = []
    else:
        unused = [f for f in set_fields if f.startswith("ngram")]
    if spec.algorithm is not None:  # the cost model's table, for every algorithm
        planned = spec.adaptive or spec.schedule == "budget"
        unused = [f for f in unused if f != "sps_table_path"] + (
            [] if planned or not spec.sps_table_path else ["sps_table_path"]
        )
    for name in unused:
        logger.warning(
            "speculative_%s is ignored with speculative_algorithm %s", name, spec.algorithm
        )


def load_drafter(config: EngineConfig, runner: ModelRunner) -> Any:
    """The drafter network's weights (DSpark / DFlash), loaded before the KV
    pools are sized; None for algorithms without one."""
    if config.spec.algorithm not in ("DSPARK", "DFLASH"):
        return None
    from specserve.speculative.drafter_loader import load_drafter as load

    return load(config, runner)


def build_proposer(
    config: EngineConfig, runner: ModelRunner, drafter: Any = None
) -> Proposer | None:
    """``drafter``: what ``load_drafter`` returned (loaded now if None)."""
    spec = config.spec
    warn_unused(spec)
    if not spec.enabled:
        return None
    if spec.algorithm == "NGRAM":
        from specserve.speculative.ngram import NgramProposer

        chain = spec.num_draft_tokens or NGRAM_DEFAULT_DRAFT_TOKENS
        return NgramProposer(chain - 1, spec.ngram_max_match, spec.ngram_min_match)
    from specserve.speculative.dspark import DSparkProposer

    proposer = DSparkProposer.from_config(config, runner, drafter)
    if not spec.ngram_first:
        return proposer
    from specserve.speculative.ngram import NgramProposer
    from specserve.speculative.ngram_first import NgramFirstProposer

    lookup = NgramProposer(proposer.max_drafts, spec.ngram_max_match, spec.ngram_min_match)
    return NgramFirstProposer(lookup, proposer)
