"""The run's own sections: where it lives and how it counts (run), the initial policy (model), its setup steps, Ray,
and the metric loggers (tracking)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batchrl.config.base import _Strict
from batchrl.references import is_reference


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
