"""The run's Ray session: the embedded local Ray or a cluster, the split of one GPU host's devices between the
engines and the update ranks, and the checks of what the stages will ask of Ray. What stages learn of it
(``Session``) reaches them through `StageContext`, never through the environment or a module global.

Why the split is decided here, once, and handed to the update stage as ``StageContext.rank_devices`` (it went
through an environment variable before, and the update stage derived it again): the embedded Ray must be started
with only the engines' GPUs visible (Ray hands its actors GPU ids from the CUDA_VISIBLE_DEVICES it starts with), so
the session is what knows the split; the update ranks' own CUDA_VISIBLE_DEVICES is set by their launcher in their
environment, the right channel to a child process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from batchrl.config import ConfigError, PipelineConfig
from batchrl.engines.pool import EnginePool
from batchrl.errors import RayStartError
from batchrl.pipeline.devices import DeviceSplit, device_split
from batchrl.pipeline.interrupts import deferred, kept_across
from batchrl.pipeline.stage import Stage

logger = logging.getLogger(__name__)


@dataclass
class Session:
    embedded_ray: bool = False  # the Ray in use is one this session started on this machine (not a cluster)
    rank_devices: str | None = None  # the GPUs the update's local ranks take (the split); None: the environment's
    # the run's generation engines, which generate and evaluate share (`StageContext.engines`); the runner closes
    # them when the run ends, before this Ray does
    engines: EnginePool = field(default_factory=EnginePool)


def cluster_address(cfg: PipelineConfig) -> str | None:
    """The Ray cluster the run joins (ray.address, else $RAY_ADDRESS); None: it starts its own Ray."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def on_cluster(cfg: PipelineConfig) -> bool:
    """Whether the run joins a Ray cluster rather than starting its own Ray (see `cluster_address`)."""
    return cluster_address(cfg) is not None


def check_devices(cfg: PipelineConfig) -> DeviceSplit | None:
    """The split of this host's GPUs the run needs (None: none), or a ConfigError naming the fields when the host
    cannot hold both the engines and the update ranks: asked before anything is written."""
    return device_split(cfg, cluster=on_cluster(cfg))


@contextlib.contextmanager
def ray_session(cfg: PipelineConfig, *, needed: bool = True) -> Iterator[Session]:
    """Embedded local Ray (or the cluster at ray.address / $RAY_ADDRESS); not started when nothing will run.

    The embedded Ray is always the run's own (``address="local"``): ray.init() without an address joins the cluster
    that the last `ray start` on this machine recorded (/tmp/ray/ray_current_cluster), so with one up every run
    failed (num_cpus is refused when joining) or, without ray.num_cpus, ran on it as if it were the run's own."""
    import ray
    from ray.data import DataContext

    if not needed or ray.is_initialized():
        yield Session()
        return
    address = cluster_address(cfg)
    saved_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    session = Session(embedded_ray=not address)
    try:
        with kept_across("ray.init"):  # ray.init replaces the driver's SIGTERM handler (see interrupts)
            if address:
                with _start_errors(address):
                    ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)  # cli.py: levels
            else:
                gpus = {}
                split = device_split(cfg, cluster=False)  # overlap on one GPU host
                if split is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(split.engines)  # what the embedded Ray hands out
                    session.rank_devices = ",".join(split.ranks)  # what the update stage gives its ranks
                    gpus = {"num_gpus": len(split.engines)}
                    logger.info(
                        "GPUs %s for the engines, %s for the update (run.max_staleness)", split.engines, split.ranks
                    )
                with _start_errors(None):
                    ray.init(
                        address="local",
                        num_cpus=cfg.ray.num_cpus,
                        include_dashboard=False,
                        logging_level=logging.WARNING,
                        configure_logging=False,
                        **gpus,
                    )
        DataContext.get_current().enable_progress_bars = False
        yield session
    finally:
        with deferred():  # a signal cutting ray.shutdown short would leave half of Ray running
            session.embedded_ray = False
            ray.shutdown()
            if saved_devices is None:  # the split lasts as long as this Ray
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_devices


@contextlib.contextmanager
def _start_errors(address: str | None) -> Iterator[None]:
    """An exception from the ray.init inside (a node that timed out during startup on an overloaded machine, a
    cluster that cannot be reached) as a RayStartError naming what was started or joined; a ConfigError passes as
    it is. Around ray.init alone: a failure of batchrl's own code is not a transient one."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:
        what = f"the Ray cluster at {address} could not be joined" if address else "the embedded Ray did not start"
        raise RayStartError(f"{what} ({type(err).__name__}: {err})") from err


def check_cluster_paths(cfg: PipelineConfig, stages: dict[str, Stage], *, run_dir: str) -> None:
    """On a Ray cluster of several nodes, the local paths the run writes (the run directory) or reads (model,
    data, reward model) must be the same on every node (a shared mount); asked of each node before any work."""
    import ray

    if not ray.is_initialized():
        return
    from batchrl.storage import is_local
    from batchrl.storage.cluster import alive_nodes, describe, unshared_paths

    num_nodes = len(alive_nodes())
    if num_nodes <= 1:
        return
    named_reads = [read for stage in stages.values() for read in stage.read_paths(cfg)]
    reads = {
        uri.removeprefix("file://"): name
        for name, uri in named_reads
        if is_local(uri) and os.path.exists(uri.removeprefix("file://"))
    }
    writes = {run_dir.removeprefix("file://"): "run.root"} if is_local(run_dir) else {}
    unshared = unshared_paths(writes, reads)
    if unshared:
        raise ConfigError(
            f"the run is connected to a Ray cluster of {num_nodes} nodes, but {describe(unshared, writes | reads)}"
            ": actors on those nodes would read or write another directory than the driver. Put these on object "
            "storage (s3://...) or on a filesystem mounted at the same path on every node"
        )


def check_actor_needs(cfg: PipelineConfig, stages: dict[str, Stage], session: Session) -> None:
    """Before any work: a stage whose one actor asks for more CPUs or GPUs than the embedded Ray has would wait
    for them forever (Ray queues the request); a ConfigError names the field to lower. ``stages``: those with work.
    Not asked of a cluster, which an autoscaler may grow when the request comes."""
    import ray

    if not (session.embedded_ray and ray.is_initialized()):
        return
    total = ray.cluster_resources()
    for name, stage in stages.items():
        for need in stage.actor_needs(cfg):
            for kind, amount, field_name in (
                ("CPU", need.cpus, need.cpus_field),
                ("GPU", need.gpus, need.gpus_field),
            ):
                if amount > total.get(kind, 0):
                    raise ConfigError(
                        f"{field_name}={amount:g}: one {name} actor asks for {amount:g} {kind}, but the Ray "
                        f"cluster has {total.get(kind, 0):g} in all; lower {field_name} or add {kind}s to it"
                    )
