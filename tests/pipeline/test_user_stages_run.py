"""User stages in real runs: the two examples chained after score, materialised and read by advantage; a run
killed (-9) while a user stage has a shard in flight resumes to the rows and weights of an uninterrupted run; an
edit to a stage's code re-runs it and what follows, nothing before; a stage that breaks its contract stops the
run with exit 3 naming the stage and the column. Tiny runs: HF engine, 8 prompts in 2 shards, 2 samples."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
from harness import REPO, cli, cli_ok, kill_run_when, read_manifest, read_metrics, read_rows, start_cli, write_pipeline

from batchrl.tracking import run_tables

pytestmark = pytest.mark.slow

PAUSE_ENV = "BATCHRL_TEST_STAGE_PAUSE"  # a directory: the probe stage waits in part-00001 until `go` is there

PROBE_SOURCE = '''
import os, time
from pathlib import Path

import pyarrow as pa


def count_tokens(table, *, note):
    """Adds each group's response token count; pauses in a shard when told to (the kill -9 test)."""
    pause = os.environ.get("{env}")
    if pause and table.num_rows and table.column("prompt_id")[0].as_py() == "{paused_prompt}":
        Path(pause, "reached").write_text("")
        while not Path(pause, "go").exists():
            time.sleep(0.1)
    tokens = [sum(lengths) for lengths in table.column("response_lengths").to_pylist()]
    notes = pa.array([note] * len(tokens))
    return table.append_column("response_tokens", pa.array(tokens)).append_column("note", notes)
'''

STAGES = [
    {
        "name": "safety",
        "after": "score",
        "call": "examples.safety_filter:SafetyFilter",
        "params": {"banned_words": ["the", "a"], "min_safety": 0.9},
        "outputs": ["scores", "safety_scores", "unsafe"],
    },
    {
        "name": "shaping",
        "after": "score",
        "call": "examples.prompt_shaping:shape_by_prompt_length",
        "params": {"tokens_per_prompt_token": 0.05, "min_budget": 2, "penalty_per_token": 0.1},
        "outputs": ["scores", "length_penalties"],
    },
    {
        "name": "probe",
        "after": "generate",
        "call": "user_probe:count_tokens",
        "params": {"note": "n"},
        "outputs": ["response_tokens", "note"],
    },
]


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory, toy_prompts_dir):
    """A directory holding user_probe.py (the probe stage's module), put first on the runs' PYTHONPATH. Shared by
    the module's tests: none writes to it (the code-edit check edits a copy)."""
    import pyarrow.parquet as pq

    first_of_second_shard = pq.read_table(sorted(Path(toy_prompts_dir).glob("*.parquet"))[0]).column("prompt_id")[4]
    code = tmp_path_factory.mktemp("code")
    (code / "user_probe.py").write_text(PROBE_SOURCE.format(env=PAUSE_ENV, paused_prompt=first_of_second_shard))
    return code


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, toy_model_dir, toy_prompts_dir, probe_dir) -> tuple[Path, Path]:
    """(pipeline file, run directory) of the uninterrupted run with the three user stages, which the chaining test
    reads and the kill test compares against."""
    directory = tmp_path_factory.mktemp("user")
    path = write_pipeline(directory, {"name": "user", "stages": STAGES}, model=toy_model_dir, prompts=toy_prompts_dir)
    run(path, "user", probe_dir)
    return path, directory / "runs" / "user"


def run(path, run_id: str, probe_dir: Path, **kwargs):
    return cli_ok("run", path, "--run-id", run_id, path_first=[probe_dir, REPO], **kwargs)


def flat(rows: list[dict], column: str) -> dict[tuple[str, int], object]:
    return {(r["prompt_id"], i): v for r in rows for i, v in enumerate(r[column])}


def test_user_stages_are_materialised_chained_and_read_by_the_next_built_in_stage(tmp_path, user_run, probe_dir):
    path, run_dir = user_run
    plan = cli_ok("plan", path, path_first=[probe_dir, REPO]).stdout
    labels = [line[2:24].strip() for line in plan.splitlines()[1:]]
    assert labels[1:7] == [
        "iter 0 generate",
        "iter 0 probe",
        "iter 0 score",
        "iter 0 safety",
        "iter 0 shaping",
        "iter 0 advantage",
    ]
    it = run_dir / "iter_0000"
    rollouts, probe = read_rows(it / "rollouts"), read_rows(it / "probe")
    assert [r["response_tokens"] for r in probe] == [sum(r["response_lengths"]) for r in rollouts]
    assert read_manifest(it / "probe")["schema"] == "rollouts" and len(read_manifest(it / "probe")["parts"]) == 2

    scores, safety, shaping = (read_rows(it / t) for t in ("scores", "safety", "shaping"))
    raw, unsafe = flat(scores, "scores"), flat(safety, "unsafe")
    assert flat(safety, "scores") == {k: 0.0 if unsafe[k] else v for k, v in raw.items()}
    penalties = flat(shaping, "length_penalties")
    expected = {k: v - penalties[k] for k, v in flat(safety, "scores").items()}
    assert flat(shaping, "scores") == pytest.approx(expected)
    advantages = read_rows(it / "advantages")
    assert {(r["prompt_id"], r["sample_idx"]): r["score"] for r in advantages} == pytest.approx(flat(shaping, "scores"))
    metrics = read_metrics(run_dir)[0]
    assert metrics["stage/probe/rows"] == 8 and "timing_s/shaping" in metrics

    labels = [t.label for t in run_tables(str(run_dir)) if t.label.startswith("iter 0")]
    assert labels == [f"iter 0 {t}" for t in ("rollouts", "probe", "scores", "safety", "shaping", "advantages")]

    again = run(path, "user", probe_dir)
    assert "ran 0 stage(s)" in again.stdout
    forced = cli_ok("plan", path, "--from-stage", "safety", path_first=[probe_dir, REPO]).stdout
    status = {line[2:24].strip(): line[24:].split()[0] for line in forced.splitlines()[1:]}
    assert status["iter 0 score"] == "done" and status["iter 0 safety"] == status["iter 0 advantage"] == "forced"

    # an edit to the probe's module re-runs it and everything after it; generate stays done (edited in a copy: the
    # module's other tests run the original)
    edited = tmp_path / "edited"
    shutil.copytree(probe_dir, edited)
    (edited / "user_probe.py").write_text((edited / "user_probe.py").read_text() + "\n# edited\n")
    replan = cli_ok("plan", path, path_first=[edited, REPO]).stdout
    status = {line[2:24].strip(): line[24:].split()[0] for line in replan.splitlines()[1:]}
    assert status["iter 0 generate"] == "done" and status["iter 0 probe"] == "stale"
    assert status["iter 0 safety"] == "stale" and status["iter 0 update"] == "stale"
    assert re.search(r"^  iter 0 probe +stale +redo \(code changed\)", replan, re.M), replan


def test_a_run_killed_inside_a_user_stage_resumes_to_the_rows_and_weights_of_an_uninterrupted_one(
    tmp_path, user_run, probe_dir
):
    path, expected = user_run  # the same pipeline, run uninterrupted
    pause = tmp_path / "pause"
    pause.mkdir()
    process = start_cli(
        "run",
        path,
        "--run-id",
        "killed",
        log=tmp_path / "killed.log",
        env={PAUSE_ENV: str(pause)},
        path_first=[probe_dir, REPO],
    )
    kill_run_when(pause / "reached", process, log=tmp_path / "killed.log")  # a shard of probe in flight
    resumed = expected.parent / "killed"
    probe_dir_killed = resumed / "iter_0000" / "probe"
    assert not (probe_dir_killed / "_MANIFEST.json").exists()
    (pause / "go").write_text("")
    run(path, "killed", probe_dir)

    for table in ("probe", "scores", "safety", "shaping", "advantages"):
        assert read_rows(resumed / "iter_0000" / table) == read_rows(expected / "iter_0000" / table), table
    weights = "iter_0000/policy/model.safetensors"
    assert _sha256(resumed / weights) == _sha256(expected / weights)


def test_a_stage_that_changes_a_column_it_does_not_declare_stops_the_run_naming_stage_and_column(
    tmp_path, pipeline, probe_dir
):
    broken = STAGES[2] | {"outputs": ["response_tokens"]}  # it also adds `note`
    result = cli("run", pipeline({"name": "user", "stages": [broken]}), path_first=[probe_dir, REPO])
    assert result.returncode == 3, result.stderr[-3000:]
    assert "data error: stage probe added the column(s) ['note'], which its outputs do not declare" in result.stderr
    assert "Traceback" not in result.stderr


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
