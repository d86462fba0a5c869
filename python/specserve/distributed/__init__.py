"""Process groups, ranks and every collective of the engine.

Nothing outside this package calls ``torch.distributed``: layers and the
runner call a ``RankGroup``'s methods, which are the identity at size 1 (the
single-device path pays nothing). See docs/parallelism.md.
"""

from specserve.distributed.group import SINGLE, DistributedError, RankGroup

__all__ = ["SINGLE", "DistributedError", "RankGroup"]
