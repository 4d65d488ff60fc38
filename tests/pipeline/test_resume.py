"""Resume semantics end to end: a changed reward re-scores stored rollouts without regenerating them,
--from-stage redoes a stage and what follows, and nightly runs warm-start from the previous run and ingest
only the prompt files it has not seen. Tiny runs: HF engine, 8 prompts, 2 samples, a 1-process update."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOUBLED_REWARD = "score.rewards=[{reward: 'custom_rewards:digit_count', weight: 2.0}]"


def pipeline_file(tmp_path: Path, *, toy_model_dir: str, train_files: list[str], **data) -> Path:
    raw = {
        "name": "resume",
        "run": {"root": str(tmp_path / "runs"), "seed": 11, "iterations": 1},
        "model": {"path": toy_model_dir, "dtype": "float32"},
        "data": {"train_files": train_files, "shard_size": 4, "max_prompt_tokens": 96, **data},
        "generate": {"engine": "hf", "num_samples_per_prompt": 2, "max_new_tokens": 8},
        "score": {"rewards": [{"reward": "custom_rewards:digit_count", "weight": 1.0}]},
        "update": {"num_processes": 1, "backend": "gloo", "lr": 1e-3, "micro_batch_size": 8},
        "ray": {"num_cpus": 2},
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def batchrl(*args: str) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests" / "stages"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "batchrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath}, timeout=600)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def files_state(table_dir: Path) -> dict[str, tuple[int, str]]:
    """name -> (mtime_ns, sha256) of every file: equal before and after means not rewritten."""
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(table_dir.iterdir())}


def rows(table_dir: Path) -> list[dict]:
    manifest = json.loads((table_dir / "_MANIFEST.json").read_text())
    return [r for p in manifest["parts"] for r in pq.read_table(table_dir / p["name"]).to_pylist()]


def plan_lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """'iter 0 score' -> 'stale    redo (config changed)' from `batchrl plan` output."""
    out = {}
    for line in result.stdout.splitlines()[1:]:
        label, rest = line[2:24].strip(), line[24:].strip()
        out[label] = rest
    return out


def test_a_changed_reward_rescores_stored_rollouts_and_redoes_only_the_stages_after_it(
        tmp_path, toy_model_dir, toy_prompts_dir):
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[toy_prompts_dir], max_prompts=8)
    ok(batchrl("run", str(path)))
    it = tmp_path / "runs" / "resume" / "iter_0000"
    rollouts, scores_before = files_state(it / "rollouts"), rows(it / "scores")
    policy_before = json.loads((it / "policy" / "_MANIFEST.json").read_text())["fingerprint"]

    plan = plan_lines(ok(batchrl("plan", str(path), "--set", DOUBLED_REWARD)))
    assert plan["ingest"].startswith("done") and plan["iter 0 generate"].startswith("done     skip (complete)")
    for stage in ("score", "advantage", "update"):
        assert plan[f"iter 0 {stage}"].startswith("stale    redo (config changed)"), plan

    rerun = ok(batchrl("run", str(path), "--set", DOUBLED_REWARD))
    assert "iter 0 generate: complete" in rerun.stderr and "iter 0 score: running" in rerun.stderr
    assert files_state(it / "rollouts") == rollouts  # not regenerated: the same files, never rewritten
    doubled = {r["prompt_id"]: r["scores"] for r in rows(it / "scores")}
    assert doubled == {r["prompt_id"]: [2 * s for s in r["scores"]] for r in scores_before}
    assert json.loads((it / "policy" / "_MANIFEST.json").read_text())["fingerprint"] != policy_before

    scores, advantages = files_state(it / "scores"), files_state(it / "advantages")
    forced = ok(batchrl("run", str(path), "--set", DOUBLED_REWARD, "--from-stage", "advantage", "--iteration", "0"))
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
        tmp_path, toy_model_dir, toy_prompts_dir):
    incoming = tmp_path / "incoming"
    source = str(sorted(Path(toy_prompts_dir).glob("*.parquet"))[0])
    write_prompts(source, incoming / "day1.parquet", slice(0, 4))
    write_prompts(source, incoming / "day2.parquet", slice(4, 8))
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[str(incoming)])
    runs = tmp_path / "runs"
    ok(batchrl("run", str(path), "--run-id", "nightly-1"))
    assert len(rows(runs / "nightly-1" / "prompts")) == 8

    day3 = write_prompts(source, incoming / "day3.parquet", slice(8, 12))
    warm = ["--set", f"run.init_from={runs / 'nightly-1'}"]
    second = ok(batchrl("run", str(path), "--run-id", "nightly-2", *warm))
    assert "2 input file(s) already ingested" in second.stderr
    assert sorted(r["prompt_id"] for r in rows(runs / "nightly-2" / "prompts")) == sorted(day3)
    lineage = json.loads((runs / "nightly-2" / "_LINEAGE.json").read_text())
    assert lineage["initial_policy"] == str(runs / "nightly-1" / "iter_0000" / "policy")
    status = ok(batchrl("status", str(runs / "nightly-2")))
    assert f"warm start: {runs / 'nightly-1' / 'iter_0000' / 'policy'}" in status.stdout
    assert status.stdout.count("skip (complete)") == 5 and "lock: free" in status.stdout

    third = ok(batchrl("run", str(path), "--run-id", "nightly-3", "--set", f"run.init_from={runs / 'nightly-2'}"))
    assert "nothing to train on" in third.stdout and "ran 0 stage(s)" in third.stdout
    assert not (runs / "nightly-3" / "prompts").exists()
    lineage = json.loads((runs / "nightly-3" / "_LINEAGE.json").read_text())
    assert lineage["no_new_files"] and len(lineage["seen_files"]) == 3
    assert lineage["initial_policy"] == str(runs / "nightly-2" / "iter_0000" / "policy")
