"""Faults, for real: the driver SIGKILLed at random moments, damaged and stray part files, a Ray worker killed
mid-stage, object storage going away mid-stage, SIGTERM mid-stage (exit 4). After each, a resumed run ends with
exactly the rows of an uninterrupted run: nothing lost, nothing duplicated; and a SIGKILLed driver leaves no
process behind. Tiny runs (8 prompts, 2 samples, 8 new tokens, the HF engine, a 1-process update) so that
several fit in a few minutes on 2 cores."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from harness import (
    cli,
    cli_ok,
    read_json,
    read_metrics,
    read_table,
    rewrite_at_the_same_size,
    start_cli,
    write_pipeline,
)

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

NUM_PROMPTS, SAMPLES, ITERATIONS = 8, 2, 2
# The tiny pipeline (8 prompts, 2 samples of 8 tokens, a digit-count reward that varies within groups, so
# advantages are non-zero and the update moves the policy), for 2 iterations.
FAULTS = {
    "name": "faults",
    "run.iterations": ITERATIONS,
    "data.max_prompts": NUM_PROMPTS,
    "generate": {"num_samples_per_prompt": SAMPLES, "temperature": 1.0},
}
KILL_MARKER_ENV = "BATCHRL_TEST_KILL_MARKER"


def digit_count_killing_its_worker_once(response, ground_truth, **row):
    """A reward (referenced as test_faults:...) that SIGKILLs the Ray actor running it, once per marker file."""
    marker = os.environ.get(KILL_MARKER_ENV)
    if marker and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        os.kill(_ray_worker_pid(), signal.SIGKILL)
    return float(sum(ch.isdigit() for ch in response))


def _ray_worker_pid() -> int:
    """This process if it is the Ray worker, else its parent (rewards may run in a child of the actor)."""
    for pid in (os.getpid(), os.getppid()):
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
            return pid
    raise AssertionError("not running in a Ray worker")


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def table_dirs() -> list[str]:
    return ["prompts"] + [f"iter_{i:04d}/{t}" for i in range(ITERATIONS) for t in ("rollouts", "scores", "advantages")]


def assert_same_rows(expected_run: Path, run: Path) -> None:
    """Every table has the same rows (ids and all values) as the uninterrupted run, each key once."""
    for rel in table_dirs():
        keys = ["prompt_id", "sample_idx"] if rel.endswith("advantages") else ["prompt_id"]
        expected, got = read_table(expected_run / rel, sort_by=keys), read_table(run / rel, sort_by=keys)
        ids = list(zip(*(got.column(k).to_pylist() for k in keys)))
        assert len(ids) == len(set(ids)) == expected.num_rows, f"{rel}: lost or duplicated rows"
        assert got.to_pylist() == expected.to_pylist(), f"{rel}: rows differ"
    for i in range(ITERATIONS):
        weights = f"iter_{i:04d}/policy/model.safetensors"
        assert sha256(run / weights) == sha256(expected_run / weights), f"{weights} differs"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> tuple[Path, Path]:
    """(pipeline file, run dir) of an uninterrupted run; tests copy it rather than change it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    path = write_pipeline(tmp_path, FAULTS, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path, "--run-id", "reference")
    return path, tmp_path / "runs" / "reference"


def copy_run(reference_run: Path, run_id: str) -> Path:
    target = reference_run.parent / run_id
    shutil.copytree(reference_run, target)
    return target


def first_partial_table(run: Path) -> Path | None:
    """A stage directory holding some parts but no manifest yet: a stage caught mid-way."""
    for rel in table_dirs()[1:]:
        table = run / rel
        if not (table / "_MANIFEST.json").exists() and any(table.glob("part-*.parquet")):
            return table
    return None


def kill_when(process: subprocess.Popen, moment, *, timeout: float) -> str | None:
    """SIGKILLs ``process`` once ``moment()`` returns something (or at the timeout); None if it finished first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        found = moment()
        if found is not None or time.monotonic() > deadline:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            return str(found or f"{timeout:.1f} s")
        time.sleep(0.02)
    return None


def test_a_driver_killed_at_random_moments_resumes_to_exactly_the_rows_of_an_uninterrupted_run(reference, tmp_path):
    path, expected_run = reference
    run = expected_run.parent / "killed"
    rng = random.Random(20261202)
    groups, history = [], []
    # two kills at seeded random moments, one as soon as a stage is caught with only some of its shards written
    moments = [("random", rng.uniform(4.0, 14.0)), ("partial", None), ("random", rng.uniform(5.0, 20.0))]
    try:
        for kind, delay in moments:
            process = start_cli("run", path, "--run-id", "killed", log=tmp_path / "killed.log")
            groups.append(process.pid)
            if kind == "random":
                what = kill_when(process, lambda: None, timeout=delay)
            else:
                what = kill_when(process, lambda: first_partial_table(run), timeout=600)
            if what is None:
                history.append(f"{kind}: the run finished first")
                break
            status = cli("status", run) if (run / "run.yaml").exists() else None
            history.append(f"SIGKILL ({kind}) at {what}\n{status.stdout if status else 'not started'}")
            if status is not None:
                # a stale lock, reported as such (or none, if the kill came after the run released it)
                assert (
                    "lock: held by pid" in status.stdout and "dead" in status.stdout
                ) or "lock: free" in status.stdout, status.stdout
            if kind == "partial":  # some or all shards written, no manifest yet
                assert re.search(r"partial  resume \(partial\)\s+[12] of 2 shards written", status.stdout), (
                    status.stdout
                )
        final = cli("run", path, "--run-id", "killed")
        assert final.returncode == 0, final.stderr[-4000:] + "\n".join(history)
    finally:
        for pgid in groups:
            kill_group(pgid)  # whatever outlived its killed driver (the watchdog should have stopped it all)
    logger.info("kill schedule and the state each kill left:\n%s", "\n".join(history))
    assert sum("SIGKILL" in h for h in history) >= 2, "\n".join(history)
    assert_same_rows(expected_run, run)
    assert [m["iteration"] for m in read_metrics(run)] == list(range(ITERATIONS))


def test_a_truncated_part_is_redone_alone_and_stray_files_are_removed_or_ignored(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "damaged")
    rollouts, scores = run / "iter_0000" / "rollouts", run / "iter_0000" / "scores"
    untouched = {p.name: p.stat().st_mtime_ns for p in rollouts.glob("part-*")}
    victim = rollouts / "part-00001.parquet"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    (rollouts / "part-00042.parquet").write_bytes(b"a stray part no manifest lists")
    (rollouts / ".tmp-0123-part-00000.parquet").write_bytes(b"a killed writer's leftover")
    (scores / "part-00042.parquet").write_bytes(b"a stray file beside a complete table")

    status = cli("status", run)
    assert "iter 0 generate        damaged  repair (redo damaged)" in status.stdout, status.stdout
    result = cli_ok("run", path, "--run-id", "damaged")
    assert "redoing damaged part-00001.parquet" in result.stderr
    assert "iter 0 score: complete" in result.stderr  # the redone part is identical: nothing after it is redone
    assert sorted(p.name for p in rollouts.iterdir()) == [
        "_MANIFEST.json",
        "_STARTED.json",
        "_journal",  # the finished shards' records, kept with the table (a later repair takes its counts from them)
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert (rollouts / "part-00000.parquet").stat().st_mtime_ns == untouched["part-00000.parquet"]
    assert (scores / "part-00042.parquet").exists()  # readers go by the manifest; a complete table is not touched
    assert_same_rows(expected_run, run)


def test_a_scoring_worker_killed_mid_stage_is_restarted_by_ray_and_the_stage_completes(reference, tmp_path):
    path, expected_run = reference
    run = copy_run(expected_run, "actor-killed")
    marker = tmp_path / "killed-once"
    rewards = "score.rewards=[{reward: 'test_faults:digit_count_killing_its_worker_once', weight: 1.0}]"
    # score.num_actors set: its pool even on the 1 CPU the engine leaves (a derived pool of one runs in the driver)
    sets = [rewards, "run.iterations=1", "score.num_actors=1"]
    result = cli_ok("run", path, "--run-id", "actor-killed", sets=sets, env={KILL_MARKER_ENV: str(marker)})
    assert marker.exists(), "the reward never killed its worker"
    assert "iter 0 generate: complete" in result.stderr
    scores = read_table(run / "iter_0000" / "scores").to_pylist()
    assert len(scores) == NUM_PROMPTS
    for row in scores:
        assert row["scores"] == [float(sum(c.isdigit() for c in text)) for text in row["response_texts"]]
        assert all(error is None for error in row["score_errors"])
    assert read_table(run / "iter_0000" / "advantages").num_rows == NUM_PROMPTS * SAMPLES


def wait_for(path_exists, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path_exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the run never reached the point to interrupt")
        time.sleep(0.2)


def test_object_storage_going_away_mid_stage_fails_cleanly_and_a_resume_completes_untorn(
    tmp_path, pipeline, restartable_s3, s3_bucket, s3_prompts
):
    s3, env = restartable_s3
    path = pipeline(
        FAULTS | {"run.iterations": 1, "run.root": f"s3://{s3_bucket}/runs", "data.train_files": [s3_prompts]}
    )
    run = f"{s3_bucket}/runs/faults"
    backend = {**env, "AWS_ENDPOINT_URL": s3.backend}  # the test looks at the bucket behind the outage

    # A long outage (2 attempts per request): the run stops with exit 4 and a one-line reason.
    process = start_cli("run", path, log=tmp_path / "outage.log", env={**env, "BATCHRL_S3_MAX_ATTEMPTS": "2"})
    try:
        backend_fs = _s3fs(backend)
        wait_for(lambda: backend_fs.exists(f"{run}/iter_0000/rollouts/_STARTED.json"), timeout=300)
        s3.stop()
        assert process.wait(timeout=300) == 4, (tmp_path / "outage.log").read_text()[-4000:]
    finally:
        kill_group(process.pid)
    log = (tmp_path / "outage.log").read_text()
    assert "interrupted: object storage unreachable" in log and "Traceback" not in log, log[-4000:]
    assert not backend_fs.exists(f"{run}/iter_0000/rollouts/_MANIFEST.json")

    # Back up; a short outage during the resume is ridden out by the retries; the run completes.
    s3.start()
    blip = threading.Thread(target=_outage_when, args=(s3, backend_fs, f"{run}/iter_0000/scores/_STARTED.json", 2.0))
    blip.start()
    resumed = cli("run", path, env=env)
    blip.join()
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for table in ("prompts", "iter_0000/rollouts", "iter_0000/scores", "iter_0000/advantages", "iter_0000/policy"):
        manifest = json.loads(backend_fs.cat_file(f"{run}/{table}/_MANIFEST.json"))
        for part in manifest["parts"]:  # no torn table: every listed part is there, whole
            data = backend_fs.cat_file(f"{run}/{table}/{part['name']}")
            assert hashlib.sha256(data).hexdigest() == part["sha256"], f"{table}/{part['name']}"
    assert (
        sum(p["rows"] for p in json.loads(backend_fs.cat_file(f"{run}/iter_0000/advantages/_MANIFEST.json"))["parts"])
        == NUM_PROMPTS * SAMPLES
    )


def _s3fs(env: dict):
    import s3fs

    return s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
        key="testing",
        secret="testing",
        skip_instance_cache=True,
        use_listings_cache=False,
    )


def _outage_when(s3, backend_fs, marker: str, seconds: float) -> None:
    try:
        wait_for(lambda: backend_fs.exists(marker), timeout=300)
    except TimeoutError:
        return
    s3.stop()
    time.sleep(seconds)
    s3.start()


STAGE_DIRS = [f"iter_{i:04d}/{t}" for i in range(ITERATIONS) for t in ("rollouts", "scores", "advantages", "policy")]


def started_at(run: Path) -> dict[str, float]:
    """When each committed stage of ``run`` started, by table directory: a redone stage starts later."""
    return {
        rel: read_json(run / rel / "_MANIFEST.json")["started_at"]
        for rel in STAGE_DIRS
        if (run / rel / "_MANIFEST.json").exists()
    }


def test_a_policy_redone_into_the_same_weights_keeps_every_stage_made_from_it(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "policy-redone")
    before = started_at(run)
    (run / "iter_0000" / "policy" / "_MANIFEST.json").unlink()
    cli_ok("run", path, "--run-id", "policy-redone")
    after = started_at(run)
    assert [rel for rel in STAGE_DIRS if after[rel] != before[rel]] == ["iter_0000/policy"]
    assert_same_rows(expected_run, run)  # a deterministic update reproduces its weights: iteration 1 is still theirs


def test_a_foreign_parquet_file_under_a_part_name_of_an_unfinished_stage_is_redone_not_taken_for_its_output(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "poisoned")
    scores = run / "iter_0001" / "scores"
    (scores / "_MANIFEST.json").unlink()  # the stage caught mid-way: its _STARTED.json and parts are there
    pq.write_table(pa.table({"question": ["What is 2 + 2?"], "answer": [4.0]}), scores / "part-00000.parquet")
    result = cli_ok("run", path, "--run-id", "poisoned")
    assert "part-00000.parquet is not this stage's output" in result.stderr, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    assert_same_rows(expected_run, run)


def test_a_journalled_part_replaced_by_other_rows_of_the_same_size_is_redone_not_trained_on(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "replaced")
    advantages = run / "iter_0001" / "advantages"
    (advantages / "_MANIFEST.json").unlink()  # the stage caught mid-way, its part journalled, the update not run
    shutil.rmtree(run / "iter_0001" / "policy")
    part = advantages / "part-00000.parquet"
    table = pq.read_table(part)
    negated = pc.negate(table.column("advantage"))
    rewrite_at_the_same_size(part, table.set_column(table.schema.get_field_index("advantage"), "advantage", negated))
    result = cli_ok("run", path, "--run-id", "replaced")
    assert f"{part} does not hash to the sha256 its journal record holds" in result.stderr, result.stderr[-4000:]
    assert_same_rows(expected_run, run)  # the update trained on the stage's own rows: the reference's weights


def test_an_update_whose_optimizer_state_is_gone_stops_with_exit_3_and_the_redo_it_names_reproduces_the_run(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "state-gone")
    shutil.rmtree(run / "iter_0000" / "policy" / "_trainer_state")  # as keep_last_k_optimizer_states prunes it
    (run / "iter_0001" / "policy" / "_MANIFEST.json").unlink()
    stopped = cli("run", path, "--run-id", "state-gone")
    assert stopped.returncode == 3, stopped.stderr[-4000:]  # not AdamW silently restarted from zero moments
    assert "iter_0000/policy/_trainer_state/" in stopped.stderr and "is gone" in stopped.stderr, stopped.stderr
    command = "--from-stage update --iteration 0"
    assert command in stopped.stderr, stopped.stderr[-4000:]

    before = started_at(run)
    cli_ok("run", path, "--run-id", "state-gone", *command.split())
    after = started_at(run)
    assert [rel for rel in STAGE_DIRS if after[rel] == before.get(rel)] == [
        "iter_0000/rollouts",
        "iter_0000/scores",
        "iter_0000/advantages",
    ]
    assert_same_rows(expected_run, run)  # the optimizer state restored exactly: the same weights as before


def test_stages_made_from_a_table_that_was_redone_differently_are_redone_even_without_its_old_manifest(reference):
    path, expected_run = reference
    run = copy_run(expected_run, "scores-redone")
    before = started_at(run)
    shutil.rmtree(run / "iter_0001" / "scores")
    # the reward now scores otherwise, by something neither the config nor its module's source (both in the
    # fingerprint) shows: an environment variable here; a helper module or a library upgrade in real life
    cli_ok("run", path, "--run-id", "scores-redone", env={"BATCHRL_TEST_DIGIT_WEIGHT": "3"})
    after = started_at(run)
    assert [rel for rel in STAGE_DIRS if after[rel] != before[rel]] == [
        "iter_0001/scores",
        "iter_0001/advantages",
        "iter_0001/policy",
    ]
    from batchrl.storage.manifest import Manifest, content_digest

    scores = Manifest.from_json((run / "iter_0001" / "scores" / "_MANIFEST.json").read_text())
    advantages = read_json(run / "iter_0001" / "advantages" / "_MANIFEST.json")
    assert advantages["inputs"]["scores"] == content_digest(scores)
    weights = "iter_0001/policy/model.safetensors"
    assert sha256(run / weights) != sha256(expected_run / weights)  # trained on other advantages


class CreatesAFileWhenUnpickled:
    """A planted pickle: unpickling it runs Path.touch, where an attacker's would run anything."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_an_optimizer_state_file_changed_after_it_was_written_is_never_unpickled_and_the_run_exits_3(
    reference, tmp_path
):
    path, expected_run = reference
    run = copy_run(expected_run, "state-tampered")
    marker = tmp_path / "code-ran"
    metadata = run / "iter_0000" / "policy" / "_trainer_state" / "optimizer" / ".metadata"
    planted = pickle.dumps(CreatesAFileWhenUnpickled(marker))
    size = metadata.stat().st_size
    assert len(planted) < size
    metadata.write_bytes(planted + b"\0" * (size - len(planted)))  # same size: only its sha256 can tell
    (run / "iter_0001" / "policy" / "_MANIFEST.json").unlink()  # iteration 1's update is redone: it loads the state
    result = cli("run", path, "--run-id", "state-tampered")
    assert not marker.exists(), "the planted optimizer state was unpickled"
    assert result.returncode == 3, result.stderr[-4000:]
    assert f"data error: {metadata}: sha256 " in result.stderr and "did not load it" in result.stderr, result.stderr[
        -4000:
    ]


def test_an_optimizer_state_recorded_without_checksums_stops_the_run_with_exit_3_unless_unverified_ones_are_allowed(
    reference,
):
    path, expected_run = reference
    run = copy_run(expected_run, "state-unchecksummed")
    manifest = run / "iter_0000" / "policy" / "_MANIFEST.json"
    written = json.loads(manifest.read_text())
    del written["trainer_state"]
    manifest.write_text(json.dumps(written))  # as an earlier batchrl wrote it: the state's files, no record of them
    (run / "iter_0001" / "policy" / "_MANIFEST.json").unlink()  # iteration 1's update is redone: it loads the state
    stopped = cli("run", path, "--run-id", "state-unchecksummed")
    assert stopped.returncode == 3, stopped.stderr[-4000:]
    assert "--set update.allow_unverified_trainer_state=true" in stopped.stderr, stopped.stderr[-4000:]
    assert (run / "iter_0001" / "policy" / "model.safetensors").exists()  # refused before anything was removed

    allowed = cli_ok(
        "run", path, "--run-id", "state-unchecksummed", sets=["update.allow_unverified_trainer_state=true"]
    )
    assert "loaded unverified" in allowed.stderr
    assert_same_rows(expected_run, run)  # the same state restored: the same weights


UPDATE_RANK = "batchrl.trainer.worker"


def session_processes(sid: int) -> list[str]:
    """Command lines of the live processes of session ``sid``: a run started by start_cli and everything it
    started (Ray's processes and update ranks stay in their driver's session). Zombies are not counted: they hold
    nothing, and whether they are reaped is up to init."""
    return [command for _, command in session_pids(sid)]


def session_pids(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each live process of session ``sid`` (see session_processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != b"Z":
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(entry.name), command))
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return found


def wait_until_none_left(sid: int, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while session_processes(sid):
        assert time.monotonic() < deadline, f"still running {timeout:.0f} s later: {session_processes(sid)}"
        time.sleep(0.2)


def stopped_with_sigterm(path: Path, run: Path, moment, *, log: Path, again_after: float | None = None) -> str:
    """Starts (or resumes) the run, SIGTERMs its driver once ``moment(process)`` is true (and again ``again_after``
    s later, during the clean-up), checks that it stopped as schedulers expect; returns its output."""
    process = start_cli("run", path, "--run-id", run.name, log=log)
    try:
        wait_for(lambda: moment(process) or process.poll() is not None, timeout=600)
        assert process.poll() is None, f"the run ended before the moment to stop it:\n{log.read_text()[-4000:]}"
        process.send_signal(signal.SIGTERM)
        if again_after is not None:
            time.sleep(again_after)
            process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
        output = log.read_text()
        assert code == 4, output[-4000:]
        assert "interrupted (SIGTERM): run again with the same command to resume" in output, output[-4000:]
        assert "Traceback" not in output and "SIGTERM received at time" not in output, output[-4000:]
        assert not (run / "run.lock").exists()
        wait_until_none_left(process.pid, timeout=30)  # Ray, update ranks, the watchdog
        return output
    finally:
        kill_group(process.pid)


def test_sigterm_during_a_ray_stage_and_during_the_update_exits_4_and_the_resumed_run_equals_an_uninterrupted_one(
    reference, tmp_path
):
    path, expected_run = reference
    run = expected_run.parent / "sigterm"
    rollouts = run / "iter_0000" / "rollouts"
    stopped_with_sigterm(path, run, lambda _: (rollouts / "_STARTED.json").exists(), log=tmp_path / "generate.log")
    assert not (rollouts / "_MANIFEST.json").exists()  # stopped in the middle of generation on Ray actors

    update_log = tmp_path / "update.log"

    def update_running(process):  # the ranks start ahead (UpdateStage.prestart): the step's own log line
        return "iter 0 update: running" in update_log.read_text(errors="replace") if update_log.exists() else False

    output = stopped_with_sigterm(path, run, update_running, log=update_log, again_after=0.2)
    assert "iter 0 update: running" in output and not (run / "iter_0000" / "policy" / "_MANIFEST.json").exists()
    assert "SIGTERM received while stopping: finishing the clean-up first" in output

    cli_ok("run", path, "--run-id", "sigterm")
    assert_same_rows(expected_run, run)


def test_a_driver_killed_with_sigkill_mid_stage_leaves_no_process_behind(tmp_path, pipeline):
    path = pipeline(FAULTS | {"run.iterations": 1})
    process = start_cli("run", path, "--run-id", "killed", log=tmp_path / "killed.log")
    try:
        generating = tmp_path / "runs" / "killed" / "iter_0000" / "rollouts" / "_STARTED.json"
        wait_for(lambda: generating.exists() or process.poll() is not None, timeout=600)
        running = session_processes(process.pid)
        # the raylet's agents are what outlived a killed driver; update ranks: tests/unit/test_reaper.py
        assert any("raylet" in c for c in running) and any("ray::DashboardAgent" in c for c in running), running
        os.kill(process.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        process.wait()
        wait_until_none_left(process.pid, timeout=30)
    finally:
        kill_group(process.pid)


def test_an_update_rank_dying_of_a_signal_stops_the_run_with_one_line_and_a_log_and_the_resume_redoes_its_policy(
    reference, tmp_path
):
    """A native crash in a rank (SIGABRT here, as glibc's "free(): invalid size" raises it): exit 1 with one line
    naming the stage, the rank and the signal, the log with the rank's stderr, nothing of that update committed."""
    path, expected_run = reference
    run = expected_run.parent / "rank-abort"
    log = tmp_path / "abort.log"
    process = start_cli("run", path, "--run-id", run.name, log=log)
    try:

        def a_rank() -> list[int]:
            return [pid for pid, command in session_pids(process.pid) if UPDATE_RANK in command]

        def updating() -> bool:  # the ranks start ahead (UpdateStage.prestart): killed once the update runs
            return "iter 0 update: running" in log.read_text(errors="replace") and bool(a_rank())

        wait_for(lambda: updating() or process.poll() is not None, timeout=600)
        assert process.poll() is None, f"the run ended before its update:\n{log.read_text()[-4000:]}"
        os.kill(a_rank()[0], signal.SIGABRT)
        code = process.wait(timeout=120)
    finally:
        kill_group(process.pid)
    output = log.read_text()
    crash_log = run / "_logs" / "iter_0_update-update_rank_0.log"
    assert code == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert [line for line in output.splitlines() if "died of" in line] == [
        f"internal failure: update rank 0 died of SIGABRT in iter 0 update; details in {crash_log}; "
        "run the same command to resume"
    ]
    assert "update rank 0 exited with code -6; stderr tail:" in crash_log.read_text()
    assert not (run / "iter_0000" / "policy" / "_MANIFEST.json").exists()

    cli_ok("run", path, "--run-id", run.name)
    assert_same_rows(expected_run, run)
