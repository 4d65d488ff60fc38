"""Where a pipeline loads (validate, plan, run, the Python API), the code it names is checked before any work:
rewards too, not only user stages, tools and environments."""

from __future__ import annotations

import pytest
from harness import cli, write_yaml

from batchrl.api import Pipeline
from batchrl.config import ConfigError, validate_dict


def raw_pipeline(tmp_path, rewards):
    return {
        "name": "p",
        "run": {"root": str(tmp_path / "runs")},
        "model": {"path": "m"},
        "data": {"train_files": [str(tmp_path / "prompts")]},
        "score": {"rewards": rewards},
    }


def test_validate_and_plan_refuse_a_reward_that_does_not_resolve_or_a_bad_param_value_with_exit_2(tmp_path):
    cases = [
        ([{"reward": "gsm8k_strictt"}], "score: unknown reward 'gsm8k_strictt'; known rewards: code_tests"),
        (
            [{"reward": "code_tests", "params": {"mode": "most"}}],
            "score: reward 'code_tests': params.mode='most' must be one of ['fraction', 'all']",
        ),
    ]
    for (rewards, message), command in zip(cases, ("validate", "plan")):
        path = write_yaml(tmp_path / f"{command}.yaml", raw_pipeline(tmp_path, rewards))
        result = cli(command, path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"config error: {path}: {message}"), result.stderr
        assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_the_python_api_checks_the_rewards_where_the_pipeline_is_made():
    config = validate_dict(raw_pipeline_without_root([{"reward": "code_tests", "params": {"timeout_s": 0}}]))
    with pytest.raises(ConfigError, match=r"params\.timeout_s=0 must be a positive number"):
        Pipeline(config)
    Pipeline(validate_dict(raw_pipeline_without_root([{"reward": "code_tests", "params": {"timeout_s": 1}}])))


def raw_pipeline_without_root(rewards):
    return {"name": "p", "model": {"path": "m"}, "data": {"train_files": ["d"]}, "score": {"rewards": rewards}}
