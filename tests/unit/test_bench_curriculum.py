"""bench_curriculum's arithmetic on made-up metrics and groups (the benchmark itself runs pipelines: `python
bench/run_all.py curriculum`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_curriculum.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_curriculum", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zero_advantage_share_sums_the_iterations_before_dividing(bench):
    first = {"data/prompts": 16, "data/prompts/easy": 8, "data/zero_advantage_groups": 8}
    metrics = [
        first | {"data/zero_advantage_groups/easy": 6},
        {"data/prompts": 16, "data/prompts/easy": 8, "data/zero_advantage_groups": 0},  # a metric left out counts 0
    ]
    assert bench.zero_advantage_share(metrics) == 8 / 32
    assert bench.zero_advantage_share(metrics, source="easy") == 6 / 16


def test_groups_are_counted_as_all_pass_all_fail_or_mixed_overall_and_by_source(bench):
    rows = [
        {"source": "easy", "scores": [1.0, 1.0]},
        {"source": "easy", "scores": [0.0, 1.0]},
        {"source": "hard", "scores": [0.0, 0.0]},
    ]
    counts = bench.group_outcomes(rows)
    assert counts == {"all_pass": 1, "all_pass/easy": 1, "mixed": 1, "mixed/easy": 1, "all_fail": 1, "all_fail/hard": 1}


def test_the_probe_counts_a_right_number_with_the_period_the_grader_refuses(bench):
    assert bench.computed_right("#### 12", "12") and bench.computed_right("#### 12.", "12")
    assert not bench.computed_right("#### 13.", "12") and not bench.computed_right("12", "12")
    split = bench.split_by_difficulty(["a", "b", "c"], [0.75, 0.25, 0.0], easy_at_least=0.5, hard_at_most=0.125)
    assert split == {"easy": ["a"], "hard": ["c"]}
