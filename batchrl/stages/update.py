"""update: advantages -> the next policy, one FSDP2 PPO-clip/GSPO update, saved as an HF checkpoint.

The stage is glue: it resolves local paths (downloading the input policy, the reference policy and the previous
optimizer state when the run lives on object storage; the ranks read the advantages parts in place, local or
s3://, each only the rows it trains on, once the stage has checked each part's sha256 against the advantages
manifest, as shard workers check their inputs), hands an UpdateSpec to the
trainer's launcher (N torch.distributed processes, gloo on CPU / NCCL on GPU), and publishes into
``iter_NNNN/policy/``. With ``update.launcher: ray`` (on a Ray cluster) the ranks are Ray actors, possibly on
other nodes: the spec then names the run directory's own URIs, each actor stages its inputs and uploads its
outputs itself (`batchrl.trainer.ray_launch`), and the stage only lists what they uploaded. Either way:

- the HF checkpoint (config, safetensors, tokenizer): the manifest's ``parts``, what the next iteration's
  generate stage loads;
- ``_trainer_state/``: AdamW moments (sharded DCP files) and ``trainer_state.json`` (global optimizer step),
  which the next iteration's update restores, so the iterations train like one long run;
- ``_logprobs/part-<rank>.parquet``: per sample, the old-policy and reference log-probs the loss used
  (per token, and summed), one part per rank with the samples it computed, listed in the manifest's
  ``extra_parts["logprobs"]``.
Leading underscores keep both out of model downloads (`local_copy` skips them) and out of the engines' way.
The optimizer state is deliberately NOT among the manifest's parts: keep-last-K deletes it later, and the runner
treats a listed part that disappeared as damage (it would redo the update). Its files are recorded with their
sha256 in the manifest's ``trainer_state`` instead, which nothing checks for damage: the next update loads the
state only if every file hashes as recorded (loading unpickles it, see `batchrl.trainer.integrity`), and stops
with a data error, never a silent restart from zero moments, when a state it needs is gone. A state recorded
without checksums (by an earlier batchrl) is a data error too, unless update.allow_unverified_trainer_state.
Reading those records, the errors and the pruning are the trainer's (`batchrl.trainer.state_store`); the stage
calls them with its context.

The reference policy of the KL loss is the run's initial policy (``model.path``). Optimizer states older
than ``update.keep_last_k_optimizer_states`` are deleted when an update starts (never the HF policies):
the state this update resumes from is always kept, so a crash before the manifest is written can redo it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.models import UpdateConfig, fingerprint_dump
from batchrl.pipeline.session import on_cluster
from batchrl.pipeline.shards import verify_parts
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.storage import is_local, join, local_copy, upload_file
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.tracking.progress import ProgressBar, progress
from batchrl.trainer.state_store import TRAINER_STATE_DIR, RecordedState, TrainerStateStore, local_trainer_state

logger = logging.getLogger(__name__)

LOGPROBS_DIR = "_logprobs"


@register
class UpdateStage(Stage):
    name = "update"
    table = "policy"
    schema = None
    inputs = ("advantages", "policy")
    timing_name = "update"

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        if cfg.update.launcher != "ray":  # auto is ray on a cluster only, and ranks on this host ask Ray for nothing
            return []
        return [
            ActorNeed(
                cpus=cfg.update.cpus_per_rank,
                gpus=0.0,
                cpus_field="update.cpus_per_rank",
                gpus_field="update.num_processes",
            )
        ]

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        lora = cfg.update.lora
        return (
            []
            if lora is None or lora.init_from_adapter is None
            else [("update.lora.init_from_adapter", lora.init_from_adapter)]
        )

    def check_inputs(self, cfg: PipelineConfig) -> None:
        # the split beside the engines: the session's check_devices
        check_rank_devices(cfg.update, cluster=on_cluster(cfg))
        check_lora_targets(cfg)

    def check_ready(self, ctx: StageContext) -> None:
        # a state it cannot continue stops the run before its old output is cleared
        _trainer_states(ctx).recorded(iteration=ctx.iteration, policy_in=ctx.policy_in)

    @classmethod
    def close(cls) -> None:
        from batchrl.trainer import shutdown_trainers

        shutdown_trainers()  # resident update ranks (update.trainer_lifetime: run) end with the run

    def prestart(self, cfg: PipelineConfig, *, embedded_ray: bool, rank_devices: str | None) -> None:
        """The resident ranks (update.trainer_lifetime: run, local gloo ranks) started before iteration 0, as the
        first update would start them (`_spec`'s rank count, threads and devices): their imports overlap the
        stages before it. On 2 CPUs they cost ~4 s of CPU each, most of the first update's extra time."""
        if cfg.update.trainer_lifetime != "run" or _launcher(cfg, embedded_ray=embedded_ray) == "ray":
            return
        from batchrl.trainer import prestart_trainers

        u = cfg.update
        prestart_trainers(
            num_processes=rank_count(u, on_ray=False),
            backend=u.backend,
            threads_per_rank=_threads_per_rank(cfg),
            cuda_devices=rank_devices,
        )

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        u = cfg.update
        config = {
            # keep_last_k_optimizer_states is placement, whether any is saved is not; lora only when set, so that
            # the fingerprints of full fine-tuning stay those from before it existed
            "update": fingerprint_dump(u, exclude=frozenset() if u.lora else frozenset({"lora"})),
            "saves_optimizer_state": u.keep_last_k_optimizer_states != 0,
            "seed": cfg.run.seed,
            "dtype": cfg.model.dtype,
            "schedule_iterations": _schedule_iterations(cfg),
            "norm_length": _norm_length(cfg),
            "reference_policy": cfg.model.path if u.kl_loss_coef > 0 else None,
        }
        if cfg.critic is not None:
            config["critic"] = critic_fingerprint(cfg)
        if cfg.run.max_staleness:  # the old log-probs come from an older (behaviour) policy
            config["max_staleness"] = cfg.run.max_staleness
        if u.mini_batch_grain == "sample":  # in it only when set: the fingerprints from before it existed stay
            config["update"].pop("mini_batch_grain")
        if u.lora is not None:  # how the engines get the policy (generate's and evaluate's business), not what it is
            config["update"]["lora"].pop("push")
        return config

    def run(self, ctx: StageContext) -> StageOutput:
        from batchrl.trainer import shutdown_trainers
        from batchrl.trainer.integrity import TrainerStateError

        on_ray = _launcher(ctx.cfg, embedded_ray=ctx.embedded_ray) == "ray"
        resident = ctx.cfg.update.trainer_lifetime == "run" and not on_ray
        if not resident:
            shutdown_trainers()  # ranks left resident by an earlier configuration in this process
        store = _trainer_states(ctx)
        state = store.recorded(iteration=ctx.iteration, policy_in=ctx.policy_in)
        store.log_recorded(state, iteration=ctx.iteration, policy_in=ctx.policy_in)
        store.prune(ctx.iteration)  # after the check: a refused update deletes nothing its redo would need
        try:
            if sum(part.rows for part in ctx.inputs["advantages"].parts) == 0:
                return _carry_policy_forward(ctx, state)
            # The ranks read the parts in place, never whole, so they are checked here, as shard workers check theirs.
            verify_parts(ctx.input_dirs["advantages"], ctx.inputs["advantages"].parts)
            output = _run_on_ray(ctx, state) if on_ray else _run_locally(ctx, state, resident=resident)
            return _with_recomputed_count(output, ctx.inputs["advantages"])
        except TrainerStateError as error:  # refused before anything was loaded from it
            raise store.unusable(state.uri, error.name, error.reason, iteration=ctx.iteration) from None


def _with_recomputed_count(output: StageOutput, advantages: Manifest) -> StageOutput:
    """The update's output, its manifest counting the samples whose old log-probs were recomputed because the
    rollouts had none (logged data without behaviour log-probs): `logprobs_recomputed`."""
    missing = int(advantages.counts.get("logprobs_missing", 0))
    if not missing:
        return output
    stats = dict(output.stats) | {"actor/recomputed_logprobs_samples": float(missing)}
    return dataclasses.replace(output, counts={**output.counts, "logprobs_recomputed": missing}, stats=stats)


def _run_locally(ctx: StageContext, state: RecordedState | None, *, resident: bool) -> StageOutput:
    """The update on local rank processes, its outputs published from a scratch directory into the run directory."""
    from batchrl.trainer import run_update

    with tempfile.TemporaryDirectory(prefix="batchrl-update-") as scratch:
        spec = _local_spec(ctx, scratch, state)
        with progress(None, "update: loading", enabled=ctx.cfg.tracking.progress_bars) as bar:
            show = _progress_display(bar) if bar.drawn else None  # no bar: the ranks write no progress file
            metrics = run_update(spec, timeout_s=ctx.cfg.update.timeout_s, on_progress=show, resident=resident)
            if show is not None:
                show({"phase": "finished"})
        parts = _publish_dir(Path(spec.policy_out), ctx.output_dir, prefix="")
        extra_parts = {"logprobs": _publish_dir(Path(scratch) / "_logprobs", ctx.output_dir, prefix="_logprobs/")}
        state_files = []
        if spec.trainer_state_out is not None:  # recorded apart from the parts: keep-last-K deletes it later
            state_files = _publish_dir(Path(spec.trainer_state_out), ctx.output_dir, prefix=f"{TRAINER_STATE_DIR}/")
            logger.info(
                "saved the optimizer state (%d files, %.1f MB) under %s",
                len(state_files),
                sum(p.num_bytes for p in state_files) / 1e6,
                join(ctx.output_dir, TRAINER_STATE_DIR),
            )
    logger.info("published policy checkpoint (%d files) to %s", len(parts), ctx.output_dir)
    return StageOutput(
        parts=parts, stats={k: float(v) for k, v in metrics.items()}, extra_parts=extra_parts, trainer_state=state_files
    )


def _carry_policy_forward(ctx: StageContext, state: RecordedState | None) -> StageOutput:
    """No advantages rows (DAPO dynamic sampling dropped every group: all rewards equal in each): nothing to train
    on, so this iteration's policy is its input policy, and its optimizer state the input's, so that the next
    update continues exactly as if this one had not happened. The run goes on (a later iteration's samples may
    differ), and `actor/update_skipped` records it. The state is checked before it is copied: the copy's
    checksums are recorded anew, and would vouch for a modified file."""
    from batchrl.trainer.integrity import verify_dir

    logger.warning(
        "iteration %s: the advantages table has no rows (every group was filtered out, e.g. by "
        "advantage.filter_groups when all of a group's rewards are equal); no update, the policy is "
        "carried forward unchanged",
        ctx.iteration,
    )
    with tempfile.TemporaryDirectory(prefix="batchrl-update-") as scratch:
        policy = Path(scratch) / "policy"
        source = local_copy(ctx.policy_in)
        if Path(source).is_dir():
            shutil.copytree(source, policy, ignore=shutil.ignore_patterns("_*", ".*"))
        else:  # a hub id (iteration 0): the checkpoint as transformers loads it
            from transformers import AutoModelForCausalLM, AutoTokenizer

            AutoModelForCausalLM.from_pretrained(source, dtype="auto").save_pretrained(str(policy))
            AutoTokenizer.from_pretrained(source).save_pretrained(str(policy))
        parts = _publish_dir(policy, ctx.output_dir, prefix="")
        state_files = []
        if state is not None:
            source = local_trainer_state(state, scratch)
            if state.sha256 is not None:
                verify_dir(source, state.sha256)
            copied = Path(scratch) / "trainer_state_out"
            shutil.copytree(source, copied)  # _publish_dir consumes its source; `source` may be the run's own
            state_files = _publish_dir(copied, ctx.output_dir, prefix=f"{TRAINER_STATE_DIR}/")
    stats = {"actor/update_skipped": 1.0, "actor/num_optimizer_steps": 0.0, "perf/num_samples": 0.0}
    return StageOutput(parts=parts, stats=stats, extra_parts={"logprobs": []}, trainer_state=state_files)


def _progress_display(bar: ProgressBar) -> Callable[[dict[str, Any]], None]:
    """Turns rank 0's progress records (`batchrl.trainer.progress_file`) into the bar: a spinner labelled with
    the phase while the ranks load and compute log-probs, then optimizer steps done / planned with the latest
    step's pg_loss and grad_norm; the label keeps the last step's numbers once training is over."""
    state = {"steps": "update: steps"}

    def show(record: dict[str, Any]) -> None:
        phase = record.get("phase")
        if phase == "logprobs":
            bar.update(description="update: old/ref log-probs")
        elif phase == "train":
            if "pg_loss" in record and "grad_norm" in record:
                state["steps"] = (
                    f"update: steps  pg_loss {float(record['pg_loss']):.3g}  grad_norm {float(record['grad_norm']):.3g}"
                )
            bar.update(completed=int(record.get("done", 0)), total=record.get("total"), description=state["steps"])
        elif phase == "save":
            bar.update(description="update: saving")
        elif phase == "finished":
            bar.update(description=state["steps"])

    return show


def rank_count(u: UpdateConfig, *, on_ray: bool) -> int:
    """update.num_processes, with auto resolved where the ranks will run (see its description). Why at the update
    and not in the plan: the ranks' count is placement, like the launcher (FSDP2's optimizer state is a sharded
    torch.distributed checkpoint, which a different count reshards on load), so the fingerprint keeps "auto" and
    a run moved to another host resumes without redoing its updates."""
    if u.num_processes != "auto":
        return u.num_processes
    if on_ray:
        import ray

        free = ray.available_resources()
        gpus = int(free.get("GPU", 0)) if u.backend != "gloo" else 0
        return max(1, gpus or int(free.get("CPU", 1) // u.cpus_per_rank))
    from batchrl.trainer.launch import usable_cpus
    from batchrl.trainer.spec import resolve_backend

    if resolve_backend(u.backend) == "nccl":
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, int(usable_cpus() // u.cpus_per_rank))


def _local_ranks(u: UpdateConfig, *, cluster: bool) -> bool:
    """Whether the ranks will be processes on this host (before Ray is up: auto is local off a cluster)."""
    return u.launcher == "local" or (u.launcher == "auto" and not cluster)


def check_rank_devices(u: UpdateConfig, *, cluster: bool) -> None:
    """ConfigError when update.num_processes asks for more ranks on this host than it has GPUs (nccl, local
    launcher): ranks past the last GPU would die with "invalid device ordinal" after generation had run."""
    from batchrl.trainer.spec import resolve_backend

    if u.num_processes == "auto" or not _local_ranks(u, cluster=cluster) or resolve_backend(u.backend) != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count()
    if u.num_processes > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ConfigError(
            f"update.num_processes={u.num_processes} ranks with backend nccl need as many GPUs, and this host has "
            f"{gpus}{shown}; set update.num_processes: auto (one rank per GPU) or at most {gpus}"
        )


def check_lora_targets(cfg: PipelineConfig) -> None:
    """ConfigError naming update.lora.target_modules when a name matches no module of model.path's architecture,
    read from its config alone (the model is built on the meta device), or update.lora.init_from_adapter when a
    local one is no PEFT adapter directory. Checked locally only: validation reads no object storage, and a hub or
    s3 model (or adapter) is checked by PEFT when the ranks load it."""
    lora = cfg.update.lora
    init = None if lora is None else lora.init_from_adapter
    if init is not None and is_local(init) and not (Path(init) / "adapter_config.json").is_file():
        raise ConfigError(
            f"update.lora.init_from_adapter={init!r} holds no adapter_config.json: name a PEFT adapter directory "
            "(a LoRA run's iter_*/policy/adapter)"
        )
    if lora is None or isinstance(lora.target_modules, str) or not Path(cfg.model.path).is_dir():
        return
    from batchrl.trainer.lora import model_module_names, unmatched_targets

    unmatched = unmatched_targets(model_module_names(cfg.model.path), lora.target_modules)
    if unmatched:
        raise ConfigError(
            f"update.lora.target_modules: {unmatched} match no module of {cfg.model.path} (PEFT matches a module "
            "whose name is the given one or ends with '.' + it: q_proj, v_proj, ...); fix the names or use all-linear"
        )


def _launcher(cfg: PipelineConfig, *, embedded_ray: bool) -> str:
    """update.launcher, with auto resolved: ray when this process is connected to a Ray cluster (not the runner's
    embedded local Ray, where local processes are the same machine without the actor overhead), else local."""
    if cfg.update.launcher != "auto":
        return cfg.update.launcher
    import ray

    return "ray" if ray.is_initialized() and not embedded_ray else "local"


def _run_on_ray(ctx: StageContext, state: RecordedState | None) -> StageOutput:
    """The update as Ray actors that read their inputs from and write their outputs to the run directory
    (`batchrl.trainer.ray_launch`); the manifest lists what they uploaded, so nothing is published from here."""
    from batchrl.trainer.ray_launch import run_update_on_ray

    u = ctx.cfg.update
    with tempfile.TemporaryDirectory(prefix="batchrl-update-") as scratch:
        spec = _spec(
            ctx,
            policy_in=ctx.policy_in,
            reference_policy=ctx.cfg.model.path if u.kl_loss_coef > 0 else None,
            behaviour_policy=_behaviour_policy(ctx),
            lora_base=ctx.cfg.model.path if u.lora is not None else None,
            advantages_files=_advantages_files(ctx),
            trainer_state_in=None if state is None else state.uri,
            trainer_state_sha256=None if state is None else state.sha256,
            policy_out=ctx.output_dir,
            out_dir=ctx.output_dir,
            metrics_path=str(Path(scratch) / "metrics.json"),
        )
        ranks = spec.update.num_processes
        with progress(None, f"update: {ranks} rank(s) on Ray", enabled=ctx.cfg.tracking.progress_bars):
            result = run_update_on_ray(spec, timeout_s=u.timeout_s, cpus_per_rank=u.cpus_per_rank)
    parts, extra_parts, state_files = [], {"logprobs": []}, []
    for uploaded in result.uploaded:
        name = uploaded.uri[len(ctx.output_dir.rstrip("/")) + 1 :]
        part = PartInfo(name=name, rows=0, sha256=uploaded.sha256, num_bytes=uploaded.num_bytes)
        if name.startswith(f"{TRAINER_STATE_DIR}/"):  # recorded apart from the parts: keep-last-K deletes it later
            state_files.append(part)
        elif name.startswith("_logprobs/"):
            extra_parts["logprobs"].append(part)
        else:
            parts.append(part)
    logger.info(
        "the update's Ray workers published the policy checkpoint (%d files) and %.1f MB of optimizer state to %s",
        len(parts),
        sum(p.num_bytes for p in state_files) / 1e6,
        ctx.output_dir,
    )
    return StageOutput(
        parts=sorted(parts, key=lambda p: p.name),
        stats=result.metrics,
        extra_parts=extra_parts,
        trainer_state=sorted(state_files, key=lambda p: p.name),
    )


def _advantages_files(ctx: StageContext) -> list[str]:
    """The advantages parts' URIs in the run directory: the ranks read them in place (a rank reads only the rows it
    trains on, so a download of the whole table would be most of the update's I/O)."""
    return [join(ctx.input_dirs["advantages"], p.name) for p in ctx.inputs["advantages"].parts]


def _local_spec(ctx: StageContext, scratch: str, state: RecordedState | None):
    """The UpdateSpec for the local launcher: the policies and the trainer state made local, the advantages read in
    place, every output in `scratch`, published after."""
    from batchrl.trainer.lora import with_local_init_adapter

    u = ctx.cfg.update
    behaviour = _behaviour_policy(ctx)
    spec = _spec(
        ctx,
        policy_in=local_copy(ctx.policy_in),
        reference_policy=local_copy(ctx.cfg.model.path) if u.kl_loss_coef > 0 else None,
        behaviour_policy=None if behaviour is None else local_copy(behaviour),
        lora_base=local_copy(ctx.cfg.model.path) if u.lora is not None else None,
        advantages_files=_advantages_files(ctx),
        trainer_state_in=None if state is None else local_trainer_state(state, scratch),
        trainer_state_sha256=None if state is None else state.sha256,
        policy_out=str(Path(scratch) / "policy"),
        out_dir=scratch,
        metrics_path=str(Path(scratch) / "metrics.json"),
    )
    # update.lora.init_from_adapter on object storage: downloaded into the scratch directory (an s3:// URI is not a
    # directory PEFT can load)
    local_update = with_local_init_adapter(spec.update, policy_in=spec.policy_in, scratch=Path(scratch))
    return dataclasses.replace(spec, update=local_update)


def _spec(
    ctx: StageContext,
    *,
    policy_in: str,
    reference_policy: str | None,
    behaviour_policy: str | None = None,
    lora_base: str | None = None,
    advantages_files: list[str],
    trainer_state_in: str | None,
    trainer_state_sha256: dict[str, str] | None,
    policy_out: str,
    out_dir: str,
    metrics_path: str,
):
    """The UpdateSpec for this iteration with the caller's paths; the trainer state and the log-probs table go
    under `out_dir` (at the names the run directory uses). The update options travel as the validated config, with
    the norm length resolved here: its default is a field of another section (generate.max_new_tokens)."""
    from batchrl.trainer import UpdateSpec

    u, cfg = ctx.cfg.update, ctx.cfg
    keeps_state = u.keep_last_k_optimizer_states != 0
    ranks = rank_count(u, on_ray=_launcher(cfg, embedded_ray=ctx.embedded_ray) == "ray")
    return UpdateSpec(
        update=u.model_copy(update={"loss_agg_norm_length": _norm_length(cfg), "num_processes": ranks}),
        policy_in=policy_in,
        policy_out=policy_out,
        advantages_files=advantages_files,
        metrics_path=metrics_path,
        seed=cfg.run.seed + (ctx.iteration or 0),
        dtype="bfloat16" if cfg.model.dtype == "bfloat16" else "float32",
        num_iterations=_schedule_iterations(cfg) or 1,
        reference_policy=reference_policy,
        behaviour_policy=behaviour_policy,
        lora_base=lora_base,
        trainer_state_in=trainer_state_in,
        trainer_state_sha256=trainer_state_sha256,
        trainer_state_out=join(out_dir, TRAINER_STATE_DIR) if keeps_state else None,
        logprobs_dir=join(out_dir, LOGPROBS_DIR),
        threads_per_rank=_threads_per_rank(cfg),
        cuda_devices=ctx.rank_devices,  # overlapped on one GPU host: the session's split
        critic=cfg.critic,
        train_actor=cfg.critic is None or (ctx.iteration or 0) >= cfg.critic.warmup_iterations,
        critic_head_seed=cfg.run.seed,
    )


def _threads_per_rank(cfg: PipelineConfig) -> int | None:
    """Each rank's threads when the update runs beside the next iteration's stages (run.max_staleness), else None
    (the launcher's share of the host)."""
    return max(1, int(cfg.update.cpus_per_rank)) if cfg.run.max_staleness else None


def critic_fingerprint(cfg: PipelineConfig) -> dict[str, Any]:
    """What of the critic section determines the critic an update trains (its values actors do not)."""
    return fingerprint_dump(cfg.critic) | {"seed": cfg.run.seed}


def _behaviour_policy(ctx: StageContext) -> str | None:
    """The policy that generated this iteration's rollouts when it is older than the input policy (run.max_staleness
    > 0 past the first iterations) and the old log-probs are recomputed: they are recomputed with it."""
    if ctx.cfg.update.old_logprobs != "recompute" or ctx.behaviour_policy in (None, ctx.policy_in):
        return None
    return ctx.behaviour_policy


def _schedule_iterations(cfg: PipelineConfig) -> int | None:
    """run.iterations when the lr schedule's length depends on it, else None: extending a run with a constant
    lr (or a fixed lr_total_steps) must not invalidate the iterations already done."""
    u = cfg.update
    if u.lr_total_steps is None and (u.lr_schedule == "cosine" or u.lr_warmup_ratio > 0):
        return cfg.run.iterations
    return None


def _norm_length(cfg: PipelineConfig) -> int | None:
    if cfg.update.loss_agg_mode != "seq-mean-token-sum-norm":
        return None
    return cfg.update.loss_agg_norm_length or cfg.generate.max_new_tokens


def _trainer_states(ctx: StageContext) -> TrainerStateStore:
    """The run's optimizer states (which one this update continues, pruning), read with the run's config."""
    return TrainerStateStore(ctx.cfg, ctx.layout)


def _publish_dir(local_dir: Path, output_dir: str, *, prefix: str) -> list[PartInfo]:
    """Copies every file under local_dir to output_dir/prefix...; returns them as manifest parts."""
    parts = []
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        relative = prefix + path.relative_to(local_dir).as_posix()
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        upload_file(str(path), join(output_dir, relative))
        parts.append(PartInfo(name=relative, rows=0, sha256=digest.hexdigest(), num_bytes=path.stat().st_size))
    shutil.rmtree(local_dir, ignore_errors=True)
    return parts
