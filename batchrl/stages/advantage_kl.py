"""KL folded into the reward (``advantage.kl_in_reward_coef``): the reference model's pass in the advantage stage.

Each sample's reward becomes its score minus coef x its summed per-token KL(behaviour || reference), before the
estimator sees it (GAE: coef x KL charged on every response token the policy wrote: a multi-turn sample's tool
tokens are charged nothing, their behaviour log-probs are placeholders). The behaviour side is the rollout's own
per-token log-probs (the policy that sampled them); the reference side is computed here by the reference model
(``model.path``, as the update's KL loss), loaded once per worker. Filtering still looks at the scores (a group
whose answers all fail is still without signal, whatever its KL).

One reference pass per shard: when the stage also needs the batch's moments (whitening, REINFORCE++'s baseline,
GAE), its first pass sees the penalised rewards too. That pass keeps the per-token KL it computed (a shard's
"tape", ``<advantages>/_journal/reference_kl/<part>``, listed in the shard's moments record, so a resumed stage
trusts it only as the journal trusts a part), and the second pass replays it instead of running the reference model
again: the same float64 numbers, read in the same order. Why a file, not the driver: the KL is one number per
response token, too much for a journal record or a trip through the driver; why replay in call order: both passes
split a shard into the same pieces (`advantage_group`'s group sizes, GAE's whole shard), so the order is the key,
and each piece's token offsets are checked against the tape's before it is used (a mismatch computes it again).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pyarrow as pa

from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError, StorageError
from batchrl.stages.advantage_table import ShardGroups
from batchrl.storage import join, read_parquet, resolve, write_parquet_atomic

KL_DIR = "_journal/reference_kl"  # in the advantages table: each input part's tape, by the part's name
Tape = list[tuple[np.ndarray, np.ndarray]]  # (per-token KL, offsets) of each `RewardKL.token_kl` call, in order


class RewardKL:
    """Summed per-token KL(behaviour || reference) of every sample of a group table, [P, n].

    Per shard (`begin_shard`), it records each piece's KL in ``tape`` and replays a tape it is given; the reference
    model is loaded on the first piece it has to compute, so a second pass that replays every shard loads none."""

    def __init__(self, reference_path: str, *, estimator: str, max_tokens: int, share_prompt: bool = False):
        self.reference_path = reference_path
        self.model, self.pad_token_id = None, 0
        self.estimator, self.max_tokens, self.share_prompt = estimator, max_tokens, share_prompt
        self.tape: Tape = []
        self._replay: Tape = []

    def begin_shard(self, replay: Tape | None = None) -> None:
        """A new shard: an empty ``tape``; ``replay``, the tape of the same shard's earlier pass, serves its pieces."""
        self.tape, self._replay = [], list(replay or [])

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from batchrl.storage import local_copy
        from batchrl.trainer.reference import load_frozen_model

        local = local_copy(self.reference_path)
        self.model = load_frozen_model(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

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
        replayed = self._replay.pop(0) if self._replay else None
        if replayed is not None and np.array_equal(replayed[1], samples.response_offsets_N1):
            self.tape.append(replayed)
            return replayed
        self._replay = []  # a piece the tape does not hold: this shard is computed from here on
        if self.model is None:
            self._load()
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
        self.tape.append((kl_flat, samples.response_offsets_N1))
        return kl_flat, samples.response_offsets_N1


def write_tape(tape: Tape, uri: str) -> tuple[int, str]:
    """Writes a shard's tape (one row per piece) atomically; (num_bytes, sha256) of the file."""
    table = pa.table(
        {
            "kl": pa.array([kl for kl, _ in tape], pa.list_(pa.float64())),
            "offsets": pa.array([offsets for _, offsets in tape], pa.list_(pa.int64())),
        }
    )
    return write_parquet_atomic(table, uri)


def drop_tapes(kl_dir: str) -> None:
    """Deletes the tapes once the second pass has read them (their records in the journal then name missing parts:
    a redo of the stage computes them again)."""
    fs, path = resolve(kl_dir)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def read_tape(kl_dir: str, part: str) -> Tape | None:
    """The tape of input part ``part`` that the first pass wrote; None when there is none."""
    try:
        table = read_parquet(join(kl_dir, part))
    except StorageError:  # none (a shard of no moments pass), or unreadable: the shard is computed
        return None
    kls, offsets = table.column("kl").combine_chunks(), table.column("offsets").combine_chunks()
    return [(kls[i].values.to_numpy(), offsets[i].values.to_numpy()) for i in range(table.num_rows)]


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
