"""The ``environment`` term: the reward a sample's environment gave it (generate.environment; batchrl.agents)."""

from __future__ import annotations

from typing import Any

from batchrl.rewards.labels import label_free


@label_free
def environment(
    response: str,
    ground_truth: str | None,
    *,
    environment_reward: float | None = None,
    failure_score: float | None = None,
    **_: Any,
) -> float | None:
    """The last reward the sample's environment gave (the row field environment_reward, from the rollouts'
    environment_rewards). A sample without one (the environment gave none, or failed: its stop status says which)
    scores ``failure_score`` when the term's params set it; otherwise the component fails (score.failure_reward,
    counted in score_errors)."""
    if environment_reward is not None:
        return float(environment_reward)
    if failure_score is not None:
        return float(failure_score)
    raise ValueError("no environment reward (none given, the environment failed, or generate.environment is unset)")
