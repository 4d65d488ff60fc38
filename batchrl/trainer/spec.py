"""The one object that crosses the process boundary into the update workers.

A plain frozen dataclass rather than the pydantic config: it must be written to JSON by the launcher and read
back by `python -m batchrl.trainer.worker` in a fresh process (or, later, on a Ray worker), and it carries
already-resolved local paths, not user-facing options. Each field is documented once, in `UpdateConfig` for
the options it mirrors; the fields only the trainer has are documented here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from batchrl.trainer.schedule import LR_SCHEDULES

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("float32", "bfloat16")
OLD_LOGPROBS_SOURCES = ("recompute", "rollout")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo_clip", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "mse", "k1+", "k3+", "low_var_kl+")  # as algorithms.kl



@dataclass(frozen=True)
class UpdateSpec:
    """One policy update: read `advantages_files`, take optimizer steps, write `policy_out`.

    Steps: each of `ppo_epochs` epochs shuffles the prompt groups and takes one optimizer step per
    mini-batch of `ppo_mini_batch_size` groups (None: the whole table is one mini-batch). A mini-batch is
    split into micro-batches by `max_tokens_per_micro_batch` padded tokens, or `micro_batch_size` samples
    per process when that is None, with gradient accumulation.
    `dtype` is the compute dtype. Master weights, gradients, optimizer state and the saved checkpoint stay in
    float32: a bfloat16 checkpoint reloaded every iteration would round away updates of lr ~1e-6.
    `max_grad_norm <= 0` disables clipping (the norm is still measured and reported).
    """

    policy_in: str  # local dir of an HF checkpoint, or a hub id
    policy_out: str  # local dir to write; replaced atomically by rename
    advantages_files: list[str]  # local Parquet paths with the advantages-table columns
    metrics_path: str  # local JSON file that rank 0 writes after saving the policy
    num_processes: int = 1
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_ratio: float | None = None
    policy_loss: str = "ppo_clip"
    loss_agg_mode: str = "token-mean"
    loss_agg_norm_length: int | None = None  # seq-mean-token-sum-norm's constant divisor (the response cap)
    micro_batch_size: int = 4
    max_tokens_per_micro_batch: int | None = None
    ppo_mini_batch_size: int | None = None
    ppo_epochs: int = 1
    seed: int = 0  # mini-batch shuffles derive from (seed, epoch); the stage passes run.seed + iteration
    dtype: str = "float32"
    old_logprobs: str = "recompute"
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    reference_policy: str | None = None  # HF checkpoint of the frozen reference; needed when kl_loss_coef > 0
    rollout_is_cap: float | None = None
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    lr_total_steps: int | None = None  # None: num_iterations x this update's optimizer steps
    num_iterations: int = 1  # iterations the lr schedule spans (run.iterations)
    cpu_offload: bool = False
    gradient_checkpointing: bool = False
    share_prompt: bool = False  # one row per prompt and several of its responses (needs max_tokens_per_micro_batch)
    trainer_state_in: str | None = None  # local dir written by a previous update's trainer_state_out
    # sha256 of trainer_state_in's files (relative paths) as their writer recorded them: checked before loading,
    # because loading unpickles them (see `integrity`). None: not checked (a state saved before they were recorded)
    trainer_state_sha256: dict[str, str] | None = None
    trainer_state_out: str | None = None  # local dir for the optimizer state and step count (None: not saved)
    logprobs_out: str | None = None  # local Parquet file for the per-sample old/reference log-probs
    progress_path: str | None = None  # local JSON-lines file rank 0 appends progress to (see progress_file)

    def __post_init__(self) -> None:
        object.__setattr__(self, "advantages_files", [str(p) for p in self.advantages_files])
        for name, choices in (("backend", BACKENDS), ("dtype", DTYPES), ("old_logprobs", OLD_LOGPROBS_SOURCES),
                              ("loss_agg_mode", LOSS_AGG_MODES), ("policy_loss", POLICY_LOSSES),
                              ("kl_estimator", KL_ESTIMATORS), ("lr_schedule", LR_SCHEDULES)):
            _check_choice(name, getattr(self, name), choices)
        if not self.advantages_files:
            raise ValueError("UpdateSpec.advantages_files is empty; pass the advantage stage's Parquet parts")
        for name in ("num_processes", "micro_batch_size", "ppo_epochs", "num_iterations", "max_tokens_per_micro_batch",
                     "ppo_mini_batch_size", "lr_total_steps", "loss_agg_norm_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"UpdateSpec.{name}={getattr(self, name)} must be >= 1")
        for name in ("lr", "weight_decay", "clip_ratio_low", "clip_ratio_high", "entropy_coeff", "kl_loss_coef",
                     "lr_warmup_steps", "lr_warmup_ratio", "min_lr_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"UpdateSpec.{name}={getattr(self, name)} must be >= 0")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.kl_loss_coef > 0 and not self.reference_policy:
            raise ValueError("UpdateSpec.kl_loss_coef > 0 needs reference_policy (the frozen reference checkpoint)")
        if self.rollout_is_cap is not None and (self.rollout_is_cap < 1 or self.old_logprobs != "recompute"):
            raise ValueError(f"UpdateSpec.rollout_is_cap={self.rollout_is_cap} must be >= 1 and needs "
                             "old_logprobs='recompute' (with 'rollout' the weights are all 1)")
        if self.dual_clip_ratio is not None and self.dual_clip_ratio <= 1:
            raise ValueError(f"UpdateSpec.dual_clip_ratio={self.dual_clip_ratio} must be > 1 (3.0 is usual) or None")
        if self.cpu_offload and self.backend == "gloo":
            raise ValueError("UpdateSpec.cpu_offload=True needs GPUs (backend nccl): on CPU the parameters are "
                             "already in host memory; set cpu_offload=False")
        if self.dual_clip_ratio is not None and self.policy_loss != "ppo_clip":
            raise ValueError("UpdateSpec.dual_clip_ratio applies to policy_loss='ppo_clip' only; set it to None")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_agg_norm_length is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs loss_agg_norm_length (e.g. the response cap)")
        if self.lr_warmup_steps > 0 and self.lr_warmup_ratio > 0:
            raise ValueError("set one of UpdateSpec.lr_warmup_steps and lr_warmup_ratio, not both")
        if self.share_prompt and self.max_tokens_per_micro_batch is None:
            raise ValueError("UpdateSpec.share_prompt=True needs max_tokens_per_micro_batch: a pack of responses "
                             "is sized in tokens, not samples")
        if self.lr_warmup_ratio > 1 or self.min_lr_ratio > 1:
            raise ValueError("UpdateSpec.lr_warmup_ratio and min_lr_ratio must be <= 1")

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> UpdateSpec:
        with open(path, encoding="utf-8") as f:
            fields_by_name = json.load(f)
        unknown = set(fields_by_name) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown UpdateSpec fields {sorted(unknown)}; remove them")
        return cls(**fields_by_name)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"UpdateSpec.{name}={value!r} must be one of {list(choices)}")


def resolve_backend(backend: str) -> str:
    """The process-group backend "auto" stands for here: nccl when CUDA is available, else gloo."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
