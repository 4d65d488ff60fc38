"""The pieces of PPO with a critic outside a run: the critic section's checks; GAE in the advantage stage (token
rewards, returns, whitening over the batch from shard moments) against the pure functions; the critic model
(fresh head seeded, a saved critic continued, values read at the position that predicts each token)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from batchrl.algorithms.advantages import batch_moments
from batchrl.algorithms.gae import gae_advantages_and_returns, masked_whiten, token_level_rewards
from batchrl.config import ConfigError, validate_dict
from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError
from batchrl.stages.advantage_gae import gae_output, gae_shard, gae_stats


def config(**sections) -> dict:
    return {"name": "t", "model": {"path": "m"}, "data": {"train_files": ["d"]}} | sections


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"advantage": {"estimator": "gae"}}, "needs the critic section"),
        ({"critic": {}}, "used by advantage.estimator=gae only"),
        ({"advantage": {"estimator": "gae", "whiten": True}, "critic": {}}, "already whitens"),
        ({"advantage": {"estimator": "gae", "filter_groups": True}, "critic": {}}, "filter_groups"),
        ({"advantage": {"estimator": "gae", "lam": 1.5}, "critic": {}}, "lam"),
        ({"advantage": {"estimator": "gae"}, "critic": {"cliprange_value": 0}}, "cliprange_value"),
    ],
)
def test_the_critic_section_is_checked(sections, message):
    with pytest.raises(ConfigError, match=message):
        validate_dict(config(**sections))


def test_gae_runs_with_one_sample_per_prompt():
    cfg = validate_dict(config(advantage={"estimator": "gae"}, critic={}, generate={"num_samples_per_prompt": 1}))
    assert cfg.critic.lr == 1e-5 and cfg.advantage.gamma == 1.0


def test_with_a_critic_advantage_reads_the_values_table_by_its_name_and_runs_after_it():
    import batchrl.stages  # noqa: F401  (registers the built-in stages and the providers)
    from batchrl.pipeline.stage import STAGES, source_table, stage_order, sync_stages

    shaping = {
        "name": "shaping",
        "after": "score",
        "call": "examples.prompt_shaping:shape_by_prompt_length",
        "outputs": ["scores"],
    }
    sync_stages(validate_dict(config(advantage={"estimator": "gae"}, critic={}, stages=[shaping])))
    try:
        assert STAGES["advantage"].inputs == ("values",) and source_table("values", "advantage") == "values"
        assert STAGES["values"].inputs[0] == "shaping" and STAGES["values"].takes_over is None
        order = stage_order()
        assert order.index("score") < order.index("shaping") < order.index("values") < order.index("advantage")
    finally:
        sync_stages(validate_dict(config()))
    assert STAGES["advantage"].inputs == ("scores",)


def group_table(groups: list[list[tuple[float, list[int], list[float]]]]) -> pa.Table:
    """A values-table shard: per group, (score, response tokens, values) of each sample."""
    rows = []
    for p, group in enumerate(groups):
        rows.append(
            {
                "prompt_id": f"p{p}",
                "data_source": "toy",
                "prompt_token_ids": [1, 2],
                "policy_version": 0,
                "scores": [s for s, _, _ in group],
                "response_token_ids": [t for _, t, _ in group],
                "response_lengths": [len(t) for _, t, _ in group],
                "response_logprobs": [[-0.1] * len(t) for _, t, _ in group],
                "response_texts": ["x"] * len(group),
                "finish_reasons": ["stop"] * len(group),
                "score_errors": [None] * len(group),
                "values": [v for _, _, v in group],
            }
        )
    return pa.Table.from_pylist(rows)


SHARDS = [
    group_table([[(1.0, [5, 6, 7], [0.1, 0.2, 0.3]), (0.0, [5], [0.4])], [(0.5, [8, 9], [0.0, -0.2]), (1.0, [], [])]]),
    group_table([[(0.0, [3, 3, 3, 3], [0.5, 0.5, 0.4, 0.1]), (1.0, [4, 4], [0.9, 0.7])]]),
]


def test_gae_over_shards_equals_gae_and_whitening_of_the_whole_batch():
    cfg = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    shards = [gae_shard(table, cfg, None) for table in SHARDS]
    moments = batch_moments(shards[0].advantages_NT, weights=shards[0].mask_NT.astype(float)) + batch_moments(
        shards[1].advantages_NT, weights=shards[1].mask_NT.astype(float)
    )
    outs = [gae_output(shard, moments, eps=1e-8) for shard in shards]
    rows = [row for out, _ in outs for row in out.to_pylist()]
    # the whole batch at once, with the pure functions
    groups = [group for table in SHARDS for group in table.to_pylist()]
    samples = [sample for group in groups for sample in zip(group["scores"], group["values"])]
    lengths = np.array([len(v) for _, v in samples])
    values_NT = np.zeros((len(samples), 4))
    for i, (_, v) in enumerate(samples):
        values_NT[i, : len(v)] = v
    mask_NT = np.arange(4)[None, :] < lengths[:, None]
    rewards_NT = token_level_rewards([s for s, _ in samples], lengths, num_tokens=4)
    advantages_NT, returns_NT = gae_advantages_and_returns(rewards_NT, values_NT, mask_NT, gamma=0.9, lam=0.8)
    whitened_NT = masked_whiten(advantages_NT, mask_NT)
    for i, row in enumerate(rows):
        n = lengths[i]
        np.testing.assert_allclose(row["token_advantages"], whitened_NT[i, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(row["returns"], returns_NT[i, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(row["values"], values_NT[i, :n], rtol=1e-6)
        assert row["advantage"] == pytest.approx(whitened_NT[i, 0] if n else 0.0, rel=1e-6, abs=1e-6)
    # the stage's metrics from the summed counts
    counts = {k: sum(c[k] for _, c in outs) for k in outs[0][1]}
    stats = gae_stats(counts)
    residual = (returns_NT - values_NT)[mask_NT]
    expected = 1 - residual.var(ddof=1) / (returns_NT[mask_NT].var(ddof=1) + 1e-5)
    assert stats["critic/vf_explained_var"] == pytest.approx(expected, rel=1e-9)
    assert stats["critic/returns/mean"] == pytest.approx(returns_NT[mask_NT].mean(), rel=1e-9)
    assert stats["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-9)


class TokenKL:
    """The reference model's per-token KL (RewardKL.token_kl) as a fixed 0.5 a token, for the arithmetic."""

    def token_kl(self, table):
        lengths = [len(t) for group in table.column("response_token_ids").to_pylist() for t in group]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return np.full(int(offsets[-1]), 0.5), offsets


def test_kl_in_the_reward_is_charged_on_every_token_before_gae():
    cfg = AdvantageConfig(estimator="gae", gamma=1.0, lam=1.0, kl_in_reward_coef=0.1)
    shard = gae_shard(SHARDS[0], cfg, TokenKL())
    # gamma = lam = 1: the first token's return is the score minus 0.1 x 0.5 per token
    lengths = [3, 1, 2, 0]
    scores = [1.0, 0.0, 0.5, 1.0]
    for i, (n, score) in enumerate(zip(lengths, scores)):
        if n:
            assert shard.returns_NT[i, 0] == pytest.approx(score - 0.05 * n)
    np.testing.assert_allclose(shard.reward_kl_N, [1.5, 0.5, 1.0, 0.0])


def test_values_that_do_not_count_the_response_tokens_are_a_data_error():
    bad = group_table([[(1.0, [5, 6], [0.1])]])
    with pytest.raises(DataError, match="1 values for a response of 2 tokens"):
        gae_shard(bad, AdvantageConfig(estimator="gae"), None)


def test_a_fresh_value_head_is_drawn_from_the_seed_and_a_saved_critic_is_continued(toy_model_dir, tmp_path):
    from batchrl.trainer.critic import critic_source, is_critic_checkpoint, load_critic, value_head

    a, b, c = (load_critic(toy_model_dir, seed=s) for s in (1, 1, 2))
    assert torch.equal(value_head(a).weight, value_head(b).weight)
    assert not torch.equal(value_head(a).weight, value_head(c).weight)
    assert critic_source(toy_model_dir, None) == toy_model_dir
    saved = tmp_path / "policy" / "critic"
    a.save_pretrained(saved)
    assert is_critic_checkpoint(str(saved)) and critic_source(str(tmp_path / "policy"), None) == str(saved)
    again = load_critic(str(saved), seed=99)  # a critic is continued: the seed draws nothing
    assert torch.equal(value_head(again).weight, value_head(a).weight)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), again.state_dict().values()))


def test_values_are_read_at_the_position_before_each_response_token(toy_model_dir):
    from batchrl.trainer.critic import load_critic, response_values
    from batchrl.trainer.data import samples_from_groups

    model = load_critic(toy_model_dir, seed=3).eval()
    table = group_table([[(1.0, [5, 6, 7], [0, 0, 0]), (0.0, [9], [0])], [(0.0, [4, 4], [0, 0]), (1.0, [], [])]])
    samples = samples_from_groups(table)
    flat = response_values(model, samples, pad_token_id=0, max_tokens=4)  # a small budget: several micro-batches
    with torch.no_grad():
        direct = model(input_ids=torch.tensor([[1, 2, 5, 6, 7]])).logits[0, :, 0]
    np.testing.assert_allclose(flat[:3], direct[1:4].numpy(), rtol=1e-5, atol=1e-6)  # V before tokens 5, 6, 7
    assert len(flat) == 3 + 1 + 2 + 0


def test_values_with_a_shared_prompt_equal_values_without(toy_model_dir):
    from batchrl.trainer.critic import load_critic, response_values
    from batchrl.trainer.data import samples_from_groups

    model = load_critic(toy_model_dir, seed=3).eval()
    table = group_table([[(1.0, [5, 6, 7], [0, 0, 0]), (0.0, [9], [0]), (0.0, [9, 8], [0, 0])], [(1.0, [4], [0])]])
    samples = samples_from_groups(table)
    alone = response_values(model, samples, pad_token_id=0, max_tokens=64)
    packed = response_values(model, samples, pad_token_id=0, max_tokens=64, share_prompt=True)
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)


def test_the_values_worker_packs_a_prompts_samples_with_update_share_prompt(toy_model_dir, monkeypatch):
    from batchrl.stages.values import ValuesWorker
    from batchrl.trainer import critic

    asked = []
    original = critic.response_values
    monkeypatch.setattr(
        critic, "response_values", lambda *a, **kw: asked.append(kw["share_prompt"]) or original(*a, **kw)
    )
    table = group_table([[(1.0, [5, 6, 7], [0, 0, 0]), (0.0, [9], [0])]]).drop_columns(["values"])
    for share_prompt in (True, False):
        out, counts = ValuesWorker(
            policy=toy_model_dir, model_path=None, seed=3, cuda=False, share_prompt=share_prompt
        ).process(table)
        assert [len(v) for v in out.column("values").to_pylist()[0]] == [3, 1] and counts["value_tokens"] == 4
    assert asked == [True, False]
