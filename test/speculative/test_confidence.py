from __future__ import annotations

import pytest

from specserve.speculative.confidence import SpsTable, budget_lengths, static_lengths


def test_static_lengths_stop_at_the_first_low_confidence() -> None:
    conf = [[0.9, 0.8, 0.3, 0.9], [0.2, 0.9], [0.7, 0.7, 0.7], []]
    assert static_lengths(conf, 0.5) == [2, 0, 3, 0]
    assert static_lengths(conf, 0.0) == [4, 2, 3, 0]


def test_budget_admits_by_survival_while_throughput_improves() -> None:
    # Verify cost grows linearly past 4 tokens: steps/s = 1 / (1 + 0.25 * max(0, B - 4)).
    def sps(b: int) -> float:
        return 1.0 / (1.0 + 0.25 * max(0, b - 4))

    conf = [[0.9, 0.9, 0.9], [0.5, 0.9]]
    # Candidates by survival: (0,1)=.9, (0,2)=.81, (0,3)=.729, (1,1)=.5, (1,2)=.45.
    # B=2, tau=2, gain 2.0 -> +(0,1): 2.9 -> +(0,2): 3.71 -> +(0,3) B=5: 4.439*0.8=3.55 < 3.71 stop.
    assert budget_lengths(conf, sps) == [2, 0]


def test_budget_stops_at_the_first_non_improvement_even_if_a_later_one_would_help() -> None:
    # Throughput dips at 3 tokens and recovers at 4: a global argmax would take 2 drafts,
    # the paper's rule stops before the dip.
    table = {2: 1.0, 3: 0.5, 4: 1.0}

    def sps(b: int) -> float:
        return table.get(b, 0.1)

    assert budget_lengths([[0.99, 0.99], [0.01]], sps) == [0, 0]


def test_budget_with_flat_cost_takes_everything() -> None:
    assert budget_lengths([[0.5, 0.5], [0.1]], lambda b: 1.0) == [2, 1]


def test_sps_table_interpolates_step_time(tmp_path) -> None:
    t = SpsTable({1: 100.0, 9: 50.0})  # 10 ms and 20 ms
    assert t(1) == pytest.approx(100.0)
    assert t(5) == pytest.approx(1 / 0.015)
    assert t(17) == pytest.approx(1 / 0.030)  # extrapolated
    path = tmp_path / "sps.json"
    t.save(str(path))
    assert SpsTable.load(str(path))(5) == pytest.approx(t(5))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="sps_table_path"):
        SpsTable.load(str(bad))
