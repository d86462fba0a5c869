"""Captured DECODE / VERIFY forwards (``runner/cuda_graph_runner.py``) and
DSpark block forwards (``speculative/block_graphs.py``) on the CPU: the
capture (``simulated_graph_capture``) replays the same function on the
static buffers and plan, with the Triton attention kernel interpreted, but
as a CUDA graph would: into the outputs it returned at capture, clobbering
the other graphs' outputs, and failing on host syncs. So padding (entries
up to a bucket, chains up to one width), the scratch slot, the buffer
refills and the copies of what the engine keeps are checked against eager
forwards and plain decoding without a GPU. The graphs themselves are
checked on CUDA (``test/engine/test_cuda_engine.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from models_zoo import model_path, random_prompts
from spec_helpers import OracleProposer
from specserve import Engine
from specserve.config import EngineConfig
from specserve.core import BatchEntry, ScheduledBatch
from specserve.runner.cuda_graph_runner import (
    GraphShape,
    HostSyncError,
    batch_buckets,
    host_sync_guard,
    simulated_graph_capture,
)
from specserve.tools.tiny_model import make_tiny_dspark

PROMPTS = random_prompts(3, [6, 13, 9], seed=71)
# Different lengths: the batch shrinks 3 -> 2 -> 1 (buckets 4, 2, 1). 17
# tokens: room for a round of each accept length 0..4 (1 + 2 + ... + 5 = 15
# tokens) between the prefill's token and the last round (which no later
# proposal observes).
PLAIN = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (17, 8, 3)]


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
        assert eng.capture_graphs(simulated_graph_capture())
    return eng


TOP = 3  # top logprobs per position


def run(eng: Engine, sampling_params, **kw) -> list[dict]:
    return eng.generate(
        input_ids=PROMPTS,
        sampling_params=sampling_params,
        return_logprob=True,
        top_logprobs_num=TOP,
        **kw,
    )


def assert_same(got: list[dict], want: list[dict]) -> None:
    """Same tokens, logprobs and top logprobs (ids and values), position by
    position (lengths checked first: a zip would hide a missing entry)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a["output_ids"] == b["output_ids"]
        ma, mb, n = a["meta_info"], b["meta_info"], len(b["output_ids"])
        la, lb = ma["output_token_logprobs"], mb["output_token_logprobs"]
        assert len(la) == len(lb) == n
        assert [x[0] for x in la] == pytest.approx([x[0] for x in lb], abs=1e-5)
        ta, tb = ma["output_top_logprobs"], mb["output_top_logprobs"]
        assert len(ta) == len(tb) == n
        for pa, pb in zip(ta, tb):
            assert len(pa) == len(pb) == TOP
            assert [t[1] for t in pa] == [t[1] for t in pb]
            assert [t[0] for t in pa] == pytest.approx([t[0] for t in pb], abs=1e-5)


def keep_outputs(owner, method: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wraps ``owner.method`` to keep every tensor it returns beside a copy
    of it at return: the caller may hold what it got across later replays
    (a graph's own outputs would be overwritten)."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = getattr(owner, method)

    def keeping(*args, **kwargs):
        out = real(*args, **kwargs)
        for t in out if isinstance(out, tuple) else (out,):
            if t is not None:
                kept.append((t, t.clone()))
        return out

    setattr(owner, method, keeping)
    return kept


def assert_unchanged(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert kept
    changed = sum(not torch.equal(t, at_return) for t, at_return in kept)
    assert changed == 0, f"{changed} of {len(kept)} outputs changed after they were returned"


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
    end (padded to one width), beside padding entries: each round accepts
    what the oracle planned, and every planned length occurs."""
    truth = {f"r{i}": out["output_ids"] for i, out in enumerate(eager)}
    schedule = [0, 3, 1, 4, 2]
    oracle = OracleProposer(truth, schedule, max_drafts=4)
    eng = engine(graphs=True, proposer=oracle)
    try:
        assert_same(run(eng, PLAIN, rid=list(truth)), eager)
        used = eng.runner.graphs.replays
        assert any(s.width == 5 for s in used), used
    finally:
        eng.shutdown()
    for rid in truth:
        seen = oracle.observed.get(rid, [])
        assert seen == oracle.planned[rid][: len(seen)], rid
    assert set(schedule) <= {n for seen in oracle.observed.values() for n in seen}


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
            dspark = eng.proposer.drafter if ngram_first else eng.proposer
            if graphs:
                assert dspark.graphs is not None
                kept = keep_outputs(eng.runner.graphs, "replay")
                kept_blocks = keep_outputs(dspark.graphs, "run")
            assert_same(run(eng, PLAIN), eager)
            if graphs:
                assert any(s.width > 1 for s in eng.runner.graphs.replays)
                assert dspark.graphs.replays > 0
                # What the replays returned (the target's features, which the
                # proposer keeps; the drafter's blocks) outlived later replays.
                assert_unchanged(kept)
                assert_unchanged(kept_blocks)
        finally:
            eng.shutdown()
    assert len(drafts[True]) == len(drafts[False]) > 5
    assert drafts[True] == drafts[False]


def test_the_budget_schedule_profiles_the_captured_verify_forwards(monkeypatch, tmp_path) -> None:
    """Where graphs apply, the budget table waits for them and times their
    replays, not the eager forwards (here: graphs "apply" on the CPU, the
    capture replaying eagerly)."""
    from specserve.runner import model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "graphs_apply", lambda self: True)
    monkeypatch.setattr(
        model_runner, "cuda_graph_capture", lambda device: simulated_graph_capture()
    )
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
        assert eng.core.spec.planner is not None
        # The profile's verify chains of every batch size, as replays.
        chain = proposer.max_drafts + 1
        assert {GraphShape(chain, 1), GraphShape(chain, 2)} <= set(graphs.replays)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("failing", ["target", "drafter"])
def test_a_failed_capture_leaves_the_engine_serving_eagerly(
    failing, monkeypatch, caplog, eager, tmp_path
) -> None:
    """A capture that fails (the target's first, or DSpark's second block
    forward after every target forward was captured) leaves nothing
    captured: the target and the drafter both serve eagerly (no replay
    runs), and the output is plain decoding's."""
    from specserve.runner import model_runner

    captures, replays = Counter(), Counter()

    def failing_capture(device):
        simulated = simulated_graph_capture()

        def capture(forward):
            kind = "drafter" if "DraftBlockGraphs" in forward.__qualname__ else "target"
            if kind == failing and captures[kind] == (0 if kind == "target" else 1):
                raise RuntimeError("capture failed here")
            captures[kind] += 1
            replay = simulated(forward)

            def counted():
                replays[kind] += 1
                return replay()

            return counted

        return capture

    monkeypatch.setattr(model_runner.ModelRunner, "graphs_apply", lambda self: True)
    monkeypatch.setattr(model_runner, "cuda_graph_capture", failing_capture)
    spec = {}
    if failing == "drafter":
        spec = {
            "speculative_algorithm": "DSPARK",
            "speculative_draft_model_path": make_tiny_dspark(
                str(tmp_path / "d"), model_path("qwen3")
            ),
        }
    with caplog.at_level("WARNING"):
        eng = engine(graphs=False, **spec)
    try:
        if failing == "drafter":  # the target's forwards were all captured first
            assert captures == {"target": 2 * len(batch_buckets(4)), "drafter": 1}
            assert eng.proposer.graphs is None
        assert eng.runner.graphs is None
        assert "capture failed here" in caplog.text and "runs eagerly" in caplog.text
        assert_same(run(eng, PLAIN), eager)
        assert sum(replays.values()) == 0, replays
    finally:
        eng.shutdown()


def test_shape_for_takes_only_uniform_decode_and_verify_steps() -> None:
    eng = engine(graphs=False)
    try:
        assert eng.runner.capture_graphs(5, (), capture=simulated_graph_capture())
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


def test_the_simulated_capture_behaves_as_graphs_in_one_pool() -> None:
    """Replays write into the tensors the capture returned, clobber the
    other graphs' outputs, and a host sync inside a forward raises."""
    capture = simulated_graph_capture()
    x = torch.zeros(2)
    double = capture(lambda: (x * 2, None))
    plus = capture(lambda: (x + 1, x - 1))
    x.fill_(3.0)
    first, _ = double()
    assert first.tolist() == [6.0, 6.0]
    x.fill_(4.0)
    assert double()[0] is first and first.tolist() == [8.0, 8.0]  # overwritten
    assert plus()[1].tolist() == [3.0, 3.0]
    assert first.isnan().all()  # another graph of the pool replayed
    syncs = [
        lambda: x[0].item(),
        lambda: bool(x[0] > 0),
        lambda: x.cpu(),
        lambda: x.tolist(),
        lambda: x[x > 0],  # a mask: its true count
        lambda: torch.nonzero(x),
        lambda: torch.repeat_interleave(x, torch.tensor([1, 2])),  # the repeats' sum
    ]
    for sync in syncs:
        with pytest.raises(HostSyncError), host_sync_guard():
            sync()
        # Under inference mode (as the runner captures) composite ops reach
        # the dispatcher whole (item, index with a mask).
        with torch.inference_mode(), pytest.raises(HostSyncError):
            capture(lambda sync=sync: (sync(), None))
    with host_sync_guard():  # what a graph may hold
        torch.where(x > 0, x, 0.0).index_select(0, torch.tensor([1])).sum()
        torch.repeat_interleave(x, torch.tensor([1, 2]), output_size=3)


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
