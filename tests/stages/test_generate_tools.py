"""generate with generate.tools on embedded Ray and the hf engine: the multi-turn columns and counts are written,
the same seeds give the same rows, and a run without tools writes the columns as null. The toy model is random, so
it writes no Hermes call: its conversations end after one turn, completed or at the token budget (the loop's tool
turns are tested on a real engine in test_agent_loop.py)."""

from __future__ import annotations

import json

import pytest
from test_generate import config, generate, ingest

from batchrl.config import validate_dict
from batchrl.stages.evaluate import EvaluateStage
from batchrl.stages.generate import GenerateStage


def tools_config(tmp_path, toy_model_dir, toy_prompts_dir, **generate_fields):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    raw = cfg.model_dump()
    raw["generate"] |= {"tools": ["calculator"], "max_turns": 3, "max_response_tokens": 24} | generate_fields
    return validate_dict(raw)


def without_seconds(rows):
    for row in rows:
        row["tool_calls"] = [[c | {"seconds": 0} for c in json.loads(calls)] for calls in row["tool_calls"]]
    return rows


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory, toy_model_dir, toy_prompts_dir):
    """Three generations shared by the module's tests: with tools twice (same seeds), then without."""
    from batchrl.engines.pool import EnginePool

    engine_pool = EnginePool()
    tmp_path = tmp_path_factory.mktemp("tools")
    cfg = tools_config(tmp_path, toy_model_dir, toy_prompts_dir)
    prompts = ingest(cfg)
    first = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="a")
    again = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="b")
    plain_cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    plain = generate(plain_cfg, prompts, engine_pool, policy=toy_model_dir, out_name="plain")
    yield cfg, first, again, plain
    engine_pool.close()


def test_multi_turn_rows_carry_masks_turns_statuses_and_calls_for_every_sample(runs):
    _, (output, rows), _, _ = runs
    assert len(rows) == 6
    for row in rows:
        lengths = row["response_lengths"]
        assert [len(m) for m in row["response_masks"]] == lengths == [len(t) for t in row["response_token_ids"]]
        assert all(n <= 24 for n in lengths)
        assert all(1 <= turns <= 3 for turns in row["num_turns"])
        assert all(status in ("completed", "length", "max_turns") for status in row["stop_statuses"])
        assert all(isinstance(json.loads(calls), list) for calls in row["tool_calls"])
        for status, reason in zip(row["stop_statuses"], row["finish_reasons"]):
            assert (status == "length") == (reason == "length")
    assert output.counts["turns"] == sum(t for r in rows for t in r["num_turns"])
    assert output.counts["tool_samples"] == sum(1 for r in rows for c in r["tool_calls"] if json.loads(c))
    assert output.stats["tools/turns_mean"] == pytest.approx(output.counts["turns"] / 18)
    assert 0.0 <= output.stats["tools/use_rate"] <= 1.0
    statuses = [status for r in rows for status in r["stop_statuses"]]
    assert {k: v for k, v in output.stats.items() if k.startswith("tools/stop/")} == {
        f"tools/stop/{status}": statuses.count(status) for status in set(statuses)
    }


def test_the_same_seeds_give_the_same_multi_turn_rows(runs):
    _, (_, rows), (_, again), _ = runs
    assert without_seconds(again) == without_seconds(rows)


def test_a_run_without_tools_writes_the_multi_turn_columns_as_null_and_no_tool_metrics(runs):
    _, _, _, (output, rows) = runs
    assert all(r["response_masks"] is None and r["num_turns"] is None and r["tool_calls"] is None for r in rows)
    assert not any(key.startswith("tools/") for key in output.stats)
    assert "turns" not in output.counts


def test_generate_and_evaluate_fingerprints_hold_the_user_tools_sources_and_are_unchanged_without_tools(
    tmp_path, toy_model_dir, toy_prompts_dir
):
    plain = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    assert "tool_sources" not in GenerateStage().fingerprint_config(plain)
    cfg = tools_config(tmp_path, toy_model_dir, toy_prompts_dir, tools=["calculator", "test_agent_loop:count"])
    sources = GenerateStage().fingerprint_config(cfg)["tool_sources"]
    assert list(sources) == ["test_agent_loop:count"] and len(sources["test_agent_loop:count"]) == 16
    # the held-out samples run the same tools: editing one re-evaluates as it regenerates
    assert EvaluateStage().fingerprint_config(cfg)["tool_sources"] == sources
    assert "tool_sources" not in EvaluateStage().fingerprint_config(plain)


def test_inspect_shows_a_multi_turn_sample_turn_by_turn_with_the_tool_outputs_marked(runs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from harness import cli

    from batchrl.agents.calls import ToolTurnFormat
    from batchrl.storage.schemas import conform

    _, (_, rows), _, _ = runs
    call = {"name": "calculator", "arguments": {"expression": "6*7"}, "output": "42", "error": None, "turn": 0}
    text = '<tool_call>{"name": "calculator", ...}</tool_call>' + ToolTurnFormat("", "\n").render(["42"]) + "It is 42."
    row = rows[0] | {
        "response_texts": [text] * 3,
        "tool_calls": [json.dumps([call])] * 3,
        "stop_statuses": ["completed"] * 3,
    }
    pq.write_table(conform(pa.Table.from_pylist([row]), "rollouts"), tmp_path / "part.parquet")
    shown = cli("inspect", tmp_path / "part.parquet", "--rows", "1").stdout
    assert "sample 2:" in shown
    assert "  [turn 0] policy: '<tool_call>" in shown
    assert """  [tool] calculator({"expression": "6*7"}) -> '42'""" in shown
    assert "  [turn 1] policy: 'It is 42.'\n  [end] completed" in shown
