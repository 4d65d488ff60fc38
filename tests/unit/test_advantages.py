"""Group-relative (GRPO / Dr.GRPO) advantages: hand-computed values and an independent per-group loop."""

import math
import statistics
import warnings

import numpy as np
import pytest
import torch

from batchrl.algorithms.advantages import grpo_advantages

EPS = 1e-6


def test_two_right_two_wrong_answers_get_plus_and_minus_0_866_with_the_unbiased_std():
    advantages = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]))
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735..., so 0.5 / (0.57735 + 1e-6) = 0.866024...
    expected = 0.5 / (math.sqrt(1.0 / 3.0) + EPS)
    np.testing.assert_allclose(advantages, [[expected, -expected, -expected, expected]], rtol=1e-12)
    assert advantages[0, 0] == pytest.approx(0.8660239, abs=1e-7)


def test_each_prompt_row_is_normalised_with_its_own_mean_and_std():
    advantages = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    # second row: mean 0.75, unbiased variance (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5
    np.testing.assert_allclose(advantages[1], [0.25 / 0.500001] * 3 + [-0.75 / 0.500001], rtol=1e-12)
    np.testing.assert_allclose(advantages[0], [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=1e-7)


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero_advantages():
    rewards = np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.1, 0.1, 0.1], [-3.7, -3.7, -3.7]])
    for std_normalize in (True, False):
        advantages = grpo_advantages(rewards, std_normalize=std_normalize)
        assert np.array_equal(advantages, np.zeros_like(rewards))


def test_all_equal_group_with_zero_eps_gives_zeros_without_a_division_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advantages = grpo_advantages(np.array([[0.5, 0.5], [1.0, 0.0]]), eps=0.0)
    np.testing.assert_allclose(advantages, [[0.0, 0.0], [1 / math.sqrt(2), -1 / math.sqrt(2)]])


def test_a_lone_sample_uses_mean_zero_and_std_one_like_verl():
    rewards = np.array([[2.0], [0.0], [-1.0]])
    np.testing.assert_allclose(grpo_advantages(rewards), rewards / (1.0 + EPS), rtol=1e-15)
    np.testing.assert_array_equal(grpo_advantages(rewards, std_normalize=False), rewards)


def test_dr_grpo_mode_only_subtracts_the_group_mean():
    advantages = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]), std_normalize=False)
    np.testing.assert_allclose(advantages, [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])


def test_advantages_are_float64_even_for_integer_or_float32_rewards():
    assert grpo_advantages(np.array([[1, 0]], dtype=np.int64)).dtype == np.float64
    assert grpo_advantages(np.array([[1, 0]], dtype=np.float32)).dtype == np.float64
    assert grpo_advantages([[True, False]]).dtype == np.float64


def test_no_prompts_give_an_empty_result_of_the_same_shape():
    assert grpo_advantages(np.zeros((0, 4))).shape == (0, 4)


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()])
def test_rewards_that_are_not_a_prompt_by_sample_matrix_are_rejected(shape):
    with pytest.raises(ValueError, match="2-D"):
        grpo_advantages(np.zeros(shape))


def test_groups_without_samples_are_rejected():
    with pytest.raises(ValueError, match="at least one sample"):
        grpo_advantages(np.zeros((3, 0)))


@pytest.mark.parametrize("bad_reward", [float("nan"), float("inf"), None])
def test_missing_or_infinite_rewards_are_rejected_with_the_offending_prompt_row(bad_reward):
    rewards = np.array([[1.0, 0.0], [1.0, bad_reward]], dtype=object)
    with pytest.raises(ValueError, match=r"prompt rows \[1\].*failure reward"):
        grpo_advantages(rewards)


def test_negative_eps_is_rejected():
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(np.ones((1, 2)), eps=-1.0)


def _reference_loop(rewards_PG: np.ndarray, *, std_normalize: bool) -> np.ndarray:
    """Independent per-group reference: Python statistics for GRPO, torch.std (as verl) cross-checked."""
    out = np.zeros_like(rewards_PG, dtype=np.float64)
    for p, group in enumerate(rewards_PG.tolist()):
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(group), statistics.stdev(group)
            torch_std = torch.std(torch.tensor(group, dtype=torch.float64)).item()
            assert std == pytest.approx(torch_std, rel=1e-12, abs=1e-15)
        for g, reward in enumerate(group):
            out[p, g] = (reward - mean) / (std + EPS) if std_normalize else reward - mean
    return out


@pytest.mark.parametrize("samples_per_group", [1, 2, 5, 16])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_vectorised_advantages_match_a_per_group_loop_on_random_rewards(samples_per_group, std_normalize):
    rng = np.random.default_rng(samples_per_group)
    binary = rng.integers(0, 2, size=(64, samples_per_group)).astype(np.float64)
    continuous = rng.normal(size=(64, samples_per_group)) * 3.0
    rewards = np.concatenate([binary, continuous])
    np.testing.assert_allclose(
        grpo_advantages(rewards, std_normalize=std_normalize),
        _reference_loop(rewards, std_normalize=std_normalize),
        rtol=1e-9,
        atol=1e-9,
    )
