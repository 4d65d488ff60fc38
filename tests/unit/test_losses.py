"""Token log-probs, entropy, PPO-clip and GSPO losses, truncated IS and loss aggregation: hand values,
direct formulas and gradient checks."""

import math

import pytest
import torch

from batchrl.algorithms.losses import (
    AGGREGATION_MODES,
    aggregate_token_losses,
    approx_kl,
    entropy_bonus,
    entropy_from_logits,
    gspo_token_losses,
    masked_mean,
    ppo_clip_token_losses,
    token_logprobs,
    truncated_is_weights,
)

LOW, HIGH = 0.2, 0.28  # asymmetric clip (DAPO clip-higher)


# ---------------------------------------------------------------- PPO clip


def _losses_for(ratios, advantages, **kwargs):
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old_logprobs = torch.zeros_like(logprobs)
    advantages = torch.tensor([advantages], dtype=torch.float64)
    kwargs = {"clip_ratio_low": LOW, "clip_ratio_high": HIGH, **kwargs}
    losses, is_clipped, ratio = ppo_clip_token_losses(logprobs, old_logprobs, advantages, **kwargs)
    return logprobs, losses, is_clipped, ratio


def test_positive_advantage_is_clipped_only_above_one_plus_clip_ratio_high():
    ratios = [1.5, 1.25, 1.1, 0.5]
    _, losses, is_clipped, ratio = _losses_for(ratios, [1.0] * 4)
    # 1.5 -> clipped to 1.28; 1.25 is inside the asymmetric upper bound; 0.5 keeps the unclipped -0.5
    torch.testing.assert_close(losses, torch.tensor([[-1.28, -1.25, -1.1, -0.5]], dtype=torch.float64))
    assert is_clipped.tolist() == [[True, False, False, False]]
    torch.testing.assert_close(ratio, torch.tensor([ratios], dtype=torch.float64))


def test_negative_advantage_is_clipped_only_below_one_minus_clip_ratio_low():
    _, losses, is_clipped, _ = _losses_for([1.5, 0.9, 0.5], [-2.0] * 3)
    # 1.5 -> unclipped 3.0 wins over 2.56; 0.9 inside; 0.5 -> clipped to 0.8, loss 1.6
    torch.testing.assert_close(losses, torch.tensor([[3.0, 1.8, 1.6]], dtype=torch.float64))
    assert is_clipped.tolist() == [[False, False, True]]


def test_clipped_tokens_get_no_gradient_and_the_others_get_minus_advantage_times_ratio():
    logprobs, losses, is_clipped, _ = _losses_for([1.5, 1.1, 0.5, 0.5], [1.0, 1.0, 1.0, -2.0])
    losses.sum().backward()
    # d(-A * exp(logprob)) / d logprob = -A * ratio
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.1, -0.5, 0.0]], dtype=torch.float64))
    assert is_clipped.tolist() == [[True, False, False, True]]


def test_zero_advantage_gives_zero_loss_and_is_never_clipped():
    _, losses, is_clipped, _ = _losses_for([3.0, 0.1], [0.0, 0.0])
    assert losses.abs().sum().item() == 0.0
    assert not is_clipped.any()


def test_clip_fraction_is_the_masked_mean_of_is_clipped():
    _, _, is_clipped, _ = _losses_for([1.5, 1.1, 0.5, 0.5], [1.0, 1.0, 1.0, -2.0])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_mean(is_clipped.float(), mask).item() == pytest.approx(1 / 3)


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_minus_advantage():
    _, plain, _, _ = _losses_for([5.0, 5.0], [-1.0, 1.0])
    _, dual, _, _ = _losses_for([5.0, 5.0], [-1.0, 1.0], dual_clip_ratio=3.0)
    torch.testing.assert_close(plain, torch.tensor([[5.0, -1.28]], dtype=torch.float64))
    torch.testing.assert_close(dual, torch.tensor([[3.0, -1.28]], dtype=torch.float64))


def test_dual_clip_stops_a_stale_negative_token_from_weighing_its_ratio_in_the_gradient():
    # a token whose probability grew 20-fold since the rollout (a late mini-batch of a stale batch), A = -1:
    # plain PPO-clip's loss is -A r, so d loss / d logp = 20; dual clip caps it at 3 with no gradient
    logprobs, plain, _, _ = _losses_for([20.0, 1.0], [-1.0, -1.0])
    (plain_grad,) = torch.autograd.grad(plain.sum(), logprobs)
    logprobs, dual, _, _ = _losses_for([20.0, 1.0], [-1.0, -1.0], dual_clip_ratio=3.0)
    (dual_grad,) = torch.autograd.grad(dual.sum(), logprobs)
    torch.testing.assert_close(plain_grad, torch.tensor([[20.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(dual_grad, torch.tensor([[0.0, 1.0]], dtype=torch.float64))


def test_the_update_config_applies_verls_dual_clip_by_default_to_ppo_clip_only():
    from batchrl.config.models import UpdateConfig

    assert UpdateConfig().dual_clip_ratio == 3.0
    assert UpdateConfig(dual_clip_ratio=None).dual_clip_ratio is None
    assert UpdateConfig(policy_loss="gspo").policy_loss == "gspo"  # the default does not conflict with gspo
    with pytest.raises(ValueError, match="ppo_clip only"):
        UpdateConfig(policy_loss="gspo", dual_clip_ratio=3.0)


def test_a_huge_log_ratio_is_clamped_so_the_loss_stays_finite():
    logprobs = torch.tensor([[100.0, -100.0]])
    losses, _, ratio = ppo_clip_token_losses(
        logprobs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(ratio, torch.exp(torch.tensor([[20.0, -20.0]])))


def test_old_logprobs_and_advantages_receive_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    advantages = torch.ones(1, 2, requires_grad=True)
    logprobs = torch.full((1, 2), 0.1, requires_grad=True)
    losses, _, _ = ppo_clip_token_losses(logprobs, old, advantages, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    losses.sum().backward()
    assert old.grad is None and advantages.grad is None and logprobs.grad is not None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_ratio_low": 1.0, "clip_ratio_high": 0.2}, "clip_ratio_low"),
        ({"clip_ratio_low": -0.1, "clip_ratio_high": 0.2}, "clip_ratio_low"),
        ({"clip_ratio_low": 0.2, "clip_ratio_high": -0.2}, "clip_ratio_high"),
        ({"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "dual_clip_ratio": 1.0}, "dual_clip_ratio"),
    ],
)
def test_invalid_clip_ratios_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ppo_clip_token_losses(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), **kwargs)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="same shape"):
        ppo_clip_token_losses(
            torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), clip_ratio_low=LOW, clip_ratio_high=HIGH
        )


# ---------------------------------------------------------------- GSPO


def _gspo(log_ratios, advantages, mask, low=LOW, high=HIGH):
    logprobs = torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True)
    old_logprobs = torch.zeros_like(logprobs)
    advantages = torch.tensor(advantages, dtype=torch.float64).expand_as(logprobs)
    mask = torch.tensor(mask)
    losses, is_clipped, ratio = gspo_token_losses(
        logprobs, old_logprobs, advantages, mask, clip_ratio_low=low, clip_ratio_high=high
    )
    return logprobs, losses, is_clipped, ratio


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios_over_the_mask_on_every_token():
    # seq 0: mean(0.1, 0.3) = 0.2 -> s = e^0.2 = 1.2214 < 1.28, not clipped, loss -A s
    # seq 1: mean(0.9) = 0.9 (the masked 100 is ignored) -> s = 2.4596, clipped to 1.28 on all its tokens
    _, losses, is_clipped, ratio = _gspo([[0.1, 0.3], [0.9, 100.0]], [[1.0], [1.0]], [[1, 1], [1, 0]])
    s0, s1 = math.exp(0.2), math.exp(0.9)
    torch.testing.assert_close(ratio, torch.tensor([[s0, s0], [s1, s1]], dtype=torch.float64))
    torch.testing.assert_close(losses, torch.tensor([[-s0, -s0], [-1.28, -1.28]], dtype=torch.float64))
    assert is_clipped.tolist() == [[False, False], [True, True]]


def test_gspo_with_negative_advantage_is_clipped_below_one_minus_clip_ratio_low():
    # s = e^-0.5 = 0.6065 < 0.8: clipped branch -A * 0.8 = 1.6 beats -A * s = 1.213
    _, losses, is_clipped, _ = _gspo([[-0.5, -0.5]], [[-2.0]], [[1, 1]])
    torch.testing.assert_close(losses, torch.tensor([[1.6, 1.6]], dtype=torch.float64))
    assert is_clipped.all()


def _sequence_level_gspo(logprobs, old_logprobs, advantages_B, mask, low, high):
    """Reference: GSPO's sequence objective with a differentiable s_i, averaged over sequences."""
    mask = mask.bool()
    s_B = torch.exp(((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1))
    per_seq = torch.maximum(-advantages_B * s_B, -advantages_B * s_B.clamp(1 - low, 1 + high))
    return per_seq.mean()


def test_gspo_token_losses_aggregated_per_sequence_equal_the_sequence_objective_in_value_and_gradient():
    generator = torch.Generator().manual_seed(0)
    batch_size, num_tokens, low, high = 12, 6, 3e-4, 4e-4  # the GSPO paper's clip ranges
    old_logprobs = -torch.rand(batch_size, num_tokens, generator=generator, dtype=torch.float64)
    drift = torch.randn(batch_size, num_tokens, generator=generator, dtype=torch.float64) * 1e-3
    logprobs = (old_logprobs + drift).requires_grad_()
    advantages_B = torch.randn(batch_size, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, num_tokens + 1, (batch_size,), generator=generator)
    mask = torch.arange(num_tokens)[None, :] < lengths[:, None]

    losses, is_clipped, _ = gspo_token_losses(
        logprobs,
        old_logprobs,
        advantages_B[:, None].expand(-1, num_tokens),
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
    )
    ours = aggregate_token_losses(losses, mask, mode="seq-mean-token-mean")
    (our_grad,) = torch.autograd.grad(ours, logprobs)
    reference = _sequence_level_gspo(logprobs, old_logprobs, advantages_B, mask, low, high)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(our_grad, reference_grad)
    clipped_seqs = (is_clipped & mask).any(-1)
    assert 0 < clipped_seqs.sum() < batch_size  # both branches are exercised
    assert (our_grad[clipped_seqs] == 0).all()  # a clipped sequence gets no gradient at all


def test_gspo_on_one_token_sequences_equals_ppo_clip():
    logprobs = torch.tensor([[0.5], [-0.5], [0.1]], dtype=torch.float64)
    advantages = torch.tensor([[1.0], [-1.0], [2.0]], dtype=torch.float64)
    gspo = gspo_token_losses(
        logprobs, torch.zeros_like(logprobs), advantages, torch.ones(3, 1), clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    ppo = ppo_clip_token_losses(
        logprobs, torch.zeros_like(logprobs), advantages, clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    for ours, theirs in zip(gspo, ppo):
        torch.testing.assert_close(ours, theirs)


def test_gspo_old_logprobs_and_advantages_receive_no_gradient_and_garbage_off_mask_does_not_leak():
    old = torch.tensor([[0.0, float("nan")]], requires_grad=True)
    advantages = torch.ones(1, 2, requires_grad=True)
    logprobs = torch.tensor([[0.1, 0.0]], requires_grad=True)
    losses, _, ratio = gspo_token_losses(
        logprobs, old, advantages, torch.tensor([[1, 0]]), clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    assert ratio[0, 0].item() == pytest.approx(math.exp(0.1))
    aggregate_token_losses(losses, torch.tensor([[1, 0]]), mode="token-mean").backward()
    assert old.grad is None and advantages.grad is None
    assert torch.isfinite(logprobs.grad).all()


def test_gspo_rejects_invalid_clip_ratios_and_mismatched_mask():
    with pytest.raises(ValueError, match="clip_ratio_low"):
        gspo_token_losses(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            clip_ratio_low=1.0,
            clip_ratio_high=0.1,
        )
    with pytest.raises(ValueError, match="same shape"):
        gspo_token_losses(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 3),
            clip_ratio_low=0.1,
            clip_ratio_high=0.1,
        )


# ---------------------------------------------------------------- truncated importance sampling


def test_truncated_is_weights_are_the_probability_ratio_capped_and_zero_off_mask():
    old = torch.tensor([[0.0, math.log(1.5), math.log(3.0), -1.0, 5.0]])
    rollout = torch.zeros(1, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights = truncated_is_weights(old, rollout, mask, cap=2.0)
    # ratio 1, 1.5, 3 -> capped 2, e^-1; the masked-out token gets 0
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, math.exp(-1.0), 0.0]]))


def test_truncated_is_weights_carry_no_gradient_and_stay_finite_for_huge_log_ratios():
    old = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    rollout = torch.zeros(1, 2, requires_grad=True)
    weights = truncated_is_weights(old, rollout, torch.ones(1, 2), cap=2.0)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0]]))


def test_truncated_is_weights_scale_the_pg_loss_and_its_gradient_token_by_token():
    logprobs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    losses, _, _ = ppo_clip_token_losses(
        logprobs, torch.zeros(1, 2), torch.ones(1, 2), clip_ratio_low=LOW, clip_ratio_high=HIGH
    )
    weights = truncated_is_weights(torch.tensor([[0.0, math.log(1.5)]]), torch.zeros(1, 2), torch.ones(1, 2), cap=2.0)
    (losses * weights).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.5]]))


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_truncated_is_rejects_a_cap_that_is_not_a_positive_number(cap):
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=cap)


# ---------------------------------------------------------------- aggregation

NAN = float("nan")
# row 0: 4 tokens, row 1: 2 tokens, row 2: 1 token, row 3: none. Masked-out entries hold garbage.
RAGGED_LOSSES = torch.tensor(
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, 100.0], [7.0, 8.0, 9.0, 10.0], [NAN, 1.0, 2.0, 3.0]]
)
RAGGED_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
NORM_LENGTH = 8  # seq-mean-token-sum-norm's constant horizon (max_response_length), > the 4 padded tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (10 + 11 + 7) / 7),  # 7 tokens
        ("seq-mean-token-mean", (2.5 + 5.5 + 7.0) / 3),  # the empty sequence does not count
        ("seq-mean-token-sum", (10 + 11 + 7) / 3),
        ("seq-mean-token-sum-norm", (10 + 11 + 7) / (3 * 8)),  # 3 sequences times the constant 8
    ],
)
def test_each_aggregation_mode_matches_hand_computed_values_on_a_ragged_mask(mode, expected):
    loss = aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode=mode, norm_length=NORM_LENGTH)
    assert loss.item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_the_constant_not_the_batch_length():
    short = aggregate_token_losses(
        RAGGED_LOSSES[:, :2], RAGGED_MASK[:, :2], mode="seq-mean-token-sum-norm", norm_length=NORM_LENGTH
    )
    # the same first two tokens: (3 + 11 + 7) / (3 * 8), whatever the padded width
    assert short.item() == pytest.approx(21 / 24)


def test_seq_mean_token_sum_norm_without_a_norm_length_is_rejected_and_other_modes_ignore_it():
    with pytest.raises(ValueError, match="norm_length.*max_response_length"):
        aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="seq-mean-token-sum-norm", norm_length=0)
    plain = aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="token-mean")
    assert aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="token-mean", norm_length=99).item() == plain


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_a_fully_masked_batch_aggregates_to_zero_not_nan(mode):
    loss = aggregate_token_losses(torch.ones(2, 3), torch.zeros(2, 3), mode=mode, norm_length=NORM_LENGTH)
    assert loss.item() == 0.0


def _random_ragged_batch(seed: int, batch_size: int = 7, num_tokens: int = 9):
    generator = torch.Generator().manual_seed(seed)
    losses = torch.randn(batch_size, num_tokens, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, num_tokens + 1, (batch_size,), generator=generator)
    lengths[2] = 0  # one fully masked sequence
    mask = torch.arange(num_tokens)[None, :] < lengths[:, None]
    return losses.requires_grad_(), mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("split", [3, 5])
def test_halves_aggregated_with_global_counts_sum_to_the_whole_batch_loss_and_gradient(mode, split):
    losses, mask = _random_ragged_batch(seed=split)
    whole = aggregate_token_losses(losses, mask, mode=mode, norm_length=NORM_LENGTH)
    (whole_grad,) = torch.autograd.grad(whole, losses)

    num_global_tokens = float(mask.sum())
    num_global_seqs = float((mask.sum(-1) > 0).sum())
    parts = [
        aggregate_token_losses(
            losses[rows],
            mask[rows],
            mode=mode,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            norm_length=NORM_LENGTH,
        )
        for rows in (slice(0, split), slice(split, None))
    ]
    (parts_grad,) = torch.autograd.grad(sum(parts), losses)
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(parts_grad, whole_grad)


def test_averaging_halves_aggregated_with_local_counts_overweights_the_half_with_fewer_tokens():
    halves = [
        aggregate_token_losses(RAGGED_LOSSES[rows], RAGGED_MASK[rows], mode="token-mean")
        for rows in (slice(0, 2), slice(2, None))
    ]
    # 21 / 6 tokens and 7 / 1 token: their mean 5.25 is not the whole-batch 28 / 7 = 4
    assert [h.item() for h in halves] == pytest.approx([3.5, 7.0])
    assert aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="token-mean").item() == pytest.approx(4.0)


def test_unknown_aggregation_mode_is_rejected_with_the_valid_modes_listed():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean.*seq-mean-token-sum"):
        aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="sum")


def test_non_positive_global_counts_are_rejected():
    with pytest.raises(ValueError, match="num_global_tokens"):
        aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="token-mean", num_global_tokens=0)
    with pytest.raises(ValueError, match="num_global_seqs"):
        aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode="seq-mean-token-sum", num_global_seqs=-1.0)


# ---------------------------------------------------------------- masked mean and KL


def test_masked_mean_ignores_masked_out_nan_and_is_zero_for_an_empty_mask():
    values = torch.tensor([[1.0, NAN], [3.0, 5.0]])
    assert masked_mean(values, torch.tensor([[1, 0], [1, 1]])).item() == pytest.approx(3.0)
    per_row = masked_mean(values, torch.tensor([[1, 0], [1, 1]]), dim=-1)
    torch.testing.assert_close(per_row, torch.tensor([1.0, 4.0]))
    assert masked_mean(values, torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0


def test_approx_kl_is_the_masked_mean_of_old_minus_new_logprobs():
    logprobs = torch.tensor([[-1.0, -2.0]])
    old_logprobs = torch.tensor([[-1.5, -1.0]])
    assert approx_kl(logprobs, old_logprobs, torch.tensor([[1, 1]])).item() == pytest.approx(0.25)
    assert approx_kl(logprobs, old_logprobs, torch.tensor([[1, 0]])).item() == pytest.approx(-0.5)


# ---------------------------------------------------------------- token log-probs and entropy


def _random_logits(batch_size=3, num_tokens=5, vocab_size=11, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, num_tokens, vocab_size, generator=generator, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab_size, (batch_size, num_tokens), generator=generator)
    return logits.to(dtype), labels


# 3 * 5 * 11 logits: whole batch in one chunk, several sequences per chunk, part of a sequence per chunk
CHUNK_SIZES = [1 << 25, 2 * 5 * 11, 2 * 11, 1]


@pytest.mark.parametrize("max_chunk_elements", CHUNK_SIZES)
def test_token_logprobs_equal_log_softmax_gather_in_value_and_gradient(max_chunk_elements):
    logits, labels = _random_logits()
    logits_ref = logits.clone().requires_grad_()
    logits = logits.requires_grad_()
    upstream = torch.randn(labels.shape)

    logprobs = token_logprobs(logits, labels, max_chunk_elements=max_chunk_elements)
    expected = torch.log_softmax(logits_ref, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    (logprobs * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, logits_ref.grad)


def test_token_logprobs_pass_gradcheck_in_float64():
    logits, labels = _random_logits(batch_size=2, num_tokens=3, vocab_size=5, dtype=torch.float64)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, max_chunk_elements=7), (logits,))


def test_token_logprobs_of_bf16_logits_are_float32_and_match_the_upcast_log_softmax():
    logits, labels = _random_logits(dtype=torch.bfloat16)
    logits.requires_grad_()
    logprobs = token_logprobs(logits, labels)
    assert logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    logprobs.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_token_logprobs_accept_a_shifted_non_contiguous_view_of_the_logits():
    logits, labels = _random_logits(num_tokens=6)
    shifted = logits[:, :-1, :]
    assert not shifted.is_contiguous()
    expected = torch.log_softmax(shifted, -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(shifted, labels[:, 1:], max_chunk_elements=13), expected)


def test_token_logprobs_reject_ignore_index_labels_and_mismatched_shapes():
    logits, labels = _random_logits()
    labels[0, 0] = -100
    with pytest.raises(ValueError, match="pad_token_id"):
        token_logprobs(logits, labels)
    with pytest.raises(ValueError, match="shift labels"):
        token_logprobs(logits, labels[:, 1:])
    with pytest.raises(ValueError, match=r"\[batch, tokens, vocab\]"):
        token_logprobs(logits[0], labels[0])


def _direct_entropy(logits):
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


@pytest.mark.parametrize("max_chunk_elements", CHUNK_SIZES)
def test_entropy_matches_minus_sum_p_log_p_in_value_and_gradient(max_chunk_elements):
    logits, _ = _random_logits()
    logits_ref = logits.clone().requires_grad_()
    logits = logits.requires_grad_()
    upstream = torch.randn(logits.shape[:-1])

    entropy = entropy_from_logits(logits, max_chunk_elements=max_chunk_elements)
    expected = _direct_entropy(logits_ref)
    torch.testing.assert_close(entropy, expected)
    (entropy * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, logits_ref.grad)


def test_entropy_passes_gradcheck_in_float64_and_leaves_its_input_untouched():
    logits, _ = _random_logits(batch_size=2, num_tokens=3, vocab_size=5, dtype=torch.float64)
    original = logits.clone()
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, max_chunk_elements=7), (logits,))
    torch.testing.assert_close(logits.detach(), original, rtol=0, atol=0)


def test_entropy_is_log_vocab_for_uniform_logits_and_near_zero_for_a_peaked_distribution():
    uniform = torch.zeros(1, 2, 8)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((1, 2), math.log(8)))
    peaked = torch.zeros(1, 1, 8)
    peaked[..., 3] = 50.0
    assert entropy_from_logits(peaked).item() < 1e-15


# ---------------------------------------------------------------- entropy bonus


def test_entropy_bonus_is_the_entropy_aggregated_like_the_pg_loss():
    logits = torch.zeros(2, 3, 4)  # uniform over 4: entropy log 4 everywhere
    logits[1, :, 0] = 50.0  # second sequence: entropy ~ 0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropy = entropy_from_logits(logits)
    token_mean = entropy_bonus(entropy, mask, mode="token-mean")
    seq_mean = entropy_bonus(entropy, mask, mode="seq-mean-token-mean")
    assert token_mean.item() == pytest.approx(2 * math.log(4) / 3)  # 3 tokens, two of entropy log 4
    assert seq_mean.item() == pytest.approx(math.log(4) / 2)  # sequence means log 4 and 0


def test_a_gradient_step_on_minus_the_entropy_bonus_raises_the_entropy():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)
    mask = torch.ones(1, 1)
    before = entropy_from_logits(logits).item()
    loss = -0.1 * entropy_bonus(entropy_from_logits(logits), mask, mode="token-mean")
    loss.backward()
    with torch.no_grad():
        after = entropy_from_logits(logits - 1.0 * logits.grad).item()
    assert after > before
