"""One GPU host's devices split between the engines and the update ranks, for overlapped iterations.

With run.max_staleness > 0 the update trains while the engines generate. On a Ray cluster the update's ranks are a
placement group of their own (update.launcher: ray). On one host the local NCCL ranks would take GPUs 0..N-1
whatever Ray gave the engines, so the runner splits the visible GPUs: the last update.num_processes go to the
ranks (`StageContext.rank_devices`, then `UpdateSpec.cuda_devices`, their CUDA_VISIBLE_DEVICES), the others to the
embedded Ray, which the run's session starts with only those visible (Ray hands its actors GPU ids from the
CUDA_VISIBLE_DEVICES it starts with).
Unverified on a GPU so far: the split is tested as a function and as the environments it produces.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from batchrl.config import ConfigError, PipelineConfig


@dataclass(frozen=True)
class DeviceSplit:
    engines: list[str]  # the GPU ids the embedded Ray hands its actors
    ranks: list[str]  # the GPU ids of the update's local ranks


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else 0..count-1 (none without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def needs_split(cfg: PipelineConfig, *, local_launcher: bool) -> bool:
    """Whether the engines and local update ranks would run at once on one host's GPUs."""
    return bool(cfg.run.max_staleness) and cfg.generate.gpus_per_actor > 0 and local_launcher


def overlap_gpu_split(cfg: PipelineConfig, visible: list[str]) -> tuple[list[str], list[str]]:
    """(the engines' GPUs, the update ranks' GPUs) of ``visible``: the last update.num_processes for the ranks. A
    ConfigError naming the fields when the host cannot hold both."""
    ranks = cfg.update.num_processes
    if ranks == "auto":
        raise ConfigError(
            f"run.max_staleness={cfg.run.max_staleness} with GPU engines on one host splits its GPUs between the "
            "engines and the update: set update.num_processes to the number of GPUs the update takes (auto would "
            "take them all)"
        )
    g = cfg.generate
    engines = math.ceil(g.num_actors * g.gpus_per_actor)
    if len(visible) < ranks + engines:
        raise ConfigError(
            f"run.max_staleness={cfg.run.max_staleness} runs the update beside the engines, on GPUs of its own: "
            f"update.num_processes={ranks} plus generate.num_actors x gpus_per_actor={engines} need {ranks + engines} "
            f"GPUs, and this host has {len(visible)}. Lower them, set run.max_staleness: 0, or run on a Ray cluster "
            "with update.launcher: ray"
        )
    return visible[:-ranks], visible[-ranks:]


def device_split(cfg: PipelineConfig, *, cluster: bool) -> DeviceSplit | None:
    """The split of this host's visible GPUs when the engines and local update ranks would run at once on them
    (None: they do not); a ConfigError naming the fields when the host cannot hold both. ``cluster``: the run joins a
    Ray cluster, where update.launcher auto puts the ranks on Ray, not on this host."""
    u = cfg.update
    local_ranks = u.launcher == "local" or (u.launcher == "auto" and not cluster)
    if not needs_split(cfg, local_launcher=local_ranks):
        return None
    engines, ranks = overlap_gpu_split(cfg, visible_gpus())
    return DeviceSplit(engines=engines, ranks=ranks)
