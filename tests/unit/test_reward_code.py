"""Editing a custom reward's code re-runs what it scored: the score and evaluate stages' fingerprints hold a digest
of the reward module's source, read without importing it; built-in rewards leave the fingerprints as they were; the
plan says "code changed" for what an edit redoes, "config changed" for what a changed setting redoes."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from harness import cli, write_yaml

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import validate_dict
from batchrl.pipeline.plan import build_plan
from batchrl.references import source_digest
from batchrl.stages.score import ScoreStage
from batchrl.storage.manifest import Manifest, write_manifest


def config(tmp_path: Path, score: dict) -> object:
    return validate_dict(
        {
            "name": "r",
            "run": {"root": str(tmp_path / "runs"), "iterations": 2},
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
            "data": {"train_files": [str(tmp_path / "in")]},
            "score": score,
            "evaluate": {"files": [str(tmp_path / "eval")]},
        }
    )


def fingerprints(cfg) -> dict[str, str]:
    return {step.label: step.fingerprint for step in build_plan(cfg, check_storage=False)}


def test_editing_a_reward_module_changes_the_fingerprints_of_the_stages_from_score_on(tmp_path, monkeypatch):
    module = tmp_path / "code" / "edited_reward_mod.py"
    module.parent.mkdir()
    module.write_text(
        "raise RuntimeError('never imported by a plan')\n\ndef score(response, ground_truth, **row):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(module.parent))
    importlib.invalidate_caches()
    cfg = config(tmp_path, {"rewards": [{"reward": "edited_reward_mod:score"}]})
    before = fingerprints(cfg)
    assert "edited_reward_mod" not in sys.modules  # the digest reads the file: its top-level code did not run
    assert fingerprints(cfg) == before  # stable while the file is unchanged
    module.write_text(module.read_text().replace("return 1.0", "return 2.0"))
    after = fingerprints(cfg)
    changed = sorted(label for label in before if before[label] != after[label])
    # all but what comes before the first scoring: ingest and iteration 0's generation (later generations run
    # on policies trained from the new scores; the evaluation before training scores with the same rewards)
    assert changed == sorted(set(before) - {"ingest", "iter 0 generate"}) and "evaluate" in changed
    assert before["ingest"] == after["ingest"] and before["iter 0 generate"] == after["iter 0 generate"]


def test_builtin_rewards_add_nothing_to_the_fingerprint_and_unknown_modules_are_marked(tmp_path):
    assert "reward_code" not in ScoreStage().fingerprint_config(config(tmp_path, {"rewards": [{"reward": "gsm8k"}]}))
    by_source = ScoreStage().fingerprint_config(
        config(tmp_path, {"reward_by_data_source": {"x": "no_such_module_xyz:fn"}})
    )
    assert by_source["reward_code"] == {"no_such_module_xyz:fn": "unresolved"}
    assert source_digest("json:dumps") != source_digest("csv:reader") != "unresolved"


def test_the_plan_says_code_changed_for_an_edited_reward_module_and_config_changed_for_a_new_weight(
    tmp_path, monkeypatch
):
    code = tmp_path / "code"
    code.mkdir()
    (code / "planned_reward_mod.py").write_text("def score(response, ground_truth, **row):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(code))
    importlib.invalidate_caches()
    score = {"rewards": [{"reward": "planned_reward_mod:score", "weight": 1.0}]}
    cfg = config(tmp_path, score)
    for step in build_plan(cfg):  # each stage committed as the runner commits it
        manifest = Manifest(
            stage=step.name,
            table=step.name,
            iteration=step.iteration,
            fingerprint=step.fingerprint,
            parts=[],
            schema="",
            started_at=0.0,
            finished_at=1.0,
            config_fingerprint=step.config_fingerprint,
        )
        write_manifest(step.output_dir, manifest)
    assert {step.status for step in build_plan(cfg)} == {"done"}

    (code / "planned_reward_mod.py").write_text("def score(response, ground_truth, **row):\n    return 2.0\n")
    edited = {step.label: step for step in build_plan(cfg)}
    assert edited["iter 0 generate"].status == "done" and edited["evaluate"].status == "stale"
    assert all(s.code_changed for s in edited.values() if s.status == "stale")
    path = write_yaml(tmp_path / "p.yaml", cfg.model_dump(mode="json", exclude_unset=True))
    plan = cli("plan", path, path_first=[code]).stdout
    assert re.search(r"^  iter 0 score +stale +redo \(code changed\)", plan, re.M), plan
    assert re.search(r"^  iter 1 update +stale +redo \(code changed\)", plan, re.M), plan

    (code / "planned_reward_mod.py").write_text("def score(response, ground_truth, **row):\n    return 1.0\n")
    reweighted = config(tmp_path, {"rewards": [{"reward": "planned_reward_mod:score", "weight": 2.0}]})
    steps = {step.label: step for step in build_plan(reweighted)}
    assert steps["iter 0 score"].status == "stale" and not steps["iter 0 score"].code_changed
