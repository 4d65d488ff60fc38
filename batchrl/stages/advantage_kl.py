"""KL folded into the reward (``advantage.kl_in_reward_coef``): the reference model's pass in the advantage stage.

Each sample's reward becomes its score minus coef x its summed per-token KL(behaviour || reference), before the
estimator sees it (GAE: coef x KL charged on every response token the policy wrote: a multi-turn sample's tool
tokens are charged nothing, their behaviour log-probs are placeholders). The behaviour side is the rollout's own
per-token log-probs (the policy that sampled them); the reference side is computed here by the reference model
(``model.path``, as the update's KL loss), loaded once per worker. Filtering still looks at the scores (a group
whose answers all fail is still without signal, whatever its KL).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError
from batchrl.stages.advantage_table import ShardGroups


class RewardKL:
    """Summed per-token KL(behaviour || reference) of every sample of a group table, [P, n]."""

    def __init__(self, reference_path: str, *, estimator: str, max_tokens: int, share_prompt: bool = False):
        from transformers import AutoTokenizer

        from batchrl.storage import local_copy
        from batchrl.trainer.reference import load_frozen_model

        local = local_copy(reference_path)
        self.model = load_frozen_model(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.estimator, self.max_tokens, self.share_prompt = estimator, max_tokens, share_prompt

    def __call__(self, groups: ShardGroups) -> np.ndarray:
        if groups.rewards_PG.size == 0:
            return np.zeros_like(groups.rewards_PG)
        from batchrl.trainer.data import sample_sums

        kl_flat, offsets_N1 = self.token_kl(groups.table)
        return sample_sums(kl_flat, offsets_N1).reshape(groups.rewards_PG.shape)  # samples in row-major [P, n] order

    def token_kl(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(per-token KL of every response token of a group table's samples, row-major, flat float64, 0 on a
        multi-turn sample's tool tokens; the offsets of each sample's tokens in it)."""
        import torch

        from batchrl.algorithms.kl import kl_penalty
        from batchrl.trainer.data import samples_from_groups
        from batchrl.trainer.reference import response_logprobs

        samples = samples_from_groups(table)
        behaviour = samples.flat_rollout_logprobs()
        if len(behaviour) != int(samples.response_offsets_N1[-1]):
            raise DataError(
                "kl_in_reward needs the rollouts' per-token log-probs, and some are missing (logged responses without "
                "response_logprobs) or of "
                "another length than their responses"
            )
        reference = response_logprobs(
            self.model,
            samples,
            pad_token_id=self.pad_token_id,
            max_tokens=self.max_tokens,
            share_prompt=self.share_prompt,
        )
        kl_flat = (
            kl_penalty(torch.from_numpy(behaviour)[None], torch.from_numpy(reference)[None], estimator=self.estimator)[
                0
            ]
            .double()
            .numpy()
        )
        if samples.response_masks:  # a tool's tokens are no action of the policy: no KL charged on them
            kl_flat = np.where(samples.flat_policy_mask(), kl_flat, 0.0)
        return kl_flat, samples.response_offsets_N1


def kl_penalized(groups: ShardGroups, reward_kl: RewardKL | None, coef: float) -> tuple[ShardGroups, np.ndarray | None]:
    """(groups with rewards - coef x summed KL, the summed KL [P, n]); unchanged and None without KL."""
    if reward_kl is None:
        return groups, None
    kl_PG = reward_kl(groups)
    return dataclasses.replace(groups, rewards_PG=groups.rewards_PG - coef * kl_PG), kl_PG


def reward_kl_for(cfg: AdvantageConfig, reference_path: str | None) -> RewardKL | None:
    if cfg.kl_in_reward_coef <= 0:
        return None
    if reference_path is None:
        raise AssertionError("advantage.kl_in_reward_coef > 0 needs the reference model path")
    return RewardKL(
        reference_path,
        estimator=cfg.kl_in_reward_estimator,
        max_tokens=cfg.kl_in_reward_max_tokens,
        share_prompt=cfg.kl_in_reward_share_prompt,
    )
