"""GAE, whitening, the clipped value loss and explained variance (batchrl.algorithms.gae): hand-computed values, and
verl 0.9.1's core_algos numbers recorded in verl_reference/gae.json (by verl_reference/make_gae_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from batchrl.algorithms.gae import (
    clipped_value_losses,
    explained_variance,
    gae_advantages_and_returns,
    masked_whiten,
    token_level_rewards,
)
from batchrl.algorithms.losses import aggregate_token_losses

REFERENCE = json.loads((Path(__file__).parent / "verl_reference" / "gae.json").read_text())


def test_gae_of_a_two_token_response_by_hand():
    # r = [0, 1], V = [0.5, 0.2], gamma 0.9, lam 0.8:
    # delta_1 = 1 + 0 - 0.2 = 0.8, A_1 = 0.8; delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.72 * 0.8 = 0.256
    advantages, returns = gae_advantages_and_returns([[0.0, 1.0]], [[0.5, 0.2]], [[1, 1]], gamma=0.9, lam=0.8)
    np.testing.assert_allclose(advantages, [[0.256, 0.8]], atol=1e-12)
    np.testing.assert_allclose(returns, [[0.756, 1.0]], atol=1e-12)


def test_padding_after_the_response_changes_nothing_and_gets_no_advantage():
    padded, _ = gae_advantages_and_returns([[0.0, 1.0, 0.0]], [[0.5, 0.2, 9.0]], [[1, 1, 0]], gamma=0.9, lam=0.8)
    np.testing.assert_allclose(padded, [[0.256, 0.8, 0.0]], atol=1e-12)


def test_the_score_sits_on_the_last_response_token_and_kl_is_charged_on_every_response_token():
    rewards = token_level_rewards([2.0, -1.0, 5.0], [2, 3, 0], num_tokens=3, kl_NT=np.full((3, 3), 0.5), kl_coef=0.1)
    np.testing.assert_allclose(rewards, [[-0.05, 1.95, 0.0], [-0.05, -0.05, -1.05], [0.0, 0.0, 0.0]])


def test_whitening_uses_the_unbiased_variance_over_the_mask():
    whitened = masked_whiten([[1.0, 3.0, 100.0]], [[1, 1, 0]])
    # mean 2, unbiased var 2: (1 - 2) / sqrt(2 + 1e-8)
    np.testing.assert_allclose(whitened[0, :2], [-1 / np.sqrt(2 + 1e-8), 1 / np.sqrt(2 + 1e-8)])


def test_the_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    values, returns, old = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 0.1]])
    losses, clip_fraction = clipped_value_losses(values, returns, old, torch.ones(1, 2), clip_range=0.2)
    # token 0: unclipped (1 - 0)^2 = 1, clipped to 0.7: 0.49 -> 0.5; token 1: 0 vs clipped 0.0 (within range) -> 0
    torch.testing.assert_close(losses, torch.tensor([[0.5, 0.0]]))
    assert float(clip_fraction) == 0.0
    losses, clip_fraction = clipped_value_losses(
        torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[-0.5]]), torch.ones(1, 1), clip_range=0.2
    )
    assert float(losses) == pytest.approx(0.5 * 1.3**2) and float(clip_fraction) == 1.0  # clipped to -0.3


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"seed{c['seed']}")
def test_advantages_and_returns_match_verls_compute_gae_advantage_return(case):
    mask = np.array(case["mask"])
    rewards = token_level_rewards(
        case["scores"], case["lengths"], num_tokens=mask.shape[1], kl_NT=case["kl"], kl_coef=case["kl_coef"]
    )
    np.testing.assert_allclose(rewards, case["rewards"], atol=1e-12)
    raw, returns = gae_advantages_and_returns(rewards, case["values"], mask, gamma=case["gamma"], lam=case["lam"])
    np.testing.assert_allclose(returns, case["returns"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(masked_whiten(raw, mask), case["advantages"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"seed{c['seed']}")
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_value_loss_matches_verls_compute_value_loss(case, mode):
    as_tensor = lambda key: torch.tensor(case[key], dtype=torch.float64)  # noqa: E731
    losses, clip_fraction = clipped_value_losses(
        as_tensor("vpreds"), as_tensor("returns"), as_tensor("values"), as_tensor("mask"), clip_range=case["clip_range"]
    )
    loss = aggregate_token_losses(losses, as_tensor("mask"), mode=mode)
    assert float(loss) == pytest.approx(case[f"vf_loss/{mode}"], rel=1e-6)
    assert float(clip_fraction) == pytest.approx(case["vf_clipfrac"], rel=1e-6)


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"seed{c['seed']}")
def test_explained_variance_matches_verls_metric(case):
    value = explained_variance(case["returns"], case["values"], case["mask"])
    assert value == pytest.approx(case["explained_var"], rel=1e-6)
