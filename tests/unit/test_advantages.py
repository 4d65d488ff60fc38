"""Advantage estimators, whitening, dynamic sampling and overlong penalty: hand-computed values and
independent per-group loops (the verl-style reference) on random rewards."""

import inspect
import itertools
import math
import statistics
import typing
import warnings

import numpy as np
import pytest
import torch

from batchrl.algorithms.advantages import (
    BatchMoments,
    batch_moments,
    dynamic_sampling_mask,
    grpo_advantages,
    overlong_penalty,
    passk_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)
from batchrl.algorithms.estimators import ESTIMATORS, compute_advantages
from batchrl.algorithms.gae import gae_advantages_and_returns
from batchrl.config.models import AdvantageConfig

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


def _random_rewards(seed: int, samples_per_group: int, num_prompts: int = 48) -> np.ndarray:
    """Binary groups (many all-equal) stacked on continuous ones."""
    rng = np.random.default_rng(seed)
    binary = rng.integers(0, 2, size=(num_prompts, samples_per_group)).astype(np.float64)
    continuous = rng.normal(size=(num_prompts, samples_per_group)) * 3.0
    return np.concatenate([binary, continuous])


# ---------------------------------------------------------------- RLOO


def test_rloo_subtracts_the_mean_of_the_other_samples_in_the_group():
    advantages = rloo_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]))
    # row 0: 1 - (0 + 0 + 1) / 3 = 2/3 and 0 - 2/3; row 1: 3 - 5/3 = 4/3, 1 - 7/3 = -4/3, 2 - 6/3 = 0
    np.testing.assert_allclose(advantages, [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]], rtol=1e-14)


def test_rloo_gives_exact_zeros_for_all_equal_groups_and_keeps_a_lone_sample_reward_like_verl():
    assert np.array_equal(rloo_advantages(np.full((2, 3), 0.1)), np.zeros((2, 3)))
    np.testing.assert_array_equal(rloo_advantages(np.array([[2.0], [-1.0]])), [[2.0], [-1.0]])


@pytest.mark.parametrize("samples_per_group", [1, 2, 3, 8])
def test_vectorised_rloo_matches_a_per_group_leave_one_out_loop(samples_per_group):
    rewards = _random_rewards(samples_per_group, samples_per_group)
    expected = np.zeros_like(rewards)
    for p, group in enumerate(rewards.tolist()):
        for i, reward in enumerate(group):
            others = group[:i] + group[i + 1 :]
            expected[p, i] = reward - statistics.fmean(others) if others else reward
    np.testing.assert_allclose(rloo_advantages(rewards), expected, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- whitening and REINFORCE++-baseline


def test_reinforce_pp_baseline_centres_each_group_then_divides_by_the_batch_std():
    advantages = reinforce_pp_baseline_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    # centred: [.5 -.5 -.5 .5] and [.25 .25 .25 -.75]; batch mean 0; sum of squares 1 + .1875 + .5625 = 1.75
    # unbiased variance 1.75 / 7 = 0.25 -> divide by sqrt(0.25 + 1e-8)
    centred = np.array([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    np.testing.assert_allclose(advantages, centred / math.sqrt(0.25 + 1e-8), rtol=1e-14)


def test_reinforce_pp_baseline_weighted_by_response_length_counts_every_token_like_verl():
    advantages = reinforce_pp_baseline_advantages(np.array([[1.0, 0.0]]), response_lengths_PG=np.array([[3, 1]]))
    # centred [.5, -.5]; token mean (3 * .5 - .5) / 4 = .25; M2 = 3 * .25^2 + .75^2 = .75; var .75 / 3 = .25
    np.testing.assert_allclose(advantages, [[0.25 / math.sqrt(0.25 + 1e-8), -0.75 / math.sqrt(0.25 + 1e-8)]])


def _verl_style_token_whitening(rewards_PG: np.ndarray, lengths_PG: np.ndarray) -> np.ndarray:
    """Reference: per-group loop for the mean, then per-TOKEN masked whitening as verl's masked_whiten."""
    flat_centred = []
    for group in rewards_PG.tolist():
        mean = statistics.fmean(group) if len(group) > 1 else 0.0
        flat_centred += [reward - mean for reward in group]
    lengths = torch.as_tensor(lengths_PG.reshape(-1))
    max_len = max(int(lengths.max()), 1)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    values = torch.tensor(flat_centred, dtype=torch.float64)[:, None].expand(-1, max_len) * mask
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = (((values - mean) ** 2) * mask).sum() / count * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8) * mask
    first_token = torch.where(lengths > 0, whitened[:, 0], 0.0)  # every token of a response holds the same value
    return first_token.numpy().reshape(rewards_PG.shape)


@pytest.mark.parametrize("samples_per_group", [1, 4, 7])
def test_reinforce_pp_baseline_matches_a_per_group_loop_with_sample_and_token_weights(samples_per_group):
    rewards = _random_rewards(10 + samples_per_group, samples_per_group)
    rng = np.random.default_rng(samples_per_group)
    lengths = rng.integers(0, 30, size=rewards.shape)
    flat = [r - (statistics.fmean(g) if len(g) > 1 else 0.0) for g in rewards.tolist() for r in g]
    by_sample = [(x - statistics.fmean(flat)) / math.sqrt(statistics.variance(flat) + 1e-8) for x in flat]
    np.testing.assert_allclose(
        reinforce_pp_baseline_advantages(rewards), np.reshape(by_sample, rewards.shape), rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        reinforce_pp_baseline_advantages(rewards, response_lengths_PG=lengths),
        _verl_style_token_whitening(rewards, lengths),
        rtol=1e-9,
        atol=1e-12,
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_shards_whitened_with_summed_moments_equal_the_whole_batch_whitened(weighted):
    rng = np.random.default_rng(3)
    values = rng.normal(loc=50.0, scale=0.01, size=(30, 4))  # large mean: the naive sum of squares cancels
    weights = rng.integers(0, 20, size=values.shape) if weighted else None
    shards = [slice(0, 7), slice(7, 8), slice(8, 30)]
    shard_weights = [None if weights is None else weights[rows] for rows in shards]
    total = sum((batch_moments(values[r], weights=w) for r, w in zip(shards, shard_weights)), BatchMoments(0, 0, 0))
    parts = [whiten(values[r], weights=w, moments=total) for r, w in zip(shards, shard_weights)]
    np.testing.assert_allclose(np.concatenate(parts), whiten(values, weights=weights), rtol=1e-9, atol=1e-9)
    if not weighted:
        assert total.mean == pytest.approx(values.mean(), rel=1e-14)
        assert total.unbiased_var == pytest.approx(values.var(ddof=1), rel=1e-9)


def test_whiten_gives_zero_mean_and_unit_std_and_zero_for_zero_weight_entries():
    whitened = whiten(np.array([1.0, 2.0, 3.0, 4.0]), eps=0.0)
    assert whitened.mean() == pytest.approx(0.0, abs=1e-15)
    assert whitened.std(ddof=1) == pytest.approx(1.0, rel=1e-14)
    np.testing.assert_array_equal(whiten(np.array([1.0, 9.0, 3.0]), weights=np.array([1, 0, 1]))[1], 0.0)


def test_whitening_a_constant_batch_with_zero_eps_gives_zeros_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(whiten(np.full(3, 2.5), eps=0.0), np.zeros(3))
        assert np.array_equal(whiten(np.array([7.0]), eps=0.0), np.zeros(1))


def test_whiten_rejects_negative_weights_and_mismatched_shapes():
    with pytest.raises(ValueError, match="weights"):
        whiten(np.ones(3), weights=np.array([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        whiten(np.ones(3), weights=np.ones(2))


# ---------------------------------------------------------------- pass@k


def test_passk_advantages_match_hand_computed_values():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    advantages = passk_advantages(rewards, k=2, eps=0.0)
    # row 0: pass@2 = 1 - C(2,2)/C(4,2) = 5/6, std sqrt(5/36); A_pos = (1/6)/std = 1/sqrt(5);
    #        A_neg = (1/6 - C(1,1)/C(3,1)) / std = -1/sqrt(5)
    # row 1: pass@2 = 1 - C(3,2)/C(4,2) = 1/2, std 1/2; A_pos = 1; A_neg = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    s5 = 1 / math.sqrt(5)
    np.testing.assert_allclose(advantages, [[s5, -s5, -s5, s5], [1.0, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-14)


def test_pass_at_1_is_grpo_with_the_population_std():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0, 1.0]])
    p = 0.4
    expected = (rewards - p) / (math.sqrt(p * (1 - p)) + 1e-6)
    np.testing.assert_allclose(passk_advantages(rewards, k=1), expected, rtol=1e-14)


def test_pass_at_k_is_zero_when_saturated_or_when_no_sample_is_right():
    rewards = np.array([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # row 0 has 1 wrong answer < k = 2: every 2-subset passes
    assert np.array_equal(passk_advantages(rewards, k=2), np.zeros_like(rewards))


def _passk_by_enumeration(rewards_PG: np.ndarray, k: int, eps: float) -> np.ndarray:
    """Reference: average over every k-subset (group reward = max) of its GRPO advantage, per member."""
    out = np.zeros_like(rewards_PG)
    for p, group in enumerate(rewards_PG.tolist()):
        subsets = list(itertools.combinations(range(len(group)), k))
        subset_reward = {s: max(group[i] for i in s) for s in subsets}
        mean = statistics.fmean(subset_reward.values())
        std = math.sqrt(mean * (1 - mean))
        for i in range(len(group)):
            mine = [subset_reward[s] for s in subsets if i in s]
            out[p, i] = (statistics.fmean(mine) - mean) / (std + eps) if std > 0 else 0.0
    return out


@pytest.mark.parametrize("samples_per_group, k", [(2, 1), (4, 2), (5, 3), (8, 4), (8, 8), (6, 5)])
def test_vectorised_passk_matches_an_enumeration_of_every_k_subset(samples_per_group, k):
    rng = np.random.default_rng(samples_per_group * 10 + k)
    rewards = (rng.random(size=(40, samples_per_group)) < rng.random(size=(40, 1))).astype(np.float64)
    np.testing.assert_allclose(
        passk_advantages(rewards, k=k), _passk_by_enumeration(rewards, k, 1e-6), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("k", [0, 5, 1.5, True])
def test_passk_rejects_k_outside_one_to_the_group_size(k):
    with pytest.raises(ValueError, match="k in"):
        passk_advantages(np.ones((1, 4)), k=k)


def test_passk_rejects_non_binary_rewards():
    with pytest.raises(ValueError, match="binary"):
        passk_advantages(np.array([[1.0, 0.5]]), k=1)


# ---------------------------------------------------------------- dynamic sampling and overlong penalty


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.2, 0.2, 0.3]])
    mask = dynamic_sampling_mask(rewards)
    assert mask.dtype == bool and mask.tolist() == [False, True, False, False, True]
    assert int((~mask).sum()) == 3  # dropped groups


def test_dynamic_sampling_keeps_lone_samples_like_verls_dapo_recipe():
    assert dynamic_sampling_mask(np.array([[1.0], [0.0]])).tolist() == [True, True]


def test_overlong_penalty_is_zero_until_the_buffer_then_linear_down_to_minus_the_factor():
    lengths = np.array([0, 10, 16, 17, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    # the buffer starts at 20 - 4 = 16: 17 -> -1/4, 18 -> -2/4, 20 -> -1; past the maximum stays -1
    np.testing.assert_allclose(penalty, [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert not np.signbit(penalty[:3]).any()  # 0.0, not -0.0
    half = overlong_penalty([18], max_response_length=20, overlong_buffer_len=4, penalty_factor=0.5)
    np.testing.assert_allclose(half, [-0.25])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_response_length": 20, "overlong_buffer_len": 0, "penalty_factor": 1.0}, "overlong_buffer_len"),
        ({"max_response_length": 20, "overlong_buffer_len": 21, "penalty_factor": 1.0}, "overlong_buffer_len"),
        ({"max_response_length": 20, "overlong_buffer_len": 4, "penalty_factor": -1.0}, "penalty_factor"),
    ],
)
def test_invalid_overlong_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty([1, 2], **kwargs)


# ---------------------------------------------------------------- dispatcher


def test_each_estimator_name_dispatches_to_its_function_before_batch_whitening():
    rewards = _random_rewards(0, 4)
    binary = rewards[:48]
    np.testing.assert_array_equal(compute_advantages("grpo", rewards), grpo_advantages(rewards))
    np.testing.assert_array_equal(compute_advantages("grpo", rewards, eps=0.1), grpo_advantages(rewards, eps=0.1))
    np.testing.assert_array_equal(compute_advantages("drgrpo", rewards), grpo_advantages(rewards, std_normalize=False))
    np.testing.assert_array_equal(compute_advantages("rloo", rewards), rloo_advantages(rewards))
    np.testing.assert_array_equal(
        whiten(compute_advantages("reinforce_pp_baseline", rewards)), reinforce_pp_baseline_advantages(rewards)
    )
    np.testing.assert_array_equal(compute_advantages("grpo_passk", binary, k=2), passk_advantages(binary, k=2))


def test_the_estimator_table_covers_every_estimator_the_config_accepts_and_no_other():
    """A new estimator cannot be half-added: named in AdvantageConfig.estimator but missing here, or the reverse."""
    assert set(ESTIMATORS) == set(typing.get_args(AdvantageConfig.model_fields["estimator"].annotation))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_each_estimators_options_are_keywords_of_its_function_set_by_advantage_config_fields(name):
    entry = ESTIMATORS[name]
    keywords = inspect.signature(entry.advantages).parameters
    assert all(keywords[k].kind is inspect.Parameter.KEYWORD_ONLY for k in entry.options)
    assert set(entry.options.values()) <= set(AdvantageConfig.model_fields)


def test_the_table_declares_each_estimators_kind_and_which_need_the_batchs_moments():
    kinds = {name: entry.kind for name, entry in ESTIMATORS.items()}
    assert kinds == {name: "group" for name in kinds if name != "gae"} | {"gae": "token"}
    assert {name for name, entry in ESTIMATORS.items() if entry.needs_batch_moments} == {"reinforce_pp_baseline", "gae"}
    assert ESTIMATORS["gae"].advantages is gae_advantages_and_returns


def test_options_are_read_from_the_advantage_config_by_field_name():
    cfg = AdvantageConfig(estimator="grpo_passk", passk_k=3, epsilon=0.25)
    assert ESTIMATORS["grpo_passk"].options_from(cfg) == {"eps": 0.25, "k": 3}
    assert ESTIMATORS["gae"].options_from(AdvantageConfig(estimator="gae", gamma=0.9)) == {"gamma": 0.9, "lam": 1.0}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_the_config_refuses_what_each_estimators_entry_rules_out_with_a_message_that_says_so(name):
    """AdvantageConfig validates from the table: whiten where the estimator whitens the batch itself, filter_groups
    for a per-token one, passk_k where its options do not read it (and requires it where they do)."""
    entry = ESTIMATORS[name]
    takes_k = "passk_k" in entry.options.values()
    k = {"passk_k": 2} if takes_k else {}
    assert AdvantageConfig(estimator=name, **k).estimator == name
    if takes_k:
        with pytest.raises(ValueError, match=f"advantage.estimator={name} needs advantage.passk_k"):
            AdvantageConfig(estimator=name)
    else:
        with pytest.raises(ValueError, match=f"passk_k is only used by estimator grpo_passk, not {name}; remove it"):
            AdvantageConfig(estimator=name, passk_k=2)
    if entry.needs_batch_moments:
        with pytest.raises(ValueError, match=f"estimator={name} already whitens the batch; remove advantage.whiten"):
            AdvantageConfig(estimator=name, whiten=True, **k)
    else:
        assert AdvantageConfig(estimator=name, whiten=True, **k).whiten
    if entry.kind == "token":
        with pytest.raises(ValueError, match=f"with estimator {name} every sample has the critic's baseline"):
            AdvantageConfig(estimator=name, filter_groups=True, **k)
    else:
        assert AdvantageConfig(estimator=name, filter_groups=True, **k).filter_groups


def test_unknown_estimator_is_rejected_with_the_valid_names_listed():
    with pytest.raises(ValueError, match="grpo.*drgrpo.*rloo.*reinforce_pp_baseline.*grpo_passk"):
        compute_advantages("ppo", np.ones((1, 2)))
    with pytest.raises(ValueError, match="unknown group advantage estimator 'gae'"):
        compute_advantages("gae", np.ones((1, 2)))


def test_an_option_the_estimator_does_not_take_or_a_missing_required_one_is_rejected():
    with pytest.raises(ValueError, match=r"'rloo' does not take \['eps'\]"):
        compute_advantages("rloo", np.ones((1, 2)), eps=1e-6)
    with pytest.raises(ValueError, match=r"'grpo_passk' needs \['k'\]"):
        compute_advantages("grpo_passk", np.ones((1, 2)))


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp_baseline", "grpo_passk"])
def test_every_estimator_rejects_non_finite_rewards_and_non_matrix_shapes(estimator):
    options = {"k": 1} if estimator == "grpo_passk" else {}
    with pytest.raises(ValueError, match="failure reward"):
        compute_advantages(estimator, np.array([[1.0, float("nan")]]), **options)
    with pytest.raises(ValueError, match="2-D"):
        compute_advantages(estimator, np.ones(4), **options)
