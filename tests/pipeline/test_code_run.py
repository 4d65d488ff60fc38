"""A code reward in a real run: a log of programming prompts with hidden stdin/stdout tests and the programs a
model wrote for them (right, wrong, half right, hanging, crashing, hostile) is scored by code_tests in the sandbox
and trained on. Every program gets its score and, where a test failed, why, in the scores table; none fails the
stage, and the run goes on to the update. Logged data: no generation, so the run is about the scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import cli_ok, read_manifest, read_rows, write_pipeline

pytestmark = pytest.mark.slow

TESTS = json.dumps([{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}])
READ = "n, k = map(int, input().split())\n"
PROGRAMS = {
    "right": f"```python\n{READ}print(n + k)\n```",
    "wrong": f"```python\n{READ}print(n - k)\n```",
    "half": f"```python\n{READ}print(5)\n```",  # right on the first test only
    "hangs": "```python\nwhile True:\n    pass\n```",
    "crashes": f"```python\n{READ}print(n // 0)\n```",
    "hostile": "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(5)\n```",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, toy_model_dir) -> Path:
    workdir = tmp_path_factory.mktemp("code-run")
    log = workdir / "code.jsonl"
    names = list(PROGRAMS)
    with log.open("w") as f:
        for i in range(0, len(names), 2):  # groups of two programs per prompt
            responses = [PROGRAMS[n] for n in names[i : i + 2]]
            record = {"prompt_id": f"p{i // 2}", "prompt": "Read n and k, print n+k.", "data_source": "code"}
            f.write(json.dumps(record | {"ground_truth": TESTS, "responses": responses}) + "\n")
    path = write_pipeline(
        workdir,
        {
            "name": "code",
            "data.train_files": [str(log)],
            "generate.logged": "all",
            "generate.max_new_tokens": 128,  # the programs' length in the toy's tokens (a logged reply must fit)
            "score.rewards": [{"reward": "code_tests", "params": {"timeout_s": 1, "wall_timeout_s": 3, "budget_s": 8}}],
            "score.timeout_s": 20,
        },
        model=toy_model_dir,
        prompts=str(log),
    )
    cli_ok("run", path, "--run-id", "code")
    return workdir / "runs" / "code"


def test_each_program_is_scored_by_its_hidden_tests_and_a_failure_says_why_without_failing_the_stage(run_dir):
    rows = read_rows(run_dir / "iter_0000" / "scores", sort_by=["prompt_id"])
    scored = {}
    for row in rows:
        for text, score, detail, error in zip(
            row["response_texts"], row["scores"], row["score_details"], row["score_errors"], strict=True
        ):
            name = next(n for n, program in PROGRAMS.items() if program == text)
            scored[name] = (score, detail or "", error)
    assert {name: s for name, (s, _, _) in scored.items()} == pytest.approx(
        {"right": 1.0, "wrong": 0.0, "half": 0.5, "hangs": 0.0, "crashes": 0.0, "hostile": 0.0}
    )
    assert all(error is None for _, _, error in scored.values())  # every program was scored, none is a failure
    assert scored["right"][1] == ""
    assert "1/2 tests passed; test 2:" in scored["half"][1]
    assert "timeout" in scored["hangs"][1]
    assert "ZeroDivisionError" in scored["crashes"][1]
    assert "0/2 tests passed" in scored["hostile"][1]  # its connection fails (the sandbox has no network)


def test_the_run_trains_on_the_code_rewards(run_dir):
    advantages = {
        (r["prompt_id"], r["sample_idx"]): r["advantage"] for r in read_rows(run_dir / "iter_0000" / "advantages")
    }
    assert advantages[("p0", 0)] > 0 > advantages[("p0", 1)]  # right beats wrong in its group
    assert advantages[("p1", 0)] > 0 > advantages[("p1", 1)]  # half right beats the hanging program
    assert advantages[("p2", 0)] == advantages[("p2", 1)] == 0  # the crash and the hostile program: both 0
    stats = read_manifest(run_dir / "iter_0000" / "policy")["stats"]
    assert stats["perf/num_samples"] == len(PROGRAMS) and stats["actor/num_optimizer_steps"] >= 1
