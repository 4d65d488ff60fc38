"""prompt_stats: per prompt, times sampled, running and last mean reward, pass rate and iterations seen, cumulative
over iterations; values worked out by hand on small scores tables."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchrl.config import validate_dict
from batchrl.errors import DataError
from batchrl.pipeline.stage import StageContext
from batchrl.stages.prompt_stats import PART, PromptStatsStage, iteration_metrics, updated_stats
from batchrl.storage import RunLayout, join, read_parquet, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest


def scores(rows: list[tuple[str, str | None, list[float]]]) -> pa.Table:
    return pa.table(
        {
            "prompt_id": [r[0] for r in rows],
            "source": pa.array([r[1] for r in rows], pa.string()),
            "data_source": ["arith"] * len(rows),
            "scores": pa.array([r[2] for r in rows], pa.list_(pa.float32())),
        }
    )


ITERATION_0 = scores([("a", "easy", [1.0, 1.0, 0.0, 1.0]), ("b", "hard", [0.0, 0.0, 0.0, 0.0])])
ITERATION_1 = scores([("b", "hard", [1.0, 0.0, 0.0, 0.0]), ("c", "easy", [0.5, 1.0, 1.0, 1.0])])


def by_id(table: pa.Table) -> dict[str, dict]:
    return {row["prompt_id"]: row for row in table.to_pylist()}


def test_the_first_iteration_counts_each_prompts_group():
    rows = by_id(updated_stats(None, ITERATION_0, iteration=0, threshold=0.5))
    assert rows["a"] == {
        "prompt_id": "a",
        "source": "easy",
        "data_source": "arith",
        "times_sampled": 1,
        "samples": 4,
        "reward_mean": 0.75,
        "last_reward_mean": 0.75,
        "passes": 3,
        "pass_rate": 0.75,
        "last_pass_rate": 0.75,
        "first_iteration": 0,
        "last_iteration": 0,
        "solved_streak": 0,
    }
    assert (rows["b"]["reward_mean"], rows["b"]["pass_rate"]) == (0.0, 0.0)


def test_the_next_iteration_updates_the_prompts_it_sampled_and_keeps_the_others():
    first = updated_stats(None, ITERATION_0, iteration=0, threshold=0.5)
    second = updated_stats(first, ITERATION_1, iteration=1, threshold=0.5)
    rows = by_id(second)
    assert list(rows) == ["a", "b", "c"]  # sorted by prompt id
    assert rows["a"] == by_id(first)["a"]  # not sampled at iteration 1: as it was
    b = rows["b"]  # 0 0 0 0 then 1 0 0 0: 1 pass in 8 samples, the last group 1 in 4
    assert (b["times_sampled"], b["samples"], b["passes"]) == (2, 8, 1)
    assert b["reward_mean"] == pytest.approx(1 / 8) and b["pass_rate"] == pytest.approx(1 / 8)
    assert b["last_reward_mean"] == pytest.approx(1 / 4) and b["last_pass_rate"] == pytest.approx(1 / 4)
    assert (b["first_iteration"], b["last_iteration"]) == (0, 1)
    c = rows["c"]  # 0.5 is not above the threshold: 3 passes of 4
    assert (c["times_sampled"], c["passes"], c["first_iteration"]) == (1, 3, 1)
    assert c["reward_mean"] == pytest.approx(3.5 / 4)


def test_the_solved_streak_counts_iterations_in_a_row_whose_group_passed_in_every_sample():
    solved, missed = scores([("a", None, [1.0, 1.0])]), scores([("a", None, [1.0, 0.0])])
    table = None
    streaks = []
    for iteration, groups in enumerate([solved, solved, missed, solved]):
        table = updated_stats(table, groups, iteration=iteration, threshold=0.5)
        streaks.append(table.column("solved_streak").to_pylist()[0])
    assert streaks == [1, 2, 0, 1]


def test_metrics_break_rewards_down_by_source_and_count_groups_that_scored_all_alike():
    table = updated_stats(None, ITERATION_0, iteration=0, threshold=0.5)
    stats = iteration_metrics(ITERATION_0, table, threshold=0.5)
    assert stats["score/reward_mean/easy"] == 0.75 and stats["score/reward_mean/hard"] == 0.0
    assert stats["score/pass_rate/easy"] == 0.75
    assert stats["data/zero_advantage_groups"] == 1 and stats["data/zero_advantage_groups/hard"] == 1
    assert stats["prompt_stats/prompts_seen"] == 2 and stats["prompt_stats/prompts_seen/easy"] == 1


def context(tmp_path, iteration: int, groups: pa.Table) -> StageContext:
    cfg = validate_dict({"name": "t", "model": {"path": "m"}, "data": {"train_files": ["x"], "prompt_stats": True}})
    layout = RunLayout.for_run(str(tmp_path), "t")
    scores_dir = layout.table_dir("scores", iteration)
    num_bytes, digest = write_parquet_atomic(groups, join(scores_dir, PART))
    manifest = Manifest(
        "score", "scores", iteration, "f", [PartInfo(PART, groups.num_rows, digest, num_bytes)], "scores", 0, 0
    )
    return StageContext(
        cfg=cfg,
        layout=layout,
        iteration=iteration,
        output_dir=layout.table_dir("prompt_stats", iteration),
        fingerprint="x",
        inputs={"scores": manifest},
        input_dirs={"scores": scores_dir},
        policy_in="m",
    )


def test_the_stage_writes_iteration_is_table_from_the_committed_table_of_the_one_before(tmp_path):
    stage = PromptStatsStage()
    first = context(tmp_path, 0, ITERATION_0)
    out = stage.run(first)
    with pytest.raises(DataError, match=r"needs iteration 0's table, which is not committed"):
        stage.run(context(tmp_path, 1, ITERATION_1))
    write_manifest(first.output_dir, Manifest("prompt_stats", "prompt_stats", 0, "x", out.parts, "prompt_stats", 0, 0))
    second = context(tmp_path, 1, ITERATION_1)
    out = stage.run(second)
    table = read_parquet(join(second.output_dir, PART))
    assert (
        table.to_pylist()
        == updated_stats(
            updated_stats(None, ITERATION_0, iteration=0, threshold=0.5), ITERATION_1, iteration=1, threshold=0.5
        ).to_pylist()
    )
    assert out.counts == {"prompts": 3, "groups": 2}
