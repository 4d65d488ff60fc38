"""Resume bookkeeping without running a stage: damaged-part detection, plan states, --from-stage, nightly
lineage (warm start + files already ingested) and the run lock. Manifests are written by hand with the
fingerprints the planner computes, so every state is set up exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchrl.config import ConfigError, validate_dict
from batchrl.errors import DataError
from batchrl.pipeline import lock as lock_module
from batchrl.pipeline.lineage import files_to_ingest, resolve_lineage
from batchrl.pipeline.lock import RunLock, RunLockedError, break_lock, holder_state
from batchrl.pipeline.plan import STARTED_MARKER, build_plan, check_from_stage, current_input_digest
from batchrl.pipeline.runner import Runner
from batchrl.pipeline.stage import STAGES, StageOutput
from batchrl.stages.update import UpdateStage
from batchrl.storage import file_identities, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo, content_digest, damaged_parts, read_manifest, write_manifest


def config(tmp_path: Path, **run) -> object:
    return validate_dict(
        {
            "name": "r",
            "run": {"root": str(tmp_path / "runs"), "iterations": 2, **run},
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
            "data": {"train_files": [str(tmp_path / "in")]},
        }
    )


def commit(table_dir: str, *, stage: str, fp: str, num_parts: int = 2, rows: int = 3) -> Manifest:
    """Writes num_parts real Parquet parts and their manifest, as a completed stage would."""
    parts = []
    for k in range(num_parts):
        name = f"part-{k:05d}.parquet"
        num_bytes, digest = write_parquet_atomic(pa.table({"x": list(range(rows))}), f"{table_dir}/{name}")
        parts.append(PartInfo(name=name, rows=rows, sha256=digest, num_bytes=num_bytes))
    manifest = Manifest(
        stage=stage,
        table=stage,
        iteration=None,
        fingerprint=fp,
        parts=parts,
        schema="s",
        started_at=0.0,
        finished_at=1.0,
    )
    write_manifest(table_dir, manifest)
    Path(table_dir, STARTED_MARKER).write_text(json.dumps({"fingerprint": fp}))
    return manifest


def test_damaged_parts_names_a_truncated_and_a_missing_part_but_not_an_intact_one(tmp_path):
    manifest = commit(str(tmp_path / "t"), stage="generate", fp="f", num_parts=3)
    assert damaged_parts(str(tmp_path / "t"), manifest) == []
    with open(tmp_path / "t" / "part-00000.parquet", "r+b") as f:
        f.truncate(10)
    (tmp_path / "t" / "part-00002.parquet").unlink()
    (tmp_path / "t" / "part-00099.parquet").write_text("a stray file is not damage")
    assert damaged_parts(str(tmp_path / "t"), manifest) == ["part-00000.parquet", "part-00002.parquet"]


def test_only_a_checksum_check_catches_a_same_size_corruption(tmp_path):
    manifest = commit(str(tmp_path / "t"), stage="generate", fp="f", num_parts=1)
    path = tmp_path / "t" / "part-00000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert damaged_parts(str(tmp_path / "t"), manifest) == []
    assert damaged_parts(str(tmp_path / "t"), manifest, checksums=True) == ["part-00000.parquet"]


def test_the_plan_tells_done_damaged_stale_partial_and_pending_apart_without_running_anything(tmp_path):
    cfg = config(tmp_path)
    steps = {(s.name, s.iteration): s for s in build_plan(cfg, check_storage=False)}
    ingest, generate, score = steps[("ingest", None)], steps[("generate", 0)], steps[("score", 0)]
    commit(ingest.output_dir, stage="ingest", fp=ingest.fingerprint, num_parts=4)
    commit(generate.output_dir, stage="generate", fp=generate.fingerprint, num_parts=4)
    commit(score.output_dir, stage="score", fp="an-older-config", num_parts=4)
    advantage = steps[("advantage", 0)]
    Path(advantage.output_dir).mkdir(parents=True)
    Path(advantage.output_dir, STARTED_MARKER).write_text(
        json.dumps({"fingerprint": advantage.fingerprint, "started_at": time.time()})
    )
    write_parquet_atomic(pa.table({"x": [1]}), f"{advantage.output_dir}/part-00001.parquet")

    plan = {(s.name, s.iteration): s for s in build_plan(cfg)}
    assert plan[("ingest", None)].status == "done"
    assert plan[("generate", 0)].status == "done"
    assert plan[("score", 0)].status == "stale"
    assert plan[("advantage", 0)].status == "partial" and plan[("advantage", 0)].parts_written == 1
    assert plan[("update", 0)].status == "pending"

    (Path(generate.output_dir) / "part-00003.parquet").unlink()
    damaged = build_plan(cfg)[1]
    assert (damaged.name, damaged.status, damaged.damaged) == ("generate", "damaged", ["part-00003.parquet"])


def test_a_partial_stage_reports_how_many_of_its_input_shards_are_written(tmp_path):
    cfg = config(tmp_path)
    steps = {(s.name, s.iteration): s for s in build_plan(cfg, check_storage=False)}
    ingest, generate = steps[("ingest", None)], steps[("generate", 0)]
    commit(ingest.output_dir, stage="ingest", fp=ingest.fingerprint, num_parts=4)
    Path(generate.output_dir).mkdir(parents=True)
    Path(generate.output_dir, STARTED_MARKER).write_text(json.dumps({"fingerprint": generate.fingerprint}))
    for k in (0, 2):
        write_parquet_atomic(pa.table({"x": [k]}), f"{generate.output_dir}/part-{k:05d}.parquet")
    (Path(generate.output_dir) / ".tmp-1234-part-00001.parquet").write_bytes(b"half a file")
    step = build_plan(cfg)[1]
    assert (step.status, step.parts_written, step.parts_total) == ("partial", 2, 4)


def test_from_stage_forces_that_stage_of_that_iteration_and_everything_after_it(tmp_path):
    cfg = config(tmp_path)
    for step in build_plan(cfg, check_storage=False):
        commit(step.output_dir, stage=step.name, fp=step.fingerprint, num_parts=1)
    plan = build_plan(cfg, from_stage="advantage", from_iteration=0)
    assert [(s.label, s.status) for s in plan] == [
        ("ingest", "done"),
        ("iter 0 generate", "done"),
        ("iter 0 score", "done"),
        ("iter 0 advantage", "forced"),
        ("iter 0 update", "forced"),
        ("iter 1 generate", "forced"),
        ("iter 1 score", "forced"),
        ("iter 1 advantage", "forced"),
        ("iter 1 update", "forced"),
    ]
    later = build_plan(cfg, from_stage="score", from_iteration=1)
    assert [s.status for s in later].count("forced") == 3


def test_from_stage_names_a_stage_and_an_iteration_of_the_run(tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(ConfigError, match="not a stage"):
        check_from_stage(cfg, "scoring", None)
    with pytest.raises(ConfigError, match="outside this run's iterations 0..1"):
        check_from_stage(cfg, "score", 2)
    with pytest.raises(ConfigError, match="drop --iteration"):
        check_from_stage(cfg, "ingest", 0)


def committed_run(cfg, *, record_inputs: bool = True) -> dict:
    """Every stage of ``cfg`` committed as the runner commits it, each with content of its own (so no two tables
    share a digest) and, with ``record_inputs``, the content digest of each input it was made from."""
    plan = build_plan(cfg, check_storage=False)
    by_dir, lineage = {s.output_dir: s for s in plan}, resolve_lineage(cfg)
    for rows, step in enumerate(plan, start=1):
        step.manifest = commit(step.output_dir, stage=step.name, fp=step.fingerprint, num_parts=1, rows=rows)
        if record_inputs:
            step.manifest.inputs = {t: current_input_digest(step, t, by_dir, lineage) for t in STAGES[step.name].inputs}
            write_manifest(step.output_dir, step.manifest)
    return {s.label: s for s in plan}


def redone_update(rows: int) -> type:
    """The update stage with a stand-in body: it writes a policy part of ``rows`` rows (the committed policy of
    iteration 0 has 5: the same rows give the same content)."""

    class RedoneUpdate(UpdateStage):
        def run(self, ctx):
            num_bytes, digest = write_parquet_atomic(
                pa.table({"x": list(range(rows))}), f"{ctx.output_dir}/part-00000.parquet"
            )
            return StageOutput(parts=[PartInfo("part-00000.parquet", rows, digest, num_bytes)], trainer_state=[])

    return RedoneUpdate


def redo_update_0(cfg, monkeypatch, *, rows: int) -> dict:
    """Runs iteration 0's update (a stand-in writing ``rows`` rows) the way a resumed run does; the plan after it."""
    monkeypatch.setitem(STAGES, "update", redone_update(rows))
    runner = Runner(cfg)
    runner.stage("update", 0)
    return {s.label: s for s in runner.steps}


READERS_OF_POLICY_0 = ["iter 1 generate", "iter 1 update"]


def test_the_content_digest_is_of_the_parts_a_reader_reads_whatever_their_order_and_side_records():
    parts = [PartInfo("part-00000.parquet", 1, "a", 1), PartInfo("part-00001.parquet", 1, "b", 1)]
    manifest = Manifest(
        stage="s", table="t", iteration=None, fingerprint="f", parts=parts, schema="s", started_at=0.0, finished_at=1.0
    )
    reordered = Manifest(
        **{
            **manifest.__dict__,
            "parts": parts[::-1],
            "extra_parts": {"rejects": [PartInfo("_rejects/part-00000.parquet", 1, "c", 1)]},
        }
    )
    assert content_digest(reordered) == content_digest(manifest)
    changed = Manifest(**{**manifest.__dict__, "parts": [parts[0], PartInfo("part-00001.parquet", 1, "x", 1)]})
    assert content_digest(changed) != content_digest(manifest)
    assert (
        Manifest.from_json(
            Manifest(**{**manifest.__dict__, "inputs": {"t": "d"}, "trainer_state": parts}).to_json()
        ).trainer_state
        == parts
    )


def test_a_stage_made_from_a_policy_that_was_replaced_since_is_outdated_and_the_stages_before_it_are_not(tmp_path):
    cfg = config(tmp_path)
    steps = committed_run(cfg)
    assert {s.status for s in build_plan(cfg)} == {"done"}
    update = steps["iter 0 update"]
    commit(update.output_dir, stage="update", fp=update.fingerprint, num_parts=1, rows=99)  # e.g. redone by hand
    plan = {s.label: s.status for s in build_plan(cfg)}
    assert [label for label, status in plan.items() if status != "done"] == READERS_OF_POLICY_0
    assert {plan[label] for label in READERS_OF_POLICY_0} == {"outdated"}


def test_a_policy_redone_without_its_old_manifest_into_other_weights_deletes_the_stages_made_from_the_old_ones(
    tmp_path, monkeypatch
):
    cfg = config(tmp_path)
    steps = committed_run(cfg)
    Path(steps["iter 0 update"].output_dir, "_MANIFEST.json").unlink()
    after = redo_update_0(cfg, monkeypatch, rows=99)
    assert [label for label, s in after.items() if s.status != "done"] == READERS_OF_POLICY_0
    for label in READERS_OF_POLICY_0:  # deleted before the new policy manifest was written: none is left "done"
        assert after[label].status == "pending" and not Path(after[label].output_dir).exists()
    assert read_manifest(steps["iter 1 score"].output_dir) is not None  # redone if its rollouts come out different
    redone = read_manifest(steps["iter 0 update"].output_dir)
    assert redone.inputs == {
        "advantages": content_digest(steps["iter 0 advantage"].manifest),
        "policy": resolve_lineage(cfg).initial_policy_fingerprint,
    }


def test_a_policy_redone_into_the_same_weights_keeps_the_stages_made_from_them(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    steps = committed_run(cfg)
    Path(steps["iter 0 update"].output_dir, "_MANIFEST.json").unlink()
    after = redo_update_0(cfg, monkeypatch, rows=5)
    assert {s.status for s in after.values()} == {"done"}


def test_readers_that_do_not_record_their_inputs_are_redone_unless_a_repair_left_their_input_unchanged(
    tmp_path, monkeypatch
):
    cfg = config(tmp_path)
    steps = committed_run(cfg, record_inputs=False)  # manifests of an older batchrl
    policy = Path(steps["iter 0 update"].output_dir)
    with open(policy / "part-00000.parquet", "r+b") as f:
        f.truncate(10)
    repaired = redo_update_0(cfg, monkeypatch, rows=5)  # damaged, redone into the same content
    assert {s.status for s in repaired.values()} == {"done"}
    (policy / "_MANIFEST.json").unlink()
    redone = redo_update_0(cfg, monkeypatch, rows=5)  # nothing to compare with: the readers cannot be trusted
    assert [label for label, s in redone.items() if s.status != "done"] == READERS_OF_POLICY_0


def test_an_update_refused_for_want_of_its_optimizer_state_leaves_the_policy_it_was_to_redo_as_it_was(tmp_path):
    cfg = config(tmp_path)
    steps = committed_run(cfg)
    policy_0 = steps["iter 0 update"]
    state = PartInfo("_trainer_state/trainer_state.json", 0, "0" * 64, 18)  # recorded, and deleted since (pruned)
    write_manifest(policy_0.output_dir, dataclasses.replace(policy_0.manifest, trainer_state=[state]))
    policy_1 = Path(steps["iter 1 update"].output_dir)
    (policy_1 / "_MANIFEST.json").unlink()  # by hand: iteration 1's update is redone, and it needs that state
    kept = sorted(p.name for p in policy_1.iterdir())
    with pytest.raises(DataError, match=r"iter_0000/policy/_trainer_state/trainer_state.json is gone"):
        Runner(cfg).stage("update", 1)
    assert sorted(p.name for p in policy_1.iterdir()) == kept


def prompt_file(path: Path, ids: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": ["1+1?"] * len(ids), "ground_truth": ["2"] * len(ids), "prompt_id": ids}), path)
    return str(path)


def finished_run(
    run_dir: Path,
    *,
    ingested: list[str],
    inherited: list[dict] | None = None,
    iterations: int = 1,
    init_from: str | None = None,
) -> None:
    """A completed run as the runner leaves it: run.yaml, prompts manifest with sources, last policy."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(yaml.safe_dump({"run": {"iterations": iterations}, "data": {}}))
    prompts = commit(str(run_dir / "prompts"), stage="ingest", fp="p", num_parts=1)
    prompts.sources = file_identities(ingested)
    write_manifest(str(run_dir / "prompts"), prompts)
    commit(str(run_dir / f"iter_{iterations - 1:04d}" / "policy"), stage="update", fp=f"policy-{run_dir.name}")
    if inherited is not None:
        (run_dir / "_LINEAGE.json").write_text(
            json.dumps(
                {
                    "init_from": init_from,
                    "initial_policy": "x",
                    "initial_policy_fingerprint": "y",
                    "seen_files": inherited,
                    "no_new_files": False,
                }
            )
        )


def test_a_nightly_run_warm_starts_from_the_last_policy_and_skips_every_file_its_chain_ingested(tmp_path):
    f1, f2, f3 = (prompt_file(tmp_path / "in" / f"day{d}.parquet", [f"d{d}"]) for d in (1, 2, 3))
    finished_run(tmp_path / "runs" / "n1", ingested=[f1])
    finished_run(
        tmp_path / "runs" / "n2",
        ingested=[f2],
        inherited=file_identities([f1]),
        iterations=2,
        init_from=str(tmp_path / "runs" / "n1"),
    )
    cfg = config(tmp_path, id="n3", init_from=str(tmp_path / "runs" / "n2"))
    lineage = resolve_lineage(cfg)
    assert lineage.initial_policy == str(tmp_path / "runs" / "n2" / "iter_0001" / "policy")
    files, skipped = files_to_ingest(cfg, lineage)
    assert [f["uri"] for f in files] == [f3] and skipped == 2
    plan = build_plan(cfg)
    assert plan[1].policy_in == lineage.initial_policy  # iteration 0 generates with the warm-start policy

    everything = config(tmp_path, id="n3b", init_from=str(tmp_path / "runs" / "n2"), new_files_only=False)
    assert [f["uri"] for f in files_to_ingest(everything, resolve_lineage(everything))[0]] == [f1, f2, f3]


def test_a_file_rewritten_in_place_counts_as_new(tmp_path):
    f1 = prompt_file(tmp_path / "in" / "day1.parquet", ["a"])
    finished_run(tmp_path / "runs" / "n1", ingested=[f1])
    prompt_file(tmp_path / "in" / "day1.parquet", ["a", "b"])
    cfg = config(tmp_path, id="n2", init_from=str(tmp_path / "runs" / "n1"))
    assert [f["uri"] for f in files_to_ingest(cfg, resolve_lineage(cfg))[0]] == [f1]


def test_warm_starting_from_an_unfinished_run_is_a_config_error_that_says_how_to_resume_it(tmp_path):
    f1 = prompt_file(tmp_path / "in" / "day1.parquet", ["a"])
    finished_run(tmp_path / "runs" / "n1", ingested=[f1], iterations=1)
    yaml_path = tmp_path / "runs" / "n1" / "run.yaml"
    yaml_path.write_text(yaml.safe_dump({"run": {"iterations": 3}, "data": {}}))
    cfg = config(tmp_path, id="n2", init_from=str(tmp_path / "runs" / "n1"))
    with pytest.raises(ConfigError, match=r"not complete .*iter_0002/policy.*resume it first"):
        resolve_lineage(cfg)


def lock_file(tmp_path: Path, **holder) -> str:
    uri = str(tmp_path / "run" / "run.lock")
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    Path(uri).write_text(json.dumps(holder))
    return uri


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    uri = lock_file(tmp_path, pid=dead_pid(), host=socket.gethostname(), since=time.time())
    with RunLock(uri):
        assert json.loads(Path(uri).read_text())["pid"] == os.getpid()
    assert not Path(uri).exists()


def test_a_lock_held_on_another_host_refuses_the_run_and_says_how_to_clear_it(tmp_path):
    uri = lock_file(tmp_path, pid=123, host="other-node", since=time.time(), heartbeat=time.time())
    with pytest.raises(RunLockedError, match=rf"other-node.*batchrl unlock {tmp_path / 'run'}"):
        RunLock(uri).__enter__()
    assert break_lock(uri)["host"] == "other-node" and not Path(uri).exists()


def test_a_lock_whose_heartbeat_expired_is_taken_over_from_any_host(tmp_path):
    old = time.time() - lock_module.EXPIRES_AFTER_S - 1
    uri = lock_file(tmp_path, pid=123, host="gone-node", since=old, heartbeat=old)
    assert holder_state(json.loads(Path(uri).read_text())) == "expired"
    with RunLock(uri):
        pass


def test_the_lock_holder_refreshes_its_heartbeat_and_unlock_refuses_a_live_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    uri = str(tmp_path / "run" / "run.lock")
    with RunLock(uri) as held:
        first = held.owner["heartbeat"]
        time.sleep(0.3)
        assert json.loads(Path(uri).read_text())["heartbeat"] > first
        with pytest.raises(RunLockedError, match="alive on this host"):
            break_lock(uri)


def test_a_lock_held_until_a_writer_has_ended_outlives_its_with_block_until_then(tmp_path):
    uri = str(tmp_path / "run" / "run.lock")
    ended = threading.Event()  # an update the run could not stop
    with RunLock(uri) as held:
        held.held_until(ended, writer="iter 0 update")
    assert json.loads(Path(uri).read_text())["pid"] == os.getpid()
    with pytest.raises(RunLockedError, match="alive on this host"):
        break_lock(uri)
    ended.set()
    deadline = time.monotonic() + 30
    while Path(uri).exists():
        assert time.monotonic() < deadline, "the lock was not released once the writer had ended"
        time.sleep(0.05)


def test_a_run_that_found_no_new_file_passes_its_policy_and_seen_files_on_to_the_next(tmp_path):
    f1, f2 = (prompt_file(tmp_path / "in" / f"day{d}.parquet", [f"d{d}"]) for d in (1, 2))
    finished_run(tmp_path / "runs" / "n1", ingested=[f1])
    empty = tmp_path / "runs" / "n2"
    empty.mkdir(parents=True)
    (empty / "run.yaml").write_text(yaml.safe_dump({"run": {"iterations": 1}, "data": {}}))
    policy = str(tmp_path / "runs" / "n1" / "iter_0000" / "policy")
    (empty / "_LINEAGE.json").write_text(
        json.dumps(
            {
                "init_from": str(tmp_path / "runs" / "n1"),
                "initial_policy": policy,
                "initial_policy_fingerprint": "fp1",
                "seen_files": file_identities([f1]),
                "no_new_files": True,
            }
        )
    )
    cfg = config(tmp_path, id="n3", init_from=str(empty))
    lineage = resolve_lineage(cfg)
    assert (lineage.initial_policy, lineage.initial_policy_fingerprint) == (policy, "fp1")
    assert [f["uri"] for f in files_to_ingest(cfg, lineage)[0]] == [f2]


def test_a_glob_init_from_picks_the_latest_complete_run_before_this_one(tmp_path):
    f1 = prompt_file(tmp_path / "in" / "day1.parquet", ["a"])
    for day in ("2026-12-01", "2026-12-02", "2026-12-04"):
        finished_run(tmp_path / "runs" / f"nightly-{day}", ingested=[f1])
    unfinished = tmp_path / "runs" / "nightly-2026-12-03"
    unfinished.mkdir()
    (unfinished / "run.yaml").write_text(yaml.safe_dump({"run": {"iterations": 1}, "data": {}}))
    pattern = str(tmp_path / "runs" / "nightly-*")
    lineage = resolve_lineage(config(tmp_path, id="nightly-2026-12-04", init_from=pattern))
    assert lineage.initial_policy == str(tmp_path / "runs" / "nightly-2026-12-02" / "iter_0000" / "policy")
    first = resolve_lineage(config(tmp_path, id="nightly-2026-11-30", init_from=pattern))
    assert first.initial_policy == "Qwen/Qwen2.5-0.5B-Instruct" and first.seen_files == []


def test_a_stage_that_resumes_from_its_journal_keeps_its_files_except_its_damaged_parts(tmp_path):
    cfg = config(tmp_path)
    ingest = build_plan(cfg, check_storage=False)[0]
    table = Path(ingest.output_dir)
    commit(ingest.output_dir, stage="ingest", fp=ingest.fingerprint, num_parts=2)
    for name in ("_journal/seg-1.json", "_rejects/part-00000.parquet", "part-00007.parquet"):  # journal, unclaimed
        (table / name).parent.mkdir(exist_ok=True)
        (table / name).write_bytes(b"kept")
    (table / "part-00001.parquet").write_bytes(b"truncated")
    runner = Runner(cfg)
    step = runner.plan[("ingest", None)]
    assert (step.status, step.damaged) == ("damaged", ["part-00001.parquet"])
    runner.tables.prepare(step)
    left = sorted(str(p.relative_to(table)) for p in table.rglob("*") if p.is_file())
    assert left == [
        "_MANIFEST.json",
        "_STARTED.json",
        "_journal/seg-1.json",
        "_rejects/part-00000.parquet",
        "part-00000.parquet",
        "part-00007.parquet",
    ]
