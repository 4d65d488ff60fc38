"""Placement fields (where, when or how fast a stage works, never what it writes) are marked once, in the config
models, and a stage's fingerprint leaves out exactly the marked fields of the section it dumps: marking a field is a
decision this file records, and a field changing results can never sit unmarked in a hand-kept exclusion set."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import batchrl.api  # noqa: F401  (registers the built-in stages and the user-stage provider)
from batchrl.config import PipelineConfig, load_pipeline, models
from batchrl.config.models import placement_fields
from batchrl.pipeline.stage import STAGES, ActorNeed, sync_stages

ROOT = Path(__file__).resolve().parents[2]
ACTORS = {"num_actors", "cpus_per_actor", "gpus_per_actor"}

MARKED = {
    "DataConfig": {"num_actors", "cpus_per_actor", "prompts_per_iteration"},
    "GenerateConfig": ACTORS
    | {"gpu_memory_utilization", "enforce_eager", "kv_block_size", "shard_timeout_s", "engine_lifetime"},
    # in the score and evaluate fingerprints all the same: they dump the score section whole (before the marker,
    # as now); leaving them out is a deliberate re-pin, not a refactor
    "RewardModelConfig": ACTORS,
    # score, evaluate and heldout dump the section less its Placement fields and its endpoint's api_key_env,
    # max_concurrency, timeout_s and retries (JudgeEndpoint's)
    "ScoreConfig": {"num_actors", "reward_processes"},
    "JudgeConfig": ACTORS | {"gpu_memory_utilization", "enforce_eager"},
    "AdvantageConfig": {"num_actors", "kl_in_reward_share_prompt"},
    "CriticConfig": ACTORS,
    "UpdateConfig": {
        "share_prompt",
        "keep_last_k_optimizer_states",  # the fingerprint keeps whether any is saved (saves_optimizer_state)
        "allow_unverified_trainer_state",
        "timeout_s",
        "trainer_lifetime",
        "launcher",
        "cpus_per_rank",
    },
    "EvaluateConfig": {"before_training", "every"},
    "UserStageConfig": ACTORS,
}

SHAPING = (
    "stages=[{name: shaping, after: score, call: 'examples.prompt_shaping:shape_by_prompt_length', "
    "params: {tokens_per_prompt_token: 0.5, min_budget: 4, penalty_per_token: 0.05}, "
    "outputs: [scores, length_penalties]}]"
)
# (stage, the section its fingerprint dumps with fingerprint_dump, the fields it leaves out besides the marked ones)
DUMPS = [
    ("ingest", "data", {"prompt_stats", "pass_threshold", "curriculum"}),  # how batches are drawn: no prompt
    ("generate", "generate", set()),
    ("advantage", "advantage", set()),
    ("evaluate", "evaluate", set()),
    ("update", "update", set()),
    ("update", "critic", set()),
    ("shaping", "stages", {"name"}),  # a user stage's name names its table's directory
]


def test_the_placement_fields_are_the_listed_ones():
    sections = {name: cls for name, cls in vars(models).items() if isinstance(cls, type) and name.endswith("Config")}
    marked = {name: set(placement_fields(cls)) for name, cls in sections.items() if placement_fields(cls)}
    assert marked == MARKED


def test_each_pooled_stage_asks_ray_for_what_its_section_sets_naming_those_fields():
    cfg = config(
        "ppo_quickstart", [SHAPING, "score.reward_model={path: /m, gpus_per_actor: 1}", "critic.cpus_per_actor=3"]
    )
    sync_stages(cfg)
    needs = {name: STAGES[name]().actor_needs(cfg) for name in ("ingest", "score", "shaping", "values")}
    sync_stages(config("quickstart"))
    assert needs == {
        "ingest": [ActorNeed(1.0, 0.0, "data.cpus_per_actor", "data.gpus_per_actor")],  # data has no GPUs to set
        "score": [ActorNeed(1.0, 1.0, "score.reward_model.cpus_per_actor", "score.reward_model.gpus_per_actor")],
        "shaping": [ActorNeed(1.0, 0.0, "stages[0].cpus_per_actor", "stages[0].gpus_per_actor")],
        "values": [ActorNeed(3.0, 0.0, "critic.cpus_per_actor", "critic.gpus_per_actor")],
    }


@pytest.mark.parametrize(("stage", "section", "unmarked_but_left_out"), DUMPS, ids=[f"{s}-{c}" for s, c, _ in DUMPS])
def test_a_stage_fingerprint_leaves_out_exactly_the_marked_fields_of_its_section(stage, section, unmarked_but_left_out):
    cfg = config("ppo_quickstart", [SHAPING])
    sync_stages(cfg)
    fingerprint = STAGES[stage]().fingerprint_config
    model = cfg.stages[0] if section == "stages" else getattr(cfg, section)
    left_out = placement_fields(type(model)) | unmarked_but_left_out
    for name, field in type(model).model_fields.items():
        changed = with_field(cfg, section, name, other_value(field.annotation, getattr(model, name)))
        assert (fingerprint(changed) == fingerprint(cfg)) == (name in left_out), f"{section}.{name}"
    sync_stages(config("quickstart"))


def config(pipeline: str, overrides: list[str] = ()) -> PipelineConfig:
    return load_pipeline(ROOT / "pipelines" / f"{pipeline}.yaml", overrides=list(overrides), run_id="placement")


def with_field(cfg: PipelineConfig, section: str, name: str, value: Any) -> PipelineConfig:
    """``cfg`` with one field of ``section`` changed, unvalidated (a value valid alone may break a cross-field rule;
    the fingerprint only reads it)."""
    if section == "stages":
        return cfg.model_copy(update={"stages": [cfg.stages[0].model_copy(update={name: value})]})
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={name: value})})


def other_value(annotation: Any, value: Any) -> Any:
    """A value of ``annotation`` other than ``value``."""
    literals = [arg for arg in _flat(annotation) if not isinstance(arg, type)]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return next((x for x in literals if x != value), value + "_other")
    if isinstance(value, list):
        return [*value, value[0] if value else "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    kinds = [arg for arg in _flat(annotation) if arg is not type(None)]
    if isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel):  # an optional section (generate.environment)
        section = kinds[0]
        return section.model_construct(**{n: other_value(f.annotation, None) for n, f in section.model_fields.items()})
    return {int: 3, float: 0.5, str: "other", list: [0], dict: {"other": 1}}.get(kinds[0], kinds[0])  # None: a literal


def _flat(annotation: Any) -> list[Any]:
    """The types and literal values a (union, Literal, list[...]) annotation admits, origins for generics."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # Placement[T]: T
        return _flat(args[0])
    if origin is typing.Literal:
        return list(args)
    if origin in (typing.Union, type(int | None)):
        return [item for arg in args for item in _flat(arg)]
    return [origin or annotation]
