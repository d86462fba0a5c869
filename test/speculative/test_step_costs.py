"""The profiled cost tables: interpolation, saving and loading, monotone
profiles."""

from __future__ import annotations

import json

import pytest

from specserve.speculative.step_costs import CostTable, StepCosts, profile_costs


def test_the_cost_table_interpolates_and_round_trips(tmp_path) -> None:
    table = CostTable([1, 4], [1, 8], [[1.0, 2.0], [4.0, 8.0]])
    assert table(1, 1) == pytest.approx(1.0)
    assert table(4, 32) == pytest.approx(8.0)
    assert table(1, 4) == pytest.approx(1.0 + 3 / 7)  # 4 tokens for 1 request
    assert table(2, 2) == pytest.approx(2.0)  # between 1 and 4 requests at 1 token each
    assert table(8, 8) == pytest.approx(8.0)  # linear past 4 requests: 1 + 3 * 7 / 3
    path = tmp_path / "costs.json"
    draft = CostTable([1, 4], [1], [[0.5], [0.9]])
    StepCosts(table, draft, draft_row=0.003).save(str(path))
    back = StepCosts.load(str(path))
    assert back.target(3, 9) == pytest.approx(table(3, 9))
    assert back.draft is not None and back.draft(2, 2) == pytest.approx(draft(2, 2))
    assert back.draft_row == pytest.approx(0.003)
    StepCosts(table).save(str(path))  # no drafter profiled (n-gram)
    assert StepCosts.load(str(path)).draft is None
    (tmp_path / "old.json").write_text(json.dumps({"1": 100.0}))  # the old format
    with pytest.raises(ValueError, match="sps_table_path"):
        StepCosts.load(str(tmp_path / "old.json"))


def test_profiled_tables_are_monotone() -> None:
    noisy = {(1, 1): 2.0, (1, 4): 1.0, (2, 1): 1.5, (2, 4): 3.0}
    clock = [0.0]

    def forward(n: int, c: int) -> None:
        clock[0] += noisy[(n, c)]

    table = profile_costs(forward, [1, 2], [1, 4], repeats=1, clock=lambda: clock[0])
    assert table.times == [[2.0, 2.0], [2.0, 3.0]]
