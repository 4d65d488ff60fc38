"""Environments on a real engine (the toy model, hf): the policy's turns are stepped, each observation is appended
as tokens with mask 0 (after the prompt for reset's, after each turn for step's), the sample's reward is the last one
given, and a failing environment is that sample's env_error, never the shard's. Token in, token out as the tool
loop: every turn is prompted with the ids so far."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from custom_environments import BadReset, Countdown, Endless, FailsOnOddSamples, HangsOnSampleOne, Slow
from test_agent_loop import Recording

from batchrl.agents.calls import ToolTurnFormat
from batchrl.agents.columns import conversation_lines
from batchrl.agents.environment import Step, as_step, run_episodes
from batchrl.agents.loop import LoopSettings, turn_seed
from batchrl.config.rollout import GenerateConfig
from batchrl.engines import SamplingSpec, make_engine
from batchrl.stages.generate import loop_settings

SEEDS = [21, 22, 23, 24]
SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=6)
PLAIN = ToolTurnFormat.for_chat_template(None)


@pytest.fixture(scope="module")
def engine(toy_model_dir):
    engine = make_engine("hf", model_path=toy_model_dir, max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count down."}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [list(ids)] * len(SEEDS)


def rows():
    return [{"prompt_id": f"p{k}", "sample_idx": k, "sample_seed": seed} for k, seed in enumerate(SEEDS)]


def play(engine, tokenizer, prompts, make_env, *, max_turns=3, budget=200, **limits):
    recording = Recording(engine)
    conversations = run_episodes(
        recording,
        prompts,
        SEEDS,
        rows(),
        sampling=SAMPLING,
        make_env=make_env,
        settings=LoopSettings(max_turns=max_turns, max_response_tokens=budget, **limits),
        tokenizer=tokenizer,
        turn_format=PLAIN,
    )
    return conversations, recording.calls


def observation_ids(tokenizer, text):
    return tokenizer.encode(PLAIN.render_observation(text), add_special_tokens=False)


def test_observations_are_appended_as_tokens_with_mask_zero_between_the_engines_turns(engine, tokenizer, prompts):
    conversations, calls = play(engine, tokenizer, prompts, Countdown)
    assert len(calls) == 2, "Countdown(turns=2) plays two policy turns"
    for k, c in enumerate(conversations):
        first = observation_ids(tokenizer, Countdown().reset(rows()[k]))
        turn0 = calls[0][2][k][0]
        middle = observation_ids(tokenizer, "1 left")
        turn1 = calls[1][2][k][0]
        assert c.token_ids == first + turn0.token_ids + middle + turn1.token_ids
        assert c.mask == [0] * len(first) + [1] * len(turn0.token_ids) + [0] * len(middle) + [1] * len(turn1.token_ids)
        # each turn is prompted with the ids so far, with the turn's seed
        assert calls[0][0][k] == prompts[k] + first and calls[0][1][k] == [SEEDS[k]]
        assert calls[1][0][k] == prompts[k] + first + turn0.token_ids + middle
        assert calls[1][1][k] == [turn_seed(SEEDS[k], 1)]
        assert c.turns == 2 and c.status == "completed"
        assert c.environment_reward == float(len(turn1.text))  # the last step's reward
        assert [call["name"] for call in c.calls] == ["reset", "step", "step"]
        assert c.calls[-1]["done"] is True and c.calls[1]["output"] == "1 left"


def test_the_same_seeds_give_the_same_episodes(engine, tokenizer, prompts):
    first, _ = play(engine, tokenizer, prompts, Countdown)
    again, _ = play(engine, tokenizer, prompts, Countdown)
    assert [(c.token_ids, c.mask, c.environment_reward, c.status) for c in again] == [
        (c.token_ids, c.mask, c.environment_reward, c.status) for c in first
    ]


def test_an_environment_never_done_ends_at_max_turns_with_its_last_turn_stepped_and_rewarded(
    engine, tokenizer, prompts
):
    conversations, calls = play(engine, tokenizer, prompts, lambda: Endless(turns=0), max_turns=3)
    assert len(calls) == 3
    for c in conversations:
        assert c.status == "max_turns" and c.turns == 3
        assert c.environment_reward == 3.0  # the third step's reward: the last given
        assert c.text.count("go on") == 2  # the last step's observation is not appended


def test_a_failing_step_is_its_samples_env_error_and_the_others_play_on(engine, tokenizer, prompts):
    conversations, _ = play(engine, tokenizer, prompts, FailsOnOddSamples)
    for k, c in enumerate(conversations):
        if k % 2:
            assert c.status == "env_error" and c.environment_reward is None and c.turns == 1
            assert c.calls[-1]["error"] == "exception" and "RuntimeError: odd sample" in c.calls[-1]["detail"]
        else:
            assert c.status == "completed" and c.environment_reward is not None


def test_a_reset_that_breaks_the_contract_ends_the_sample_before_any_turn(engine, tokenizer, prompts):
    conversations, calls = play(engine, tokenizer, prompts, BadReset)
    assert calls == []
    assert all(c.status == "env_error" and c.token_ids == [] for c in conversations)
    assert "not a str or None" in conversations[0].calls[0]["detail"]


def test_a_step_answers_a_step_or_a_triple_of_observation_reward_done():
    assert as_step(("more", 1, False)) == Step("more", 1.0, False)
    assert as_step(Step(None, None, True)) == Step(None, None, True)
    assert as_step(("x", np.int64(2), np.bool_(True))) == Step("x", 2.0, True)  # numpy's numbers are numbers
    for bad, says in [(None, "not a Step"), (("x", "1", False), "reward is a str"), ((3, 1.0, True), "observation")]:
        with pytest.raises(ValueError, match=says):
            as_step(bad)


def test_inspect_shows_an_episodes_reset_and_steps_with_their_rewards(engine, tokenizer, prompts):
    (first, *_), _ = play(engine, tokenizer, prompts, Countdown)
    lines = conversation_lines(first.text, json.dumps(first.calls), status=first.status)
    assert lines[1] == f"  [env] reset (turn -1) -> {Countdown().reset(rows()[0])!r}"
    assert lines[2] == "  [env] step (turn 0) -> '1 left'"
    assert lines[3] == f"  [env] step (turn 1) -> None, reward {first.environment_reward:g}, done"
    assert lines[-1] == "  [end] completed"


def test_a_turn_cut_at_the_budget_is_still_stepped_and_its_reward_kept(engine, tokenizer, prompts):
    opening = len(observation_ids(tokenizer, Countdown().reset(rows()[0])))
    budget = opening + 3  # room for 3 of the turn's 6 tokens
    conversations, _ = play(engine, tokenizer, prompts, lambda: Countdown(reward_each_turn=0.25), budget=budget)
    cut = [c for c in conversations if len(c.token_ids) == budget]
    assert cut, "no turn reached the budget: the test would prove nothing"
    for c in cut:
        assert c.status == "length" and c.finish_reason == "length" and c.turns == 1
        assert c.environment_reward == 0.25 and c.calls[-1]["name"] == "step"


def test_a_step_past_tool_timeout_s_is_its_samples_env_error_timeout_and_the_others_complete(
    engine, tokenizer, prompts
):
    started = time.monotonic()
    conversations, calls = play(engine, tokenizer, prompts, HangsOnSampleOne, tool_timeout_s=1.0)
    assert time.monotonic() - started < 9, "the loop waited for the hung step (10 s) instead of its 1 s deadline"
    hung = conversations[1]
    assert hung.status == "env_error" and hung.environment_reward is None and hung.turns == 1
    assert hung.calls[-1]["error"] == "timeout" and hung.calls[-1]["seconds"] == 1.0
    assert "ran past 1 s" in hung.calls[-1]["detail"]
    others = [c for k, c in enumerate(conversations) if k != 1]
    assert all(c.status == "completed" and c.turns == 2 and c.environment_reward is not None for c in others)
    assert len(calls[1][0]) == len(SEEDS) - 1, "the second turn is generated for the live samples only"


def test_the_steps_of_a_turn_run_at_once_and_give_the_episodes_of_steps_run_one_by_one(engine, tokenizer, prompts):
    """Four samples, each step sleeping 0.5 s: one by one a turn's steps take 2 s, at once 0.5 s."""
    Slow.spans.clear()
    parallel, _ = play(engine, tokenizer, prompts, Slow, max_parallel_tool_calls=4)
    for turn in (0, 1):
        spans = [(start, end) for t, start, end in Slow.spans if t == turn]
        assert len(spans) == len(SEEDS)
        assert max(start for start, _ in spans) < min(end for _, end in spans), f"turn {turn}'s steps did not overlap"
        assert max(end for _, end in spans) - min(start for start, _ in spans) < 1.5, "2 s one by one"
    one_by_one, _ = play(engine, tokenizer, prompts, lambda: Slow(seconds=0.0), max_parallel_tool_calls=1)
    assert [(c.token_ids, c.mask, c.environment_reward, c.status, c.text) for c in parallel] == [
        (c.token_ids, c.mask, c.environment_reward, c.status, c.text) for c in one_by_one
    ]


def test_an_environments_timeout_and_threads_are_the_tools_settings_refused_without_either():
    with_environment = GenerateConfig(
        environment={"call": "custom_environments:Slow"}, tool_timeout_s=2.5, max_parallel_tool_calls=3
    )
    loop = loop_settings(with_environment)["loop"]
    assert loop["tool_timeout_s"] == 2.5 and loop["max_parallel_tool_calls"] == 3
    with pytest.raises(ValueError, match="generate.tool_timeout_s is set but generate.tools is empty"):
        GenerateConfig(tool_timeout_s=2.5)
