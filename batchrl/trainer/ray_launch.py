"""Run one update as N Ray actors in a placement group: the update's ranks on a Ray cluster.

Why: on a cluster the driver's host may have no GPU, or too few; the ranks belong where Ray has the resources.
`launch` starts processes on the driver's host; this module reserves one placement-group bundle per rank
({"CPU": cpus_per_rank}, plus {"GPU": 1} with nccl; PACK by default: as few nodes as possible, for the
collectives' sake), starts one actor per bundle and runs the unchanged worker code (`worker.run`) in each. Each
actor is its own Ray worker process, killed after the update: a crashing rank takes its actor down, not the driver.
Rank 0's actor picks the rendezvous (its node's IP and a free port) and the others join it.

Each actor stages its own data, because it may run on a node where the driver's scratch paths do not exist. The
spec's path fields are therefore read as URIs of the run directory (local paths or s3://...), not as copies made
by the driver:
- inputs: the advantages parts are read in place by the worker (local or s3://, only the rows the rank trains on);
  the previous trainer state is downloaded into the actor's node-local scratch directory when it is on object
  storage (read in place when local); the input and reference policies go
  through `local_copy` (downloaded once per node into its model cache). A downloaded trainer state is checked
  whole against `trainer_state_sha256` by each actor before the worker loads it (each node has its own copy, and
  the worker's check shares the hashing out among the ranks: of one copy, it would vouch for the others);
- outputs: the worker writes into the scratch directory, then each actor uploads what its own rank wrote: rank 0
  the HF policy (into `policy_out`) and the trainer state's `trainer_state.json` and DCP `.metadata`; every rank
  its part of the log-probs table and its own DCP shard files (`__<rank>_*.distcp`, see
  `checkpoint.save_trainer_state`).
  Each actor has a scratch directory of its own, so "what this rank wrote" is simply all of it. The uploads come
  back as (uri, sha256, size), so the caller can list them in a manifest without reading them back;
  `metrics_path` is written by the driver.
On a cluster of more than one alive node, a local path is accepted only when every node sees it as the driver
does (a filesystem mounted at the same path everywhere; `batchrl.storage.cluster` asks each node); otherwise the
ranks on other nodes could not read it, and rank 0's uploads would land on whichever node it ran on.

Departures from `launch.run_update`: one-shot actors only (no resident ranks: a Ray actor holding a model between
updates would hold its bundle's CPUs/GPU too); no progress records (`on_progress` is ignored: rank 0's progress
file would be on its own node); `backend="auto"` means nccl when the cluster has GPUs, not the driver's host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrl.storage import is_local, join, local_copy, resolve, upload_file, write_bytes_atomic
from batchrl.storage.cluster import Probe, alive_nodes, describe, unshared_paths
from batchrl.trainer.integrity import TrainerStateError, verify_dir
from batchrl.trainer.spec import UpdateSpec

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0  # waiting longer for free resources means the cluster cannot fit the update


@dataclass(frozen=True)
class UploadedFile:
    uri: str
    sha256: str
    num_bytes: int


@dataclass(frozen=True)
class RayUpdateResult:
    metrics: dict[str, float]  # rank 0's, as `launch.run_update` returns them
    uploaded: list[UploadedFile]  # every file the ranks wrote, at its final URI


def run_update_on_ray(
    spec: UpdateSpec,
    *,
    timeout_s: float | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    cpus_per_rank: float = 1.0,
    placement_strategy: str = "PACK",
) -> RayUpdateResult:
    """Run one update as `spec.update.num_processes` Ray actors; return rank 0's metrics and the files uploaded.

    The spec's paths are URIs that every rank can reach (see the module docstring). Raises RuntimeError naming the
    failing rank and its error if any rank fails, or if the update outlives `timeout_s` (placement included); the
    actors are killed and the placement group removed in every case. `on_progress` is not supported (ignored).
    Needs a connected Ray (`ray.init`, or the pipeline runner's session). A trainer state that does not hash as
    `spec.trainer_state_sha256` records raises TrainerStateError, before any rank has loaded it.
    """
    import ray

    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 (or None for no limit)")
    if not ray.is_initialized():
        raise RuntimeError("run_update_on_ray needs a connected Ray: call ray.init() first (the runner does)")
    if on_progress is not None:
        logger.debug("update on Ray: no progress records (rank 0's progress file would be on its own node)")
    # Re-validated with the backend the cluster resolves "auto" to (update.cpu_offload needs nccl).
    spec = dataclasses.replace(spec.with_update(backend=_cluster_backend(spec.update.backend)), progress_path=None)
    check_reachable_from_all_nodes(spec, num_nodes=len(alive_nodes()))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    bundle = {"CPU": float(cpus_per_rank)} | ({"GPU": 1.0} if spec.update.backend == "nccl" else {})
    started = time.perf_counter()
    group = ray.util.placement_group(
        [dict(bundle) for _ in range(spec.update.num_processes)], strategy=placement_strategy
    )
    try:
        _wait_for_placement(group, bundle=bundle, spec=spec, deadline=deadline, timeout_s=timeout_s)
        results = _run_ranks(group, spec, bundle=bundle, deadline=deadline, timeout_s=timeout_s)
    finally:
        ray.util.remove_placement_group(group)
    metrics = results[0]["metrics"]
    write_bytes_atomic(spec.metrics_path, json.dumps(metrics, indent=2, sort_keys=True).encode())
    nodes = sorted({r["node_ip"] for r in results})
    logger.info(
        "update finished in %.1f s on %d Ray worker(s) on node(s) %s",
        time.perf_counter() - started,
        len(results),
        ", ".join(nodes),
    )
    return RayUpdateResult(metrics=metrics, uploaded=[f for r in results for f in r["uploaded"]])


def check_reachable_from_all_nodes(spec: UpdateSpec, *, num_nodes: int, probe: Probe | None = None) -> None:
    """On a cluster of several nodes, every local input and output must be the same on every node: a shared mount
    (asked of each node by `cluster.unshared_paths`, or `probe`), else object storage (see module docstring).

    A policy that is not a local directory on the driver (a hub id) is fine: every node downloads it itself."""
    if num_nodes <= 1:
        return
    writes = {
        uri: name
        for name, uri in (
            ("policy_out", spec.policy_out),
            ("trainer_state_out", spec.trainer_state_out),
            ("logprobs_dir", spec.logprobs_dir),
        )
        if uri is not None and is_local(uri)
    }
    reads = {
        uri: name
        for name, uri in (("policy_in", spec.policy_in), ("reference_policy", spec.reference_policy))
        if uri is not None and is_local(uri) and os.path.exists(uri.removeprefix("file://"))
    }
    reads |= {
        uri: name
        for name, uri in [("trainer_state_in", spec.trainer_state_in)]
        + [("advantages_files", uri) for uri in spec.advantages_files]
        if uri is not None and is_local(uri)
    }
    if not writes and not reads:
        return
    unshared = (probe or unshared_paths)(
        [u.removeprefix("file://") for u in writes], [u.removeprefix("file://") for u in reads]
    )
    if unshared:
        names = {uri.removeprefix("file://"): name for uri, name in (writes | reads).items()}
        raise ValueError(
            f"the update runs on a Ray cluster of {num_nodes} nodes, but {describe(unshared, names)}: ranks on those "
            "nodes cannot read or write it. Put run.root (and a local model.path) on object storage (s3://...) or on "
            "a filesystem mounted at the same path on every node, or set update.launcher: local to run the update "
            "on the driver's host"
        )


class RankActor:
    """One rank of the update, in its own Ray worker process (wrapped with ray.remote by `_run_ranks`)."""

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: its node's IP and a port free there, for MASTER_ADDR / MASTER_PORT."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def update(self, spec: UpdateSpec, *, rank: int, master_addr: str, master_port: int) -> dict[str, Any]:
        """Stage the inputs, run this rank of the update, upload what it wrote; {metrics, uploaded, node_ip}."""
        import ray
        from transformers.utils import logging as hf_logging

        from batchrl.trainer.worker import leave, run

        hf_logging.disable_progress_bar()  # as the worker's main does: bars in a Ray actor's log are noise

        # One process per bundle; with nccl, Ray makes the bundle's one GPU the only visible device: local rank 0.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(spec.update.num_processes),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        with tempfile.TemporaryDirectory(prefix=f"batchrl-update-rank{rank}-") as scratch:
            local_spec = stage_inputs(spec, Path(scratch))
            metrics = run(local_spec)
            leave()  # the group destroyed with its threads joined, as a rank process leaves
            uploaded = upload_outputs(local_spec, spec, rank=rank)
        return {"metrics": metrics, "uploaded": uploaded, "node_ip": ray.util.get_node_ip_address()}


def stage_inputs(spec: UpdateSpec, scratch: Path) -> UpdateSpec:
    """`spec` with every input readable on this node and every output under `scratch` (see module docstring)."""
    from batchrl.trainer.lora import with_local_init_adapter

    trainer_state_in = None
    if spec.trainer_state_in is not None:
        trainer_state_in = _local_dir(spec.trainer_state_in, scratch / "trainer_state_in")
        if spec.trainer_state_sha256 is not None and not is_local(spec.trainer_state_in):
            verify_dir(trainer_state_in, spec.trainer_state_sha256)
    policy_in = local_copy(spec.policy_in)
    return dataclasses.replace(
        spec,
        update=with_local_init_adapter(spec.update, policy_in=policy_in, scratch=scratch),
        policy_in=policy_in,
        reference_policy=None if spec.reference_policy is None else local_copy(spec.reference_policy),
        behaviour_policy=None if spec.behaviour_policy is None else local_copy(spec.behaviour_policy),
        lora_base=None if spec.lora_base is None else local_copy(spec.lora_base),
        trainer_state_in=trainer_state_in,
        policy_out=str(scratch / "policy"),
        metrics_path=str(scratch / "metrics.json"),
        trainer_state_out=None if spec.trainer_state_out is None else str(scratch / "trainer_state"),
        logprobs_dir=None if spec.logprobs_dir is None else str(scratch / "logprobs"),
    )


def upload_outputs(local_spec: UpdateSpec, spec: UpdateSpec, *, rank: int) -> list[UploadedFile]:
    """Copy what this rank wrote under `local_spec`'s outputs to `spec`'s: rank 0 the policy, every rank its part of
    the log-probs table and its trainer-state files (whatever is in its own scratch directory). Rank 0's
    trainer_state.json sorts after optimizer/, so it is uploaded last, as the checkpoint writes it last."""
    uploaded = []
    if rank == 0:
        uploaded += _upload_dir(Path(local_spec.policy_out), spec.policy_out)
    if spec.logprobs_dir is not None:
        uploaded += _upload_dir(Path(local_spec.logprobs_dir), spec.logprobs_dir)
    if spec.trainer_state_out is not None:
        uploaded += _upload_dir(Path(local_spec.trainer_state_out), spec.trainer_state_out)
    return uploaded


def _run_ranks(
    group, spec: UpdateSpec, *, bundle: dict, deadline: float | None, timeout_s: float | None
) -> list[dict[str, Any]]:
    """Start one actor per bundle, run the update on all of them, kill them whatever happens."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_class = ray.remote(RankActor)
    actors = [
        actor_class.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            ),
        ).remote()
        for rank in range(spec.update.num_processes)
    ]
    try:
        pending = [actors[0].rendezvous.remote()]
        master = _wait_for_ranks(pending, ranks={pending[0]: 0}, deadline=deadline, timeout_s=timeout_s)
        master_addr, master_port = master[0]
        refs = [
            actor.update.remote(spec, rank=rank, master_addr=master_addr, master_port=master_port)
            for rank, actor in enumerate(actors)
        ]
        results = _wait_for_ranks(
            refs, ranks={ref: rank for rank, ref in enumerate(refs)}, deadline=deadline, timeout_s=timeout_s
        )
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return [results[rank] for rank in range(spec.update.num_processes)]


def _wait_for_ranks(refs: list, *, ranks: dict, deadline: float | None, timeout_s: float | None) -> dict[int, Any]:
    """{rank: result} once every ref is done; RuntimeError at the first failed rank (the others are then stuck in a
    collective: the caller kills them) or at the deadline."""
    import ray

    results, pending = {}, list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise RuntimeError(
                f"update timed out after {timeout_s} s on Ray (update.timeout_s); ranks still "
                f"running: {sorted(ranks[ref] for ref in pending)}"
            )
        rank = ranks[done[0]]
        try:
            results[rank] = ray.get(done[0])
        except ray.exceptions.RayError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, TrainerStateError):  # refused before loading: the caller reports the file
                raise TrainerStateError(cause.name, cause.reason) from None
            raise RuntimeError(f"update rank {rank} failed on Ray: {error}") from None
    return results


def _wait_for_placement(
    group, *, bundle: dict, spec: UpdateSpec, deadline: float | None, timeout_s: float | None
) -> None:
    import ray

    left = None if deadline is None else deadline - time.monotonic()
    wait_s = PLACEMENT_TIMEOUT_S if left is None else min(PLACEMENT_TIMEOUT_S, left)
    ready, _ = ray.wait([group.ready()], timeout=max(0.0, wait_s))
    if not ready and left is not None and left < PLACEMENT_TIMEOUT_S:
        # The update's own deadline ran out first: a timeout, whatever the cluster could have placed later.
        raise RuntimeError(
            f"update timed out after {timeout_s} s on Ray (update.timeout_s) while Ray was placing "
            f"{spec.update.num_processes} rank(s) of {bundle}"
        )
    if not ready:
        raise RuntimeError(
            f"update: Ray could not place {spec.update.num_processes} rank(s) of {bundle} (update.num_processes x "
            f"update.cpus_per_rank, a GPU each with nccl) within {wait_s:.0f} s; the cluster has "
            f"{ray.cluster_resources()} in all, {ray.available_resources()} free. Lower update.num_processes or "
            "update.cpus_per_rank, or free resources (generate.engine_lifetime: stage releases the engines)"
        )


def _cluster_backend(backend: str) -> str:
    """ "auto" on a cluster: nccl when the cluster has GPUs (the driver's host may have none), else gloo."""
    if backend != "auto":
        return backend
    import ray

    return "nccl" if ray.cluster_resources().get("GPU", 0) >= 1 else "gloo"


def _local_dir(uri: str, target: Path) -> str:
    if is_local(uri):
        return uri.removeprefix("file://")
    fs, path = resolve(uri)
    for remote in fs.find(path):
        local = target / remote[len(path.rstrip("/")) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))
    return str(target)


def _upload_dir(local_dir: Path, uri: str) -> list[UploadedFile]:
    return [
        _upload(path, join(uri, path.relative_to(local_dir).as_posix()))
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file())
    ]


def _upload(path: Path, uri: str) -> UploadedFile:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    upload_file(str(path), uri)
    return UploadedFile(uri=uri, sha256=digest.hexdigest(), num_bytes=path.stat().st_size)
