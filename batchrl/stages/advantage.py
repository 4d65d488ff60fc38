"""advantage: scores -> advantages, group-relative within each row, then one row per sample.

The group is the row (one prompt, its n samples), so no groupby is needed: the rewards of a shard form
a dense [num_prompts, n] array handed to a pure function. The output explodes to one row per sample,
keyed by (prompt_id, sample_idx), which the update stage consumes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from batchrl.algorithms.advantages import grpo_advantages
from batchrl.config import PipelineConfig
from batchrl.pipeline.shards import ShardWorker, run_sharded
from batchrl.pipeline.stage import StageContext, StageOutput, register

logger = logging.getLogger(__name__)


class AdvantageWorker(ShardWorker):
    schema = "advantages"

    def __init__(self, *, estimator: str, epsilon: float):
        self.std_normalize = estimator == "grpo"
        self.epsilon = epsilon

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        scores = table.column("scores").to_pylist()
        group_sizes = {len(g) for g in scores}
        if len(group_sizes) > 1:
            raise AssertionError(f"groups of unequal sizes {sorted(group_sizes)} in one shard")
        rewards_PG = np.asarray(scores, dtype=np.float64).reshape(table.num_rows, -1)
        advantages_PG = grpo_advantages(rewards_PG, std_normalize=self.std_normalize, eps=self.epsilon)
        out = explode_groups(table, advantages_PG)
        return out, summarize_advantages(out)


def explode_groups(table: pa.Table, advantages_PG: np.ndarray) -> pa.Table:
    """One row per sample: scalar columns repeat per sample, list-of-sample columns are flattened."""
    num_samples_P = np.asarray([len(g) for g in table.column("scores").to_pylist()], dtype=np.int64)
    take_S = np.repeat(np.arange(table.num_rows), num_samples_P)
    sample_idx_S = np.concatenate([np.arange(n) for n in num_samples_P]) if len(num_samples_P) else np.zeros(0)
    repeated = table.select(["prompt_id", "data_source", "prompt_token_ids", "policy_version"]).take(take_S)
    flattened = {
        "response_token_ids": "response_token_ids", "response_logprobs": "response_logprobs",
        "response_text": "response_texts", "finish_reason": "finish_reasons", "score": "scores",
        "score_error": "score_errors",
    }
    columns = {name: repeated.column(name) for name in repeated.column_names}
    columns["sample_idx"] = pa.array(sample_idx_S, pa.int32())
    for out_name, list_name in flattened.items():
        columns[out_name] = pa.concat_arrays([c.flatten() for c in table.column(list_name).chunks]) \
            if table.num_rows else pa.array([], table.schema.field(list_name).type.value_type)
    columns["advantage"] = pa.array(advantages_PG.reshape(-1), pa.float32())
    return pa.table(columns)


def summarize_advantages(table: pa.Table) -> dict[str, float]:
    advantages = table.column("advantage").to_numpy()
    per_group = table.group_by("prompt_id").aggregate([("score", "min"), ("score", "max")])
    all_equal = np.asarray(per_group.column("score_min")) == np.asarray(per_group.column("score_max"))
    return {"groups": per_group.num_rows, "groups_all_equal": int(all_equal.sum()),
            "num_samples": len(advantages), "advantage_sum": float(advantages.sum()),
            "advantage_max": float(advantages.max(initial=-np.inf)), "advantage_min": float(advantages.min(initial=np.inf))}


@register
class AdvantageStage:
    name = "advantage"
    table = "advantages"
    schema = "advantages"
    inputs = ("scores",)
    per_iteration = True

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {"advantage": cfg.advantage.model_dump()}

    def run(self, ctx: StageContext) -> StageOutput:
        a = ctx.cfg.advantage
        parts, counts = run_sharded(
            input_dir=ctx.input_dirs["scores"], input_manifest=ctx.inputs["scores"], output_dir=ctx.output_dir,
            worker_cls=AdvantageWorker, worker_kwargs={"estimator": a.estimator, "epsilon": a.epsilon},
            summarize=summarize_advantages, concurrency=max(1, ctx.cfg.ray.num_cpus or 2), num_cpus=1)
        n = counts.get("num_samples", 0)
        stats = {"critic/advantages/mean": counts["advantage_sum"] / n, "critic/advantages/max": counts["advantage_max"],
                 "critic/advantages/min": counts["advantage_min"]} if n else {}
        return StageOutput(parts=parts, counts={k: int(v) for k, v in counts.items() if not k.startswith("advantage")},
                           stats=stats)
