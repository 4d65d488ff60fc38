"""The score stage: config checks before anything runs, and a real run on embedded Ray where a hanging rule
reward is timed out inside the Ray actor while the reward model scores every sample."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_score_components import (  # noqa: F401  (reward_model_dir is a fixture)
    reward_model_dir,
    rollouts,
    run_score_stage,
)

from batchrl.config import ConfigError, validate_dict
from batchrl.stages.score import ScoreStage
from batchrl.storage import read_parquet

HERE = Path(__file__).resolve().parent


def config(tmp_path, toy_model_dir, toy_prompts_dir, score: dict):
    return validate_dict(
        {
            "name": "score",
            "run": {"root": str(tmp_path / "runs")},
            "model": {"path": toy_model_dir},
            "data": {"train_files": [toy_prompts_dir]},
            "score": score,
            "ray": {"num_cpus": 2},
        }
    )


@pytest.mark.parametrize(
    ("score", "complaint"),
    [
        ({"rewards": [{"reward": "gsm9k"}]}, "unknown reward 'gsm9k'"),
        (
            {"rewards": [{"reward": "overlong_penalty", "params": {"max_length": 9}}]},
            r"needs params \['buffer_length'\]",
        ),
        ({"rewards": [{"reward": "gsm8k", "params": {"strict": True}}]}, r"has no parameter\(s\) \['strict'\]"),
        ({"reward_by_data_source": {"trivia": "no_such_module:fn"}}, "cannot import module 'no_such_module'"),
        ({"reward_model": {"path": "./no/such/dir"}}, "neither a local checkpoint directory nor a hub id"),
    ],
)
def test_config_mistakes_are_config_errors_before_anything_runs(
    tmp_path, toy_model_dir, toy_prompts_dir, score, complaint
):
    with pytest.raises(ConfigError, match=complaint):
        ScoreStage().check_inputs(config(tmp_path, toy_model_dir, toy_prompts_dir, score))


def test_duplicate_component_names_are_rejected_by_the_config():
    with pytest.raises(ConfigError, match=r"component names \['reward_model'\] are not unique"):
        validate_dict(
            {
                "name": "x",
                "model": {"path": "m"},
                "data": {"train_files": ["d"]},
                "score": {"rewards": [{"reward": "gsm8k", "name": "reward_model"}], "reward_model": {"path": "org/rm"}},
            }
        )


def test_preflight_wants_a_reward_for_every_data_source_unless_the_reward_model_scores_alone(
    tmp_path, toy_model_dir, toy_prompts_dir, reward_model_dir
):
    rules = config(tmp_path, toy_model_dir, toy_prompts_dir, {})
    with pytest.raises(ConfigError, match="no reward for data_source 'chat'"):
        ScoreStage().check_data_sources(rules, ["arith", "chat"])
    model_only = config(tmp_path, toy_model_dir, toy_prompts_dir, {"reward_model": {"path": reward_model_dir}})
    ScoreStage().check_inputs(model_only)
    ScoreStage().check_data_sources(model_only, ["arith", "chat"])


def test_a_hanging_reward_times_out_inside_ray_actors_and_the_stage_completes(
    ray_session, tmp_path, toy_model_dir, toy_prompts_dir, reward_model_dir
):
    cfg = config(
        tmp_path,
        toy_model_dir,
        toy_prompts_dir,
        {
            "rewards": [{"reward": "gsm8k"}, {"reward": "custom_rewards:hangs_on_second_sample", "weight": 0.0}],
            "timeout_s": 1.0,
            "failure_reward": -1.0,
            "reward_model": {"path": reward_model_dir, "batch_size": 4},
        },
    )
    tables = [
        rollouts(
            [{"prompt_id": f"p{k}{i}", "truth": "7", "responses": ["#### 7", "#### 7", "#### 8"]} for i in range(2)]
        )
        for k in range(2)
    ]
    output, out_dir = run_score_stage(cfg, tables, tmp_path)
    rows = [r for p in output.parts for r in read_parquet(f"{out_dir}/{p.name}").to_pylist()]
    assert [r["prompt_id"] for r in rows] == ["p00", "p01", "p10", "p11"]
    for row in rows:
        assert row["score_errors"] == [None, "hangs_on_second_sample timed out after 1s", None]
        assert row["scores"][1] == -1.0
        assert [v[0] for v in row["reward_values"]] == [1.0, 1.0, 0.0]  # gsm8k still scored the hung sample
        assert all(v[2] is not None for v in row["reward_values"])  # and so did the reward model
    assert output.counts["failed_samples"] == 4 and output.counts["timed_out_samples"] == 4
    assert output.stats["critic/rewards/gsm8k/mean"] == pytest.approx(2 / 3)
    assert "critic/rewards/reward_model/mean" in output.stats
    assert "critic/rewards/hangs_on_second_sample/mean" in output.stats
