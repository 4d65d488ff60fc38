"""Faults, for real: the driver SIGKILLed at random moments, damaged and stray part files, a Ray worker killed
mid-stage, object storage going away mid-stage. After each, a resumed run ends with exactly the rows of an
uninterrupted run: nothing lost, nothing duplicated. Tiny runs (8 prompts, 2 samples, 8 new tokens, the HF
engine, a 1-process update) so that several fit in a few minutes on 2 cores."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, SAMPLES, ITERATIONS = 8, 2, 2
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


def pipeline_file(tmp_path: Path, *, toy_model_dir: str, train_files: list[str], root: str,
                  iterations: int = ITERATIONS) -> Path:
    raw = {
        "name": "faults",
        "run": {"root": root, "seed": 5, "iterations": iterations},
        "model": {"path": toy_model_dir, "dtype": "float32"},
        "data": {"train_files": train_files, "shard_size": 4, "max_prompt_tokens": 96, "max_prompts": NUM_PROMPTS},
        "generate": {"engine": "hf", "num_samples_per_prompt": SAMPLES, "max_new_tokens": 8, "temperature": 1.0},
        # varies within groups, so advantages are non-zero and the update moves the policy
        "score": {"rewards": [{"reward": "custom_rewards:digit_count", "weight": 1.0}]},
        "update": {"num_processes": 1, "backend": "gloo", "lr": 1e-3, "micro_batch_size": 8},
        "ray": {"num_cpus": 2},
    }
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def environment(extra: dict | None = None) -> dict:
    paths = [str(REPO / "tests" / "stages"), str(REPO / "tests" / "pipeline"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), **(extra or {})}


def batchrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=environment(env), timeout=600)


def start_batchrl(*args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    """A run in its own process group, so that what a SIGKILLed driver leaves behind can be cleaned up."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "batchrl.cli", *args], cwd=REPO, stdout=out, stderr=out,
                                env=environment(env), start_new_session=True)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def committed_table(table_dir: Path) -> pa.Table:
    manifest = read_json(table_dir / "_MANIFEST.json")
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(table_dir / p["name"]) for p in manifest["parts"]])


def table_dirs() -> list[str]:
    return ["prompts"] + [f"iter_{i:04d}/{t}" for i in range(ITERATIONS) for t in ("rollouts", "scores", "advantages")]


def assert_same_rows(expected_run: Path, run: Path) -> None:
    """Every table has the same rows (ids and all values) as the uninterrupted run, each key once."""
    for rel in table_dirs():
        keys = ["prompt_id", "sample_idx"] if rel.endswith("advantages") else ["prompt_id"]
        expected, got = committed_table(expected_run / rel), committed_table(run / rel)
        ids = list(zip(*(got.column(k).to_pylist() for k in keys)))
        assert len(ids) == len(set(ids)) == expected.num_rows, f"{rel}: lost or duplicated rows"
        order = [(k, "ascending") for k in keys]
        assert got.sort_by(order).to_pylist() == expected.sort_by(order).to_pylist(), f"{rel}: rows differ"
    for i in range(ITERATIONS):
        weights = f"iter_{i:04d}/policy/model.safetensors"
        assert sha256(run / weights) == sha256(expected_run / weights), f"{weights} differs"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> tuple[Path, Path]:
    """(pipeline file, run dir) of an uninterrupted run; tests copy it rather than change it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[toy_prompts_dir],
                         root=str(tmp_path / "runs"))
    result = batchrl("run", str(path), "--run-id", "reference")
    assert result.returncode == 0, result.stderr[-4000:]
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
            process = start_batchrl("run", str(path), "--run-id", "killed", log=tmp_path / "killed.log")
            groups.append(process.pid)
            if kind == "random":
                what = kill_when(process, lambda: None, timeout=delay)
            else:
                what = kill_when(process, lambda: first_partial_table(run), timeout=600)
            if what is None:
                history.append(f"{kind}: the run finished first")
                break
            status = batchrl("status", str(run)) if (run / "run.yaml").exists() else None
            history.append(f"SIGKILL ({kind}) at {what}\n{status.stdout if status else 'not started'}")
            if status is not None:
                # a stale lock, reported as such (or none, if the kill came after the run released it)
                assert ("lock: held by pid" in status.stdout and "dead" in status.stdout) or \
                    "lock: free" in status.stdout, status.stdout
            if kind == "partial":  # some or all shards written, no manifest yet
                assert re.search(r"partial  resume \(partial\)\s+[12] of 2 shards written", status.stdout), status.stdout
        final = batchrl("run", str(path), "--run-id", "killed")
        assert final.returncode == 0, final.stderr[-4000:] + "\n".join(history)
    finally:
        for pgid in groups:
            kill_group(pgid)  # Ray agents and update ranks that outlived their killed driver
    logger.info("kill schedule and the state each kill left:\n%s", "\n".join(history))
    assert sum("SIGKILL" in h for h in history) >= 2, "\n".join(history)
    assert_same_rows(expected_run, run)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(ITERATIONS))


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

    status = batchrl("status", str(run))
    assert "iter 0 generate        damaged  repair (redo damaged)" in status.stdout, status.stdout
    result = batchrl("run", str(path), "--run-id", "damaged")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "redoing damaged part-00001.parquet" in result.stderr
    assert "iter 0 score: complete" in result.stderr  # the redone part is identical: nothing after it is redone
    assert sorted(p.name for p in rollouts.iterdir()) == ["_MANIFEST.json", "_STARTED.json", "part-00000.parquet",
                                                          "part-00001.parquet"]
    assert (rollouts / "part-00000.parquet").stat().st_mtime_ns == untouched["part-00000.parquet"]
    assert (scores / "part-00042.parquet").exists()  # readers go by the manifest; a complete table is not touched
    assert_same_rows(expected_run, run)


def test_a_scoring_worker_killed_mid_stage_is_restarted_by_ray_and_the_stage_completes(reference, tmp_path):
    path, expected_run = reference
    run = copy_run(expected_run, "actor-killed")
    marker = tmp_path / "killed-once"
    rewards = "score.rewards=[{reward: 'test_faults:digit_count_killing_its_worker_once', weight: 1.0}]"
    result = batchrl("run", str(path), "--run-id", "actor-killed", "--set", rewards, "--set", "run.iterations=1",
                     env={KILL_MARKER_ENV: str(marker)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert marker.exists(), "the reward never killed its worker"
    assert "iter 0 generate: complete" in result.stderr
    scores = committed_table(run / "iter_0000" / "scores").to_pylist()
    assert len(scores) == NUM_PROMPTS
    for row in scores:
        assert row["scores"] == [float(sum(c.isdigit() for c in text)) for text in row["response_texts"]]
        assert all(error is None for error in row["score_errors"])
    assert committed_table(run / "iter_0000" / "advantages").num_rows == NUM_PROMPTS * SAMPLES


def wait_for(path_exists, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path_exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the run never reached the point to interrupt")
        time.sleep(0.2)


def test_object_storage_going_away_mid_stage_fails_cleanly_and_a_resume_completes_untorn(
        tmp_path, toy_model_dir, toy_prompts_dir, restartable_s3, s3_bucket):
    s3, env = restartable_s3
    from batchrl.storage import resolve

    fs, _ = resolve(f"s3://{s3_bucket}")
    for local in sorted(Path(toy_prompts_dir).glob("*.parquet")):
        fs.put_file(str(local), f"{s3_bucket}/prompts/{local.name}")
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[f"s3://{s3_bucket}/prompts/"],
                         root=f"s3://{s3_bucket}/runs", iterations=1)
    run = f"{s3_bucket}/runs/faults"
    backend = {**env, "AWS_ENDPOINT_URL": s3.backend}  # the test looks at the bucket behind the outage

    # A long outage (2 attempts per request): the run stops with exit 4 and a one-line reason.
    process = start_batchrl("run", str(path), log=tmp_path / "outage.log", env={**env, "BATCHRL_S3_MAX_ATTEMPTS": "2"})
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
    resumed = batchrl("run", str(path), env=env)
    blip.join()
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for table in ("prompts", "iter_0000/rollouts", "iter_0000/scores", "iter_0000/advantages", "iter_0000/policy"):
        manifest = json.loads(backend_fs.cat_file(f"{run}/{table}/_MANIFEST.json"))
        for part in manifest["parts"]:  # no torn table: every listed part is there, whole
            data = backend_fs.cat_file(f"{run}/{table}/{part['name']}")
            assert hashlib.sha256(data).hexdigest() == part["sha256"], f"{table}/{part['name']}"
    assert sum(p["rows"] for p in json.loads(backend_fs.cat_file(f"{run}/iter_0000/advantages/_MANIFEST.json"))[
        "parts"]) == NUM_PROMPTS * SAMPLES


def _s3fs(env: dict):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}, key="testing",
                             secret="testing", skip_instance_cache=True, use_listings_cache=False)


def _outage_when(s3, backend_fs, marker: str, seconds: float) -> None:
    try:
        wait_for(lambda: backend_fs.exists(marker), timeout=300)
    except TimeoutError:
        return
    s3.stop()
    time.sleep(seconds)
    s3.start()
