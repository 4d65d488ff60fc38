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

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("float32", "bfloat16")
OLD_LOGPROBS_SOURCES = ("recompute", "rollout")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class UpdateSpec:
    """One policy update: read `advantages_files`, take `ppo_epochs` optimizer steps, write `policy_out`.

    `dtype` is the compute dtype. Master weights, gradients, optimizer state and the saved checkpoint stay in
    float32: a bfloat16 checkpoint reloaded every iteration would round away updates of lr ~1e-6.
    One optimizer step per epoch: the whole advantages table is one mini-batch, split into micro-batches of
    `micro_batch_size` samples per process for gradient accumulation.
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
    loss_agg_mode: str = "token-mean"
    micro_batch_size: int = 4
    ppo_epochs: int = 1
    seed: int = 0
    dtype: str = "float32"
    old_logprobs: str = "recompute"
    entropy_coeff: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "advantages_files", [str(p) for p in self.advantages_files])
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("old_logprobs", self.old_logprobs, OLD_LOGPROBS_SOURCES)
        _check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if not self.advantages_files:
            raise ValueError("UpdateSpec.advantages_files is empty; pass the advantage stage's Parquet parts")
        for name in ("num_processes", "micro_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"UpdateSpec.{name}={getattr(self, name)} must be >= 1")
        for name in ("lr", "weight_decay", "clip_ratio_low", "clip_ratio_high", "entropy_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"UpdateSpec.{name}={getattr(self, name)} must be >= 0")

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
