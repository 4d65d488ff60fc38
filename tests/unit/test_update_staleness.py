"""How stale the update's optimizer steps are: step k of an update that started at the rollout's policy has taken
k optimizer steps since that policy, so its samples are k steps off-policy."""

from __future__ import annotations

import pytest

from batchrl.config.models import UpdateConfig
from batchrl.trainer import UpdateSpec
from batchrl.trainer.training import summarize


def step(staleness: float, pg_loss: float) -> dict[str, float]:
    return {
        "actor/pg_loss": pg_loss,
        "actor/lr": 1e-6,
        "perf/step_time_s": 0.1,
        "perf/padded_tokens": 10.0,
        "perf/real_tokens": 8.0,
        "update/staleness": staleness,
    }


def spec() -> UpdateSpec:
    return UpdateSpec(
        policy_in="in", policy_out="out", advantages_files=["a.parquet"], metrics_path="m.json", update=UpdateConfig()
    )


def test_two_epochs_of_two_mini_batches_report_staleness_mean_one_and_a_half_and_max_three():
    metrics = summarize([step(k, pg_loss=k) for k in range(4)], spec=spec(), global_step=4)

    assert metrics["update/staleness_mean"] == pytest.approx(1.5)
    assert metrics["update/staleness_max"] == 3.0
    assert "update/staleness" not in metrics  # only the summaries, not a mean under the per-step name
    assert metrics["actor/pg_loss"] == pytest.approx(1.5)  # the other metrics are still means


def test_one_optimizer_step_is_on_policy():
    metrics = summarize([step(0, pg_loss=1.0)], spec=spec(), global_step=7)
    assert metrics["update/staleness_mean"] == 0.0 and metrics["update/staleness_max"] == 0.0
