"""Typed pipeline configuration: the whole pipeline (PipelineConfig) and its user stages; the sections live in the
modules beside this one (run, rollout, reward, training; base: what they share) and are importable from here.

Every field is documented once, in ``Field(description=...)``; ``batchrl validate`` and the docs
read these descriptions. Models forbid unknown keys so a typo is an error that names the field, not a
silently ignored setting. Validators check values only: they never touch storage, the network or a GPU.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batchrl.config.base import ActorResources, Placement, _Strict, fingerprint_dump, placement_fields
from batchrl.config.judge import JudgeConfig, judge_sharing_problem, judge_term_problem
from batchrl.config.reward import RewardModelConfig, RewardTerm, ScoreConfig
from batchrl.config.rollout import DataConfig, EvaluateConfig, GenerateConfig
from batchrl.config.run import ModelConfig, RayConfig, RunConfig, SetupStep, TrackingConfig
from batchrl.config.training import AdvantageConfig, CriticConfig, UpdateConfig
from batchrl.references import is_reference

__all__ = [
    "RESERVED_STAGE_NAMES",
    "ActorResources",
    "AdvantageConfig",
    "CriticConfig",
    "DataConfig",
    "EvaluateConfig",
    "GenerateConfig",
    "InsertionPoint",
    "JudgeConfig",
    "ModelConfig",
    "PipelineConfig",
    "Placement",
    "RayConfig",
    "RewardModelConfig",
    "RewardTerm",
    "RunConfig",
    "ScoreConfig",
    "SetupStep",
    "TrackingConfig",
    "UpdateConfig",
    "UserStageConfig",
    "fingerprint_dump",
    "placement_fields",
]

RESERVED_STAGE_NAMES = frozenset(
    {"ingest", "generate", "judge", "score", "values", "advantage", "update", "evaluate"}
    | {"prompts", "prompt_rejects", "rollouts", "judgements", "scores", "advantages", "evaluations", "policy", "critic"}
)


# The built-in stages a user stage may follow: the one list of them. What each one's table is comes from the stage
# registry (batchrl.stages.user), which config, a layer below the stages, cannot import.
InsertionPoint = Literal["generate", "score", "advantage"]


class UserStageConfig(ActorResources):
    """One user-defined stage: a function over one shard's table, inserted after a built-in stage."""

    name: str = Field(
        ...,
        pattern=r"^[a-z][a-z0-9_]*$",
        description="Stage name (lower case, digits, _): in the plan, `--from-stage`, metrics (stage/<name>/...) and "
        "its table's directory, <iteration>/<name>/.",
    )
    num_actors: Placement[int | None] = Field(
        None,
        ge=1,
        description="Actors of the stage's pool, each building its Class once; null: as many as the Ray cluster's "
        "CPUs (and GPUs, with gpus_per_actor) hold at cpus_per_actor (gpus_per_actor) each.",
    )
    after: InsertionPoint = Field(
        ...,
        description="The built-in stage it follows: it reads that stage's table (rollouts, scores, advantages) and "
        "the next stage reads its table instead. Stages with the same `after` run in the order listed, each "
        "reading the one before.",
    )
    call: str = Field(
        ...,
        description="'package.module:function', called once per shard as function(table, **params) with the "
        "shard's pyarrow.Table and returning a table; or 'package.module:Class', built once per actor as "
        "Class(**params) (load models there) and called as instance(table). The module must be importable where "
        "the stage's actors run. Its source file is part of the stage's fingerprint: editing it re-runs the "
        "stage and everything after it.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the call (see call). `batchrl validate`, `plan` and `run` import the "
        "module and check them against the function's (or constructor's) signature before any work: an unknown "
        "name (unless it takes **kwargs) or a missing required one is exit 2 naming stages[i].params.<name>.",
    )
    outputs: list[str] = Field(
        ...,
        min_length=1,
        description="The columns it adds or changes. Every other column must come out as it went in, with as "
        "many rows in the same order; a shard that breaks this fails the run (exit 3) naming the stage and "
        "the column.",
    )

    @field_validator("call")
    @classmethod
    def _check_call(cls, call: str) -> str:
        if not is_reference(call):
            raise ValueError(f"{call!r} is not a 'package.module:function' (or 'package.module:Class') reference")
        return call

    @field_validator("outputs")
    @classmethod
    def _check_outputs(cls, outputs: list[str]) -> list[str]:
        repeated = sorted({c for c in outputs if outputs.count(c) > 1})
        if repeated or any(not c for c in outputs):
            raise ValueError(f"outputs must be distinct non-empty column names (repeated: {repeated})")
        return outputs


class PipelineConfig(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Pipeline name (default run id).")
    profiles: list[str] = Field(
        default_factory=list,
        description="Profiles merged under this file, e.g. engine/vllm_cpu: engine/vllm_cpu.yaml from the first "
        "conf dir holding it ($BATCHRL_CONF_DIR, conf/ beside this file or beside its directory, ./conf), else the "
        "one batchrl ships (batchrl/conf/).",
    )
    setup: dict[str, SetupStep] = Field(
        default_factory=dict,
        description="Functions `batchrl run` calls before the "
        "run, by name: {toy_assets: {call: batchrl_toy:setup_toy_assets, arguments: "
        "{...}}}. A name is letters, digits, _ and -, so that --set "
        "setup.<name>.arguments.<key>=value reaches it.",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="Run directory, seed and iterations.")
    stages: list[UserStageConfig] = Field(
        default_factory=list,
        description="User-defined stages, each a function over one shard's table inserted after generate, score "
        "or advantage: materialised as its own table with a manifest, sharded over Ray actors, resumed per shard, "
        "fingerprinted like a built-in stage (see docs/ARCHITECTURE.md, the stage contract).",
    )
    model: ModelConfig = Field(..., description="Initial policy and tokenizer.")
    data: DataConfig = Field(..., description="Prompt data.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Rollout generation.")
    judge: JudgeConfig | None = Field(
        None,
        description="An LLM judge of every response (the judge stage, between generate and score); its verdicts are "
        "the score.rewards term {reward: judge}. None = no judge.",
    )
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Reward scoring.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimation.")
    update: UpdateConfig = Field(default_factory=UpdateConfig, description="Policy update (FSDP2).")
    critic: CriticConfig | None = Field(
        None,
        description="PPO's value model (advantage.estimator: gae): the values stage computes its per-token values "
        "of each rollout, and it trains in the update's ranks after the actor. None = no critic.",
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray (embedded or cluster).")
    evaluate: EvaluateConfig | None = Field(
        None,
        description="Held-out evaluation before training and after "
        "iterations (val-core/* metrics); None = no evaluation.",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Metric loggers (TensorBoard, MLflow, W&B) and progress bars."
    )

    @field_validator("setup")
    @classmethod
    def _setup_names_are_plain(cls, setup: dict[str, SetupStep]) -> dict[str, SetupStep]:
        for name in setup:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(
                    f"step name {name!r} must be letters, digits, _ and - (it is part of the field "
                    f"names setup.<name>.call and setup.<name>.arguments)"
                )
        return setup

    @model_validator(mode="after")
    def _check_cross_fields(self) -> PipelineConfig:
        n = self.generate.num_samples_per_prompt
        if self.advantage.passk_k is not None and self.advantage.passk_k > n:
            raise ValueError(
                f"advantage.passk_k={self.advantage.passk_k} must be <= generate.num_samples_per_prompt={n}"
            )
        if (self.advantage.estimator == "gae") != (self.critic is not None):
            raise ValueError(
                "advantage.estimator=gae needs the critic section (critic: {} for the defaults)"
                if self.critic is None
                else f"the critic section is used by advantage.estimator=gae only, not {self.advantage.estimator}; "
                "set the estimator to gae or remove critic"
            )
        if self.update.lora is not None and self.critic is not None:
            raise ValueError(
                "update.lora trains the policy's adapter only; a critic (advantage.estimator=gae) with LoRA is not "
                "supported yet: remove update.lora, or use a critic-free estimator (grpo, rloo, ...)"
            )
        if self.advantage.estimator not in ("reinforce_pp_baseline", "gae") and n < 2:
            raise ValueError(
                f"generate.num_samples_per_prompt={n} must be >= 2 for group-relative advantages "
                f"(advantage.estimator={self.advantage.estimator}); set it to 2 or more"
            )
        if self.generate.top_k == 0 or self.generate.top_k < -1:
            raise ValueError(f"generate.top_k={self.generate.top_k} must be -1 (disabled) or >= 1")
        names = [stage.name for stage in self.stages]
        for index, name in enumerate(names):
            if name in RESERVED_STAGE_NAMES:
                raise ValueError(
                    f"stages[{index}].name={name!r} is a built-in stage or table name; pick another "
                    f"(reserved: {sorted(RESERVED_STAGE_NAMES)})"
                )
            if name in names[:index]:
                raise ValueError(f"stages[{index}].name={name!r} is used twice; each user stage needs its own name")
        return self

    @model_validator(mode="after")
    def _check_lora_push(self) -> PipelineConfig:
        """update.lora.push: adapter serves through vLLM's LoRA support, which the hf engine lacks and vLLM's level-2
        sleep breaks: it drops the base weights, and reloading them into an engine with LoRA enabled fails (KeyError:
        LoRA's wrappers move each parameter under base_layer, vllm#39934, open)."""
        if self.update.lora is None or self.update.lora.push != "adapter":
            return self
        if self.generate.engine == "hf":
            raise ValueError(
                "update.lora.push=adapter needs vLLM's LoRA serving, and generate.engine is hf: set generate.engine "
                "vllm (or auto), or update.lora.push: merged"
            )
        if self.generate.engine_lifetime == "sleep":
            raise ValueError(
                "update.lora.push=adapter with generate.engine_lifetime=sleep: waking from vLLM's level-2 sleep "
                "with LoRA enabled crashes the engine (vllm#39934); set generate.engine_lifetime: run or stage, or "
                "update.lora.push: merged"
            )
        return self

    @model_validator(mode="after")
    def _check_data_sources(self) -> PipelineConfig:
        if self.data.sources is not None and self.run.epochs is not None:
            raise ValueError(
                "run.epochs counts passes over one prompt table; with data.sources each source has its own epochs: "
                "set run.iterations instead (and run.epochs: null)"
            )
        return self

    @model_validator(mode="after")
    def _check_curriculum(self) -> PipelineConfig:
        # with overlap, iteration i's rollouts start before iteration i-1's prompt_stats exist
        if self.data.curriculum is not None and self.run.max_staleness:
            raise ValueError(
                f"data.curriculum with run.max_staleness={self.run.max_staleness}: iteration i's batch reads "
                "iteration i-1's prompt_stats, which the overlap has not made yet when i's rollouts start; set "
                "run.max_staleness: 0"
            )
        return self

    @model_validator(mode="after")
    def _check_source_fields(self) -> PipelineConfig:
        """A source's own rewards and eval set against the sections they need (data.sources' rewards, eval_files)."""
        for source in self.data.sources or []:
            field = f"data.sources[{source.name}]"
            for index, term in enumerate(source.rewards or []):
                problem = None
                if term.component_name == "reward_model" and self.score.reward_model is not None:
                    problem = "is named 'reward_model', the reward model's component; give the term another `name:`"
                elif term.reward == "judge" and self.judge is None:
                    problem = "has reward: judge but there is no judge section to make its verdicts"
                elif term.reward == "environment" and self.generate.environment is None:
                    problem = "has reward: environment, which reads generate.environment's rewards, but it is not set"
                if problem:
                    raise ValueError(f"{field}.rewards[{index}] {problem}")
            if source.eval_files and self.evaluate is None:
                raise ValueError(
                    f"{field}.eval_files needs an evaluate: section (its greedy, num_samples, ... apply to every "
                    "held-out prompt); add `evaluate: {}` for the defaults, or remove eval_files"
                )
        if self.evaluate is not None and not self.evaluate.files and not self.eval_files_by_source():
            raise ValueError(
                "evaluate.files is empty and no data.sources entry has eval_files: list the held-out prompt files in "
                "one of them, or remove the evaluate: section"
            )
        return self

    def eval_files_by_source(self) -> dict[str, list[str]]:
        """data.sources' eval_files by source name, in the sources' order (empty when none has any)."""
        return {s.name: list(s.eval_files) for s in self.data.sources or [] if s.eval_files}

    @model_validator(mode="after")
    def _check_judge(self) -> PipelineConfig:
        # a source's judge term reads the verdicts too (without a judge section, _check_source_fields names it)
        source_terms = [t for s in self.data.sources or [] for t in s.rewards or []] if self.judge else []
        problem = judge_term_problem(self.judge, terms=[*self.score.rewards, *source_terms])
        if problem is None and self.judge is not None:
            problem = judge_sharing_problem(self.judge, generate=self.generate, run=self.run, update=self.update)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_environment_term(self) -> PipelineConfig:
        uses = [i for i, t in enumerate(self.score.rewards) if t.reward == "environment"]
        if uses and self.generate.environment is None:  # every sample would fail the term
            raise ValueError(
                f"score.rewards[{uses[0]}] has reward: environment, which reads the reward generate.environment "
                "gives, but generate.environment is not set"
            )
        return self

    @property
    def run_id(self) -> str:
        return self.run.id or self.name
