"""Overlapped iterations (run.max_staleness: 1) in real runs: iteration i generates with policy i-2 while iteration
i-1's update trains; the tables record the policy version; the old log-probs are recomputed from the behaviour
policy's checkpoint; the metrics count the lag; the rows equal a strict run's where the policy versions agree; a
run killed with two iterations in flight resumes to the same rows and weights; a run stopped while its update
cannot be stopped keeps the run lock until the update has ended. Tiny runs: HF engine, gloo update."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from harness import (
    REPO,
    cli_ok,
    kill_run_when,
    merged,
    pausing_stage,
    read_metrics,
    read_rows,
    start_cli,
    tiny_pipeline,
    write_pipeline,
)

from batchrl.api import Pipeline
from batchrl.pipeline.lock import lock_holder

pytestmark = pytest.mark.slow

PAUSE_ENV = "BATCHRL_TEST_OVERLAP_PAUSE"
BASE = {
    "run.iterations": 3,
    "stages": [
        {"name": "probe", "after": "score", "call": "overlap_probe:pause_in_iteration_2", "outputs": ["probed"]}
    ],
}


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    """The probe stage's module: after score, pausing at its 5th shard (2 shards an iteration) for the kill test."""
    directory = tmp_path_factory.mktemp("probe")
    pausing_stage(directory, "overlap_probe", function="pause_in_iteration_2", env=PAUSE_ENV, call=5)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_model_dir, toy_prompts_dir, probe_dir) -> dict:
    """A strict and an overlapped run of the same pipeline: {"strict": run dir, "overlapped": run dir, "path": the
    overlapped pipeline file, "log": the overlapped run's stderr}."""
    directory = tmp_path_factory.mktemp("overlap")
    strict = write_pipeline(directory, BASE, model=toy_model_dir, prompts=toy_prompts_dir, file_name="strict.yaml")
    overlapped = write_pipeline(
        directory, BASE | {"run.max_staleness": 1}, model=toy_model_dir, prompts=toy_prompts_dir
    )
    cli_ok("run", strict, "--run-id", "strict", path_first=[probe_dir, REPO])
    done = cli_ok("run", overlapped, "--run-id", "overlapped", path_first=[probe_dir, REPO])
    runs = directory / "runs"
    return {"strict": runs / "strict", "overlapped": runs / "overlapped", "path": overlapped, "log": done.stderr}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_iteration_1_generates_while_iteration_0_updates(runs):
    log = runs["log"]
    assert log.index("iter 1 generate: running") < log.index("iter 0 update: done")


def test_the_rows_equal_a_strict_runs_where_the_policy_versions_agree(runs):
    strict, overlapped = runs["strict"], runs["overlapped"]
    for table in ("rollouts", "scores", "advantages"):  # iteration 0: both generate with the initial policy
        assert read_rows(overlapped / "iter_0000" / table) == read_rows(strict / "iter_0000" / table), table
    weights = "iter_0000/policy/model.safetensors"
    assert _sha256(overlapped / weights) == _sha256(strict / weights)
    versions = {
        run: [{r["policy_version"] for r in read_rows(runs[run] / f"iter_{i:04d}" / "rollouts")} for i in range(3)]
        for run in ("strict", "overlapped")
    }
    assert versions == {"strict": [{0}, {1}, {2}], "overlapped": [{0}, {0}, {1}]}


def test_the_metrics_count_the_policy_lag_and_the_old_logprobs_are_the_behaviour_policys(runs):
    lags = [m["update/policy_lag_max"] for m in read_metrics(runs["overlapped"])]
    assert lags == [0.0, 1.0, 1.0]
    assert [m["update/policy_lag_mean"] for m in read_metrics(runs["strict"])] == [0.0, 0.0, 0.0]
    # Iteration 2 trains policy 1 on rollouts of policy 0 (version 1): the recomputed old log-probs are the
    # behaviour policy's, which the engine's own log-probs equal up to float rounding (same weights, float32)
    run = runs["overlapped"] / "iter_0002"
    old = {
        (r["prompt_id"], r["sample_idx"]): r["old_logprobs"]
        for part in sorted((run / "policy" / "_logprobs").glob("part-*.parquet"))
        for r in pq.read_table(part).to_pylist()
    }
    engine = {(r["prompt_id"], r["sample_idx"]): r["response_logprobs"] for r in read_rows(run / "advantages")}
    diffs = np.concatenate([np.abs(np.subtract(old[key], engine[key])) for key in engine if engine[key]])
    assert diffs.max() < 1e-3


def test_a_run_killed_with_two_iterations_in_flight_resumes_to_the_rows_and_weights_of_an_uninterrupted_one(
    tmp_path, runs, probe_dir
):
    expected = runs["overlapped"]
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "killed.log"
    process = start_cli(
        "run", runs["path"], "--run-id", "killed", log=log, env={PAUSE_ENV: str(pause)}, path_first=[probe_dir, REPO]
    )
    kill_run_when(pause / "reached", process, log=log)  # iteration 2's probe in flight, iteration 1's update too
    resumed = expected.parent / "killed"
    assert not (resumed / "iter_0002" / "probe" / "_MANIFEST.json").exists()
    status = cli_ok("status", resumed, path_first=[probe_dir, REPO])
    assert "run.max_staleness=1" in status.stdout and "in flight when interrupted: iterations" in status.stdout
    assert "iter 2 probe" in status.stdout
    (pause / "go").write_text("")
    cli_ok("run", runs["path"], "--run-id", "killed", path_first=[probe_dir, REPO])
    for iteration in range(3):
        for table in ("rollouts", "advantages"):
            directory = f"iter_{iteration:04d}/{table}"
            assert read_rows(resumed / directory) == read_rows(expected / directory), directory
        weights = f"iter_{iteration:04d}/policy/model.safetensors"
        assert _sha256(resumed / weights) == _sha256(expected / weights), weights
    assert [m["iteration"] for m in read_metrics(resumed)] == [0, 1, 2]


def _children() -> dict[int, bytes]:
    """This process's child processes: pid -> command line."""
    children = {}
    for entry in Path("/proc").iterdir():
        try:
            if int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1]) == os.getpid():
                children[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return children


@contextlib.contextmanager
def stuck_update_ranks() -> Iterator[Callable[[], None]]:
    """Stops (SIGSTOP) the update ranks this process starts as they appear, and with the first the run's watchdog,
    which would otherwise stop them when the run ends: an update that nothing stops, as a rank hung in I/O or in a
    collective is. Yields the function that lets the ranks go on; everything is let go at the end."""
    ranks, watchdogs, done = set(), set(), threading.Event()

    def freeze() -> None:
        while not done.wait(0.05):
            for pid, command in _children().items():
                if b"batchrl.trainer.worker" in command and pid not in ranks:
                    os.kill(pid, signal.SIGSTOP)
                    ranks.add(pid)
                if ranks and b"reaper.py" in command and pid not in watchdogs:
                    os.kill(pid, signal.SIGSTOP)
                    watchdogs.add(pid)

    def go_on(pids: set[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    freezer = threading.Thread(target=freeze, daemon=True)
    freezer.start()
    try:
        yield lambda: go_on(ranks)
    finally:
        done.set()
        freezer.join()
        go_on(ranks | watchdogs)


def interrupt_when_logged(caplog, message: str) -> None:
    """SIGINT to this process (a KeyboardInterrupt in its main thread, as batchrl's SIGTERM handler raises) a second
    after a log record containing ``message``."""

    # A process started in the background by a shell without job control (a CI script's `cmd &`) inherits SIGINT
    # ignored, and Python then installs no handler: the signal would be lost and the run wait for its stopped ranks
    # forever. The default handler raises KeyboardInterrupt, as batchrl's own does in `batchrl run`.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def wait_then_interrupt() -> None:
        deadline = time.monotonic() + 600
        while not any(message in record.getMessage() for record in list(caplog.records)):
            if time.monotonic() > deadline:
                break  # the run never got there: interrupt it anyway, so that the test fails instead of hanging
            time.sleep(0.1)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=wait_then_interrupt, daemon=True).start()


def test_a_run_stopped_while_its_update_cannot_be_stopped_holds_the_run_lock_until_the_update_has_ended(
    tmp_path, toy_model_dir, toy_prompts_dir, caplog
):
    raw = merged(
        tiny_pipeline(model=toy_model_dir, prompts=toy_prompts_dir, root=str(tmp_path)),
        {
            "name": "stuck",
            "run": {"iterations": 2, "max_staleness": 1},
            "data.max_prompts": 4,  # one shard: every stage runs in this process
            "score.rewards": [{"reward": "gsm8k"}],  # a reward this process imports (tests/stages is not on its path)
            "update.trainer_lifetime": "stage",  # fresh ranks, which closing the stage does not stop
            "tracking.progress_bars": False,
        },
    )
    caplog.set_level(logging.INFO, logger="batchrl")
    run_dir = tmp_path / "stuck"
    with stuck_update_ranks() as let_the_ranks_go_on:
        interrupt_when_logged(caplog, "iter 1 generate: done")  # iteration 0's update in flight, its ranks stopped
        with pytest.raises(KeyboardInterrupt):
            Pipeline.from_dict(raw).run()
        assert "iter 0 update did not stop within 30 s" in caplog.text
        assert lock_holder(str(run_dir / "run.lock"))["pid"] == os.getpid()  # the update can still write: held
        let_the_ranks_go_on()
        deadline = time.monotonic() + 600
        while lock_holder(str(run_dir / "run.lock")) is not None:
            assert time.monotonic() < deadline, "the run lock was not released once the update ended"
            time.sleep(0.2)
    assert (run_dir / "iter_0000" / "policy" / "_MANIFEST.json").exists()  # published while the lock was held
