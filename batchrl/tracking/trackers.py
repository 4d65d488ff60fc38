"""Metric loggers beside metrics.jsonl: TensorBoard event files, MLflow and W&B (offline by default).

Why trackers get every iteration on every start: the runner derives an iteration's metrics from the stage
manifests, so a resumed run re-logs the iterations an earlier attempt already logged. Each tracker keeps a
small ledger (``<run>/tracking/<backend>.json``: a digest of the metrics logged per step, plus the MLflow run
id) and skips a step logged before with the same values. A step whose values changed (``--from-stage``
redid it) is logged again: TensorBoard opens its writer with ``purge_step`` at the first step it writes, so
the older events from that step on are hidden; MLflow appends the new point to the same MLflow run. W&B's
history only grows (a step below the run's last one is ignored), so there a redone step keeps its old values.

Object-store run directories: TensorBoard and W&B write to a local temporary directory, copied under
``<run>/tensorboard/`` (after every iteration) and ``<run>/wandb/`` (at the end). MLflow needs a tracking URI
there (``tracking.mlflow_tracking_uri`` or $MLFLOW_TRACKING_URI).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Protocol

from batchrl.config import ConfigError
from batchrl.config.models import TrackingConfig
from batchrl.storage import is_local, join, resolve, upload_file, write_bytes_atomic

logger = logging.getLogger(__name__)

STEP_KEY = "iteration"  # the step itself, not logged as a metric
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install 'batchrl[tracking]'"),
    "mlflow": ("mlflow", "pip install 'batchrl[mlflow]' (mlflow-skinny) or mlflow"),
    "wandb": ("wandb", "pip install 'batchrl[wandb]'"),
}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], *, step: int) -> None: ...

    def close(self) -> None: ...


def check_tracking(cfg: TrackingConfig, *, run_dir: str) -> list[str]:
    """The backends to open (jsonl is the runner's own); ConfigError for one that cannot work here."""
    names = []
    for name in cfg.backends:
        if name == "jsonl":
            continue
        module, install = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            if name == "tensorboard" and "backends" not in cfg.model_fields_set:
                logger.warning("tensorboard is not installed: no event files for this run (%s)", install)
                continue
            raise ConfigError(
                f"tracking.backends lists {name}, but the {module} package is not installed: {install}, "
                f"or remove {name} from tracking.backends"
            )
        names.append(name)
    if "mlflow" in names and not is_local(run_dir) and not _mlflow_uri(cfg, run_dir=None):
        raise ConfigError(
            f"tracking.backends lists mlflow for a run on object storage ({run_dir}): set "
            "tracking.mlflow_tracking_uri (or $MLFLOW_TRACKING_URI) to an MLflow server or database"
        )
    return names


def make_trackers(
    cfg: TrackingConfig, *, run_dir: str, run_id: str, config_dict: dict, skip_failing: bool = False
) -> list[Tracker]:
    """Opens the configured trackers (ConfigError when one cannot work here). Close them with close().

    ``skip_failing``: a backend that fails to open for another reason (an MLflow server down) is left out with
    a warning instead of failing the run."""
    experiment = cfg.experiment or str(config_dict.get("name") or run_id)
    openers = {
        "tensorboard": lambda: TensorBoardTracker(run_dir=run_dir),
        "mlflow": lambda: MlflowTracker(
            tracking_uri=_mlflow_uri(cfg, run_dir=run_dir),
            experiment=experiment,
            run_dir=run_dir,
            run_id=run_id,
            config_dict=config_dict,
        ),
        "wandb": lambda: WandbTracker(
            mode=cfg.wandb_mode, project=experiment, run_dir=run_dir, run_id=run_id, config_dict=config_dict
        ),
    }
    trackers: list[Tracker] = []
    try:
        for name in check_tracking(cfg, run_dir=run_dir):
            try:
                trackers.append(openers[name]())
            except Exception as err:
                if not skip_failing:
                    raise
                logger.warning(
                    "tracker %s could not be opened (%s: %s): this run goes on without it",
                    name,
                    type(err).__name__,
                    err,
                )
    except BaseException:
        for tracker in trackers:
            _close_quietly(tracker)
        raise
    return trackers


class Trackers:
    """The trackers of a run behind one ``log``: a tracker that fails (an MLflow server gone) is reported once
    and dropped, and the run goes on: metrics.jsonl, the record the report reads, does not depend on it."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(metrics, step=step)
            except Exception as err:
                logger.warning(
                    "%s failed (%s: %s); it gets no more metrics in this run",
                    type(tracker).__name__,
                    type(err).__name__,
                    err,
                )
                self.trackers.remove(tracker)
                _close_quietly(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            _close_quietly(tracker)
        self.trackers = []


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception as err:
        logger.warning("closing %s failed: %s: %s", type(tracker).__name__, type(err).__name__, err)


@contextlib.contextmanager
def tracking_session(cfg: TrackingConfig, *, run_dir: str, run_id: str, config_dict: dict) -> Iterator[Trackers]:
    """``make_trackers`` as a context: ``with tracking_session(...) as trackers: trackers.log(m, step=i)``;
    every tracker is closed on the way out, also when the run fails. A tracker that cannot be opened or that
    fails later costs a warning, not the run (a configuration mistake is still a ConfigError)."""
    trackers = Trackers(make_trackers(cfg, run_dir=run_dir, run_id=run_id, config_dict=config_dict, skip_failing=True))
    try:
        yield trackers
    finally:
        trackers.close()


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of ``metrics`` as floats, without the step key (strings, None, NaN dropped)."""
    out = {}
    for key, value in metrics.items():
        if key != STEP_KEY and isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


class Ledger:
    """``<run>/tracking/<backend>.json``: the digest of the metrics logged per step, and backend state."""

    def __init__(self, run_dir: str, backend: str):
        self.uri = join(run_dir, "tracking", f"{backend}.json")
        fs, path = resolve(self.uri)
        try:
            self.state = json.loads(fs.cat_file(path).decode())
        except FileNotFoundError:
            self.state = {}
        self.state.setdefault("steps", {})

    @staticmethod
    def digest(metrics: dict[str, float]) -> str:
        return hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:16]

    def logged(self, step: int, metrics: dict[str, float]) -> bool:
        return self.state["steps"].get(str(step)) == self.digest(metrics)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        self.state["steps"][str(step)] = self.digest(metrics)
        self.save()

    def save(self) -> None:
        write_bytes_atomic(self.uri, json.dumps(self.state, indent=1, sort_keys=True).encode())


class LocalMirror:
    """A local directory standing for ``<run>/<subdir>``: ``path`` is that directory itself for a local run;
    for a run on object storage it lies in a temporary ``root``, and ``sync()`` uploads its files."""

    def __init__(self, run_dir: str, subdir: str):
        self.remote = join(run_dir, subdir)
        self.temporary = not is_local(run_dir)
        self.root = tempfile.mkdtemp(prefix=f"batchrl-{subdir}-") if self.temporary else resolve(run_dir)[1]
        self.path = os.path.join(self.root, subdir)
        os.makedirs(self.path, exist_ok=True)

    def sync(self) -> None:
        if not self.temporary:
            return
        for root, _, files in os.walk(self.path):
            for name in files:
                local = os.path.join(root, name)
                upload_file(local, join(self.remote, os.path.relpath(local, self.path).replace(os.sep, "/")))

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)


class TensorBoardTracker:
    """Scalars under ``<run>/tensorboard/``; each metric name (critic/score/mean) is one TensorBoard tag."""

    def __init__(self, *, run_dir: str):
        self.ledger = Ledger(run_dir, "tensorboard")
        self.mirror = LocalMirror(run_dir, "tensorboard")
        self.writer = None

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        values = numeric_metrics(metrics)
        if self.ledger.logged(step, values):
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides events of earlier writers at steps >= this one (a redone step)
            self.writer = SummaryWriter(self.mirror.path, purge_step=step)
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()
        self.mirror.sync()
        self.ledger.record(step, values)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.mirror.sync()
        self.mirror.cleanup()


def _mlflow_uri(cfg: TrackingConfig, *, run_dir: str | None) -> str | None:
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None and run_dir is not None and is_local(run_dir):
        uri = "file://" + os.path.abspath(os.path.join(resolve(run_dir)[1], "mlruns"))
    return uri


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"update": {"lr": 1e-6}} -> {"update.lr": "1e-06"}: a nested config as MLflow params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class MlflowTracker:
    """One MLflow run per batchrl run (its id kept in the ledger, so a resumed run continues it); the resolved
    config as params. A file: tracking URI is MLflow's file store (in maintenance mode upstream, but the only
    store without a server or SQLAlchemy); it is allowed for this process."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_dir: str, run_id: str, config_dict: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri)
        self.ledger = Ledger(run_dir, "mlflow")
        self.run_id = (
            self.ledger.state.get("mlflow_run_id") if self.ledger.state.get("tracking_uri") == tracking_uri else None
        )
        if self.run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(
                experiment_id, run_name=run_id, tags={"batchrl.run_dir": run_dir}
            ).info.run_id
            params = [Param(k, v[:6000]) for k, v in flatten(config_dict).items()]
            for start in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[start : start + 100])
            self.ledger.state.update(mlflow_run_id=self.run_id, tracking_uri=tracking_uri, steps={})
            self.ledger.save()
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        values = numeric_metrics(metrics)
        if self.ledger.logged(step, values):
            return
        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for start in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])
        self.ledger.record(step, values)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow metric names allow alphanumerics, _ - . space : / only."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


class WandbTracker:
    """A W&B run (offline by default, under ``<run>/wandb/``) whose id derives from the run directory, so syncing
    the offline directories of a run's attempts continues one W&B run. Started at the first step to log: a
    no-op resume starts no W&B process and leaves no empty offline run."""

    def __init__(self, *, mode: str, project: str, run_dir: str, run_id: str, config_dict: dict):
        self.ledger = Ledger(run_dir, "wandb")
        self.mirror = LocalMirror(run_dir, "wandb")
        self.init_kwargs = {
            "mode": mode,
            "dir": self.mirror.root,
            "project": project,
            "name": run_id,
            "resume": "allow",
            "id": re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:48] + "-" + hashlib.sha256(run_dir.encode()).hexdigest()[:8],
            "config": config_dict,
            "reinit": "create_new",
        }
        self.run = None
        self.pending: dict[int, dict[str, float]] = {}  # recorded in the ledger once finish() has flushed them

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        values = numeric_metrics(metrics)
        if self.ledger.logged(step, values):
            return
        if self.run is None:
            import wandb

            settings = wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                disable_git=True,
                save_code=False,
                x_disable_machine_info=True,
            )
            self.run = wandb.init(settings=settings, **self.init_kwargs)  # writes <dir>/wandb/
        self.run.log(values, step=step)
        self.pending[step] = values

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.mirror.sync()
            for step, values in self.pending.items():
                self.ledger.record(step, values)
        self.mirror.cleanup()
