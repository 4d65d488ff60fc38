"""update: advantages -> the next policy, one FSDP2 PPO-clip update, saved as an HF checkpoint.

The stage is glue: it resolves local paths (downloading the advantages parts and the input policy when
the run lives on object storage), hands an UpdateSpec to the trainer's launcher (N torch.distributed
processes, gloo on CPU / NCCL on GPU), and publishes the checkpoint into ``iter_NNNN/policy/``. The
policy manifest, written last, lists every checkpoint file with its checksum; the next iteration's
generate stage loads this directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from batchrl.config import PipelineConfig
from batchrl.pipeline.manifest import PartInfo
from batchrl.pipeline.stage import StageContext, StageOutput, register
from batchrl.storage import is_local, join, local_copy, resolve, upload_file

logger = logging.getLogger(__name__)


@register
class UpdateStage:
    name = "update"
    table = "policy"
    schema = None
    inputs = ("advantages", "policy")
    per_iteration = True

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {"update": cfg.update.model_dump(exclude={"timeout_s"}), "seed": cfg.run.seed, "dtype": cfg.model.dtype}

    def run(self, ctx: StageContext) -> StageOutput:
        from batchrl.trainer import UpdateSpec, run_update

        u = ctx.cfg.update
        with tempfile.TemporaryDirectory(prefix="batchrl-update-") as scratch:
            files = [_local_part(join(ctx.input_dirs["advantages"], p.name), scratch) for p in ctx.inputs["advantages"].parts]
            staging = Path(scratch) / "policy"
            spec = UpdateSpec(
                policy_in=local_copy(ctx.policy_in), policy_out=str(staging), advantages_files=files,
                metrics_path=str(Path(scratch) / "metrics.json"), num_processes=u.num_processes, backend=u.backend,
                lr=u.lr, weight_decay=u.weight_decay, max_grad_norm=u.max_grad_norm, clip_ratio_low=u.clip_ratio_low,
                clip_ratio_high=u.clip_ratio_high, loss_agg_mode=u.loss_agg_mode, micro_batch_size=u.micro_batch_size,
                ppo_epochs=u.ppo_epochs, seed=ctx.cfg.run.seed + (ctx.iteration or 0),
                dtype="bfloat16" if ctx.cfg.model.dtype == "bfloat16" else "float32",
                old_logprobs=u.old_logprobs, entropy_coeff=u.entropy_coeff)
            metrics = run_update(spec, timeout_s=u.timeout_s)
            parts = _publish(staging, ctx.output_dir)
        return StageOutput(parts=parts, stats={k: float(v) for k, v in metrics.items()})


def _local_part(uri: str, scratch: str) -> str:
    if is_local(uri):
        return uri.removeprefix("file://")
    fs, path = resolve(uri)
    target = os.path.join(scratch, "advantages", path.rsplit("/", 1)[-1])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fs.get_file(path, target)
    return target


def _publish(staging: Path, output_dir: str) -> list[PartInfo]:
    """Copies the checkpoint files into the policy directory; returns them as manifest parts."""
    import hashlib

    parts = []
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        relative = path.relative_to(staging).as_posix()
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        upload_file(str(path), join(output_dir, relative))
        parts.append(PartInfo(name=relative, rows=0, sha256=digest.hexdigest(), num_bytes=path.stat().st_size))
    shutil.rmtree(staging, ignore_errors=True)
    logger.info("published policy checkpoint (%d files) to %s", len(parts), output_dir)
    return parts
