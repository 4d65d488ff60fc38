"""A run with generate.tools end to end on the tiny toy pipeline: validate refuses a tool whose docstring does not
describe its parameters (exit 2, naming generate.tools[i], before any work); the run generates multi-turn rollouts
(every column, the mask as long as the response), scores, trains on them and reports the tool metrics per
iteration; inspect shows the conversations. The random toy model writes no call: the tool turns are tested on real
engines in tests/stages/test_agent_loop.py."""

from __future__ import annotations

import json

import pytest
from harness import cli, cli_ok, read_manifest, read_metrics, read_rows

pytestmark = pytest.mark.slow


def test_a_run_with_tools_rolls_out_conversations_trains_on_them_and_reports_tool_metrics(tmp_path, pipeline):
    bad = pipeline({"name": "tools", "generate.tools": ["calculator", "test_agent_loop:scripted_calls"]})
    refused = cli("validate", bad)
    assert refused.returncode == 2 and "generate.tools[1]='test_agent_loop:scripted_calls'" in refused.stderr
    assert "not described in the docstring" in refused.stderr and not (tmp_path / "runs").exists()

    path = pipeline(
        {"name": "tools", "generate.tools": ["calculator", "test_agent_loop:count"], "generate.max_turns": 2}
    )
    cli_ok("run", path)
    it = tmp_path / "runs" / "tools" / "iter_0000"
    rows = read_rows(it / "rollouts")
    assert len(rows) == 8
    for row in rows:
        assert [len(m) for m in row["response_masks"]] == row["response_lengths"]
        assert row["num_turns"] == [1 + sum(1 for _ in json.loads(c)) for c in row["tool_calls"]]
        assert set(row["stop_statuses"]) <= {"completed", "length", "max_turns"}
    assert read_manifest(it / "rollouts")["counts"]["turns"] == sum(t for r in rows for t in r["num_turns"])
    assert (it / "policy" / "_MANIFEST.json").exists()
    [metrics] = read_metrics(tmp_path / "runs" / "tools")
    assert metrics["tools/turns_mean"] >= 1.0 and 0.0 <= metrics["tools/use_rate"] <= 1.0
    shown = cli_ok("inspect", it / "rollouts", "--rows", "1").stdout
    assert "sample 1:" in shown and "  [turn 0] policy: " in shown and "  [end] " in shown
