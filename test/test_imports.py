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
    "distributed",
)


def imported(path: pathlib.Path, prefix: str = "specserve.") -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith(prefix)}


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


def test_only_distributed_touches_torch_distributed() -> None:
    """One module owns process groups and collectives (docs/parallelism.md);
    nor does it import the stages that use it (no cycle through it)."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if path.parent.name != "distributed" and imported(path, "torch.distributed")
    ]
    assert not offenders, offenders
    for path in (ROOT / "distributed").rglob("*.py"):
        stages = {m.split(".")[1] for m in imported(path)} - {"core", "distributed"}
        assert not stages, f"{path.name} imports {stages}"
