"""The judge stage with the toy model as its judge (hf engine, on CPU): its verdicts are garbage, so what is tested
is what happens to garbage: unparsable texts are retried with other seeds, counted and recorded, a sample the template
cannot render fails without a call, a redone shard is the same, and score rewards the verdicts as a weighted term."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from test_score_components import rollouts, score

from batchrl.config import validate_dict
from batchrl.pipeline.stage import StageContext
from batchrl.rewards.judge import parse_verdict
from batchrl.stages.judge import JudgeStage
from batchrl.storage import RunLayout, read_parquet, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import conform

TEMPLATE = "Rubric: {rubric}\nQ: {prompt}\nA: {response}\nScore 0-9:"


def config(tmp_path, toy_model_dir, toy_prompts_dir, **judge):
    return validate_dict(
        {
            "name": "judged",
            "run": {"root": str(tmp_path / "runs")},
            "model": {"path": toy_model_dir},
            "data": {"train_files": [toy_prompts_dir]},
            "judge": {
                "model": toy_model_dir,
                "engine": "hf",
                "template": TEMPLATE,
                "temperature": 1.0,
                "max_new_tokens": 8,
                "verdict": {"kind": "number", "min": 0, "max": 9},
            }
            | judge,
            "score": {"rewards": [{"reward": "judge", "weight": 2.0}, {"reward": "gsm8k"}]},
        }
    )


def groups_with_rubric() -> pa.Table:
    """Two groups of three samples: the first with a rubric in its extra_info, the second without one."""
    table = rollouts([{"prompt_id": f"p{i}", "truth": "7", "responses": ["#### 7", "#### 8", "7"]} for i in range(2)])
    extra = [json.dumps({"rubric": "Exact answer required."}), None]
    return table.set_column(table.schema.get_field_index("extra_info_json"), "extra_info_json", pa.array(extra))


def judge_once(tmp_path, cfg, table: pa.Table, name: str) -> tuple[list[dict], dict]:
    """The judge stage over one part holding ``table`` (a lone CPU shard: judged in this process)."""
    in_dir, out_dir = str(tmp_path / "rollouts"), str(tmp_path / name)
    num_bytes, digest = write_parquet_atomic(table, f"{in_dir}/part-00000.parquet")
    part = PartInfo(name="part-00000.parquet", rows=table.num_rows, sha256=digest, num_bytes=num_bytes)
    manifest = Manifest(
        stage="generate", table="rollouts", iteration=0, fingerprint="g", parts=[part], schema="rollouts",
        started_at=0, finished_at=0,
    )  # fmt: skip
    ctx = StageContext(
        cfg=cfg,
        layout=RunLayout.for_run(cfg.run.root, cfg.run_id),
        iteration=0,
        output_dir=out_dir,
        fingerprint="j",
        inputs={"rollouts": manifest},
        input_dirs={"rollouts": in_dir},
        policy_in=cfg.model.path,
        embedded_ray=True,
    )
    output = JudgeStage().run(ctx)
    return read_parquet(f"{out_dir}/part-00000.parquet").to_pylist(), output.counts


@pytest.fixture(scope="module")
def judged(tmp_path_factory, toy_model_dir, toy_prompts_dir):
    tmp_path = tmp_path_factory.mktemp("judge")
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir)
    first = judge_once(tmp_path, cfg, groups_with_rubric(), "first")
    again = judge_once(tmp_path, cfg, groups_with_rubric(), "again")
    return cfg, first, again


def test_every_sample_has_a_verdict_its_text_parses_to_or_a_recorded_failure_after_every_retry(judged):
    cfg, (rows, counts), _ = judged
    with_rubric, without = rows
    for text, verdict, attempts, error in zip(
        with_rubric["judge_texts"],
        with_rubric["judge_scores"],
        with_rubric["judge_attempts"],
        with_rubric["judge_errors"],
    ):
        parsed, why = parse_verdict(text, cfg.judge.verdict)
        if verdict is None:  # garbage every time: retried to the limit, the last text and why it failed kept
            assert attempts == cfg.judge.max_retries + 1 and error == f"unparsable: {why}"
        else:
            assert 1 <= attempts <= cfg.judge.max_retries + 1 and error is None and parsed == pytest.approx(verdict)
    assert without["judge_scores"] == [None] * 3 and without["judge_attempts"] == [0] * 3
    assert all(e.startswith("template: ") and "{rubric}" in e for e in without["judge_errors"])
    assert counts["samples"] == 6 and counts["failed"] == 6 - counts["judged"] and counts["failed"] >= 3
    assert counts["attempts"] == sum(with_rubric["judge_attempts"]) and counts["judge_tokens"] > 0


def test_a_redone_shard_gives_the_same_verdicts_from_the_same_seeded_calls(judged):
    _, (rows, _), (again, _) = judged
    columns = ("judge_scores", "judge_texts", "judge_attempts", "judge_errors", "judge_tokens")
    assert [[row[c] for c in columns] for row in again] == [[row[c] for c in columns] for row in rows]


def test_retries_draw_other_seeds_and_a_verdict_the_toy_never_writes_fails_after_three_calls(
    tmp_path, toy_model_dir, toy_prompts_dir
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, verdict={"kind": "letter", "grades": {"VERDICT_PASS": 1}})
    rows, counts = judge_once(tmp_path, cfg, groups_with_rubric().slice(0, 1), "letters")
    assert rows[0]["judge_attempts"] == [3, 3, 3] and counts["attempts"] == 9
    assert all(e.startswith("unparsable: no grade of ['VERDICT_PASS']") for e in rows[0]["judge_errors"])


def test_score_rewards_the_verdict_as_a_weighted_term_beside_the_rule_reward(judged):
    _, (rows, _), _ = judged
    table = conform(pa.Table.from_pylist(rows), "judgements")
    out, _ = score(table, terms=[{"reward": "judge", "weight": 2.0}, {"reward": "gsm8k"}], failure_reward=-1.0)
    for row, scored in zip(rows, out.to_pylist()):
        assert scored["reward_names"] == ["judge", "gsm8k"]
        for verdict, values, total in zip(row["judge_scores"], scored["reward_values"], scored["scores"]):
            if verdict is None:
                assert values[0] is None and total == -1.0
            else:
                assert values[0] == pytest.approx(verdict) and total == pytest.approx(2 * verdict + values[1])


def test_a_judge_prompt_longer_than_the_judge_context_is_not_sent_and_is_recorded(
    tmp_path, toy_model_dir, toy_prompts_dir
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, max_model_len=16)
    rows, counts = judge_once(tmp_path, cfg, groups_with_rubric().slice(0, 1), "too_long")
    assert rows[0]["judge_attempts"] == [0, 0, 0] and rows[0]["judge_tokens"] == [0, 0, 0]
    assert all(e.startswith("too_long: ") and "the judge's context 16" in e for e in rows[0]["judge_errors"])
    assert counts["failed"] == 3 and counts["attempts"] == 0
