"""The score section: the weighted reward terms and the optional reward model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from batchrl.config.base import ActorResources, Placement, _Strict


class RewardTerm(_Strict):
    reward: str = Field(
        ...,
        description="Registry name (gsm8k, gsm8k_flexible, math, exact_match, format_hash, "
        "format_boxed, format_think, overlong_penalty, truncation_penalty; see batchrl.rewards) or "
        "'package.module:function'.",
    )
    weight: float = Field(1.0, description="Weight of this term in the total reward.")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Component name, in the scores "
        "table's reward_names and the metric critic/rewards/<name>/mean. Default: the registry "
        "name, or the function name of a module:function reference. Unique within score.rewards.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the reward on "
        "every call, e.g. {max_length: 1024, buffer_length: 256} for overlong_penalty. Each "
        "key must be a named parameter of the function and not a row field's name.",
    )

    @property
    def component_name(self) -> str:
        return self.name or self.reward.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


class RewardModelConfig(ActorResources):
    """A reward model each score actor loads once. Its actors (num_actors, cpus_per_actor, gpus_per_actor) are in the
    score and evaluate fingerprints, which dump the score section whole, unlike every other section's."""

    path: str = Field(
        ...,
        description="Reward model: a local directory or hub id of an HF "
        "AutoModelForSequenceClassification checkpoint with num_labels=1.",
    )
    tokenizer: str | None = Field(None, description="Reward model tokenizer; defaults to reward_model.path.")
    weight: float = Field(1.0, description="Weight of the reward model's score (component 'reward_model').")
    input_format: Literal["concat", "chat"] = Field(
        "concat",
        description="concat: score prompt_text + response; "
        "chat: the reward model's chat template over the prompt "
        "messages and the response as the assistant turn.",
    )
    batch_size: int = Field(8, ge=1, description="Texts per reward-model forward pass.")
    max_length: int | None = Field(
        None,
        ge=1,
        description="Longer texts keep their last max_length tokens "
        "(counted); default the model's max_position_embeddings.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Reward model weights dtype.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the reward model checkpoint.")


class ScoreConfig(_Strict):
    rewards: list[RewardTerm] = Field(
        default_factory=list,
        description="Weighted reward terms applied to every "
        "sample; each is a component of the reward. Empty = the default reward of each "
        "row's data_source, or, when reward_model is set, the reward model alone.",
    )
    reward_by_data_source: dict[str, str] = Field(
        default_factory=dict,
        description="data_source -> reward name or module:function, overriding the built-in defaults.",
    )
    failure_reward: float = Field(
        0.0,
        description="Reward given to a sample whose reward function failed "
        "(raised, returned None or NaN, timed out); the failure is recorded and counted.",
    )
    timeout_s: float | None = Field(
        10.0,
        gt=0,
        description="Deadline of each rule-reward call, in seconds. Rule "
        "rewards then run in a child process of each score actor, which is killed and "
        "restarted when a call overruns (that sample fails with '<term> timed out'). "
        "null = call rewards in the actor itself, without a deadline (trusted rewards).",
    )
    reward_model: RewardModelConfig | None = Field(
        None,
        description="A sequence-classification reward model whose score is one more component, named 'reward_model'.",
    )
    num_actors: Placement[int | None] = Field(
        None,
        ge=1,
        description="Actors scoring rule rewards, one CPU each (with a reward model: score.reward_model.num_actors); "
        "null: one per CPU of the Ray cluster.",
    )
    reward_processes: Placement[int] = Field(
        1,
        ge=1,
        description="Reward processes per score actor (with timeout_s set), each scoring small chunks of a shard's "
        "samples in turn. More than 1 for rewards that mostly wait (code_tests: a hanging program waits out its "
        "timeout in one process while the others go on); CPU-bound rewards gain nothing beyond the actor's CPUs. "
        "Placement: it changes how fast, not what, the stage scores.",
    )

    @model_validator(mode="after")
    def _component_names_are_unique(self) -> ScoreConfig:
        names = [t.component_name for t in self.rewards] + (["reward_model"] if self.reward_model else [])
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"score.rewards: component names {duplicates} are not unique; give terms a distinct "
                "`name:` ('reward_model' is the reward model's)"
            )
        return self
