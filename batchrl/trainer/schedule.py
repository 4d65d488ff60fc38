"""Learning-rate schedule as a pure function of the global optimizer step.

Why a function of the step rather than a torch LRScheduler object: the update runs once per iteration in
fresh processes, so the schedule must resume from a saved step count. A pure `lr_at_step(step)` needs only
that integer (kept in the trainer state next to the optimizer moments), and the worker sets each param
group's lr before every step.

Shapes: linear warmup over `warmup_steps`, then constant or cosine decay to `min_lr_ratio * lr` at
`total_steps` (held there after).
Departures from verl (transformers' `get_constant/cosine_schedule_with_warmup`): warmup is
`(step + 1) / (warmup_steps + 1)` as in torchtitan, so the first step does not run at lr 0; and the step
counts OPTIMIZER steps (mini-batches) across iterations, where verl advances its scheduler once per
training iteration.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)


def lr_at_step(
    step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> float:
    """The learning rate of optimizer step `step` (0-based). `schedule` and `min_lr_ratio` are update.lr_schedule
    and update.min_lr_ratio, which UpdateConfig validates."""
    if step < 0 or warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"step={step}, warmup_steps={warmup_steps} must be >= 0 and total_steps={total_steps} >= 1")
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return lr
    assert schedule == "cosine", schedule
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def resolve_warmup_steps(*, warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """`warmup_steps` when set (> 0), else round(warmup_ratio * total_steps)."""
    if warmup_steps > 0:
        return warmup_steps
    return int(round(warmup_ratio * total_steps))
