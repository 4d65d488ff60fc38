"""Where the evaluate stage sits in a plan, without running anything: before training and after every
evaluate.every-th iteration (the last always), on the policy that iteration's update wrote, reading the held-out
prompts that the heldout stage ingests once per run; its config never touches training's fingerprints, and
--from-stage evaluate (or heldout) re-evaluates without retraining."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import ConfigError, validate_dict
from batchrl.pipeline.plan import STARTED_MARKER, build_plan, check_from_stage
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest


def config(tmp_path: Path, *, iterations: int = 3, evaluate: dict | None = {}, **fields) -> object:  # noqa: B006
    """A 3-iteration config; evaluate=None: no evaluate section, else its fields (plus ``fields``)."""
    evaluate = None if evaluate is None else {**evaluate, **fields}
    raw = {
        "name": "r",
        "run": {"root": str(tmp_path / "runs"), "iterations": iterations},
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        "data": {"train_files": [str(tmp_path / "in")]},
    }
    if evaluate is not None:
        raw["evaluate"] = {"files": [str(tmp_path / "eval")], **evaluate}
    return validate_dict(raw)


def commit(table_dir: str, *, stage: str, fp: str) -> None:
    from batchrl.storage import write_parquet_atomic

    num_bytes, digest = write_parquet_atomic(pa.table({"x": [1]}), f"{table_dir}/part-00000.parquet")
    write_manifest(
        table_dir,
        Manifest(
            stage=stage,
            table=stage,
            iteration=None,
            fingerprint=fp,
            schema="s",
            parts=[PartInfo(name="part-00000.parquet", rows=1, sha256=digest, num_bytes=num_bytes)],
            started_at=0.0,
            finished_at=1.0,
        ),
    )
    Path(table_dir, STARTED_MARKER).write_text(json.dumps({"fingerprint": fp}))


def labels(plan) -> list[str]:
    return [step.label for step in plan]


def test_evaluation_runs_before_training_and_after_every_second_and_the_last_iteration(tmp_path):
    plan = build_plan(config(tmp_path, every=2), check_storage=False)
    evaluations = [step for step in plan if step.name == "evaluate"]
    assert [s.label for s in evaluations] == ["evaluate", "iter 1 evaluate", "iter 2 evaluate"]
    steps = {step.label: step for step in plan}
    assert labels(plan)[:3] == ["heldout", "ingest", "evaluate"]  # the once-per-run tables, then before training
    assert all(s.input_dirs == {"evaluation_prompts": steps["heldout"].output_dir} for s in evaluations)
    assert steps["heldout"].output_dir.endswith("/evaluation_prompts")
    assert labels(plan).index("iter 1 evaluate") == labels(plan).index("iter 1 update") + 1
    assert steps["evaluate"].policy_in == "Qwen/Qwen2.5-0.5B-Instruct"  # the initial policy
    assert steps["iter 1 evaluate"].policy_in == steps["iter 1 update"].output_dir  # what iteration 1 wrote
    assert steps["iter 2 generate"].policy_in == steps["iter 1 update"].output_dir  # training is unchanged
    assert steps["evaluate"].output_dir.endswith("/evaluation")
    assert steps["iter 2 evaluate"].output_dir.endswith("iter_0002/evaluation")


def test_no_evaluate_section_plans_no_evaluation_and_before_training_false_skips_the_initial_one(tmp_path):
    names = {s.name for s in build_plan(config(tmp_path, evaluate=None), check_storage=False)}
    assert "evaluate" not in names and "heldout" not in names
    plan = build_plan(config(tmp_path, iterations=2, before_training=False), check_storage=False)
    assert [s.label for s in plan if s.name == "evaluate"] == ["iter 0 evaluate", "iter 1 evaluate"]


def test_changing_the_evaluation_changes_only_evaluation_fingerprints(tmp_path):
    base = {s.label: s.fingerprint for s in build_plan(config(tmp_path), check_storage=False)}
    other = {s.label: s.fingerprint for s in build_plan(config(tmp_path, num_samples=4), check_storage=False)}
    changed = sorted(label for label in base if base[label] != other[label])
    assert changed == ["evaluate", "iter 0 evaluate", "iter 1 evaluate", "iter 2 evaluate"]


@pytest.mark.parametrize(
    "change",
    [
        {"evaluate": {"files": ["other"]}},
        {"evaluate": {"max_prompts": 7}},
        {"data": {"max_prompt_tokens": 77}},
        {"data": {"apply_chat_template": False}},
        {"data": {"overlong_prompts": "truncate_left"}},
        {"model": {"tokenizer": "other/tokenizer"}},
        {"score": {"rewards": [{"reward": "gsm8k"}]}},
    ],
)
def test_what_re_ingests_the_held_out_prompts_re_evaluates_through_evaluates_own_fingerprint(tmp_path, change):
    """The held-out table is left out of evaluate's fingerprint (its evaluations made before that table existed keep
    theirs): that loses nothing only because whatever changes the table changes evaluate's config as well."""
    from batchrl.stages.evaluate import EvaluateStage
    from batchrl.stages.heldout import HeldOutStage

    base = config(tmp_path)
    raw = base.model_dump(mode="json")
    for section, fields in change.items():
        raw[section] = (raw[section] or {}) | fields
    changed = validate_dict(raw)
    assert HeldOutStage().fingerprint_config(changed) != HeldOutStage().fingerprint_config(base)
    assert EvaluateStage().fingerprint_config(changed) != EvaluateStage().fingerprint_config(base)


def test_from_stage_heldout_re_ingests_the_held_out_prompts_and_re_evaluates_without_retraining(tmp_path):
    cfg = config(tmp_path)
    for step in build_plan(cfg, check_storage=False):
        commit(step.output_dir, stage=step.name, fp=step.fingerprint)
    forced = [s.label for s in build_plan(cfg, from_stage="heldout") if s.status == "forced"]
    assert forced == ["heldout", "evaluate", "iter 0 evaluate", "iter 1 evaluate", "iter 2 evaluate"]
    forced = [s.label for s in build_plan(cfg, from_stage="ingest") if s.status == "forced"]
    assert "heldout" not in forced and "iter 0 generate" in forced  # re-ingesting training prompts retrains


def test_from_stage_evaluate_forces_only_evaluations_and_a_forced_update_forces_the_evaluations_after_it(tmp_path):
    cfg = config(tmp_path)
    for step in build_plan(cfg, check_storage=False):
        commit(step.output_dir, stage=step.name, fp=step.fingerprint)
    forced = [s.label for s in build_plan(cfg, from_stage="evaluate", from_iteration=1) if s.status == "forced"]
    assert forced == ["iter 1 evaluate", "iter 2 evaluate"]
    forced = [s.label for s in build_plan(cfg, from_stage="evaluate") if s.status == "forced"]
    assert forced == ["evaluate", "iter 0 evaluate", "iter 1 evaluate", "iter 2 evaluate"]
    forced = [s.label for s in build_plan(cfg, from_stage="update", from_iteration=2) if s.status == "forced"]
    assert forced == ["iter 2 update", "iter 2 evaluate"]


def test_from_stage_evaluate_must_name_an_evaluated_iteration_of_a_config_that_evaluates(tmp_path):
    with pytest.raises(ConfigError, match="only at iterations before training, 1, 2; pick one"):
        check_from_stage(config(tmp_path, every=2), "evaluate", 0)
    with pytest.raises(ConfigError, match="never runs it .add an evaluate: section"):
        check_from_stage(config(tmp_path, evaluate=None), "evaluate", None)
    check_from_stage(config(tmp_path, every=2), "evaluate", 1)


def test_evaluations_made_before_the_held_out_prompts_were_a_table_stay_done_when_heldout_first_runs(tmp_path):
    """A run made by an earlier batchrl: its evaluations record their policy only. The plan of the same config has
    the same evaluate fingerprints, so they are done; heldout is new (pending), and committing it keeps them."""
    from batchrl.pipeline.plan import Plan, current_input_digest
    from batchrl.pipeline.tables import Tables
    from batchrl.storage.manifest import read_manifest

    cfg = config(tmp_path)
    for step in build_plan(cfg, check_storage=False):
        if step.name != "heldout":
            commit(step.output_dir, stage=step.name, fp=step.fingerprint)
    before = Plan(cfg)
    for step in before.steps:
        if step.name == "evaluate":  # as an earlier batchrl wrote it: the policy recorded, no held-out table
            manifest = read_manifest(step.output_dir)
            manifest.inputs = {"policy": current_input_digest(step, "policy", before.by_dir, before.lineage)}
            write_manifest(step.output_dir, manifest)
    plan = Plan(cfg)
    assert {s.label: s.status for s in plan.steps if s.name in ("heldout", "evaluate")} == {
        "heldout": "pending",
        "evaluate": "done",
        "iter 0 evaluate": "done",
        "iter 1 evaluate": "done",
        "iter 2 evaluate": "done",
    }
    heldout = plan[("heldout", None)]
    commit(heldout.output_dir, stage="heldout", fp=heldout.fingerprint)
    Tables(plan).commit(heldout, read_manifest(heldout.output_dir), previous=None)
    assert all(s.status == "done" for s in plan.steps if s.name == "evaluate")
    assert Path(plan[("evaluate", None)].output_dir, "part-00000.parquet").exists()
