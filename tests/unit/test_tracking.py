"""Trackers write what they are given, where a user looks for it, once per iteration across resumes; the summary
table and progress bars render what they should. Real backends throughout: TensorBoard event files read back
with TensorBoard's own reader, MLflow's file store read back with its client, W&B's offline run file parsed."""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import pytest
from rich.console import Console

from batchrl.config import ConfigError
from batchrl.config.models import TrackingConfig
from batchrl.tracking import check_tracking, format_summary, make_trackers, progress

CONFIG = {"name": "demo", "update": {"lr": 1e-6, "micro_batch_size": 4}, "generate": {"stop": ["</s>"]}}


def iteration(step: int, score: float) -> dict:
    return {"iteration": step, "critic/score/mean": score, "actor/ppo_kl": 0.01 * step, "note": "text is not logged"}


def open_trackers(run_dir: Path, backend: str, **options) -> list:
    return make_trackers(
        TrackingConfig(backends=["jsonl", backend], **options), run_dir=str(run_dir), run_id="run-1", config_dict=CONFIG
    )


def log_and_close(trackers: list, rows: list[dict]) -> None:
    for row in rows:
        for tracker in trackers:
            tracker.log(row, step=row["iteration"])
    for tracker in trackers:
        tracker.close()


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]


def test_tensorboard_event_files_hold_every_numeric_metric_per_iteration(tmp_path):
    trackers = open_trackers(tmp_path, "tensorboard")
    assert len(trackers) == 1  # jsonl is the runner's own file
    log_and_close(trackers, [iteration(0, 0.25), iteration(1, 0.5)])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["actor/ppo_kl", "critic/score/mean"]
    assert tensorboard_scalars(tmp_path / "tensorboard", "critic/score/mean") == [(0, 0.25), (1, 0.5)]


def test_a_resumed_run_shows_each_iteration_once_and_a_redone_one_with_its_new_values(tmp_path):
    log_and_close(open_trackers(tmp_path, "tensorboard"), [iteration(0, 0.25), iteration(1, 0.5)])
    # the resume re-logs every iteration from the manifests, then a new one
    log_and_close(open_trackers(tmp_path, "tensorboard"), [iteration(0, 0.25), iteration(1, 0.5), iteration(2, 0.75)])
    assert tensorboard_scalars(tmp_path / "tensorboard", "critic/score/mean") == [(0, 0.25), (1, 0.5), (2, 0.75)]
    # --from-stage redid iteration 1 (new values) and the run stopped before iteration 2
    log_and_close(open_trackers(tmp_path, "tensorboard"), [iteration(0, 0.25), iteration(1, 0.125)])
    assert tensorboard_scalars(tmp_path / "tensorboard", "critic/score/mean") == [(0, 0.25), (1, 0.125)]


def test_mlflow_gets_params_and_metrics_and_a_resumed_run_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log_and_close(open_trackers(tmp_path, "mlflow"), [iteration(0, 0.25)])
    log_and_close(open_trackers(tmp_path, "mlflow"), [iteration(0, 0.25), iteration(1, 0.5)])

    client = MlflowClient(f"file://{tmp_path}/mlruns")
    experiment = client.get_experiment_by_name("demo")  # default experiment: the pipeline name
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "run-1" and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "critic/score/mean")] == [(0, 0.25), (1, 0.5)]
    assert runs[0].data.params["update.lr"] == "1e-06" and runs[0].data.params["generate.stop"] == '["</s>"]'
    assert "iteration" not in runs[0].data.metrics and "note" not in runs[0].data.metrics


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of a W&B offline run file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block tail too short for a header is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0:
            break
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                records.append(items)
    return records


def test_wandb_offline_run_lands_under_the_run_directory_with_the_metrics_and_a_no_op_resume_adds_none(tmp_path):
    log_and_close(open_trackers(tmp_path, "wandb"), [iteration(0, 0.25), iteration(1, 0.5)])
    log_and_close(open_trackers(tmp_path, "wandb"), [iteration(0, 0.25), iteration(1, 0.5)])  # nothing new
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history = wandb_history(run_files[0])
    assert [(h["_step"], h["critic/score/mean"]) for h in history] == [(0, 0.25), (1, 0.5)]
    assert "note" not in history[0]


def test_a_tracker_that_cannot_open_fails_make_trackers_unless_told_to_go_on_without_it(tmp_path, caplog):
    config = TrackingConfig(backends=["tensorboard", "mlflow"], mlflow_tracking_uri="nosuchscheme://mlflow")
    with pytest.raises(Exception, match="unsupported URI 'nosuchscheme://mlflow'"):
        make_trackers(config, run_dir=str(tmp_path), run_id="r", config_dict=CONFIG)
    trackers = make_trackers(config, run_dir=str(tmp_path), run_id="r", config_dict=CONFIG, skip_failing=True)
    assert [type(t).__name__ for t in trackers] == ["TensorBoardTracker"]
    assert "tracker mlflow could not be opened" in caplog.text
    log_and_close(trackers, [iteration(0, 0.25)])


def test_selecting_a_tracker_whose_package_is_missing_is_a_config_error_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an environment without mlflow looks like to find_spec
    with pytest.raises(ConfigError, match=r"mlflow package is not installed: pip install 'batchrl\[mlflow\]'"):
        check_tracking(TrackingConfig(backends=["mlflow"]), run_dir=str(tmp_path))


def test_tensorboard_left_at_the_default_is_skipped_when_missing_but_named_explicitly_it_is_an_error(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert check_tracking(TrackingConfig(), run_dir=str(tmp_path)) == []
    with pytest.raises(ConfigError, match="tensorboard package is not installed"):
        check_tracking(TrackingConfig(backends=["tensorboard"]), run_dir=str(tmp_path))


def test_mlflow_for_a_run_on_object_storage_needs_a_tracking_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="set tracking.mlflow_tracking_uri"):
        check_tracking(TrackingConfig(backends=["mlflow"]), run_dir="s3://bucket/runs/r")
    config = TrackingConfig(backends=["mlflow"], mlflow_tracking_uri="http://mlflow:5000")
    assert check_tracking(config, run_dir="s3://bucket/runs/r") == ["mlflow"]


def test_listing_a_tracker_twice_is_rejected():
    with pytest.raises(ValueError, match=r"lists \['wandb'\] more than once"):
        TrackingConfig(backends=["wandb", "tensorboard", "wandb"])


def test_summary_table_shows_the_columns_that_have_values_one_line_per_iteration():
    rows = [
        {"iteration": 0, "critic/score/mean": 0.25, "actor/pg_loss": -0.0001234, "timing_s/step": 12.5},
        {"iteration": 1, "critic/score/mean": 0.5, "val-core/gsm8k/acc": 0.75, "timing_s/step": 11.0},
    ]
    assert format_summary(rows).splitlines() == [
        "iter  score  accuracy    pg_loss  step_s",
        "   0   0.25         -  -1.23e-04    12.5",
        "   1    0.5      0.75          -      11",
    ]
    assert format_summary([]) == ""


def test_progress_bar_draws_on_a_terminal_and_stays_silent_in_a_log():
    terminal = io.StringIO()
    with progress(3, "iter 0 generate: shards", console=Console(file=terminal, force_terminal=True, width=100)) as bar:
        for _ in range(3):
            bar.advance()
    assert "iter 0 generate: shards" in terminal.getvalue() and "3/3" in terminal.getvalue()

    log = io.StringIO()
    with progress(3, "scoring", console=Console(file=log, force_terminal=False)) as bar:
        bar.advance(2)
    assert log.getvalue() == "" and bar.completed == 2


class UnreachableServer:
    """A tracker whose server went away: every call raises."""

    closed = False

    def log(self, metrics, *, step):
        raise ConnectionError("tracking server unreachable")

    def close(self):
        self.closed = True


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_others_keep_logging(tmp_path, caplog):
    from batchrl.tracking import Trackers

    broken = UnreachableServer()
    trackers = Trackers([broken, *open_trackers(tmp_path, "tensorboard")])
    trackers.log(iteration(0, 0.25), step=0)
    trackers.log(iteration(1, 0.5), step=1)
    trackers.close()
    assert broken.closed and "UnreachableServer failed (ConnectionError" in caplog.text
    assert caplog.text.count("UnreachableServer failed") == 1
    assert tensorboard_scalars(tmp_path / "tensorboard", "critic/score/mean") == [(0, 0.25), (1, 0.5)]
