"""specserve: a small LLM serving engine built around speculative decoding."""

from __future__ import annotations

from specserve.engine.data_parallel import DataParallelEngine
from specserve.engine.engine import Engine
from specserve.sampling.params import SamplingParams

__all__ = ["DataParallelEngine", "Engine", "SamplingParams"]
__version__ = "0.1.0"
