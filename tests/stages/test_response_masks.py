"""Multi-turn samples' policy masks (response_masks: 1 on tokens the policy wrote, 0 on tokens a tool appended)
from the advantage stage to the update: GAE with holes, KL in the reward, the token counts, the micro-batch tensors
and the loss. A tool token stays in the model input as context and is in no loss, KL, entropy or count; without a
mask (single-turn, logged data) or with one of all ones, everything is exactly as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import ADVANTAGES_SCHEMA, make_spec

from batchrl.algorithms.gae import gae_advantages_and_returns, token_level_rewards
from batchrl.config.models import AdvantageConfig
from batchrl.stages.advantage_gae import gae_output, gae_shard
from batchrl.stages.advantage_table import explode_groups, shard_groups
from batchrl.trainer.data import Samples, collate, collate_packs, samples_from_groups
from batchrl.trainer.training import SUM_NAMES, micro_batch_backward

CPU = torch.device("cpu")

# ------------------------------------------------------------------------------------ advantage stage

# (score, response tokens, mask, values) per sample: A ends on the policy's answer after a 2-token tool turn,
# B ends on a tool's answer (truncated at max_turns), C is all the policy's
SAMPLES = [
    (1.0, [5, 6, 7, 8, 9], [1, 1, 0, 0, 1], [0.1, 0.2, 0.3, 0.4, 0.5]),
    (0.5, [5, 6, 7], [1, 0, 0], [0.2, 0.9, 0.9]),
    (0.0, [4, 4], [1, 1], [0.6, 0.3]),
]


def scores_table(samples=SAMPLES, *, masks: bool = True) -> pa.Table:
    """One values-table group of `samples` (with or without their masks)."""
    row = {
        "prompt_id": "p0",
        "data_source": "toy",
        "prompt_token_ids": [1, 2],
        "policy_version": 0,
        "scores": [s for s, _, _, _ in samples],
        "response_token_ids": [t for _, t, _, _ in samples],
        "response_lengths": [len(t) for _, t, _, _ in samples],
        "response_logprobs": [[-0.1 if m else 0.0 for m in mask] for _, _, mask, _ in samples],
        "response_texts": ["x"] * len(samples),
        "finish_reasons": ["stop"] * len(samples),
        "score_errors": [None] * len(samples),
        "values": [v for _, _, _, v in samples],
    }
    if masks:
        row["response_masks"] = [m for _, _, m, _ in samples]
    return pa.Table.from_pylist([row])


def test_gae_skips_tool_tokens_as_holes_and_puts_the_score_on_the_policys_last_token():
    cfg = AdvantageConfig(estimator="gae", gamma=1.0, lam=1.0)
    shard = gae_shard(scores_table(), cfg, None)
    # gamma = lam = 1: a policy token's advantage is the score minus its value; a hole carries the next one's
    np.testing.assert_allclose(shard.advantages_NT[0], [0.9, 0.8, 0.5, 0.5, 0.5])
    assert shard.advantages_NT[1, 0] == pytest.approx(0.5 - 0.2)  # the score of B sits on its only policy token
    np.testing.assert_allclose(shard.advantages_NT[2, :2], [-0.6, -0.3])
    # the same as the pure function on the hand-built rewards and mask with holes
    mask_NT = np.array([[1, 1, 0, 0, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], bool)
    values_NT = np.zeros((3, 5))
    for i, (_, _, _, v) in enumerate(SAMPLES):
        values_NT[i, : len(v)] = v
    rewards_NT = token_level_rewards([1.0, 0.5, 0.0], [5, 1, 2], num_tokens=5)
    expected_NT, returns_NT = gae_advantages_and_returns(rewards_NT, values_NT, mask_NT, gamma=0.9, lam=0.8)
    shard = gae_shard(scores_table(), AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8), None)
    np.testing.assert_allclose(shard.advantages_NT, expected_NT, rtol=1e-12)
    np.testing.assert_array_equal(shard.mask_NT, mask_NT)
    # whitening and the critic metrics count the policy's 6 tokens; the lists keep one value per response token
    out, counts = gae_output(shard, shard_moments(shard), eps=1e-8)
    assert counts["gae_tokens"] == 6
    assert [len(a) for a in out.column("token_advantages").to_pylist()] == [5, 3, 2]
    assert out.column("response_mask").to_pylist() == [m for _, _, m, _ in SAMPLES]
    np.testing.assert_allclose(returns_NT[mask_NT], shard.returns_NT[mask_NT])


def shard_moments(shard):
    from batchrl.algorithms.advantages import batch_moments

    return batch_moments(shard.advantages_NT, weights=shard.mask_NT.astype(float))


def test_without_masks_or_with_all_ones_gae_is_what_it_was():
    all_ones = [(s, t, [1] * len(t), v) for s, t, _, v in SAMPLES]
    cfg = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    plain, ones = gae_shard(scores_table(masks=False), cfg, None), gae_shard(scores_table(all_ones), cfg, None)
    assert np.array_equal(plain.advantages_NT, ones.advantages_NT)
    assert np.array_equal(plain.returns_NT, ones.returns_NT)
    assert explode_groups(scores_table(masks=False), np.zeros((1, 3))).column("response_mask").null_count == 3


def test_group_whitening_weighs_each_sample_by_the_tokens_the_policy_wrote():
    assert shard_groups(scores_table(), filter_groups=False).lengths_PG.tolist() == [[3.0, 1.0, 2.0]]
    assert shard_groups(scores_table(masks=False), filter_groups=False).lengths_PG.tolist() == [[5.0, 3.0, 2.0]]


# ------------------------------------------------------------------------------------ the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from batchrl.trainer.fsdp import load_model
    from batchrl_toy import build_toy_model

    path = tmp_path_factory.mktemp("tiny") / "m"
    build_toy_model(path, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return path, load_model(str(path)).eval()


def test_kl_in_the_reward_charges_nothing_on_tool_tokens(tiny):
    from batchrl.stages.advantage_kl import RewardKL

    reward_kl = RewardKL(str(tiny[0]), estimator="k1", max_tokens=256)
    masked, _ = reward_kl.token_kl(scores_table())
    unmasked, offsets = reward_kl.token_kl(scores_table(masks=False))
    policy = np.concatenate([np.asarray(m, bool) for _, _, m, _ in SAMPLES])
    assert np.all(masked[~policy] == 0.0) and np.all(unmasked[~policy] != 0.0)
    np.testing.assert_array_equal(masked[policy], unmasked[policy])  # the reference pass itself is unchanged
    shard = gae_shard(scores_table(), AdvantageConfig(estimator="gae", kl_in_reward_coef=0.1), reward_kl)
    np.testing.assert_allclose(shard.reward_kl_N, [masked[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])])


# (prompt, response, mask) of a micro-batch: two multi-turn samples and a single-turn one of another prompt
PROMPTS = [[11, 12, 13], [11, 12, 13], [21, 22]]
RESPONSES = [[31, 32, 41, 42, 43, 33, 34], [35, 44, 45, 36], [37, 38, 39]]
MASKS = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1]]


def samples_of(masks=MASKS, advantages=(1.0, -0.5, 2.0)) -> Samples:
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in RESPONSES])]).astype(np.int64)
    return Samples(
        prompt_ids=["a", "a", "b"],
        sample_idx=[0, 1, 0],
        prompt_token_ids=PROMPTS,
        response_token_ids=RESPONSES,
        rollout_logprobs=[[] for _ in RESPONSES],
        advantages_N=np.asarray(advantages, dtype=np.float64),
        group_N=np.array([0, 0, 1]),
        response_offsets_N1=offsets,
        response_masks=masks,
    )


def test_the_update_input_is_the_engines_tokens_and_only_policy_tokens_are_in_the_loss():
    samples = samples_of()
    mb = collate(samples, [0, 1, 2], pad_token_id=0, device=CPU)
    for s in range(3):  # the row is prompt + response exactly, tool tokens included (they are context)
        n = len(PROMPTS[s]) + len(RESPONSES[s])
        assert mb.input_ids_BL[s, :n].tolist() == PROMPTS[s] + RESPONSES[s]
        assert mb.response_mask_SR[s, : len(MASKS[s])].tolist() == [bool(m) for m in MASKS[s]]
        assert mb.scored_SR[s, : len(MASKS[s])].all()
    assert samples.loss_tokens_N.tolist() == [4, 2, 3]
    packed = collate_packs(samples, [[0, 1], [2]], pad_token_id=0, device=CPU)
    assert packed.input_ids_BL[0].tolist() == PROMPTS[0] + RESPONSES[0] + RESPONSES[1]
    assert torch.equal(packed.response_mask_SR, mb.response_mask_SR)


def backward(model, samples, old_flat, *, ref_flat=None, **options):
    """(SUM_NAMES sums, gradients) of one micro-batch's loss, token-mean over the samples' loss tokens."""
    spec = make_spec(
        policy_in="m", policy_out="o", advantages_files=["x"], metrics_path="x", reference_policy="m", **options
    )
    values = {"old": old_flat} | ({"ref": ref_flat} if ref_flat is not None else {})
    mb = collate_packs(samples, [[0], [1], [2]], pad_token_id=0, device=CPU, token_values=values)
    model.zero_grad(set_to_none=True)
    num_tokens = int(samples.loss_tokens_N.sum())
    sums = micro_batch_backward(model, mb, spec=spec, num_tokens=num_tokens, num_seqs=3)
    return dict(zip(SUM_NAMES, sums.tolist())), {n: p.grad.clone() for n, p in model.named_parameters()}


def engine_logprobs(model, samples) -> np.ndarray:
    """The policy's log-prob of every response token, flat (tool tokens too): what the pre-update pass computes."""
    from batchrl.trainer.data import scatter_response_values
    from batchrl.trainer.forward import policy_logprobs

    out = torch.zeros(int(samples.response_offsets_N1[-1]))
    with torch.no_grad():
        mb = collate(samples, [0, 1, 2], pad_token_id=0, device=CPU)
        scatter_response_values(policy_logprobs(model, mb, entropy_grad=False)[0], mb, samples, out_flat=out)
    return out.numpy()


LOSS_OPTIONS = dict(entropy_coeff=0.01, kl_loss_coef=0.1, kl_estimator="k1", loss_agg_mode="token-mean")


def test_the_loss_is_over_policy_tokens_and_tool_tokens_values_change_nothing(tiny):
    model = tiny[1]
    samples = samples_of()
    old = engine_logprobs(model, samples)  # the ratio is 1: the policy loss is minus the mean advantage
    sums, grads = backward(model, samples, old, ref_flat=old - 0.25, **LOSS_OPTIONS)
    policy_advantages = [1.0] * 4 + [-0.5] * 2 + [2.0] * 3
    assert sums["pg_loss"] == pytest.approx(-np.mean(policy_advantages), rel=1e-6)
    # the same micro-batch with the tool tokens' advantages, old and reference log-probs changed: the same loss
    tool = ~samples.flat_policy_mask()
    changed_old, changed_ref = old.copy(), old - 0.25
    changed_old[tool], changed_ref[tool] = 3.0, -7.0
    per_token = dataclasses.replace(samples, token_lists={})
    sums2, grads2 = backward(model, per_token, changed_old, ref_flat=changed_ref, **LOSS_OPTIONS)
    assert sums2 == sums
    for name, grad in grads.items():
        assert torch.equal(grads2[name], grad), name
    # the gradient is the hand-written loss's over the policy tokens only, from the whole rows' forward
    from batchrl.trainer.forward import policy_logprobs

    mb = collate(samples, [0, 1, 2], pad_token_id=0, device=CPU)
    model.zero_grad(set_to_none=True)
    logprobs, entropy = policy_logprobs(model, mb, entropy_grad=True)
    policy = torch.zeros_like(mb.response_mask_SR)
    for s, mask in enumerate(MASKS):
        policy[s, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    ratio = torch.exp(logprobs - logprobs.detach())
    kl = logprobs - (logprobs.detach() - 0.25)  # k1 estimator
    loss = (-mb.advantages_SR * ratio - 0.01 * entropy + 0.1 * kl)[policy].sum() / 9
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert sums["entropy"] == pytest.approx(float(entropy.detach()[policy].sum()), rel=1e-5)


def test_a_mask_of_all_ones_and_no_mask_give_bit_identical_losses_and_gradients(tiny):
    model = tiny[1]
    ones = samples_of(masks=[[1] * len(r) for r in RESPONSES])
    old = engine_logprobs(model, ones) - 0.1
    with_ones, grads_ones = backward(model, ones, old, ref_flat=old, **LOSS_OPTIONS)
    without, grads_none = backward(model, samples_of(masks=()), old, ref_flat=old, **LOSS_OPTIONS)
    assert with_ones == without
    for name, grad in grads_none.items():
        assert torch.equal(grads_ones[name], grad), name


# ------------------------------------------------------------------------------------ through the table


def write_masked_advantages(
    path, token_advantages, *, prompts=PROMPTS, masks=MASKS, tool_logprob: float = 0.0
) -> list[str]:
    rows = [
        {
            "prompt_id": pid,
            "sample_idx": k,
            "prompt_token_ids": prompt,
            "response_token_ids": response,
            "response_logprobs": [-0.5 if m else tool_logprob for m in mask or [1] * len(response)],
            "advantage": float(advantages[0]),
            "prompt_length": len(prompt),
            "response_length": len(response),
            "token_advantages": advantages,
            "response_mask": mask,
        }
        for pid, k, prompt, response, mask, advantages in zip(
            ["a", "a", "b"], [0, 1, 0], prompts, RESPONSES, masks, token_advantages
        )
    ]
    schema = ADVANTAGES_SCHEMA
    for name, kind in [("prompt_length", pa.int32()), ("response_length", pa.int32())]:
        schema = schema.append(pa.field(name, kind))
    for name, kind in [("token_advantages", pa.float32()), ("response_mask", pa.int32())]:
        schema = schema.append(pa.field(name, pa.list_(kind)))
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path / "part-00000.parquet")
    return [str(path / "part-00000.parquet")]


def test_the_update_reads_masks_from_the_table_and_trains_the_same_whatever_the_tool_tokens_advantages(tiny, tmp_path):
    from batchrl.trainer.index import read_index
    from batchrl.trainer.rows import RowReader

    model = tiny[1]
    token_advantages = [[0.5, 0.4, 0.0, 0.0, 0.0, 0.3, 0.2], [-1.0, 0.0, 0.0, -0.5], [1.0, 1.5, 2.0]]
    changed = [[a if m else 9.0 for a, m in zip(adv, mask)] for adv, mask in zip(token_advantages, MASKS)]
    results = []
    for name, advantages in (("given", token_advantages), ("changed", changed)):
        index = read_index(write_masked_advantages(tmp_path / name, advantages))
        assert index.loss_tokens_N.tolist() == [4, 2, 3]  # token-mean and token budgets count policy tokens
        rows = RowReader(index, with_rollout_logprobs=True, token_columns=["token_advantages"]).read([0, 1, 2])
        mb = collate(rows, [0, 1, 2], pad_token_id=0, device=CPU)
        for s in range(3):  # the update's input ids are the engine's: prompt + response, nothing re-tokenised
            n = len(PROMPTS[s]) + len(RESPONSES[s])
            assert mb.input_ids_BL[s, :n].tolist() == PROMPTS[s] + RESPONSES[s]
        rows = dataclasses.replace(rows, advantages_N=index.advantages_N)
        old = rows.flat_rollout_logprobs()
        values = {"old": old, "advantages": rows.flat_token_list("token_advantages")}
        mb = collate_packs(rows, [[0, 1], [2]], pad_token_id=0, device=CPU, token_values=values)
        spec = make_spec(policy_in="m", policy_out="o", advantages_files=["x"], metrics_path="x")
        model.zero_grad(set_to_none=True)
        sums = micro_batch_backward(model, mb, spec=spec, num_tokens=int(index.loss_tokens_N.sum()), num_seqs=3)
        results.append((sums, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.equal(results[1][1][name], grad), name
    assert any(grad.abs().sum() > 0 for grad in results[0][1].values())


def test_the_logprobs_table_sums_over_policy_tokens_and_keeps_every_tokens_value():
    from batchrl.trainer.checkpoint import logprobs_table

    samples = samples_of()
    flat = np.arange(1.0, 15.0, dtype=np.float32)
    table = logprobs_table(samples, old_flat=flat, ref_flat=None)
    assert table.column("num_loss_tokens").to_pylist() == [4, 2, 3]
    assert table.column("old_logprob_sum").to_pylist() == [1 + 2 + 6 + 7, 8 + 11, 12 + 13 + 14]
    assert [len(v) for v in table.column("old_logprobs").to_pylist()] == [7, 4, 3]


def test_samples_of_a_group_table_carry_its_masks_and_a_wrong_length_is_named():
    samples = samples_from_groups(scores_table())
    assert samples.flat_policy_mask().tolist() == [bool(m) for _, _, mask, _ in SAMPLES for m in mask]
    bad = samples_of(masks=[[1, 0], [1, 0, 0, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="2 response_mask entries for 7 response tokens"):
        collate(bad, [0], pad_token_id=0, device=CPU)


def test_the_critic_gives_tool_tokens_no_value_and_its_loss_ignores_their_returns(tiny):
    from batchrl.algorithms.gae import clipped_value_losses
    from batchrl.algorithms.losses import aggregate_token_losses
    from batchrl.trainer.critic import critic_values, load_critic, response_values

    critic = load_critic(str(tiny[0]), seed=0)
    masked = response_values(critic, samples_from_groups(scores_table()), pad_token_id=0, max_tokens=256)
    plain = response_values(critic, samples_from_groups(scores_table(masks=False)), pad_token_id=0, max_tokens=256)
    policy = samples_from_groups(scores_table()).flat_policy_mask()
    assert np.all(masked[~policy] == 0.0) and np.array_equal(masked[policy], plain[policy])

    samples = samples_of()
    grads = []
    for tool_return in (0.0, 50.0):
        returns = np.where(samples.flat_policy_mask(), 1.0, tool_return).astype(np.float32)
        values = {"returns": returns, "values": np.zeros_like(returns)}
        mb = collate(samples, [0, 1, 2], pad_token_id=0, device=CPU, token_values=values)
        critic.zero_grad(set_to_none=True)
        losses, _ = clipped_value_losses(
            critic_values(critic, mb),
            mb.token_values_SR["returns"],
            mb.token_values_SR["values"],
            mb.response_mask_SR,
            clip_range=0.5,
        )
        loss = aggregate_token_losses(
            losses, mb.response_mask_SR, mode="token-mean", num_global_tokens=9, num_global_seqs=3
        )
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in critic.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_the_index_and_the_rows_count_the_same_loss_tokens_after_an_empty_prompt(tmp_path):
    from batchrl.trainer.index import read_index
    from batchrl.trainer.rows import RowReader

    # sample 0 starts with a tool token and has no prompt: that token is out of the loss once, not twice
    masks = [[0, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1], None]
    advantages = [[0.0] * len(r) for r in RESPONSES]
    index = read_index(write_masked_advantages(tmp_path, advantages, prompts=[[], [11], [21, 22]], masks=masks))
    rows = RowReader(index, with_rollout_logprobs=False).read([0, 1, 2])
    assert index.loss_tokens_N.tolist() == rows.loss_tokens_N.tolist() == [3, 2, 3]


def test_a_masked_table_trains_in_the_rank_processes_whatever_its_tool_tokens_log_probs(tiny, tmp_path):
    from trainer_helpers import load_weights

    from batchrl.trainer import run_update

    advantages = [[1.0] * 7, [-0.5] * 4, [2.0] * 3]
    outs = []
    for name, tool_logprob in (("placeholder", 0.0), ("changed", -9.0)):
        files = write_masked_advantages(tmp_path / name / "adv", advantages, tool_logprob=tool_logprob)
        spec = make_spec(
            policy_in=str(tiny[0]),
            policy_out=str(tmp_path / name / "policy"),
            advantages_files=files,
            metrics_path=str(tmp_path / name / "metrics.json"),
            logprobs_dir=str(tmp_path / name / "logprobs"),
            reference_policy=str(tiny[0]),
            num_processes=1,
            backend="gloo",
            old_logprobs="rollout",
            micro_batch_size=2,
            lr=1e-3,
            **LOSS_OPTIONS,
        )
        metrics = run_update(spec, timeout_s=120)
        outs.append((metrics, load_weights(tmp_path / name / "policy")))
    assert outs[0][0]["perf/num_tokens"] == 9  # the policy's tokens: 4 + 2 + 3
    assert outs[0][0]["actor/pg_loss"] == outs[1][0]["actor/pg_loss"]
    for name, weight in outs[0][1].items():
        assert torch.equal(outs[1][1][name], weight), name
    assert not all(torch.equal(w, outs[0][1][n]) for n, w in load_weights(tiny[0]).items())  # it trained
    logprobs = pa.concat_tables(pq.read_table(f) for f in sorted((tmp_path / "changed" / "logprobs").glob("*.parquet")))
    assert sorted(logprobs.column("num_loss_tokens").to_pylist()) == [2, 3, 4]
