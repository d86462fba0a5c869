"""Flag parsing: the demo defaults of ``serve`` / ``generate``."""

from __future__ import annotations

import os

import pytest

from specserve.assets import DEMO_ROOT
from specserve.server.args import apply_demo_defaults, build_parser

demo_built = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)


def parsed(*argv: str):
    args = build_parser().parse_args(list(argv))
    apply_demo_defaults(args)
    return args


@demo_built
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_no_model_path_means_the_demo_and_its_drafters(command) -> None:
    extra = ["--prompt", "x"] if command == "generate" else []
    args = parsed(command, *extra)
    assert args.model_path == os.path.join(DEMO_ROOT, "target")
    assert args.speculative_draft_model_path is None
    if command == "serve":
        assert args.served_model_name == "specserve-demo"
        assert parsed("serve", "--served-model-name", "m").served_model_name == "m"
    for alg in ("DSPARK", "DFLASH"):
        args = parsed(command, *extra, "--speculative-algorithm", alg)
        assert args.speculative_draft_model_path == os.path.join(DEMO_ROOT, alg.lower())
        assert args.speculative_token_map == os.path.join(DEMO_ROOT, "token_map.pt")
        flags = ["--speculative-algorithm", alg, "--speculative-token-map", "/m.pt"]
        assert parsed(command, *extra, *flags).speculative_token_map == "/m.pt"
    # NGRAM needs no drafter; an explicit drafter is kept.
    assert (
        parsed(command, *extra, "--speculative-algorithm", "NGRAM").speculative_draft_model_path
        is None
    )
    args = parsed(
        command, *extra, "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "/d"
    )
    assert args.speculative_draft_model_path == "/d" and args.speculative_token_map is None


def test_another_target_gets_no_demo_drafter(tmp_path) -> None:
    args = parsed("serve", "--model-path", str(tmp_path), "--speculative-algorithm", "DSPARK")
    assert args.model_path == str(tmp_path) and args.speculative_draft_model_path is None
    assert args.served_model_name is None  # the server names it by its path


def test_missing_demo_is_a_clear_error(monkeypatch, tmp_path) -> None:
    import specserve.assets as assets

    monkeypatch.setattr(assets, "DEMO_ROOT", str(tmp_path))
    with pytest.raises(ValueError, match="demo model is not installed.*--model-path"):
        parsed("serve")


def test_ngram_first_flag_reaches_the_spec_config(tmp_path) -> None:
    from specserve.config import EngineConfig
    from specserve.server.args import engine_kwargs

    base = ["serve", "--model-path", str(tmp_path), "--speculative-algorithm", "DSPARK"]
    base += ["--speculative-draft-model-path", "/d"]
    for extra, want in (([], False), (["--speculative-ngram-first"], True)):
        kwargs = engine_kwargs(parsed(*base, *extra))
        assert EngineConfig.from_kwargs(str(tmp_path), **kwargs).spec.ngram_first is want


def flags_config(model_path, *flags: str):
    """The EngineConfig ``specserve serve --model-path M FLAGS`` builds."""
    from specserve.config import EngineConfig
    from specserve.server.args import engine_kwargs

    kwargs = engine_kwargs(parsed("serve", "--model-path", str(model_path), *flags))
    return EngineConfig.from_kwargs(str(model_path), **kwargs)


def test_grammar_limit_flags_reach_the_engine_config(tmp_path) -> None:
    from specserve.config import LimitsConfig

    def config(*flags: str):
        return flags_config(tmp_path, *flags)

    default = config()
    assert (default.grammar_compile_timeout, default.grammar_compile_max_memory) == (30.0, 4096)
    assert default.limits.max_grammar_length == LimitsConfig().max_grammar_length == 131072
    cfg = config(
        "--grammar-compile-timeout", "2.5",
        "--grammar-compile-max-memory", "512",
        "--max-grammar-length", "100",
    )  # fmt: skip
    assert (cfg.grammar_compile_timeout, cfg.grammar_compile_max_memory) == (2.5, 512)
    assert cfg.limits.max_grammar_length == 100
    for flags, message in (
        (("--grammar-compile-timeout", "0"), "grammar_compile_timeout must be"),
        (("--grammar-compile-timeout", "nan"), "grammar_compile_timeout must be"),
        (("--grammar-compile-timeout", "inf"), "grammar_compile_timeout must be"),
        (("--grammar-compile-max-memory", "0"), "grammar_compile_max_memory must be"),
        (("--max-grammar-length", "0"), "max_grammar_length must be"),
    ):
        with pytest.raises(ValueError, match=message):
            config(*flags)


def test_parallel_flags_reach_the_config_and_bad_layouts_are_named(tmp_path) -> None:
    def config(*flags: str):
        return flags_config(tmp_path, *flags)

    par = config(
        "--tp-size", "4", "--ep-size", "4", "--dp-size", "2", "--nnodes", "2",
        "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000", "--dist-timeout", "30",
    ).parallel  # fmt: skip
    assert (par.tp_size, par.ep_size, par.dp_size, par.nnodes, par.node_rank) == (4, 4, 2, 2, 1)
    assert (par.dist_init_addr, par.dist_timeout, par.node_ranks) == (
        "10.0.0.1:5000",
        30.0,
        range(2, 4),
    )
    assert config().parallel.tp_size == 1
    # The drafter's placement: split over the group, or rank 0 alone (the
    # CPU's default: collectives cost more there than a small drafter).
    assert config("--tp-size", "2").draft_tp_size == 1
    split = config("--tp-size", "2", "--speculative-draft-tensor-parallel-size", "2")
    assert split.draft_tp_size == 2
    for flags, message in (
        (
            ("--tp-size", "4", "--speculative-draft-tensor-parallel-size", "2"),
            "speculative_draft_tensor_parallel_size must be 1",
        ),
        (("--tp-size", "0"), "tp_size must be"),
        (("--dp-size", "0"), "dp_size must be"),
        (("--tp-size", "4", "--ep-size", "2"), "ep_size must be 1 or tp_size"),
        (("--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"), "nnodes must be"),
        (("--tp-size", "2", "--nnodes", "2"), "dist_init_addr .* is required"),
        (("--node-rank", "1"), "node_rank must be in"),
        (("--dist-init-addr", "nohost"), "dist_init_addr must be host:port"),
        (("--dist-timeout", "0"), "dist_timeout must be"),
        (("--tp-size", "2", "--enable-torch-compile"), "enable_torch_compile: not supported"),
    ):
        with pytest.raises(ValueError, match=message):
            config(*flags)
