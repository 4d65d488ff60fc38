"""Token log-probs, entropy, PPO-clip losses and loss aggregation: hand values and direct formulas."""

import math

import pytest
import torch

from batchrl.algorithms.losses import (
    AGGREGATION_MODES,
    aggregate_token_losses,
    approx_kl,
    entropy_from_logits,
    masked_mean,
    ppo_clip_token_losses,
    token_logprobs,
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


# ---------------------------------------------------------------- aggregation

NAN = float("nan")
# row 0: 4 tokens, row 1: 2 tokens, row 2: 1 token, row 3: none. Masked-out entries hold garbage.
RAGGED_LOSSES = torch.tensor(
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, 100.0], [7.0, 8.0, 9.0, 10.0], [NAN, 1.0, 2.0, 3.0]]
)
RAGGED_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (10 + 11 + 7) / 7),  # 7 tokens
        ("seq-mean-token-mean", (2.5 + 5.5 + 7.0) / 3),  # the empty sequence does not count
        ("seq-mean-token-sum", (10 + 11 + 7) / 3),
    ],
)
def test_each_aggregation_mode_matches_hand_computed_values_on_a_ragged_mask(mode, expected):
    loss = aggregate_token_losses(RAGGED_LOSSES, RAGGED_MASK, mode=mode)
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_a_fully_masked_batch_aggregates_to_zero_not_nan(mode):
    assert aggregate_token_losses(torch.ones(2, 3), torch.zeros(2, 3), mode=mode).item() == 0.0


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
    whole = aggregate_token_losses(losses, mask, mode=mode)
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
