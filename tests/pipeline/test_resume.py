"""Resume semantics end to end: a changed reward re-scores stored rollouts without regenerating them,
--from-stage redoes a stage and what follows, and nightly runs warm-start from the previous run and ingest
only the prompt files it has not seen. Tiny runs: HF engine, 8 prompts, 2 samples, a 1-process update."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import DEFAULT, cli_ok, read_rows

pytestmark = pytest.mark.slow

RESUME = {"name": "resume", "run.seed": 11}
DOUBLED_REWARD = "score.rewards=[{reward: 'custom_rewards:digit_count', weight: 2.0}]"


def files_state(table_dir: Path) -> dict[str, tuple[int, str]]:
    """relative path -> (mtime_ns, sha256) of every file (the journal's too): equal before and after means not
    rewritten."""
    return {
        p.relative_to(table_dir).as_posix(): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(table_dir.rglob("*"))
        if p.is_file()
    }


def plan_lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """'iter 0 score' -> 'stale    redo (config changed)' from `batchrl plan` output."""
    out = {}
    for line in result.stdout.splitlines()[1:]:
        label, rest = line[2:24].strip(), line[24:].strip()
        out[label] = rest
    return out


def test_a_changed_reward_rescores_stored_rollouts_and_redoes_only_the_stages_after_it(tmp_path, pipeline):
    path = pipeline(RESUME)
    cli_ok("run", path)
    it = tmp_path / "runs" / "resume" / "iter_0000"
    rollouts, scores_before = files_state(it / "rollouts"), read_rows(it / "scores")
    policy_before = json.loads((it / "policy" / "_MANIFEST.json").read_text())["fingerprint"]

    plan = plan_lines(cli_ok("plan", path, sets=[DOUBLED_REWARD]))
    assert plan["ingest"].startswith("done") and plan["iter 0 generate"].startswith("done     skip (complete)")
    for stage in ("score", "advantage", "update"):
        assert plan[f"iter 0 {stage}"].startswith("stale    redo (config changed)"), plan

    rerun = cli_ok("run", path, sets=[DOUBLED_REWARD])
    assert "iter 0 generate: complete" in rerun.stderr and "iter 0 score: running" in rerun.stderr
    assert files_state(it / "rollouts") == rollouts  # not regenerated: the same files, never rewritten
    doubled = {r["prompt_id"]: r["scores"] for r in read_rows(it / "scores")}
    assert doubled == {r["prompt_id"]: [2 * s for s in r["scores"]] for r in scores_before}
    assert json.loads((it / "policy" / "_MANIFEST.json").read_text())["fingerprint"] != policy_before

    scores, advantages = files_state(it / "scores"), files_state(it / "advantages")
    forced = cli_ok("run", path, "--from-stage", "advantage", "--iteration", "0", sets=[DOUBLED_REWARD])
    assert "iter 0 score: complete" in forced.stderr and "iter 0 advantage: running" in forced.stderr
    assert files_state(it / "rollouts") == rollouts and files_state(it / "scores") == scores
    assert files_state(it / "advantages") != advantages  # redone (same rows, new files)
    assert "ran 2 stage(s)" in forced.stdout


def write_prompts(source: str, target: Path, rows_slice: slice) -> list[str]:
    table = pq.read_table(source)
    table = table.slice(rows_slice.start, rows_slice.stop - rows_slice.start)
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, target)
    return table.column("prompt_id").to_pylist()


def test_nightly_runs_warm_start_from_the_last_policy_and_ingest_only_files_not_seen_before(
    tmp_path, pipeline, toy_prompts_dir
):
    incoming = tmp_path / "incoming"
    source = str(sorted(Path(toy_prompts_dir).glob("*.parquet"))[0])
    write_prompts(source, incoming / "day1.parquet", slice(0, 4))
    write_prompts(source, incoming / "day2.parquet", slice(4, 8))
    # data.prompt_stats: each night's statistics go on from the last night's (issue 37's 3-night chain)
    path = pipeline(RESUME | {"data": {"train_files": [str(incoming)], "max_prompts": DEFAULT, "prompt_stats": True}})
    runs = tmp_path / "runs"
    cli_ok("run", path, "--run-id", "nightly-1")
    assert len(read_rows(runs / "nightly-1" / "prompts")) == 8
    stats_1 = {r["prompt_id"]: r for r in read_rows(runs / "nightly-1" / "iter_0000" / "prompt_stats")}
    assert len(stats_1) == 8 and {r["times_sampled"] for r in stats_1.values()} == {1}

    day3 = write_prompts(source, incoming / "day3.parquet", slice(8, 12))
    second = cli_ok("run", path, "--run-id", "nightly-2", sets=[f"run.init_from={runs / 'nightly-1'}"])
    assert "2 input file(s) already ingested" in second.stderr
    assert sorted(r["prompt_id"] for r in read_rows(runs / "nightly-2" / "prompts")) == sorted(day3)
    lineage = json.loads((runs / "nightly-2" / "_LINEAGE.json").read_text())
    assert lineage["initial_policy"] == str(runs / "nightly-1" / "iter_0000" / "policy")
    status = cli_ok("status", runs / "nightly-2")
    assert f"warm start: {runs / 'nightly-1' / 'iter_0000' / 'policy'}" in status.stdout
    assert status.stdout.count("skip (complete)") == 6 and "lock: free" in status.stdout
    stats_2 = {r["prompt_id"]: r for r in read_rows(runs / "nightly-2" / "iter_0000" / "prompt_stats")}
    assert {pid: stats_2[pid] for pid in stats_1} == stats_1  # last night's rows carried as they were
    assert {pid: stats_2[pid]["times_sampled"] for pid in day3} == dict.fromkeys(day3, 1)  # new prompts joined

    day4 = write_prompts(source, incoming / "day4.parquet", slice(12, 16))
    third = cli_ok("run", path, "--run-id", "nightly-3", sets=[f"run.init_from={runs / 'nightly-2'}"])
    assert "3 input file(s) already ingested" in third.stderr
    stats_3 = {r["prompt_id"]: r for r in read_rows(runs / "nightly-3" / "iter_0000" / "prompt_stats")}
    assert {pid: stats_3[pid] for pid in stats_2} == stats_2 and set(stats_3) == set(stats_2) | set(day4)
    assert {stats_3[pid]["first_iteration"] for pid in day4} == {0}

    fourth = cli_ok("run", path, "--run-id", "nightly-4", sets=[f"run.init_from={runs / 'nightly-3'}"])
    assert "nothing to train on" in fourth.stdout and "ran 0 stage(s)" in fourth.stdout
    assert not (runs / "nightly-4" / "prompts").exists()
    lineage = json.loads((runs / "nightly-4" / "_LINEAGE.json").read_text())
    assert lineage["no_new_files"] and len(lineage["seen_files"]) == 4
    assert lineage["initial_policy"] == str(runs / "nightly-3" / "iter_0000" / "policy")
