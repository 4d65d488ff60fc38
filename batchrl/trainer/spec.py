"""The one object that crosses the process boundary into the update workers.

Why the spec carries the validated `UpdateConfig` itself (`spec.update`) instead of a copy of its fields: the
options are declared, defaulted, documented and validated once, in `batchrl.config.models`; a second list here
drifted from it (other defaults, checks run twice with other messages). The spec adds only what the config does
not know: the resolved paths of this update's inputs and outputs, the seed of this iteration, the compute dtype
(from `model.dtype`), how many iterations the lr schedule spans, the reference checkpoint and the trainer state's
checksums. The update stage resolves the one update option whose default lives in another section
(`update.loss_agg_norm_length`, default `generate.max_new_tokens`) into the config it hands over.

The spec is written to JSON by the launcher and read back by `python -m batchrl.trainer.worker` in a fresh
process; the config travels as its `model_dump(exclude_unset=True)` and is re-validated there with
`UpdateConfig.model_validate`, so the rank sees the config the driver validated, including which fields were set
(the `update.dual_clip_ratio` check ignores the default). On Ray the spec object is pickled as it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from batchrl.config.models import CriticConfig, UpdateConfig

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class UpdateSpec:
    """One policy update: read `advantages_files`, take optimizer steps as `update` says, write `policy_out`.

    `dtype` is the compute dtype. Master weights, gradients, optimizer state and the saved checkpoint stay in
    float32: a bfloat16 checkpoint reloaded every iteration would round away updates of lr ~1e-6.
    """

    policy_in: str  # local dir of an HF checkpoint, or a hub id
    policy_out: str  # local dir to write; replaced atomically by rename
    # Parquet parts with the advantages-table columns: local paths or URIs (s3://...), which each rank reads in place
    advantages_files: list[str]
    metrics_path: str  # local JSON file that rank 0 writes after saving the policy
    update: UpdateConfig = dataclasses.field(default_factory=UpdateConfig)  # the run's update options
    seed: int = 0  # mini-batch shuffles derive from (seed, epoch); the stage passes run.seed + iteration
    dtype: str = "float32"  # compute dtype: bfloat16 when model.dtype is bfloat16
    num_iterations: int = 1  # iterations the lr schedule spans (run.iterations), unless update.lr_total_steps
    reference_policy: str | None = None  # HF checkpoint of the frozen reference; needed when kl_loss_coef > 0
    # HF checkpoint of the policy that generated the rollouts, when it is not policy_in (run.max_staleness > 0):
    # old_logprobs=recompute computes the old log-probs with it
    behaviour_policy: str | None = None
    trainer_state_in: str | None = None  # local dir written by a previous update's trainer_state_out
    # sha256 of trainer_state_in's files (relative paths) as their writer recorded them: checked before loading,
    # because loading unpickles them (see `integrity`). None: not checked (a state saved before they were recorded)
    trainer_state_sha256: dict[str, str] | None = None
    trainer_state_out: str | None = None  # local dir for the optimizer state and step count (None: not saved)
    # local dir for the per-sample old/reference log-probs table: each rank writes part-<rank>.parquet
    logprobs_dir: str | None = None
    progress_path: str | None = None  # local JSON-lines file rank 0 appends progress to (see progress_file)
    # threads of each local rank (OMP_NUM_THREADS) when the update shares the host with running engines
    # (run.max_staleness > 0: update.cpus_per_rank); None: the host's CPUs divided among the ranks
    threads_per_rank: int | None = None
    # CUDA_VISIBLE_DEVICES of the local ranks when the update shares one GPU host with running engines (the
    # runner's split, batchrl.pipeline.devices); None: the environment's
    cuda_devices: str | None = None
    # PPO with a critic (advantage.estimator gae): the advantages table has per-token advantages, values, returns
    # The critic is built from `critic.critic_source(policy_in, critic.model_path)` and saved to policy_out/critic/
    critic: CriticConfig | None = None
    train_actor: bool = True  # False during critic.warmup_iterations: the policy is saved as it was loaded
    critic_head_seed: int = 0  # seeds a fresh value head (run.seed: the values stage draws the same one)
    # update.lora: the frozen base under the adapter (model.path, local); the adapter continues from policy_in's
    lora_base: str | None = None

    def __post_init__(self) -> None:
        # Checks of the fields the config does not have; UpdateConfig has validated its own.
        object.__setattr__(self, "advantages_files", [str(p) for p in self.advantages_files])
        if not self.advantages_files:
            raise ValueError("UpdateSpec.advantages_files is empty; pass the advantage stage's Parquet parts")
        if self.dtype not in DTYPES:
            raise ValueError(f"UpdateSpec.dtype={self.dtype!r} must be one of {list(DTYPES)}")
        if self.num_iterations < 1:
            raise ValueError(f"UpdateSpec.num_iterations={self.num_iterations} must be >= 1")
        if self.update.kl_loss_coef > 0 and not self.reference_policy:
            raise ValueError(
                "update.kl_loss_coef > 0 needs UpdateSpec.reference_policy (the frozen reference checkpoint)"
            )
        if self.update.lora is not None and not self.lora_base:
            raise ValueError("update.lora needs UpdateSpec.lora_base (the base checkpoint, model.path)")
        if not self.train_actor and self.critic is None:
            raise ValueError("UpdateSpec.train_actor=False (a critic warm-up) needs a critic")
        if self.update.loss_agg_mode == "seq-mean-token-sum-norm" and self.update.loss_agg_norm_length is None:
            raise ValueError(
                "update.loss_agg_mode='seq-mean-token-sum-norm' needs update.loss_agg_norm_length in the "
                "spec (the update stage resolves it to generate.max_new_tokens)"
            )

    def with_update(self, **options: Any) -> UpdateSpec:
        """This spec with `options` changed in `update`, validated as UpdateConfig validates a user's options."""
        return dataclasses.replace(self, update=UpdateConfig.model_validate(self._update_dump() | options))

    def _update_dump(self) -> dict[str, Any]:
        # Only the fields that were set: re-validation then sees what the driver's validation saw.
        return self.update.model_dump(mode="json", exclude_unset=True)

    def to_json(self, path: str | os.PathLike) -> None:
        fields_by_name = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields_by_name["update"] = self._update_dump()
        fields_by_name["critic"] = None if self.critic is None else self.critic.model_dump(mode="json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(fields_by_name, f, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> UpdateSpec:
        with open(path, encoding="utf-8") as f:
            fields_by_name = json.load(f)
        unknown = set(fields_by_name) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown UpdateSpec fields {sorted(unknown)}; remove them")
        fields_by_name["update"] = UpdateConfig.model_validate(fields_by_name.get("update", {}))
        if fields_by_name.get("critic") is not None:
            fields_by_name["critic"] = CriticConfig.model_validate(fields_by_name["critic"])
        return cls(**fields_by_name)


def resolve_backend(backend: str) -> str:
    """The process-group backend "auto" stands for here: nccl when CUDA is available, else gloo."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
