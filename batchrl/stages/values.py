"""values: scored rollouts -> the same rows plus the critic's per-token values (PPO with a critic).

The stage exists when the pipeline has a ``critic:`` section (advantage.estimator gae). It reads the table score
wrote (or the last user stage placed after score) and the iteration's input policy, whose ``critic/`` is the critic
the previous update trained (at the first iteration: critic.model_path, or the policy with a fresh value head
seeded by run.seed; `batchrl.trainer.critic.critic_source`). Each actor loads that critic once and adds a
``values`` column: per sample, V(s_t) before each response token. With a critic the advantage stage declares this
table as its input (`batchrl.stages.advantage.advantage_stages`), so GAE runs on rows that carry both the rewards
and the values, and the run order puts values before advantage because advantage reads it.

Why a stage of its own and not inside advantage (where KL-in-reward loads the reference model):
- the values are a table one can inspect and resume from, made by the critic that existed when the rollouts were
  made (the input policy's), so a resumed or repeated advantage computes the same numbers;
- changing gamma, lam or the estimator's options re-runs advantage alone, not the critic's forward;
- the critic forward wants its own resources (critic.gpus_per_actor, critic.num_actors), and batch whitening's
  moments pass reads the values from the table instead of running the critic twice.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from batchrl.config import PipelineConfig
from batchrl.pipeline.shards import ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import POLICY, STAGE_PROVIDERS, ActorNeed, Stage, StageContext, StageOutput

logger = logging.getLogger(__name__)

MAX_TOKENS_PER_FORWARD = 8192  # padded tokens of one critic forward (a micro-batch; a longer sample goes alone)


class ValuesStage(Stage):
    name = "values"
    table = "values"
    schema = "values"
    inputs: tuple[str, ...] = ("scores", POLICY)  # the first: set to the table it reads by `values_stages`
    reads_policy = "behaviour"  # the critic of the policy that generated the rollouts
    config_section = "critic"
    timing_name = "values"

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        # Where the critic comes from after the first iteration is the input policy, already in the chain.
        return {"critic_model_path": cfg.critic.model_path, "seed": cfg.run.seed}

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [ActorNeed.of(cfg.critic, field="critic")]

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        path = cfg.critic.model_path
        return [] if path is None else [("critic.model_path", path)]

    def run(self, ctx: StageContext) -> StageOutput:
        critic = ctx.cfg.critic
        table = self.inputs[0]
        parts, counts = run_sharded(
            ShardRun.of(ctx, table, description="values"),
            worker_cls=ValuesWorker,
            worker_kwargs={
                "policy": ctx.policy_in,
                "model_path": critic.model_path,
                "seed": ctx.cfg.run.seed,
                "cuda": critic.gpus_per_actor > 0,
                "share_prompt": ctx.cfg.update.share_prompt,
            },
            actors=critic,
        )
        # critic/values/mean is the advantage stage's (over the tokens it trains on)
        return StageOutput(
            parts=parts, counts={"samples": int(counts.get("samples", 0)), "tokens": int(counts.get("value_tokens", 0))}
        )


class ValuesWorker(ShardWorker):
    """Loads the critic once; adds each shard's per-token values."""

    schema = "values"

    def __init__(self, *, policy: str, model_path: str | None, seed: int, cuda: bool, share_prompt: bool = False):
        import torch
        from transformers import AutoTokenizer

        from batchrl.storage import local_copy
        from batchrl.trainer.critic import critic_source, load_critic

        local = local_copy(policy)
        source = critic_source(local, None if model_path is None else local_copy(model_path))
        self.model = load_critic(source, seed=seed).eval().requires_grad_(False)
        if cuda:
            self.model.to(torch.device("cuda"))
        tokenizer = AutoTokenizer.from_pretrained(local)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.share_prompt = share_prompt

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        from batchrl.trainer.critic import response_values
        from batchrl.trainer.data import samples_from_groups

        samples = samples_from_groups(table)
        flat = response_values(
            self.model,
            samples,
            pad_token_id=self.pad_token_id,
            max_tokens=MAX_TOKENS_PER_FORWARD,
            share_prompt=self.share_prompt,
        )
        offsets = samples.response_offsets_N1
        per_sample = [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(samples.num_samples)]
        sizes = [len(group) for group in table.column("response_token_ids").to_pylist()]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        grouped = [per_sample[starts[row] : starts[row + 1]] for row in range(table.num_rows)]
        out = table.append_column("values", pa.array(grouped, pa.list_(pa.list_(pa.float32()))))
        counts = {"samples": samples.num_samples, "value_tokens": float(len(flat))}
        return out, counts


def values_stages(cfg: PipelineConfig) -> list[type[Stage]]:
    """The values stage when the pipeline has a critic: it reads the last table after score (a user stage's, or
    the scores), named here from the config, so the order the providers were appended in does not matter."""
    if cfg.critic is None:
        return []
    after_score = [entry.name for entry in cfg.stages if entry.after == "score"]
    source = after_score[-1] if after_score else "scores"
    return [type("ValuesStage", (ValuesStage,), {"inputs": (source, POLICY), "__module__": __name__})]


STAGE_PROVIDERS.append(values_stages)
