"""KL estimators (k1, k2, k3, low_var_kl, abs, mse and the straight-through "+" forms) and the KL folded
into rewards: hand values, exact expectations over small categorical distributions, sampled expectations
with a fixed seed, and the expected gradients that make the "+" forms worth having."""

import math

import numpy as np
import pytest
import torch

from batchrl.algorithms.advantages import grpo_advantages
from batchrl.algorithms.kl import KL_ESTIMATORS, kl_penalized_rewards, kl_penalty

# two tokens: log p - log p_ref = 0.5 and -1.0
LOGPROBS = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF_LOGPROBS = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),  # 0.5 * 0.5^2, 0.5 * 1^2
        ("mse", [0.125, 0.5]),
        ("abs", [0.5, 1.0]),
        # ref - logp = -0.5 and 1: e^-0.5 + 0.5 - 1 = 0.10653, e - 1 - 1 = 0.71828
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("k1+", [0.5, -1.0]),
        ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("low_var_kl+", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_each_estimator_matches_hand_computed_values(estimator, expected):
    values = kl_penalty(LOGPROBS, REF_LOGPROBS, estimator=estimator)
    torch.testing.assert_close(values, torch.tensor([expected], dtype=torch.float64))


def test_estimators_relate_as_k2_half_k1_squared_abs_is_abs_k1_and_k3_is_non_negative():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(64, 16, generator=generator, dtype=torch.float64) * 5
    ref_logprobs = -torch.rand(64, 16, generator=generator, dtype=torch.float64) * 5
    k1 = kl_penalty(logprobs, ref_logprobs, estimator="k1")
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, estimator="k2"), 0.5 * k1**2)
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, estimator="abs"), k1.abs())
    k3 = kl_penalty(logprobs, ref_logprobs, estimator="k3")
    assert (k3 >= 0).all() and (k1 < 0).any()  # k1 can be negative, k3 never


def test_k3_and_low_var_kl_are_clamped_at_10_as_in_verl_so_a_stale_token_cannot_blow_up():
    # the case: a stale batch with log p = -15 against log p_ref = -0.1 gave k3 = e^14.9 - 15.9 = 2.96e6
    logprobs = torch.tensor([[-15.0, -200.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.1, 0.0, -1.5]])
    for estimator in ("k3", "low_var_kl"):
        kl = kl_penalty(logprobs, ref, estimator=estimator)
        # a token near the reference is unclamped: exp(-0.5) + 0.5 - 1
        torch.testing.assert_close(kl, torch.tensor([[10.0, 10.0, math.exp(-0.5) - 0.5]]))
        (grad,) = torch.autograd.grad(kl.sum(), logprobs)
        torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 1.0 - math.exp(-0.5)]]))  # no gradient when clamped


# two close categorical distributions over 6 tokens: p = policy, q = reference
P = np.array([0.30, 0.25, 0.15, 0.12, 0.10, 0.08])
Q = np.array([0.25, 0.25, 0.20, 0.10, 0.12, 0.08])
EXACT_KL_PQ = float(np.sum(P * np.log(P / Q)))


@pytest.mark.parametrize("estimator", ["k1", "k3", "low_var_kl"])
def test_k1_and_k3_are_exactly_unbiased_when_averaged_with_the_policy_probabilities(estimator):
    values = kl_penalty(torch.tensor(np.log(P)), torch.tensor(np.log(Q)), estimator=estimator).numpy()
    assert float(np.sum(P * values)) == pytest.approx(EXACT_KL_PQ, rel=1e-12)


def test_sampled_k1_and_k3_estimate_the_exact_kl_and_k3_has_the_lower_variance():
    rng = np.random.default_rng(1234)
    tokens = rng.choice(len(P), size=200_000, p=P)
    logprobs = torch.tensor(np.log(P)[tokens])[None, :]
    ref_logprobs = torch.tensor(np.log(Q)[tokens])[None, :]
    samples = {e: kl_penalty(logprobs, ref_logprobs, estimator=e).numpy()[0] for e in ("k1", "k2", "k3")}
    for estimator in ("k1", "k3"):
        standard_error = samples[estimator].std() / math.sqrt(tokens.size)
        assert abs(samples[estimator].mean() - EXACT_KL_PQ) < 4 * standard_error
    assert samples["k3"].var() < samples["k1"].var() / 10  # Schulman: k3 is the low-variance one
    # k2 is biased, but only by a small fraction of the KL for close distributions
    assert samples["k2"].mean() == pytest.approx(EXACT_KL_PQ, rel=0.1)


def _expected_pathwise_gradient(estimator: str) -> torch.Tensor:
    """sum_x p(x) * d estimator(x) / d theta with p = softmax(theta): the loss term's expected gradient."""
    theta = torch.tensor(np.log(P), requires_grad=True)
    logprobs = torch.log_softmax(theta, -1)
    values = kl_penalty(logprobs[None, :], torch.tensor(np.log(Q))[None, :], estimator=estimator)[0]
    (gradient,) = torch.autograd.grad((torch.softmax(theta, -1).detach() * values).sum(), theta)
    return gradient


def _exact_kl_gradient(reverse: bool) -> torch.Tensor:
    theta = torch.tensor(np.log(P), requires_grad=True)
    logp, logq = torch.log_softmax(theta, -1), torch.tensor(np.log(Q))
    kl = (logp.exp() * (logp - logq)).sum() if reverse else (logq.exp() * (logq - logp)).sum()
    (gradient,) = torch.autograd.grad(kl, theta)
    return gradient


def test_as_a_loss_k1_has_zero_expected_gradient_k2_follows_reverse_kl_and_k3_forward_kl():
    torch.testing.assert_close(_expected_pathwise_gradient("k1"), torch.zeros(len(P), dtype=torch.float64))
    torch.testing.assert_close(_expected_pathwise_gradient("k2"), _exact_kl_gradient(reverse=True))
    torch.testing.assert_close(_expected_pathwise_gradient("k3"), _exact_kl_gradient(reverse=False))
    assert not torch.allclose(_exact_kl_gradient(reverse=True), _exact_kl_gradient(reverse=False))


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_estimators_keep_their_value_and_take_the_k2_gradient(estimator):
    logprobs = LOGPROBS.clone().requires_grad_()
    values = kl_penalty(logprobs, REF_LOGPROBS, estimator=estimator)
    torch.testing.assert_close(values, kl_penalty(LOGPROBS, REF_LOGPROBS, estimator=estimator.removesuffix("+")))
    values.sum().backward()
    torch.testing.assert_close(logprobs.grad, LOGPROBS - REF_LOGPROBS)  # d/dlogp 0.5 (logp - ref)^2
    torch.testing.assert_close(_expected_pathwise_gradient(estimator), _exact_kl_gradient(reverse=True))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_the_reference_log_probs_receive_no_gradient(estimator):
    logprobs = LOGPROBS.clone().requires_grad_()
    ref = REF_LOGPROBS.clone().requires_grad_()
    kl_penalty(logprobs, ref, estimator=estimator).sum().backward()
    assert ref.grad is None and logprobs.grad is not None


def test_unknown_estimator_and_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="k1.*k2.*k3.*low_var_kl"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, estimator="full")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(LOGPROBS, REF_LOGPROBS[:, :1], estimator="k1")


# ---------------------------------------------------------------- KL in the reward


def test_kl_penalized_rewards_subtract_coef_times_the_masked_kl_sum():
    scores = np.array([1.0, 0.0])
    kl = np.array([[0.1, 0.2, np.nan], [0.5, -0.1, 0.3]])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    # 1 - 0.5 * 0.3 = 0.85 (the masked NaN is ignored); 0 - 0.5 * 0.7 = -0.35
    np.testing.assert_allclose(kl_penalized_rewards(scores, kl, mask, coef=0.5), [0.85, -0.35])


def test_folding_the_summed_kl_per_sequence_gives_the_same_grpo_advantages_as_folding_per_token():
    rng = np.random.default_rng(0)
    num_prompts, group, tokens = 5, 4, 7
    scores = rng.integers(0, 2, size=num_prompts * group).astype(np.float64)
    kl = rng.normal(scale=0.05, size=(num_prompts * group, tokens))
    lengths = rng.integers(1, tokens + 1, size=num_prompts * group)
    mask = np.arange(tokens)[None, :] < lengths[:, None]
    # verl: score on the last response token, minus coef * kl on every token; outcome estimators sum them
    token_rewards = np.where(mask, -0.1 * kl, 0.0)
    token_rewards[np.arange(len(lengths)), lengths - 1] += scores
    per_token = grpo_advantages(token_rewards.sum(axis=1).reshape(num_prompts, group))
    per_sequence = grpo_advantages(kl_penalized_rewards(scores, kl, mask, coef=0.1).reshape(num_prompts, group))
    np.testing.assert_allclose(per_sequence, per_token, rtol=1e-9, atol=1e-12)


def test_kl_penalized_rewards_reject_bad_shapes_negative_coef_and_non_finite_kl_on_the_mask():
    with pytest.raises(ValueError, match="num_samples"):
        kl_penalized_rewards(np.zeros(2), np.zeros((3, 4)), np.ones((3, 4)), coef=0.1)
    with pytest.raises(ValueError, match="coef"):
        kl_penalized_rewards(np.zeros(1), np.zeros((1, 4)), np.ones((1, 4)), coef=-0.1)
    with pytest.raises(ValueError, match="NaN or inf"):
        kl_penalized_rewards(np.zeros(1), np.array([[np.inf, 0.0]]), np.ones((1, 2)), coef=0.1)
