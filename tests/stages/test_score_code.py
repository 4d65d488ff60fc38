"""The score stage with the code_tests reward over hand-made rollouts: programs run in the sandbox from the reward
process, a hanging or crashing program scores 0 for its tests with the reason in score_details, and nothing fails."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest
from test_score_components import rollouts, run_score_stage

from batchrl.config import validate_dict
from batchrl.rewards.combine import TermSpec
from batchrl.stages.score import ScoreWorker
from batchrl.storage import read_parquet

STDIO = [
    {"input": "2 3\n", "output": "5\n"},
    {"input": "10 -4\n", "output": "6\n"},
    {"input": "0 0\n", "output": "0\n"},
]
ASSERTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
SUM = "```python\nn, k = map(int, input().split())\nprint(n + k)\n```"


def code_rollouts() -> pa.Table:
    table = rollouts(
        [
            {
                "prompt_id": "sum",
                "truth": json.dumps(STDIO),
                "responses": [SUM, SUM.replace("n + k", "n + k if n else 1"), "import time\ntime.sleep(60)", "1/0"],
            },
            {
                "prompt_id": "add",
                "truth": ASSERTS,
                "responses": ["def add(n, k):\n    return n + k", "def add(n, k):\n    return abs(n) + k"],
            },
        ]
    )
    return table.set_column(table.schema.get_field_index("data_source"), "data_source", pa.array(["code"] * 2))


def test_code_rows_are_scored_by_their_tests_and_failures_are_explained_not_raised(tmp_path):
    params = {"timeout_s": 1.0}  # a 3 s wall clock: the hanging program waits it out, no right program misses it
    cfg = validate_dict(
        {
            "name": "code",
            "run": {"root": str(tmp_path / "runs")},
            "model": {"path": "toy"},
            "data": {"train_files": ["prompts"]},
            "score": {"reward_by_data_source": {}, "rewards": [{"reward": "code_tests", "params": params}]},
        }
    )
    # a lone CPU shard on the embedded Ray: scored in this process, the reward processes under it
    output, out_dir = run_score_stage(cfg, [code_rollouts()], tmp_path, embedded_ray=True)
    sums, adds = read_parquet(f"{out_dir}/part-00000.parquet").to_pylist()
    assert [round(s, 3) for s in sums["scores"]] == [1.0, 0.667, 0.0, 0.0]
    assert sums["score_errors"] == [None] * 4 and adds["score_errors"] == [None] * 2
    assert sums["score_details"][0] is None
    assert sums["score_details"][1] == "code_tests: 2/3 tests passed; test 3: wrong answer (expected '0', got '1')"
    assert sums["score_details"][2] == "code_tests: 0/3 tests passed; test 1: timeout; test 2: timeout; test 3: timeout"
    assert sums["score_details"][3].startswith("code_tests: 0/3 tests passed; test 1: error: ZeroDivisionError")
    assert adds["scores"] == [1.0, 0.5] and "test 2: error: AssertionError" in adds["score_details"][1]
    assert output.counts["failed_samples"] == 0
    assert output.stats["critic/rewards/code_tests/mean"] == pytest.approx((1 + 2 / 3 + 1 + 0.5) / 6, rel=1e-6)


def test_several_reward_processes_wait_out_hanging_programs_side_by_side():
    hang, wall_s = "import time\ntime.sleep(60)", 3.0
    table = rollouts([{"prompt_id": "sum", "truth": json.dumps(STDIO[:1]), "responses": [hang, SUM, hang, SUM, hang]}])
    warm = rollouts([{"prompt_id": "warm", "truth": json.dumps(STDIO[:1]), "responses": [SUM] * 3}])
    term = TermSpec("code_tests", 1.0, params={"timeout_s": 1.0, "wall_timeout_s": wall_s})
    worker = ScoreWorker(terms=[term], by_data_source={}, failure_reward=0.0, timeout_s=30.0, reward_processes=3)
    try:
        worker.process(warm)  # starts every reward process
        started = time.monotonic()
        out, counts = worker.process(table)
        elapsed = time.monotonic() - started
    finally:
        worker.close()
    assert elapsed < 7.0  # in series the three hangs alone take 9 s
    assert out.column("scores").to_pylist() == [[0.0, 1.0, 0.0, 1.0, 0.0]]  # in order, whichever process scored it
    details = out.column("score_details").to_pylist()[0]
    assert details[1::2] == [None, None] and all(d.endswith("test 1: timeout") for d in details[0::2])
    assert counts["failed_samples"] == 0
