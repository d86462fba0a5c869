"""Files shipped inside the package: the demo model (``demo/``).

The demo is a small Qwen3-architecture model pretrained on Python's own
standard-library sources, with a DSpark and a DFlash drafter trained against
it (``specserve build-demo`` rebuilds it; ``demo/manifest.json`` records how).
It is for trying the engine and seeing speculation work without a download,
not a chat assistant.
"""

from __future__ import annotations

import os

DEMO_ROOT = os.path.join(os.path.dirname(__file__), "demo")
DEMO_PARTS = ("target", "dspark", "dflash")
DEMO_NAME = "specserve-demo"  # the served model name when the demo is served by default


def demo_token_map() -> str | None:
    """The demo drafters' token map (``--speculative-token-map``), if shipped."""
    path = os.path.join(DEMO_ROOT, "token_map.pt")
    return path if os.path.isfile(path) else None


def demo_path(part: str = "target") -> str:
    """Directory of a demo checkpoint (``target``, ``dspark`` or ``dflash``)."""
    if part not in DEMO_PARTS:
        raise ValueError(f"demo part must be one of {DEMO_PARTS}, got {part!r}")
    path = os.path.join(DEMO_ROOT, part)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"the demo model is not installed ({path!r} is missing); pass --model-path"
        )
    return path
