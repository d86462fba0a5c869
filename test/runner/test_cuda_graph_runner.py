"""Captured DECODE / VERIFY forwards (``runner/cuda_graph_runner.py``) and
DSpark block forwards (``speculative/block_graphs.py``) on the CPU: the
capture replays the same function eagerly on the static buffers and plan
(``replay_eagerly``), with the Triton attention kernel interpreted, so
padding (entries up to a bucket, chains up to one width), the scratch slot
and the buffer refills are checked against eager forwards and plain
decoding without a GPU. The graphs themselves are checked on CUDA
(``test/engine/test_cuda_engine.py``)."""

from __future__ import annotations

import pytest

from models_zoo import model_path, random_prompts
from spec_helpers import OracleProposer
from specserve import Engine
from specserve.config import EngineConfig
from specserve.core import BatchEntry, ScheduledBatch
from specserve.runner.cuda_graph_runner import GraphShape, batch_buckets, replay_eagerly
from specserve.tools.tiny_model import make_tiny_dspark

PROMPTS = random_prompts(3, [6, 13, 9], seed=71)
# Different lengths: the batch shrinks 3 -> 2 -> 1 (buckets 4, 2, 1).
PLAIN = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (14, 8, 3)]


def engine(graphs: bool, **kw) -> Engine:
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        page_size=4,
        max_total_tokens=1024,
        attention_backend="triton",
        cuda_graph_max_bs=4,
        **kw,
    )
    if graphs:
        assert eng.capture_graphs(replay_eagerly)
    return eng


def run(eng: Engine, sampling_params) -> list[dict]:
    return eng.generate(
        input_ids=PROMPTS, sampling_params=sampling_params, return_logprob=True, top_logprobs_num=3
    )


def assert_same(got: list[dict], want: list[dict]) -> None:
    for a, b in zip(got, want):
        assert a["output_ids"] == b["output_ids"]
        ma, mb = a["meta_info"], b["meta_info"]
        assert [x[0] for x in ma["output_token_logprobs"]] == pytest.approx(
            [x[0] for x in mb["output_token_logprobs"]], abs=1e-5
        )
        for ta, tb in zip(ma["output_top_logprobs"], mb["output_top_logprobs"]):
            assert [t[1] for t in ta] == [t[1] for t in tb]


@pytest.fixture(scope="module")
def eager() -> list[dict]:
    eng = engine(graphs=False)
    try:
        assert eng.runner.graphs is None  # the CPU captures nothing by itself
        return run(eng, PLAIN)
    finally:
        eng.shutdown()


def test_replayed_decode_equals_eager(eager) -> None:
    eng = engine(graphs=True)
    try:
        assert_same(run(eng, PLAIN), eager)
        used = eng.runner.graphs.replays
        assert {GraphShape(1, 4), GraphShape(1, 2), GraphShape(1, 1)} <= set(used)
    finally:
        eng.shutdown()


def test_replayed_verify_chains_equal_plain_decoding(eager) -> None:
    """Chains of every accept length and shorter chains near each request's
    end (padded to one width), beside padding entries."""
    truth = {f"r{i}": out["output_ids"] for i, out in enumerate(eager)}
    oracle = OracleProposer(truth, [0, 3, 1, 4, 2], max_drafts=4)
    eng = engine(graphs=True, proposer=oracle)
    try:
        got = eng.generate(
            input_ids=PROMPTS,
            sampling_params=PLAIN,
            return_logprob=True,
            top_logprobs_num=3,
            rid=list(truth),
        )
        assert_same(got, eager)
        used = eng.runner.graphs.replays
        assert any(s.width == 5 for s in used), used
    finally:
        eng.shutdown()


@pytest.mark.parametrize("algorithm", ["NGRAM", "DSPARK"])
def test_chains_padded_past_the_context_end(algorithm, tmp_path) -> None:
    """Requests that run into the context length: their last chains are
    short, and padded to the width they reach past the context's end (and
    DSpark's last blocks run past it, as eagerly)."""
    prompts = random_prompts(2, [20, 26], seed=72)
    sp = [{"temperature": 0, "max_new_tokens": 40 - len(p), "ignore_eos": True} for p in prompts]
    spec = {"speculative_algorithm": algorithm}
    if algorithm == "DSPARK":
        spec["speculative_draft_model_path"] = make_tiny_dspark(
            str(tmp_path / "d"), model_path("qwen3")
        )
    outs = {}
    for graphs in (False, True):
        eng = engine(graphs=graphs, context_length=40, **spec)
        try:
            outs[graphs] = eng.generate(input_ids=prompts, sampling_params=sp)
            if graphs:
                assert any(s.width > 1 for s in eng.runner.graphs.replays)
        finally:
            eng.shutdown()
    for p, a, b in zip(prompts, outs[False], outs[True]):
        assert len(p) + len(a["output_ids"]) == 40  # to the context's last position
        assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("ngram_first", [False, True])
def test_dspark_replayed_equals_eager_and_plain_decoding(eager, tmp_path, ngram_first) -> None:
    """DSPARK reads target layers captured inside the replayed forward, and
    its block forward (each request's committed rows as context, padded to
    one count) replays too: the drafts of every round are the eager
    drafter's, and the output is plain decoding's (also behind
    ``--speculative-ngram-first``, which hands the capture on)."""
    drafter = make_tiny_dspark(str(tmp_path / "d"), model_path("qwen3"))
    drafts = {}
    for graphs in (False, True):
        eng = engine(
            graphs=graphs,
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=drafter,
            speculative_ngram_first=ngram_first,
        )
        try:
            seen = drafts[graphs] = []
            real = eng.proposer.propose

            def recording(reqs, max_lens, real=real, seen=seen):
                out = real(reqs, max_lens)
                seen.append(out.tokens)
                return out

            eng.proposer.propose = recording
            assert_same(run(eng, PLAIN), eager)
            if graphs:
                assert any(s.width > 1 for s in eng.runner.graphs.replays)
                dspark = eng.proposer.drafter if ngram_first else eng.proposer
                assert dspark.graphs is not None and dspark.graphs.replays > 0
        finally:
            eng.shutdown()
    assert drafts[True] == drafts[False] and len(drafts[True]) > 5


def test_the_budget_schedule_profiles_the_captured_verify_forwards(monkeypatch, tmp_path) -> None:
    """Where graphs apply, the budget table waits for them and times their
    replays, not the eager forwards (here: graphs "apply" on the CPU, the
    capture replaying eagerly)."""
    from specserve.runner import model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "graphs_apply", lambda self: True)
    monkeypatch.setattr(model_runner, "cuda_graph_capture", lambda device: replay_eagerly)
    drafter = make_tiny_dspark(str(tmp_path / "d"), model_path("qwen3"))
    eng = engine(
        graphs=False,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
        speculative_dspark_schedule="budget",
        max_running_requests=2,
    )
    try:
        proposer, graphs = eng.proposer, eng.runner.graphs
        assert graphs is not None and proposer.graphs is not None
        assert proposer.sps is not None and proposer.profile_for is None
        # The profile's verify chains of every batch size, as replays.
        chain = proposer.max_drafts + 1
        assert {GraphShape(chain, 1), GraphShape(chain, 2)} <= set(graphs.replays)
    finally:
        eng.shutdown()


def test_a_failed_capture_leaves_the_engine_serving_eagerly(monkeypatch, caplog, eager) -> None:
    from specserve.runner import model_runner

    def broken(device):
        def capture(forward):
            raise RuntimeError("capture failed here")

        return capture

    monkeypatch.setattr(model_runner.ModelRunner, "graphs_apply", lambda self: True)
    monkeypatch.setattr(model_runner, "cuda_graph_capture", broken)
    with caplog.at_level("WARNING"):
        eng = engine(graphs=False)
    try:
        assert eng.runner.graphs is None
        assert "capture failed here" in caplog.text and "runs eagerly" in caplog.text
        assert_same(run(eng, PLAIN), eager)
    finally:
        eng.shutdown()


def test_shape_for_takes_only_uniform_decode_and_verify_steps() -> None:
    eng = engine(graphs=False)
    try:
        assert eng.runner.capture_graphs(5, (), capture=replay_eagerly)
        graphs = eng.runner.graphs

        def shape(*entries: BatchEntry, capture=()) -> GraphShape | None:
            return graphs.shape_for(ScheduledBatch(list(entries), [], capture))

        decode = BatchEntry([7], 3, [0], [0])
        chain = BatchEntry([7, 8, 9], 3, [0, 1], [0, 1, 2])
        assert shape(decode) == GraphShape(1, 1)
        assert shape(decode, decode, decode) == GraphShape(1, 4)
        assert shape(decode, chain) == GraphShape(5, 2)
        assert shape(*[decode] * 5) is None  # past the largest bucket
        assert shape(BatchEntry([7, 8], 0, [0], [1])) is None  # a prefill chunk
        assert shape(BatchEntry([7] * 6, 3, [0, 1, 2], list(range(6)))) is None  # too long
        assert shape(BatchEntry([7], 3, [0], [0], [[1]])) is None  # further cache groups
        assert shape(decode, capture=(1,)) is None  # other layers captured
    finally:
        eng.shutdown()


def test_buckets_and_flags() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model_path="m", cuda_graph_max_bs=0)
    from specserve.server.args import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    kw = engine_kwargs(args)
    assert kw["disable_cuda_graph"] is True and kw["cuda_graph_max_bs"] == 16
