"""judge: rollouts -> the same rows plus an LLM judge's verdict of every sample (a ``judge:`` section).

Each sample's response is put into ``judge.template`` with its prompt, reference answer and rubric, the judge answers,
and ``judge.verdict`` reads a score from its text; an unparsable text is asked again (``judge.max_retries`` times, each
call with another seed), and what is kept per sample is the score (null without one), the raw text of the last
attempt, the number of attempts and the error kind. Score reads this table in place of the rollouts
(``takes_over``), and its term ``{reward: judge}`` turns the verdict into a reward component, weighted and combined
with the rule rewards like any other.

Why a stage and not a reward function called inside score:
- a changed judge prompt, model or parser re-runs the judge and what follows, never generation: the verdicts are a
  table of their own whose fingerprint chains into score's, and score's weights change without re-judging;
- the judge is a model as big as the policy or bigger, with its own engines and Ray resources (judge.num_actors,
  gpus_per_actor), not a function in score's CPU actors; its verdicts are resumable shard by shard like any stage's
  (a judge call is seeded by the run seed, iteration, prompt, sample and attempt, so a redone shard is the same);
- its raw texts are inspectable (`batchrl inspect`), which is how one finds a template or parser that misreads.
The judge's engines never receive policy weights: they are built from judge.model by this stage's own actors (not
the run's EnginePool, which holds the policy's engines), for the length of the stage.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pyarrow as pa

from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.judge import JudgeConfig
from batchrl.config.models import fingerprint_dump
from batchrl.pipeline.shards import ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import STAGE_PROVIDERS, ActorNeed, Stage, StageContext, StageOutput
from batchrl.stages.judge_calls import JudgeCalls, judge_group_columns
from batchrl.stages.user import user_stages  # noqa: F401  (its provider first: score reads the judge's table)
from batchrl.storage.manifest import Manifest
from batchrl.storage.sources import check_checkpoint_source

logger = logging.getLogger(__name__)

COUNTED = ("samples", "judged", "failed", "attempts", "judge_tokens", "judge_prompt_tokens", "verdict_sum")


class JudgeStage(Stage):
    name = "judge"
    table = "judgements"
    schema = "judgements"
    inputs: tuple[str, ...] = ("rollouts",)  # set to the table it reads by `judge_stages`
    takes_over = "rollouts"
    # It reads no policy; "behaviour" (the one generate read) lets it run beside the previous iteration's update with
    # run.max_staleness instead of waiting for the policy that update writes
    reads_policy = "behaviour"
    config_section = "judge"
    timing_name = "judge"

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        judge = cfg.judge
        endpoint = {} if judge.endpoint is None else {"endpoint": fingerprint_dump(judge.endpoint)}
        return {"judge": fingerprint_dump(judge, exclude=frozenset({"endpoint"})) | endpoint, "seed": cfg.run.seed}

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [ActorNeed.of(cfg.judge, field="judge")]

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        return [] if cfg.judge.model is None else [("judge.model", cfg.judge.model)]

    def check_inputs(self, cfg: PipelineConfig) -> None:
        if cfg.judge.model is not None:
            check_checkpoint_source(cfg.judge.model, field="judge.model", example="Qwen/Qwen3-8B")
        key = cfg.judge.endpoint.api_key_env if cfg.judge.endpoint is not None else None
        if key and not os.environ.get(key):  # the actors read it from the environment they inherit
            raise ConfigError(f"judge.endpoint.api_key_env: ${key} is not set in this environment")

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        stats = dict(manifest.stats)
        seconds = timings.get("judge")
        if seconds:
            stats["judge/tokens_per_s"] = manifest.counts.get("judge_tokens", 0) / seconds
        return stats

    def run(self, ctx: StageContext) -> StageOutput:
        cfg = ctx.cfg
        parts, counts = run_sharded(
            ShardRun.of(ctx, self.inputs[0], description="judge"),
            worker_cls=JudgeWorker,
            worker_kwargs={"judge": cfg.judge.model_dump(), "run_seed": cfg.run.seed, "iteration": ctx.iteration},
            actors=cfg.judge,
        )
        kept = {key: int(counts.get(key, 0)) for key in COUNTED if key != "verdict_sum"}
        if kept["failed"]:
            logger.warning("%d of %d samples have no judge verdict (see judge_errors)", kept["failed"], kept["samples"])
        return StageOutput(parts=parts, counts=kept, stats=judge_stats(counts))


def judge_stats(counts: dict[str, float]) -> dict[str, float]:
    """judge/verdict/mean (over the samples with a verdict), judge/failed_fraction and judge/attempts_per_sample."""
    samples, judged = counts.get("samples", 0), counts.get("judged", 0)
    if not samples:
        return {}
    stats = {
        "judge/failed_fraction": counts.get("failed", 0) / samples,
        "judge/attempts_per_sample": counts.get("attempts", 0) / samples,
    }
    if judged:
        stats["judge/verdict/mean"] = counts.get("verdict_sum", 0.0) / judged
    return stats


class JudgeWorker(ShardWorker):
    """Builds the judge once (an engine of judge.model, or an HTTP client of judge.endpoint); judges each shard."""

    schema = "judgements"

    def __init__(self, *, judge: dict[str, Any], run_seed: int, iteration: int | None):
        self.calls = JudgeCalls(JudgeConfig.model_validate(judge), run_seed=run_seed, iteration=iteration or 0)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        columns, counts = judge_group_columns(self.calls, table)
        out = table
        for name, column in columns.items():
            out = out.append_column(name, column)
        return out, counts

    def close(self) -> None:
        self.calls.close()


def judge_stages(cfg: PipelineConfig) -> list[type[Stage]]:
    """The judge stage when the pipeline has a judge: it reads the last table after generate (a user stage's, or the
    rollouts), named here from the config, and score reads its table in turn."""
    if cfg.judge is None:
        return []
    after_generate = [entry.name for entry in cfg.stages if entry.after == "generate"]
    source = after_generate[-1] if after_generate else "rollouts"
    return [type("JudgeStage", (JudgeStage,), {"inputs": (source,), "__module__": __name__})]


STAGE_PROVIDERS.append(judge_stages)
