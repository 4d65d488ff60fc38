"""generate: prompts -> rollouts, n samples per prompt from the iteration's input policy.

A Ray Data actor pool runs the engine (vLLM by default, transformers as fallback); each actor builds its
engine once and reuses it for every shard it is given. One output row per prompt group, with list
columns holding its n samples. Every sample's seed derives from (run seed, iteration, prompt_id,
sample_idx), so a regenerated shard equals the lost one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import pyarrow as pa

from batchrl.config import PipelineConfig
from batchrl.pipeline.shards import ShardWorker, run_sharded
from batchrl.pipeline.stage import StageContext, StageOutput, register
from batchrl.storage import local_copy

logger = logging.getLogger(__name__)


def sample_seed(run_seed: int, iteration: int, prompt_id: str, sample_idx: int) -> int:
    """A 31-bit seed that depends only on its arguments (stable across processes and machines)."""
    digest = hashlib.sha256(f"{run_seed}/{iteration}/{prompt_id}/{sample_idx}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class GenerateWorker(ShardWorker):
    schema = "rollouts"

    def __init__(self, *, model_path: str, engine: str, dtype: str, max_model_len: int | None,
                 engine_kwargs: dict[str, Any], sampling: dict[str, Any], num_samples_per_prompt: int,
                 run_seed: int, iteration: int):
        from batchrl.engines import SamplingSpec, make_engine

        started = time.perf_counter()
        self.engine = make_engine(engine, model_path=local_copy(model_path), dtype=dtype,
                                  max_model_len=max_model_len, engine_kwargs=engine_kwargs)
        logger.info("%s engine ready in %.1f s", self.engine.name, time.perf_counter() - started)
        self.sampling = SamplingSpec(**sampling)
        self.num_samples = num_samples_per_prompt
        self.run_seed = run_seed
        self.iteration = iteration

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        prompt_ids = table.column("prompt_id").to_pylist()
        seeds = [[sample_seed(self.run_seed, self.iteration, pid, s) for s in range(self.num_samples)]
                 for pid in prompt_ids]
        started = time.perf_counter()
        groups = self.engine.generate(table.column("prompt_token_ids").to_pylist(), seeds=seeds,
                                      sampling=self.sampling)
        elapsed = time.perf_counter() - started
        lengths = [[len(s.token_ids) for s in group] for group in groups]
        out = table
        for name, values in {
            "response_texts": [[s.text for s in g] for g in groups],
            "response_token_ids": [[s.token_ids for s in g] for g in groups],
            "response_logprobs": [[s.logprobs for s in g] for g in groups],
            "finish_reasons": [[s.finish_reason for s in g] for g in groups],
            "response_lengths": lengths,
            "sample_seeds": seeds,
            "policy_version": [self.iteration] * table.num_rows,
        }.items():
            out = out.append_column(name, pa.array(values))
        return out, summarize_rollouts(out) | {"gen_time_s": elapsed}


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


@register
class GenerateStage:
    name = "generate"
    table = "rollouts"
    schema = "rollouts"
    inputs = ("prompts", "policy")
    per_iteration = True

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        placement = {"num_actors", "cpus_per_actor", "gpus_per_actor", "gpu_memory_utilization", "enforce_eager"}
        return {"generate": cfg.generate.model_dump(exclude=placement), "seed": cfg.run.seed,
                "dtype": cfg.model.dtype}

    def run(self, ctx: StageContext) -> StageOutput:
        g = ctx.cfg.generate
        max_model_len = g.max_model_len or ctx.cfg.data.max_prompt_tokens + g.max_new_tokens
        engine_kwargs = {"tensor_parallel_size": g.tensor_parallel_size, "enforce_eager": g.enforce_eager,
                         "seed": ctx.cfg.run.seed, "trust_remote_code": ctx.cfg.model.trust_remote_code}
        if g.gpus_per_actor > 0:
            engine_kwargs["gpu_memory_utilization"] = g.gpu_memory_utilization
        worker_kwargs = {
            "model_path": ctx.policy_in, "engine": g.engine, "dtype": ctx.cfg.model.dtype,
            "max_model_len": max_model_len, "engine_kwargs": engine_kwargs,
            "sampling": {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                         "max_new_tokens": g.max_new_tokens, "stop": tuple(g.stop)},
            "num_samples_per_prompt": g.num_samples_per_prompt, "run_seed": ctx.cfg.run.seed,
            "iteration": ctx.iteration,
        }
        parts, counts = run_sharded(
            input_dir=ctx.input_dirs["prompts"], input_manifest=ctx.inputs["prompts"], output_dir=ctx.output_dir,
            worker_cls=GenerateWorker, worker_kwargs=worker_kwargs, summarize=summarize_rollouts,
            concurrency=g.num_actors, num_cpus=g.cpus_per_actor, num_gpus=g.gpus_per_actor)
        stats = {}
        if counts.get("num_samples"):
            stats["response_length/mean"] = counts["response_tokens"] / counts["num_samples"]
            stats["response_length/max"] = counts["response_length_max"]
            stats["response_length/min"] = counts["response_length_min"]
            stats["response_length/clip_ratio"] = counts["clipped_samples"] / counts["num_samples"]
        return StageOutput(parts=parts, counts={k: int(v) for k, v in counts.items() if not k.endswith("_s")},
                           stats=stats)
