"""The evaluate stage: exact mean@k / pass@k / maj@k on hand-made results, config checks (the held-out files are
the heldout stage's, its errors naming evaluate.files), and a real run on embedded Ray (HF engine), on the held-out
prompts table, whose table and metrics agree with the reward, with the same samples every time."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from batchrl.agents.columns import conversation_counts
from batchrl.agents.environment import environment_counts
from batchrl.agents.loop import Conversation
from batchrl.config import ConfigError, validate_dict
from batchrl.errors import DataError
from batchrl.pipeline.stage import StageContext
from batchrl.rewards.gsm8k import gsm8k_strict
from batchrl.stages.evaluate import (
    EvaluateStage,
    answer_extractor,
    compare,
    evaluated_iterations,
    evaluation_metrics_from_table,
    evaluation_table,
    loop_stats,
)
from batchrl.stages.heldout import HeldOutStage
from batchrl.storage import RunLayout, read_parquet
from batchrl.storage.manifest import Manifest
from batchrl_toy import build_arith_prompts


def config(tmp_path, model_dir="m", eval_files=("e",), evaluate=None, iterations=1):
    return validate_dict(
        {
            "name": "ev",
            "run": {"root": str(tmp_path / "runs"), "seed": 3, "iterations": iterations},
            "model": {"path": model_dir},
            "data": {"train_files": ["d"], "max_prompt_tokens": 96},
            "generate": {"engine": "hf", "max_new_tokens": 6},
            "evaluate": {"files": list(eval_files), **(evaluate or {})},
        }
    )


def scored(rows: list[tuple[str, str, list[str], list[float]]]) -> pa.Table:
    """A scored-rollouts table: (prompt_id, data_source, responses, scores) per prompt; ground truth '5'."""
    return pa.Table.from_pylist(
        [
            {
                "prompt_id": pid,
                "data_source": source,
                "prompt_text": f"q {pid}",
                "ground_truth": "5",
                "response_texts": texts,
                "scores": scores,
                "response_lengths": [len(t) for t in texts],
                "score_errors": [None] * len(texts),
            }
            for pid, source, texts, scores in rows
        ]
    )


def test_metrics_of_a_hand_made_evaluation_are_exact(tmp_path):
    greedy = scored(
        [("a1", "arith", ["#### 5"], [1.0]), ("a2", "arith", ["#### 4"], [0.0]), ("b1", "gsm8k", ["five"], [0.0])]
    )
    sampled = scored(
        [
            ("a1", "arith", ["#### 5", "#### 3", "#### 3", "#### 5"], [1.0, 0.0, 0.0, 1.0]),  # 2-2 tie: "5" came first
            (
                "a2",
                "arith",
                ["#### 7", "x #### 7", "no answer", "#### 5"],
                [0.0, 0.0, 0.0, 1.0],
            ),  # majority "7" is wrong
            ("b1", "gsm8k", ["no", "answer", "at", "all"], [0.0, 0.0, 0.0, 0.0]),
        ]
    )  # every response abstains
    table = evaluation_table(greedy, sampled, policy="p", extract_answer=answer_extractor(config(tmp_path)))
    assert table.column("majority_answer").to_pylist() == ["5", "7", None]
    assert table.column("sample_answers").to_pylist()[1] == ["7", "7", None, "5"]
    metrics = evaluation_metrics_from_table(table, pass_threshold=1.0)
    expected = {
        "val-core/arith/reward/mean@1": 0.5,
        "val-core/arith/reward/mean@4": 3 / 8,
        "val-core/arith/reward/pass@4": 1.0,
        "val-aux/arith/reward/pass@2": (5 / 6 + 1 / 2) / 2,
        "val-aux/arith/reward/pass@1": 3 / 8,
        "val-core/arith/reward/maj@4": 0.5,
        "val-aux/arith/answered/mean@1": 1.0,
        "val-aux/arith/answered/mean@4": 7 / 8,
        "val-aux/arith/num_prompts": 2,
        "val-core/gsm8k/reward/mean@1": 0.0,
        "val-core/gsm8k/reward/mean@4": 0.0,
        "val-core/gsm8k/reward/pass@4": 0.0,
        "val-core/gsm8k/reward/maj@4": 0.0,
        "val-aux/gsm8k/answered/mean@1": 0.0,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value), name
    assert metrics["val-aux/arith/reward/std@4"] == pytest.approx((0.5 + math.sqrt(3) / 4) / 2)


def test_evaluation_runs_before_training_every_nth_iteration_and_after_the_last(tmp_path):
    assert evaluated_iterations(config(tmp_path, iterations=3)) == [None, 0, 1, 2]
    cfg = config(tmp_path, iterations=5, evaluate={"every": 2, "before_training": False})
    assert evaluated_iterations(cfg) == [1, 3, 4]
    no_evaluate = validate_dict({"name": "x", "model": {"path": "m"}, "data": {"train_files": ["d"]}})
    assert evaluated_iterations(no_evaluate) == []


def test_config_mistakes_are_config_errors(tmp_path, toy_model_dir, toy_prompts_dir):
    with pytest.raises(ConfigError, match="nothing would be evaluated"):
        config(tmp_path, evaluate={"greedy": False, "num_samples": 0})
    with pytest.raises(ConfigError, match="two different mean@1"):
        config(tmp_path, evaluate={"num_samples": 1})
    with pytest.raises(ConfigError, match="evaluate.files: .*does not exist"):
        HeldOutStage().check_inputs(config(tmp_path, toy_model_dir, [str(tmp_path / "missing")]))
    with pytest.raises(ConfigError, match="evaluate.max_new_tokens=9 exceeds generate.max_new_tokens=6"):
        EvaluateStage().check_inputs(config(tmp_path, toy_model_dir, [toy_prompts_dir], {"max_new_tokens": 9}))


def test_an_unreadable_held_out_file_is_a_data_error_naming_evaluate_files(tmp_path, toy_model_dir):
    (tmp_path / "held_out.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=f"evaluate.files: {tmp_path / 'held_out.parquet'} is not a readable Parquet"):
        HeldOutStage().check_inputs(config(tmp_path, toy_model_dir, [str(tmp_path / "held_out.parquet")]))


def conversation(turns: int, calls: int, status: str = "completed") -> Conversation:
    c = Conversation([1], seed=0, turns=turns, status=status)
    c.calls = [{"name": "calculator", "error": None} for _ in range(calls)]
    return c


def test_held_out_tool_use_is_generates_tool_metrics_over_every_shards_samples_under_val_aux():
    shards = [
        [conversation(2, 1), conversation(1, 0)],  # say the greedy shard
        [conversation(3, 2), conversation(1, 0), conversation(4, 1, "max_turns")],
    ]
    stats = loop_stats([{"num_samples": len(s)} | conversation_counts(s) for s in shards])
    assert stats["val-aux/tools/use_rate"] == pytest.approx(3 / 5)
    assert stats["val-aux/tools/turns_mean"] == pytest.approx(11 / 5)
    assert stats["val-aux/tools/calls_per_sample"] == pytest.approx(4 / 5)
    assert stats["val-aux/tools/stop/max_turns"] == 1
    assert not [name for name in stats if not name.startswith("val-aux/tools/")]


def test_held_out_episodes_give_generates_environment_metrics_and_single_turn_samples_none():
    episodes = [conversation(2, 3), conversation(1, 2, "env_error")]
    episodes[0].environment_reward = 0.5
    stats = loop_stats([{"num_samples": 2} | environment_counts(episodes)])
    assert stats["val-aux/environment/turns_mean"] == pytest.approx(3 / 2)
    assert stats["val-aux/environment/error_rate"] == pytest.approx(1 / 2)
    assert stats["val-aux/environment/reward_mean"] == pytest.approx(0.5)
    assert not [name for name in stats if "/tools/" in name]  # a reset and steps are no tool calls
    assert loop_stats([{"num_samples": 4, "response_tokens": 9}, {"num_samples": 2, "response_tokens": 3}]) == {}


def test_compare_reports_core_metrics_in_points():
    lines = compare(
        {"val-core/arith/reward/mean@1": 0.25, "val-aux/arith/num_prompts": 4},
        {"val-core/arith/reward/mean@1": 0.625, "val-aux/arith/num_prompts": 4},
    )
    assert lines == ["val-core/arith/reward/mean@1: 0.250 -> 0.625 (+37.5 points)"]


def run_stage(stage, cfg, *, output_dir: str, inputs: dict[str, tuple[str, Manifest]], engines=None):
    """``stage`` run as the runner runs it at iteration None, on the initial policy; its output as a manifest."""
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=output_dir,
        fingerprint="e",
        inputs={table: manifest for table, (_, manifest) in inputs.items()},
        input_dirs={table: directory for table, (directory, _) in inputs.items()},
        policy_in=cfg.model.path,
        embedded_ray=True,
        engines=engines,
    )
    output = stage.run(ctx)
    manifest = Manifest(stage.name, stage.table, None, "e", output.parts, stage.schema, 0.0, 1.0, output.counts)
    return output, manifest


def run_evaluate(cfg, out_name: str, engines):
    """The held-out prompts ingested by the heldout stage, then evaluated; the output and the first part's rows."""
    run_dir = RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir
    prompts_dir = f"{run_dir}/evaluation_prompts"
    _, prompts = run_stage(HeldOutStage(), cfg, output_dir=prompts_dir, inputs={})
    out_dir = f"{run_dir}/{out_name}"
    output, _ = run_stage(
        EvaluateStage(), cfg, output_dir=out_dir, inputs={"evaluation_prompts": (prompts_dir, prompts)}, engines=engines
    )
    return output, read_parquet(f"{out_dir}/{output.parts[0].name}")


def test_a_real_evaluation_agrees_with_the_reward_and_resamples_identically(engine_pool, tmp_path, toy_model_dir):
    build_arith_prompts(str(tmp_path / "held_out"), num_prompts=5, num_shards=1, seed=11)
    cfg = config(tmp_path, toy_model_dir, [str(tmp_path / "held_out")], {"num_samples": 3, "max_new_tokens": 4})
    output, table = run_evaluate(cfg, "first", engine_pool)
    assert table.num_rows == 5 and output.counts["prompts"] == 5
    rows = table.to_pylist()
    assert all(len(r["sample_responses"]) == len(r["sample_scores"]) == 3 for r in rows)
    assert [r["greedy_score"] for r in rows] == [gsm8k_strict(r["greedy_response"], r["ground_truth"]) for r in rows]
    greedy_P = np.array([r["greedy_score"] for r in rows])
    assert output.stats["val-core/arith/reward/mean@1"] == pytest.approx(greedy_P.mean())
    assert {
        "val-core/arith/reward/mean@3",
        "val-core/arith/reward/pass@3",
        "val-core/arith/reward/maj@3",
        "val-aux/arith/response_length/mean@3",
    } <= set(output.stats)
    assert all(1 <= n <= 4 for r in rows for n in r["sample_lengths"])
    assert sorted(output.extra_parts) == ["rollouts", "scores"]  # the prompts are the heldout stage's table
    assert not [name for name in output.stats if "/tools/" in name or "/environment/" in name], "single-turn"
    _, again = run_evaluate(cfg, "second", engine_pool)
    assert again.column("sample_responses").to_pylist() == table.column("sample_responses").to_pylist()
    assert again.column("greedy_response").to_pylist() == table.column("greedy_response").to_pylist()


def test_a_sources_eval_files_are_held_out_under_its_name_scored_by_its_terms_and_reported_per_source(
    engine_pool, tmp_path, toy_model_dir
):
    """evaluate.files (no source) and the chat source's eval_files, in one held-out table: the chat rows carry their
    source and are scored by its own term (format_hash, weight 2), the others by arith's default; val-core stays
    per data_source over every row, and val-source/chat/* covers the chat rows alone."""
    import pyarrow.parquet as pq

    build_arith_prompts(str(tmp_path / "core"), num_prompts=3, num_shards=1, seed=11)
    chat = tmp_path / "chat_eval.parquet"
    rows = [{"prompt_id": f"chat-{i}", "data_source": "arith", "prompt": f"What is {i} + 2?"} for i in range(2)]
    pq.write_table(pa.Table.from_pylist([r | {"ground_truth": str(i + 2)} for i, r in enumerate(rows)]), chat)
    cfg = validate_dict(
        {
            "name": "ev",
            "run": {"root": str(tmp_path / "runs"), "seed": 3, "iterations": 1},
            "model": {"path": toy_model_dir},
            "data": {
                "sources": [
                    {"name": "math", "files": ["m.parquet"], "count": 1},
                    {
                        "name": "chat",
                        "files": ["c.parquet"],
                        "count": 1,
                        "rewards": [{"reward": "format_hash", "name": "fmt", "weight": 2.0}],
                        "eval_files": [str(chat)],
                    },
                ],
                "prompts_per_iteration": 2,
                "max_prompt_tokens": 96,
            },
            "generate": {"engine": "hf", "max_new_tokens": 6},
            "evaluate": {"files": [str(tmp_path / "core")], "num_samples": 2, "max_new_tokens": 4},
        }
    )
    HeldOutStage().check_inputs(cfg)
    run_dir = RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir
    _, prompts = run_stage(HeldOutStage(), cfg, output_dir=f"{run_dir}/evaluation_prompts", inputs={})
    assert [p.name for p in prompts.parts] == ["part-00000.parquet", "chat/part-00001.parquet"]
    inputs = {"evaluation_prompts": (f"{run_dir}/evaluation_prompts", prompts)}
    output, _ = run_stage(EvaluateStage(), cfg, output_dir=f"{run_dir}/ev", inputs=inputs, engines=engine_pool)
    table = pa.concat_tables([read_parquet(f"{run_dir}/ev/{part.name}") for part in output.parts])
    assert table.column("source").to_pylist() == [None, None, None, "chat", "chat"]
    scores = read_parquet(f"{run_dir}/ev/_scores/greedy-chat/part-00001.parquet")
    assert scores.column("reward_names").to_pylist() == [["fmt"], ["fmt"]]
    assert (
        read_parquet(f"{run_dir}/ev/_scores/greedy-part-00000.parquet").column("reward_names").to_pylist()
        == [["gsm8k"]] * 3
    )
    from batchrl.rewards.basic import format_hash

    chat_rows = [r for r in table.to_pylist() if r["source"] == "chat"]
    assert [r["greedy_score"] for r in chat_rows] == [2.0 * format_hash(r["greedy_response"]) for r in chat_rows]
    greedy = [r["greedy_score"] for r in table.to_pylist()]
    assert output.stats["val-core/arith/reward/mean@1"] == pytest.approx(np.mean(greedy))
    assert output.stats["val-source/chat/reward/mean@1"] == pytest.approx(
        np.mean([r["greedy_score"] for r in chat_rows])
    )
    assert output.stats["val-source-aux/chat/num_prompts"] == 2
    assert {"val-source/chat/reward/mean@2", "val-source/chat/reward/pass@2", "val-source/chat/reward/maj@2"} <= set(
        output.stats
    )
    assert not [name for name in output.stats if name.startswith("val-source/math")]  # no eval_files: no metrics
