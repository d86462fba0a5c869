"""SGLang's spelling: ``python -m specserve.launch_server --model-path PATH ...``."""

from __future__ import annotations

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
