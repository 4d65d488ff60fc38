"""generate with generate.environment on embedded Ray and the hf engine (the environment imported in the engine's
actor): the rollouts carry the multi-turn columns and each sample's environment reward, the same seeds give the same
rows, a failing environment is counted per sample; and score's `environment` term reads the reward."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from test_generate import config, generate, ingest
from test_score_components import HEALTHY_CALL_S, column, rollouts, score

from batchrl.config import validate_dict
from batchrl.rewards.combine import TermSpec
from batchrl.stages.evaluate import EvaluateStage
from batchrl.stages.generate import GenerateStage


def environment_config(tmp_path, toy_model_dir, toy_prompts_dir, call, **params):
    raw = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf").model_dump()
    raw["generate"] |= {"environment": {"call": call, "params": params}, "max_turns": 3, "max_response_tokens": 96}
    return validate_dict(raw)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory, toy_model_dir, toy_prompts_dir):
    """Countdown twice (same seeds), then an environment whose step fails on odd samples."""
    from batchrl.engines.pool import EnginePool

    engine_pool = EnginePool()
    tmp_path = tmp_path_factory.mktemp("environment")
    cfg = environment_config(tmp_path, toy_model_dir, toy_prompts_dir, "custom_environments:Countdown", turns=2)
    prompts = ingest(cfg)
    first = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="a")
    again = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="b")
    failing = environment_config(tmp_path, toy_model_dir, toy_prompts_dir, "custom_environments:FailsOnOddSamples")
    odd = generate(failing, prompts, engine_pool, policy=toy_model_dir, out_name="odd")
    yield cfg, first, again, odd
    engine_pool.close()


def test_rows_carry_each_samples_environment_reward_turns_steps_and_masks(runs):
    _, (output, rows), _, _ = runs
    assert len(rows) == 6
    for row in rows:
        for ids, mask, reward, text, status, turns, steps in zip(
            row["response_token_ids"],
            row["response_masks"],
            row["environment_rewards"],
            row["response_texts"],
            row["stop_statuses"],
            row["num_turns"],
            row["tool_calls"],
            strict=True,
        ):
            assert len(mask) == len(ids) and mask[0] == 0  # reset's observation opens the response
            steps = json.loads(steps)
            assert [s["name"] for s in steps][:2] == ["reset", "step"] and len(steps) == turns + 1
            if status == "completed":  # the second step ended it with the last turn's length as its reward
                assert turns == 2 and reward == float(len(text.rsplit("1 left\n", 1)[-1]))
            else:
                assert status == "length" and reward is None
    statuses = [s for row in rows for s in row["stop_statuses"]]
    assert output.counts["env_rewarded"] == statuses.count("completed") > 0
    assert output.stats["environment/rewarded_rate"] == pytest.approx(statuses.count("completed") / 18)
    assert output.stats["environment/error_rate"] == 0.0
    assert not any(key.startswith("tools/") for key in output.stats)


def test_the_same_seeds_give_the_same_environment_rows(runs):
    _, (_, rows), (_, again), _ = runs
    for row in rows + again:
        row["tool_calls"] = [[s | {"seconds": 0} for s in json.loads(steps)] for steps in row["tool_calls"]]
    assert again == rows


def test_a_failing_environment_is_counted_per_sample_and_the_stage_finishes(runs):
    _, _, _, (output, rows) = runs
    for row in rows:
        for idx, (status, reward) in enumerate(zip(row["stop_statuses"], row["environment_rewards"], strict=True)):
            if idx % 2:
                assert status == "env_error" and reward is None
    assert output.counts["env_errors"] == 6  # sample 1 of each of the 6 groups of 3
    assert output.stats["environment/error_rate"] == pytest.approx(6 / 18)


def test_the_environment_and_its_source_are_in_generates_fingerprint_only_when_set(runs, tmp_path, toy_model_dir):
    cfg = runs[0]
    prints = GenerateStage().fingerprint_config(cfg)
    assert prints["generate"]["environment"] == {"call": "custom_environments:Countdown", "params": {"turns": 2}}
    assert len(prints["environment_source"]) == 16
    plain = config(tmp_path, toy_model_dir, str(tmp_path), "hf")
    assert "environment_source" not in GenerateStage().fingerprint_config(plain)
    # the held-out samples are played against it too, so the evaluation's fingerprint holds it
    assert EvaluateStage().fingerprint_config(cfg)["tools"]["environment"]["call"] == "custom_environments:Countdown"
    assert "tools" not in EvaluateStage().fingerprint_config(plain)


def test_the_environment_term_scores_the_environments_reward_and_a_sample_without_one_fails_or_scores_its_default():
    table = rollouts([{"prompt_id": "p0", "truth": None, "responses": ["a", "b", "c"]}])
    rewards = pa.array([[0.5, None, -2.0]], type=table.schema.field("environment_rewards").type)
    table = table.set_column(table.schema.get_field_index("environment_rewards"), "environment_rewards", rewards)
    terms = [TermSpec("environment", 1.0), TermSpec("environment", 1.0, name="or_zero", params={"failure_score": 0.0})]
    out, _ = score(table, terms=terms, timeout_s=HEALTHY_CALL_S, failure_reward=-1.0)
    values = column(out, "reward_values")[0]
    assert [v[1] for v in values] == [0.5, 0.0, -2.0]
    assert values[0][0] == 0.5 and values[2][0] == -2.0
    errors = column(out, "score_errors")[0]
    assert errors[0] is None and "no environment reward" in errors[1] and errors[2] is None


def test_the_environment_term_of_a_table_without_an_environment_fails_every_sample():
    table = rollouts([{"prompt_id": "p0", "truth": None, "responses": ["a"]}])
    out, _ = score(table, terms=[TermSpec("environment", 1.0)], timeout_s=HEALTHY_CALL_S, failure_reward=-1.0)
    assert column(out, "scores") == [[-1.0]] and "no environment reward" in column(out, "score_errors")[0][0]


def test_an_environment_with_tools_or_a_call_that_is_no_class_is_a_config_error_naming_it(tmp_path, toy_model_dir):
    from batchrl.agents.environment import check_environment
    from batchrl.errors import ConfigError

    raw = config(tmp_path, toy_model_dir, str(tmp_path), "hf").model_dump()
    raw["generate"] |= {"environment": {"call": "custom_environments:Countdown"}, "tools": ["calculator"]}
    with pytest.raises(ValueError, match="generate.environment and generate.tools are both set"):
        validate_dict(raw)
    raw["generate"] |= {"tools": [], "environment": {"call": "custom_environments:not_a_class"}}
    with pytest.raises(
        ConfigError, match=r"generate.environment.call='custom_environments:not_a_class': is a function"
    ):
        check_environment(validate_dict(raw).generate.environment)


def test_the_environment_term_without_an_environment_is_a_config_error_naming_the_term(tmp_path, toy_model_dir):
    raw = config(tmp_path, toy_model_dir, str(tmp_path), "hf").model_dump()
    raw["score"]["rewards"] = [{"reward": "gsm8k"}, {"reward": "environment"}]
    with pytest.raises(ValueError, match=r"score.rewards\[1\] has reward: environment.*generate.environment is not"):
        validate_dict(raw)
    raw["generate"]["environment"] = {"call": "custom_environments:Countdown"}
    assert validate_dict(raw).score.rewards[1].reward == "environment"
