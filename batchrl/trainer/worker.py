"""One torch.distributed rank of the FSDP2 policy update: `python -m batchrl.trainer.worker SPEC.json`.

Why a separate process per rank (started by `launch.run_update`, or as a Ray actor by `ray_launch`): FSDP needs one
process per device, and a crashed or NaN update must not take the pipeline driver down with it.

This module is the rank's lifecycle: read the spec, set up (`fsdp`), build or reuse the model and optimizer,
run one update, save, report. What one update does (PPO-clip or GSPO, as in GRPO):
1. Every rank reads the small columns of the advantages table (`index`: keys, lengths, advantages), sorted by
   (prompt_id, sample_idx), so it can compute the same batching plan for every rank (`batching`) without talking;
   the list columns are checked in streamed passes shared out among the ranks, and every rank raises the same
   error, before anything is loaded.
2. Pre-update log-probs, before any step, a mini-batch at a time (`logprobs`); each rank reads only the rows of
   its own micro-batches (`rows`), from local paths or object storage, in place.
3. The optimizer steps, epoch by epoch and mini-batch by mini-batch (`training`), reading each mini-batch's rows
   when it trains.
4. The optimizer state (sharded, DCP) and the HF checkpoint are written (`checkpoint`); rank 0 writes the metrics
   last.

Resident mode (`python -m batchrl.trainer.worker --serve`, started by `launch.run_update(..., resident=True)`):
the rank stays alive and runs one update per spec path read from stdin, so the imports, the process group and,
when the next update continues from exactly what this one saved, the sharded model, optimizer and tokenizer are
reused (`Resident`). "Exactly" is checked by content, not by path: the pipeline publishes policy_out and
trainer_state_out to the run directory and hands the copies to the next update, so the rank records the
sha256 of every file it saved and reuses its memory only when the next inputs hash the same. The in-memory
model is then the saved float32 policy and the optimizer what DCP saved, so a resident update computes what a
fresh process would, bit for bit (tests/stages/test_trainer_resident.py).

Before anything is loaded from `trainer_state_in` (DCP unpickles it), its files are hashed (the same hashing, shared
by the ranks) and checked against the sha256 its writer recorded, `spec.trainer_state_sha256` (`integrity`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import hashlib
import logging
import os
import select
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from batchrl.trainer.checkpoint import (
    TRAINER_STATE_FILE,
    load_trainer_state,
    save_policy,
    save_trainer_state,
    write_json_atomic,
)
from batchrl.trainer.critic import TOKEN_COLUMNS, update_critic
from batchrl.trainer.forward import check_attention
from batchrl.trainer.fsdp import (
    Dist,
    close_process_group,
    import_distributed_modules,
    init_distributed,
    load_model,
    set_dropout_free_mode,
    shard_model,
)
from batchrl.trainer.index import (
    ListScan,
    SampleIndex,
    check_advantages,
    check_lists,
    check_token_ids,
    read_index,
    scan_part,
)
from batchrl.trainer.integrity import TrainerStateError, check_digests, write_error
from batchrl.trainer.logprobs import UpdateInputs, pre_update_pass, recomputes_old, uses_rollout_logprobs
from batchrl.trainer.lora import build_lora_model, save_lora_policy, set_adapter_dropout
from batchrl.trainer.progress_file import ProgressWriter
from batchrl.trainer.rows import RowReader, read_over_share
from batchrl.trainer.spec import UpdateSpec
from batchrl.trainer.training import new_optimizer, summarize, train

logger = logging.getLogger(__name__)

# Spec fields that may change from one update to the next while a resident rank keeps its model and optimizer:
# where to read and write, which data, the seed. Any other difference (an update option, the dtype, the
# reference, ...) rebuilds them from disk, as a fresh process would.
PER_UPDATE_FIELDS = frozenset(
    {
        "policy_in",
        "policy_out",
        "behaviour_policy",
        "advantages_files",
        "metrics_path",
        "seed",
        "trainer_state_in",
        "trainer_state_sha256",
        "trainer_state_out",
        "logprobs_dir",
        "progress_path",
    }
)


@dataclass
class Resident:
    """What a resident rank keeps after an update, and what it is an exact copy of.

    `policy_files` / `state_files`: sha256 per relative path of the policy and trainer state it saved (None:
    no trainer state saved). The next update may reuse the memory only if its inputs hash the same.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    global_step: int
    settings: dict
    policy_files: dict[str, str]
    state_files: dict[str, str] | None


def spec_settings(spec: UpdateSpec) -> dict:
    """The spec minus PER_UPDATE_FIELDS: what must be equal for a resident rank to reuse its model/optimizer.
    The update options compare by value, whichever of them the user spelled out."""
    settings = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in PER_UPDATE_FIELDS}
    return settings | {"update": spec.update.model_dump()}


def checkpoint_files(root: str) -> list[str] | None:
    """Relative paths of the files under `root`, sorted; entries whose top-level name starts with "_" or "." are
    not part of a checkpoint (the run's manifest, _trainer_state, _logprobs, a cache's .complete marker).
    None when `root` is not a local directory (a hub id)."""
    base = Path(root)
    if not base.is_dir():
        return None
    return sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*")
        if p.is_file() and not p.relative_to(base).parts[0].startswith(("_", "."))
    )


def file_digests(root: str, *, ctx: Dist) -> dict[str, str] | None:
    """{relative path: sha256} of the checkpoint under `root`, computed by all ranks (each hashes every
    world_size-th file) and identical on every rank. A collective: every rank must call it."""
    names = checkpoint_files(root)
    if names is None:
        return None
    mine = {}
    for name in names[ctx.rank :: ctx.world_size]:
        with open(Path(root) / name, "rb") as f:
            mine[name] = hashlib.file_digest(f, "sha256").hexdigest()
    gathered: list[dict[str, str] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {name: digest for part in gathered for name, digest in part.items()}


def verified_trainer_state(spec: UpdateSpec, *, ctx: Dist) -> dict[str, str] | None:
    """The digests of spec.trainer_state_in's files (None without one), checked against spec.trainer_state_sha256
    (when given) before anything is loaded from them: DCP unpickles them. A collective; a mismatch raises
    TrainerStateError on every rank (they compare the same gathered digests), and rank 0 reports it to the
    local launcher."""
    if spec.trainer_state_in is None:
        return None
    digests = file_digests(spec.trainer_state_in, ctx=ctx) or {}
    if spec.trainer_state_sha256 is not None:
        try:
            check_digests(spec.trainer_state_sha256, digests)
        except TrainerStateError as error:
            if ctx.rank == 0:
                write_error(spec.metrics_path, error)
            raise
    return digests


def can_reuse(kept: Resident | None, spec: UpdateSpec, *, ctx: Dist, state_files: dict[str, str] | None) -> bool:
    """True when `spec` continues from exactly what `kept` holds: same settings, its policy_in has the bytes of the
    policy `kept` saved, and its trainer state (`state_files`: the digests of trainer_state_in's files, if any)
    those of the trainer state `kept` saved.

    Every branch depends on values that are equal on all ranks, so all ranks take the same collectives."""
    if kept is None or spec_settings(spec) != kept.settings:
        return False
    if spec.trainer_state_in is not None and kept.state_files is None:
        return False
    if file_digests(spec.policy_in, ctx=ctx) != kept.policy_files:
        return False
    return spec.trainer_state_in is None or state_files == kept.state_files


def build_trainer(spec: UpdateSpec, *, ctx: Dist) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, int]:
    """(model, optimizer, tokenizer, global step) from spec.policy_in and spec.trainer_state_in, on disk."""
    from transformers import AutoTokenizer

    if spec.update.lora is not None:  # the base of model.path with the adapter of policy_in (see `lora`)
        model = build_lora_model(
            policy_in=spec.policy_in,
            lora_base=spec.lora_base,
            update=spec.update,
            gradient_checkpointing=spec.update.gradient_checkpointing,
        )
    else:
        model = load_model(spec.policy_in, gradient_checkpointing=spec.update.gradient_checkpointing)
    tokenizer = AutoTokenizer.from_pretrained(spec.policy_in)
    shard_model(model, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=spec.update.cpu_offload)
    set_dropout_free_mode(model)
    # Built before any forward: only then does model.parameters() yield the sharded DTensors for every module.
    optimizer = new_optimizer(model, spec)
    start_step = 0
    if has_actor_state(spec):
        start_step = load_trainer_state(model, optimizer, in_dir=spec.trainer_state_in)
    return model, optimizer, tokenizer, start_step


def has_actor_state(spec: UpdateSpec) -> bool:
    """Whether spec.trainer_state_in holds the actor's optimizer state: a critic warm-up saves only the critic's
    (the actor took no step), and the actor then starts from fresh moments, as it would have without a warm-up."""
    return spec.trainer_state_in is not None and (Path(spec.trainer_state_in) / TRAINER_STATE_FILE).is_file()


def reuse_trainer(kept: Resident, spec: UpdateSpec) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, int]:
    """What `kept` holds, as build_trainer would load it: without a trainer_state_in a fresh process starts Adam
    from zero moments at step 0, so the optimizer is replaced by a new one."""
    if has_actor_state(spec):
        return kept.model, kept.optimizer, kept.tokenizer, kept.global_step
    kept.model.reshard()  # the new optimizer must hold the sharded parameters, as in build_trainer
    return kept.model, new_optimizer(kept.model, spec), kept.tokenizer, 0


def run(spec: UpdateSpec) -> dict[str, float] | None:
    """The whole update on this rank, in a fresh process; returns the metrics on rank 0, None elsewhere."""
    return update(spec, ctx=init_distributed(spec))[0]


def update(
    spec: UpdateSpec, *, ctx: Dist, kept: Resident | None = None, keep: bool = False
) -> tuple[dict[str, float] | None, Resident | None]:
    """One update on this rank: (the metrics on rank 0 / None elsewhere, what to keep for the next update).

    `kept`: what the previous update of this process left (reused if `can_reuse`, else freed and rebuilt).
    `keep`: return a Resident (costs hashing the saved files); else None.
    """
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    index, scans = checked_index(spec, ctx=ctx)
    state_files = verified_trainer_state(spec, ctx=ctx)
    reused = can_reuse(kept, spec, ctx=ctx, state_files=state_files)
    if reused:
        model, optimizer, tokenizer, start_step = reuse_trainer(kept, spec)
    else:
        kept = None  # free the previous model and optimizer before loading the next
        gc.collect()
        model, optimizer, tokenizer, start_step = build_trainer(spec, ctx=ctx)
    kept = None
    check_token_ids(scans, vocab_size=model.get_input_embeddings().num_embeddings)
    missing_logprobs = sum(scan.missing_logprobs for scan in scans)
    check_attention(model, share_prompt=spec.update.share_prompt)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reader = RowReader(
        index,
        with_rollout_logprobs=uses_rollout_logprobs(spec) and spec.train_actor,
        token_columns=TOKEN_COLUMNS if spec.critic is not None else (),
    )
    load_time = time.perf_counter() - start

    progress = ProgressWriter(spec.progress_path if ctx.rank == 0 else None)
    logprob_start = time.perf_counter()
    step_metrics, global_step, train_start = [], start_step, logprob_start
    if spec.train_actor:  # else a critic warm-up: the policy is its input
        recompute_old = recomputes_old(spec, missing_rollout_logprobs=missing_logprobs)
        step_metrics, global_step, train_start = actor_steps(
            model,
            optimizer,
            index,
            reader,
            spec=spec,
            ctx=ctx,
            pad_token_id=pad_token_id,
            start_step=start_step,
            recompute_old=recompute_old,
            progress=progress,
        )
    train_time = time.perf_counter() - train_start
    progress.write({"phase": "save"})

    save_start = time.perf_counter()
    if spec.trainer_state_out is not None and (spec.train_actor or has_actor_state(spec)):
        save_trainer_state(model, optimizer, out_dir=spec.trainer_state_out, global_step=global_step, rank=ctx.rank)
    if spec.update.lora is not None:
        save_lora_policy(model, tokenizer, policy_out=spec.policy_out, lora_base=spec.lora_base, rank=ctx.rank)
    else:
        save_policy(model, tokenizer, policy_out=spec.policy_out, rank=ctx.rank)
    save_time = time.perf_counter() - save_start
    critic_metrics = {}
    if spec.critic is not None:
        progress.write({"phase": "critic"})
        critic_start = time.perf_counter()
        critic_metrics = update_critic(
            spec, ctx=ctx, index=index, reader=reader, tokenizer=tokenizer, pad_token_id=pad_token_id
        )
        critic_metrics["perf/critic_time_s"] = time.perf_counter() - critic_start  # its load, steps and save
    progress.close()
    if keep:
        optimizer.zero_grad(set_to_none=True)  # the next step zeroes them anyway; free the memory meanwhile
        kept = Resident(
            model=model,
            optimizer=optimizer,
            tokenizer=tokenizer,
            global_step=global_step,
            settings=spec_settings(spec),
            policy_files=file_digests(spec.policy_out, ctx=ctx),
            state_files=None if spec.trainer_state_out is None else file_digests(spec.trainer_state_out, ctx=ctx),
        )
    timings = {
        "perf/update_time_s": save_start - logprob_start,
        "perf/logprob_time_s": train_start - logprob_start,
        "perf/train_time_s": train_time,
        "perf/load_time_s": load_time,
        "perf/save_time_s": save_time,
    }
    metrics = update_metrics(step_metrics, spec=spec, index=index, global_step=global_step, timings=timings)
    metrics |= critic_metrics | {
        "actor/trainer_reused": float(reused),
        "perf/read_over_share": read_over_share(reader, ctx=ctx),
    }
    return (metrics if ctx.rank == 0 else None), kept


def actor_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    index: SampleIndex,
    reader: RowReader,
    *,
    spec: UpdateSpec,
    ctx: Dist,
    pad_token_id: int,
    start_step: int,
    recompute_old: bool,
    progress: ProgressWriter,
) -> tuple[list[dict[str, float]], int, float]:
    """The actor's part of an update: the pre-update log-probs, spilled to this rank's scratch directory, then the
    optimizer steps over them. Returns (each step's metrics, the global step after the last, when the steps began)."""
    progress.write({"phase": "logprobs"})
    set_adapter_dropout(model, active=False)  # update.lora.dropout: in the optimizer steps only
    with tempfile.TemporaryDirectory(prefix=f"batchrl-update-rank{ctx.rank}-") as scratch:
        spilled = pre_update_pass(
            model,
            index,
            reader,
            spec=spec,
            ctx=ctx,
            pad_token_id=pad_token_id,
            scratch_dir=scratch,
            recompute_old=recompute_old,
        )
        train_start = time.perf_counter()
        set_adapter_dropout(model, active=True)
        try:
            step_metrics, global_step = train(
                model,
                optimizer,
                UpdateInputs(index=index, reader=reader, spilled=spilled, spec=spec),
                spec=spec,
                ctx=ctx,
                pad_token_id=pad_token_id,
                start_step=start_step,
                progress=progress,
            )
        finally:
            spilled.close()
            set_adapter_dropout(model, active=False)
    return step_metrics, global_step, train_start


def update_metrics(
    step_metrics: list[dict[str, float]],
    *,
    spec: UpdateSpec,
    index: SampleIndex,
    global_step: int,
    timings: dict[str, float],
) -> dict[str, float]:
    """The actor's metrics of an update (a critic warm-up's: that it took no step), its sizes and ``timings``."""
    if spec.train_actor:
        metrics = summarize(step_metrics, spec=spec, global_step=global_step)
    else:  # critic warm-up: the policy is its input
        metrics = {"actor/warmup": 1.0, "actor/num_optimizer_steps": 0.0, "perf/real_tokens": 0.0}
    return metrics | {
        "actor/optimizer_state_restored": float(has_actor_state(spec)),
        "perf/num_tokens": float(index.loss_tokens_N.sum()),
        "perf/num_samples": float(index.num_samples),
        **timings,
        "perf/train_tokens_per_s": metrics["perf/real_tokens"] / max(timings["perf/train_time_s"], 1e-9),
    }


def checked_index(spec: UpdateSpec, *, ctx: Dist) -> tuple[SampleIndex, list[ListScan]]:
    """The advantages table's index, and the scans of its list columns, checked before anything is loaded.

    Every rank reads the small columns of every part (the same plan everywhere) and scans the list columns of
    every world_size-th part; the scans are gathered, so every rank raises the same error. A collective."""
    index = read_index(spec.advantages_files)
    check_advantages(index)
    mine = [
        scan_part(index, part, check_rollout_logprobs=uses_rollout_logprobs(spec))
        for part in range(ctx.rank, len(index.files), ctx.world_size)
    ]
    gathered: list[list[ListScan] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    scans = sorted((scan for part in gathered for scan in part), key=lambda scan: scan.part)
    check_lists(scans)
    return index, scans


def serve() -> None:
    """Resident mode: for each spec path read from stdin, one update, then an empty `<spec path>.rank<R>.done`
    file (rank 0 writes the metrics before it). An error exits the process, as in one-shot mode: the launcher
    then kills the other ranks (stuck in a collective) and reports this rank's stderr."""
    rank = os.environ.get("RANK", "0")
    ctx, kept = None, []  # kept: at most one Resident, popped into update() so that a rebuild can free it first
    warm_imports()
    for spec_path in _commands():
        spec = UpdateSpec.from_json(spec_path)
        ctx = ctx or init_distributed(spec)
        metrics, resident = update(spec, ctx=ctx, kept=kept.pop() if kept else None, keep=True)
        kept.append(resident)
        del resident  # `kept` is its only holder: a rebuild frees it, and so does leaving
        if metrics is not None:
            write_json_atomic(spec.metrics_path, metrics)
        Path(f"{spec_path}.rank{rank}.done").touch()
        sys.stdout.flush()
        sys.stderr.flush()
    if ctx is not None:  # stdin closed: the pool is shut down; leave as a one-shot rank does
        kept.clear()  # the resident model and optimizer go before the group (see close_process_group)
        leave()


def warm_imports() -> None:
    """What every update imports, imported before the first command: the launcher may start the resident ranks
    ahead of the first update (`launch.prestart_trainers`), and these imports (~4 s of CPU per rank) are most of a
    rank's start. torch.distributed's modules go before any process group exists (see `import_distributed_modules`)."""
    import_distributed_modules()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: F401


def _commands():
    """Spec paths, one per stdin line, until stdin closes or the launching process dies (this rank would be
    orphaned; a forked child of the launcher could keep stdin open, so the parent is checked too). Reads the raw
    file descriptor: a buffered reader could hold a line that select() no longer reports."""
    parent, fd, buffer = os.getppid(), sys.stdin.fileno(), b""
    while os.getppid() == parent:
        if b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode().strip()
            continue
        readable, _, _ = select.select([fd], [], [], 1.0)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        buffer += chunk


def main() -> None:
    """Entry point of one rank. Logging is configured here because this is a process's main, like cli.py."""
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m batchrl.trainer.worker SPEC.json | --serve")
    # A native abort (issue 30's "free(): invalid size" in a rank) prints every thread's Python stack to stderr,
    # which the launcher keeps in the rank's crash log: the next one names the Python line it happened under.
    faulthandler.enable(all_threads=True)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if sys.argv[1] == "--serve":
        serve()
    else:
        spec = UpdateSpec.from_json(sys.argv[1])
        metrics = run(spec)
        if metrics is not None:
            write_json_atomic(spec.metrics_path, metrics)
        leave()
    # The interpreter finalises as usual: `leave` has joined gloo's threads, which could otherwise take the GIL during
    # finalisation and abort the rank (issue 30; see close_process_group). The Parquet case is in storage/fs.py.


def leave() -> None:
    """Destroy the process group, its threads joined; a warning names the gloo threads that outlive it."""
    remaining = close_process_group()
    if remaining:
        logger.warning(
            "gloo threads %s outlive the destroyed process group: something still holds it, and this rank may "
            "abort at exit with 'terminate called without an active exception' (see close_process_group)",
            remaining,
        )


if __name__ == "__main__":
    main()
