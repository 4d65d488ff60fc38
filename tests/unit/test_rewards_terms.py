"""Shaping and format terms, term params (checked at start-up), safe calls and the weighted combination."""

from __future__ import annotations

import numpy as np
import pytest

from batchrl.rewards import check_reward_params, resolve_reward
from batchrl.rewards.basic import format_think
from batchrl.rewards.combine import RewardSet, TermSpec, combine_components
from batchrl.rewards.shaping import overlong_penalty, truncation_penalty


def not_a_number(response, ground_truth, **row):
    return float("nan")


ROW = {
    "prompt_id": "p0",
    "data_source": "math",
    "prompt_text": "q",
    "extra_info": None,
    "sample_idx": 0,
    "response_length": 0,
    "finish_reason": "stop",
}


@pytest.mark.parametrize(
    ("response_length", "penalty_factor", "expected"),
    [
        (50, 1.0, 0.0),
        (80, 1.0, 0.0),  # max_length - buffer_length: the ramp starts here
        (85, 1.0, -0.25),  # (85 - 80) / 20
        (90, 1.0, -0.5),
        (100, 1.0, -1.0),
        (130, 1.0, -1.0),  # clamped beyond max_length (verl would give -2.5)
        (90, 0.5, -0.25),
    ],
)
def test_overlong_penalty_ramps_linearly_over_the_buffer(response_length, penalty_factor, expected):
    row = ROW | {"response_length": response_length}
    assert overlong_penalty(
        "text", None, max_length=100, buffer_length=20, penalty_factor=penalty_factor, **row
    ) == pytest.approx(expected)


def test_overlong_penalty_rejects_a_buffer_longer_than_the_cap():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty("x", None, max_length=10, buffer_length=20, **ROW)


@pytest.mark.parametrize(
    ("finish_reason", "penalty", "expected"), [("length", -1.0, -1.0), ("stop", -1.0, 0.0), ("length", -0.5, -0.5)]
)
def test_truncation_penalty_applies_only_to_samples_cut_by_the_length_cap(finish_reason, penalty, expected):
    assert truncation_penalty("x", None, penalty=penalty, **(ROW | {"finish_reason": finish_reason})) == expected


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<think>2+2 is 4</think> The answer is 4.", 1.0),
        ("<think>二加二等于四</think> 答案：4", 1.0),  # unicode
        ("\n <think>\nreasoning\n</think>\n\\boxed{4}", 1.0),
        ("<think></think> 4", 0.0),  # blank thinking
        ("<think>reasoning</think>   ", 0.0),  # no answer after the thinking
        ("4 <think>reasoning</think> 4", 0.0),  # text before the thinking
        ("<think>a</think><think>b</think> 4", 0.0),  # two thinking blocks
        ("<think>unclosed reasoning 4", 0.0),
        ("The answer is 4", 0.0),
    ],
)
def test_format_think_wants_one_thinking_block_then_an_answer(response, score):
    assert format_think(response) == score


def test_params_must_be_named_parameters_of_the_reward():
    with pytest.raises(ValueError, match=r"has no parameter\(s\) \['max_len'\].*'buffer_length'"):
        check_reward_params(overlong_penalty, {"max_len": 10, "buffer_length": 2}, name="overlong_penalty")


def test_a_required_parameter_left_unset_is_named():
    with pytest.raises(ValueError, match=r"needs params \['buffer_length', 'max_length'\]"):
        check_reward_params(overlong_penalty, {}, name="overlong_penalty")


def test_params_may_not_shadow_row_fields():
    with pytest.raises(ValueError, match=r"\['response_length'\] would replace row fields"):
        check_reward_params(
            overlong_penalty, {"response_length": 3, "max_length": 9, "buffer_length": 2}, name="overlong_penalty"
        )


def test_a_reward_that_needs_a_row_field_by_keyword_resolves():
    assert resolve_reward("overlong_penalty") is overlong_penalty
    check_reward_params(truncation_penalty, {}, name="truncation_penalty")  # finish_reason comes from the row


def test_a_reward_set_passes_params_and_row_fields_and_checks_each_value():
    rewards = RewardSet(
        terms=[
            TermSpec("overlong_penalty", 0.5, params={"max_length": 10, "buffer_length": 4}),
            TermSpec(f"{__name__}:not_a_number", 1.0, name="nan"),
            ("exact_match", 2.0),
        ],
        by_data_source={},
        failure_reward=-1.0,
    )
    values, errors = rewards.evaluate("7", "7", ROW | {"response_length": 8})
    assert values == [pytest.approx(-0.5), None, 1.0]
    assert errors == [None, "nan returned nan (not a finite number)", None]


def test_numpy_scalars_count_as_numbers_and_strings_do_not():
    rewards = RewardSet(terms=[("batchrl.rewards.basic:exact_match", 1.0)], by_data_source={}, failure_reward=0.0)
    term = rewards.terms[0]
    assert term.name == "exact_match"
    from batchrl.rewards.combine import ResolvedTerm, call_reward

    as_numpy = ResolvedTerm(name="np", fn=lambda r, g, **row: np.float32(0.25), weight=1.0, params={})
    as_text = ResolvedTerm(name="text", fn=lambda r, g, **row: "1.0", weight=1.0, params={})
    assert call_reward(as_numpy, "x", None, ROW) == (0.25, None)
    assert call_reward(as_text, "x", None, ROW) == (None, "text returned '1.0' (not a finite number)")


def test_terms_with_the_same_name_are_rejected():
    with pytest.raises(ValueError, match=r"share the name\(s\) \['gsm8k'\]"):
        RewardSet(terms=[("gsm8k", 1.0), ("gsm8k", 0.5)], by_data_source={}, failure_reward=0.0)


def test_combined_reward_is_the_weighted_sum_or_the_failure_reward_when_a_component_failed():
    values_SK = np.array([[1.0, 0.5, -2.0], [0.0, 1.0, 4.0], [1.0, np.nan, 3.0]])
    weights_K = np.array([1.0, 0.2, 0.5])
    # 1 + 0.1 - 1 = 0.1; 0 + 0.2 + 2 = 2.2; a NaN component -> failure_reward
    np.testing.assert_allclose(combine_components(values_SK, weights_K, failure_reward=-1.0), [0.1, 2.2, -1.0])
