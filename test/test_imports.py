"""The package's layering, read from the source: the shared types in
``core.py`` import no stage, and the stages below the engine (proposers,
runner, models, kernels, sampling, caches, grammar) never import the engine or
the server, so no import cycle runs between packages."""

from __future__ import annotations

import ast
import pathlib

import specserve

ROOT = pathlib.Path(specserve.__file__).parent
STAGES = ("engine", "server", "runner", "speculative", "cache", "models", "layers", "kernels")
BELOW_ENGINE = (
    "speculative",
    "runner",
    "models",
    "layers",
    "kernels",
    "sampling",
    "cache",
    "grammar",
)


def imported(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("specserve.")}


def test_core_imports_no_stage() -> None:
    bad = [m for m in imported(ROOT / "core.py") if m.split(".")[1] in STAGES]
    assert not bad, f"core.py imports stages: {bad}"


def test_nothing_below_the_engine_imports_it() -> None:
    offenders = []
    for package in BELOW_ENGINE:
        for path in (ROOT / package).rglob("*.py"):
            for m in imported(path):
                if m.split(".")[1] in ("engine", "server"):
                    offenders.append(f"{path.relative_to(ROOT)} imports {m}")
    assert not offenders, "\n".join(offenders)
