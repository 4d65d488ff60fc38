"""The advantage estimators, one entry each: the table the advantage stage dispatches through (advantage.estimator).

Why a table: what differs between estimators is data, so the stage is glue that reads it, with no branch per
estimator name. Each entry declares
- its kind: "group" (one reward per sample; a group is a row, so a shard's rewards are a [num_prompts, n] matrix
  and its baseline is a group statistic) or "token" (per-token rewards and a critic's per-token values: GAE);
- whether it needs the batch's moments: its advantages are whitened over the whole batch, all shards, so the stage
  first merges each shard's moments (REINFORCE++-baseline, GAE; any estimator with advantage.whiten);
- its options: the keywords of its function and the advantage config field that sets each.
The function gives the advantages BEFORE batch whitening: the stage whitens them with the merged moments
(`advantages.whiten`). A new estimator is one entry here and its name in AdvantageConfig.estimator
(tests/unit/test_advantages.py checks that the two agree).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from batchrl.algorithms.advantages import grpo_advantages, passk_advantages, rloo_advantages
from batchrl.algorithms.gae import gae_advantages_and_returns


@dataclass(frozen=True)
class Estimator:
    kind: Literal["group", "token"]
    # group: rewards_PG -> advantages_PG; token: (rewards_NT, values_NT, mask_NT) -> (advantages_NT, returns_NT)
    advantages: Callable[..., Any]
    needs_batch_moments: bool = False  # whitened over the whole batch (the stage's first pass merges the moments)
    options: Mapping[str, str] = field(default_factory=dict)  # keyword of `advantages` -> advantage config field

    def options_from(self, settings: Any) -> dict[str, Any]:
        """The keyword arguments of `advantages`, read from an object with the named fields (the advantage config)."""
        return {keyword: getattr(settings, name) for keyword, name in self.options.items()}


def _grpo(rewards_PG: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    return grpo_advantages(rewards_PG, std_normalize=True, eps=eps)


def _group_centered(rewards_PG: np.ndarray) -> np.ndarray:
    """r - group mean: Dr.GRPO's advantages, and REINFORCE++-baseline's before the batch whitening."""
    return grpo_advantages(rewards_PG, std_normalize=False)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("group", _grpo, options={"eps": "epsilon"}),
    "drgrpo": Estimator("group", _group_centered),
    "rloo": Estimator("group", rloo_advantages),
    # verl weighs every response token in the batch statistics: the stage whitens with token-weighted moments
    "reinforce_pp_baseline": Estimator("group", _group_centered, needs_batch_moments=True),
    "grpo_passk": Estimator("group", passk_advantages, options={"eps": "epsilon", "k": "passk_k"}),
    "gae": Estimator(
        "token", gae_advantages_and_returns, needs_batch_moments=True, options={"gamma": "gamma", "lam": "lam"}
    ),
}


def compute_advantages(estimator: str, rewards_PG: np.ndarray, **options) -> np.ndarray:
    """Return the advantages of the group estimator `estimator` for `rewards_PG` [num_prompts, samples_per_group],
    float64, before batch whitening (`ESTIMATORS[estimator].needs_batch_moments`: whiten them over the batch).

    Options: "grpo" (eps), "drgrpo", "rloo", "reinforce_pp_baseline" (none), "grpo_passk" (k required, eps). An
    unknown or per-token estimator, an option the estimator does not take, or a missing required one is a ValueError.
    """
    entry = ESTIMATORS.get(estimator)
    if entry is None or entry.kind != "group":
        groups = [name for name, e in ESTIMATORS.items() if e.kind == "group"]
        raise ValueError(f"unknown group advantage estimator {estimator!r}; choose one of {groups}")
    parameters = inspect.signature(entry.advantages).parameters
    accepted = {name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    required = {name for name in accepted if parameters[name].default is inspect.Parameter.empty}
    if set(options) - accepted:
        raise ValueError(
            f"advantage estimator {estimator!r} does not take {sorted(set(options) - accepted)}; "
            f"its options are {sorted(accepted)}"
        )
    if required - set(options):
        raise ValueError(f"advantage estimator {estimator!r} needs {sorted(required - set(options))}")
    return entry.advantages(rewards_PG, **options)
