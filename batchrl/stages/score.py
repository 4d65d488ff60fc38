"""score: rollouts -> scores, applying rule rewards within each group row (no groupby, no shuffle).

The reward of a row is either the weighted sum of ``score.rewards`` terms, or (when none are listed) the
default reward of its data_source. A reward that raises, returns None or returns NaN does not fail the
stage: the sample gets ``score.failure_reward``, the error is kept in ``score_errors`` and counted.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pyarrow as pa

from batchrl.config import ConfigError, PipelineConfig
from batchrl.pipeline.shards import ShardWorker, run_sharded
from batchrl.pipeline.stage import StageContext, StageOutput, register
from batchrl.rewards import RewardFn, resolve_reward, reward_name_for

logger = logging.getLogger(__name__)


class RewardSet:
    """Resolves reward functions once; ``score(response, row)`` returns (total reward, error or None)."""

    def __init__(self, *, terms: list[tuple[str, float]], by_data_source: dict[str, str], failure_reward: float):
        self.terms = [(resolve_reward(name), weight) for name, weight in terms]
        self.by_data_source = by_data_source
        self.failure_reward = failure_reward
        self._defaults: dict[str, RewardFn] = {}

    def functions_for(self, data_source: str) -> list[tuple[RewardFn, float]]:
        if self.terms:
            return self.terms
        if data_source not in self._defaults:
            self._defaults[data_source] = resolve_reward(reward_name_for(data_source, overrides=self.by_data_source))
        return [(self._defaults[data_source], 1.0)]

    def score(self, response: str, ground_truth: str | None, row: dict[str, Any]) -> tuple[float, str | None]:
        """``row``: the other prompt fields passed to reward functions as keywords (data_source, extra_info...)."""
        total = 0.0
        for fn, weight in self.functions_for(row["data_source"]):
            name = getattr(fn, "__name__", repr(fn))
            try:
                value = fn(response, ground_truth, **row)
            except Exception as err:  # noqa: BLE001 — a user reward's failure is recorded, not fatal
                return self.failure_reward, f"{name} raised {type(err).__name__}: {err}"[:500]
            if value is None:
                return self.failure_reward, f"{name} returned None"
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
                return self.failure_reward, f"{name} returned {value!r} (not a finite number)"
            total += weight * float(value)
        return total, None


class ScoreWorker(ShardWorker):
    schema = "scores"

    def __init__(self, **reward_kwargs):
        self.rewards = RewardSet(**reward_kwargs)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        extra_columns = ("prompt_id", "data_source", "ground_truth", "extra_info_json")
        rows = table.select(list(extra_columns)).to_pylist()
        all_scores, all_errors = [], []
        for row, responses in zip(rows, table.column("response_texts").to_pylist()):
            row = dict(row)
            ground_truth = row.pop("ground_truth")
            row["extra_info"] = json.loads(row.pop("extra_info_json")) if row.get("extra_info_json") else None
            results = [self.rewards.score(response, ground_truth, row) for response in responses]
            all_scores.append([r[0] for r in results])
            all_errors.append([r[1] for r in results])
        out = table.append_column("scores", pa.array(all_scores, pa.list_(pa.float32())))
        out = out.append_column("score_errors", pa.array(all_errors, pa.list_(pa.string())))
        return out, summarize_scores(out)


def summarize_scores(table: pa.Table) -> dict[str, float]:
    scores = [s for group in table.column("scores").to_pylist() for s in group]
    errors = [e for group in table.column("score_errors").to_pylist() for e in group]
    return {"num_samples": len(scores), "score_sum": sum(scores), "score_max": max(scores, default=0.0),
            "score_min": min(scores, default=0.0), "failed_samples": sum(e is not None for e in errors)}


@register
class ScoreStage:
    name = "score"
    table = "scores"
    schema = "scores"
    inputs = ("rollouts",)
    per_iteration = True

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {"score": cfg.score.model_dump()}

    @staticmethod
    def reward_kwargs(cfg: PipelineConfig) -> dict[str, Any]:
        s = cfg.score
        return {"terms": [(t.reward, t.weight) for t in s.rewards],
                "by_data_source": dict(s.reward_by_data_source), "failure_reward": s.failure_reward}

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: every reward named in the config resolves."""
        kwargs = self.reward_kwargs(cfg)
        try:
            RewardSet(**kwargs)
            for reward in kwargs["by_data_source"].values():
                resolve_reward(reward)
        except ValueError as err:
            raise ConfigError(f"score: {err}") from None

    def preflight(self, cfg: PipelineConfig, *, data_sources: list[str]) -> None:
        """After ingest, before any generation: every data_source in the prompts has a reward."""
        rewards = RewardSet(**self.reward_kwargs(cfg))
        for data_source in data_sources:
            try:
                rewards.functions_for(data_source)
            except ValueError as err:
                raise ConfigError(f"score: {err}") from None

    def run(self, ctx: StageContext) -> StageOutput:
        reward_kwargs = self.reward_kwargs(ctx.cfg)
        parts, counts = run_sharded(
            input_dir=ctx.input_dirs["rollouts"], input_manifest=ctx.inputs["rollouts"], output_dir=ctx.output_dir,
            worker_cls=ScoreWorker, worker_kwargs=reward_kwargs, summarize=summarize_scores,
            concurrency=max(1, ctx.cfg.ray.num_cpus or 2), num_cpus=1)
        n = counts.get("num_samples", 0)
        stats = {"critic/score/mean": counts["score_sum"] / n, "critic/score/max": counts["score_max"],
                 "critic/score/min": counts["score_min"]} if n else {}
        if counts.get("failed_samples"):
            logger.warning("%d of %d samples failed to score (see score_errors)", counts["failed_samples"], n)
        return StageOutput(parts=parts, counts={"num_samples": int(n), "failed_samples": int(counts.get("failed_samples", 0))},
                           stats=stats)
