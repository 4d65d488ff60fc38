"""Training on logged data in real runs: a JSONL log (prompt, responses, some rewards, some behaviour log-probs,
groups of 1, 2 and 3, rows without labels) becomes the rollouts of every iteration; score keeps the logged rewards
and computes the missing ones; the update recomputes the missing log-probs and its manifest counts them; a run
killed (-9) after the import resumes to the rows and weights of an uninterrupted one; with generate.logged: [0] the
next iteration generates. Tiny runs: HF engine, gloo update."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from harness import REPO, cli, cli_ok, kill_run_when, read_manifest, read_metrics, read_rows, start_cli, write_pipeline

pytestmark = pytest.mark.slow

PAUSE_ENV = "BATCHRL_TEST_LOGGED_PAUSE"

PROBE_SOURCE = """
import os, time
from pathlib import Path

import pyarrow as pa


def pause_in_second_shard(table):
    pause = os.environ.get("{env}")
    if pause and table.num_rows and table.column("prompt_id")[0].as_py() == "q4":
        Path(pause, "reached").write_text("")
        while not Path(pause, "go").exists():
            time.sleep(0.1)
    return table.append_column("probed", pa.array([True] * table.num_rows))
"""

# (prompt_id, prompt, ground truth, record fields): 8 valid rows in 2 shards of 4, then 2 bad ones
LOG = [
    ("q0", "1+1=", None, {"responses": ["2", "3"], "rewards": [1.0, 0.0]}),
    ("q1", "2+2=", None, {"responses": ["4", "5", "44"], "rewards": [1.0, 0.0, 0.5]}),
    ("q2", "3+3=", None, {"response": "6", "reward": 1.0, "response_logprobs": None}),
    ("q3", "4+4=", "8", {"responses": ["8", "nine"], "rewards": [None, 0.25]}),
    ("q4", "5+5=", "10", {"responses": ["10 and 11", "ten"]}),
    ("q5", "6+6=", None, {"responses": ["12", "13"], "rewards": [1, 0], "response_token_ids": [[20, 21], [22]]}),
    ("q6", "7+7=", None, {"responses": ["14", "15"], "rewards": [0.0, 1.0]}),
    ("q7", "8+8=", None, {"responses": ["16", "61"], "rewards": [1.0, 0.0]}),
    ("bad0", "9+9=", "18", {}),  # no responses
    ("bad1", "1+9=", "10", {"responses": ["10"], "rewards": [1.0, 2.0]}),  # 2 rewards for 1 response
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One directory for the module: the log, the probe stage's code and the runs the tests share."""
    return tmp_path_factory.mktemp("logged")


@pytest.fixture(scope="module")
def log_file(workdir, toy_model_dir) -> Path:
    """The log as gzipped JSONL; q5's log-probs count its token ids, q0's count the tokenized reply plus EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    q0_tokens = len(tokenizer("2", add_special_tokens=False)["input_ids"]) + 1
    path = workdir / "logs" / "chat.jsonl.gz"
    path.parent.mkdir()
    with gzip.open(path, "wt") as f:
        for prompt_id, prompt, truth, fields in LOG:
            record = {"prompt_id": prompt_id, "prompt": prompt, **fields}
            if truth is not None:
                record["ground_truth"] = truth
            if prompt_id == "q0":
                record["response_logprobs"] = [[-0.5] * q0_tokens, None]
            if prompt_id == "q5":
                record["response_logprobs"] = [[-0.1, -0.2], [-0.3]]
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def probe_dir(workdir) -> Path:
    code = workdir / "code"
    code.mkdir()
    (code / "logged_probe.py").write_text(PROBE_SOURCE.format(env=PAUSE_ENV))
    return code


def logged_pipeline(directory: Path, model: str, log_file: Path, **overrides) -> Path:
    stage = {"name": "probe", "after": "generate", "call": "logged_probe:pause_in_second_shard", "outputs": ["probed"]}
    return write_pipeline(
        directory,
        {
            "name": "logged",
            "data.train_files": [str(log_file)],
            "data.max_prompts": 100,
            "generate.logged": "all",
            "update.old_logprobs": "rollout",  # the loss reads the behaviour log-probs: the missing are recomputed
            "stages": [stage],
        }
        | overrides,
        model=model,
        prompts=str(log_file),
    )


@pytest.fixture(scope="module")
def uninterrupted(workdir, toy_model_dir, log_file, probe_dir) -> tuple[Path, Path]:
    """(the pipeline file, the run directory of its uninterrupted run)."""
    path = logged_pipeline(workdir, toy_model_dir, log_file)
    cli_ok("run", path, "--run-id", "uninterrupted", path_first=[probe_dir, REPO])
    return path, workdir / "runs" / "uninterrupted"


def test_a_logged_jsonl_log_is_scored_where_it_lacks_rewards_and_trained_on(uninterrupted, toy_model_dir):
    from transformers import AutoTokenizer

    run = uninterrupted[1]
    prompts = read_manifest(run / "prompts")
    assert prompts["counts"]["prompts"] == 8
    assert prompts["counts"]["rejected/missing_responses"] == 1 and prompts["counts"]["rejected/bad_rewards"] == 1

    it = run / "iter_0000"
    rollouts = {r["prompt_id"]: r for r in read_rows(it / "rollouts")}
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    for prompt_id, _, _, fields in LOG[:8]:
        row = rollouts[prompt_id]
        texts = fields.get("responses") or [fields["response"]]
        assert row["response_texts"] == texts and row["policy_version"] == -1
        assert row["finish_reasons"] == ["logged"] * len(texts) and row["sample_seeds"] == [-1] * len(texts)
        if prompt_id != "q5":  # tokenized with the policy's tokenizer, EOS appended
            expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
            assert row["response_token_ids"] == expected
        assert row["logged_responses"] is None and row["logged_logprobs"] is None
    assert rollouts["q5"]["response_token_ids"] == [[20, 21], [22]]
    assert [x for lp in rollouts["q5"]["response_logprobs"] for x in lp] == pytest.approx([-0.1, -0.2, -0.3])
    assert rollouts["q0"]["response_logprobs"][1] == [] and rollouts["q4"]["response_logprobs"] == [[], []]
    counts = read_manifest(it / "rollouts")["counts"]
    assert counts["logged_samples"] == 16 and counts["logged_rewards"] == 13
    assert counts["logprobs_missing"] == 16 - 3  # q0's first reply and q5's two came with log-probs

    scores = {r["prompt_id"]: r for r in read_rows(it / "scores")}
    # logged rewards kept; the missing ones computed by the configured reward (digit_count), which needs a label:
    # q3 and q4 have one, the rows whose every reply has a logged reward need none
    assert scores["q1"]["scores"] == pytest.approx([1.0, 0.0, 0.5])
    assert scores["q3"]["scores"] == pytest.approx([1.0, 0.25])  # "8" has one digit
    assert scores["q4"]["scores"] == pytest.approx([4.0, 0.0])
    assert scores["q3"]["reward_names"] == ["digit_count", "logged"]
    assert scores["q3"]["reward_values"] == [[1.0, None], [None, 0.25]]  # a logged reward ran nothing else
    assert scores["q3"]["score_errors"] == [None, None]

    advantages = {(r["prompt_id"], r["sample_idx"]): r["advantage"] for r in read_rows(it / "advantages")}
    # a group of one: its reward over (std 1 + epsilon 1e-6), verl's GRPO rule
    assert advantages[("q2", 0)] == pytest.approx(1.0 / (1.0 + 1e-6), rel=1e-6)
    assert advantages[("q1", 0)] > 0 > advantages[("q1", 1)]  # a group of three

    policy = read_manifest(it / "policy")
    assert policy["counts"]["logprobs_recomputed"] == 13
    metrics = read_metrics(run)[0]
    assert metrics["actor/recomputed_logprobs_samples"] == 13
    assert metrics["critic/rewards/logged/mean"] == pytest.approx(
        sum(r for *_, f in LOG[:8] for r in f.get("rewards", [f.get("reward")]) if r is not None) / 13
    )
    assert "score/failed_samples" in metrics and metrics["score/failed_samples"] == 0


def test_a_run_killed_after_the_log_import_resumes_to_the_rows_and_weights_of_an_uninterrupted_one(
    tmp_path, uninterrupted, probe_dir
):
    path, expected = uninterrupted
    pause = tmp_path / "pause"
    pause.mkdir()
    process = start_cli(
        "run",
        path,
        "--run-id",
        "killed",
        log=tmp_path / "killed.log",
        env={PAUSE_ENV: str(pause)},
        path_first=[probe_dir, REPO],
    )
    kill_run_when(pause / "reached", process, log=tmp_path / "killed.log")  # a shard of probe in flight
    resumed = expected.parent / "killed"
    assert (resumed / "iter_0000" / "rollouts" / "_MANIFEST.json").exists()  # killed after the import
    assert not (resumed / "iter_0000" / "probe" / "_MANIFEST.json").exists()
    (pause / "go").write_text("")
    cli_ok("run", path, "--run-id", "killed", path_first=[probe_dir, REPO])

    for table in ("prompts",):
        assert read_rows(resumed / table) == read_rows(expected / table)
    for table in ("rollouts", "scores", "advantages"):
        assert read_rows(resumed / "iter_0000" / table) == read_rows(expected / "iter_0000" / table), table
    weights = "iter_0000/policy/model.safetensors"
    assert _sha256(resumed / weights) == _sha256(expected / weights)


def test_logged_for_iteration_0_only_then_generated_and_rows_need_labels_for_it(
    tmp_path, toy_model_dir, log_file, probe_dir
):
    labelled = tmp_path / "labelled.jsonl"  # the log with labels, but for q6
    with gzip.open(log_file, "rt") as f:
        records = [json.loads(line) for line in f]
    labelled.write_text(
        "".join(json.dumps(r | ({"ground_truth": "1"} if r["prompt_id"] != "q6" else {})) + "\n" for r in records)
    )
    path = logged_pipeline(tmp_path, toy_model_dir, labelled, **{"generate.logged": [0], "run.iterations": 2})
    cli_ok("run", path, "--run-id", "mixed", path_first=[probe_dir, REPO])
    run = tmp_path / "runs" / "mixed"
    # iteration 1 generates fresh replies, scored by digit_count, which needs a label: q6 has none
    counts = read_manifest(run / "prompts")["counts"]
    assert counts["prompts"] == 7 and counts["rejected/missing_ground_truth"] == 1
    fresh = read_rows(run / "iter_0001" / "rollouts")
    assert {r["policy_version"] for r in fresh} == {1} and all(r["logged_rewards"] is None for r in fresh)
    assert all(len(r["response_texts"]) == 2 for r in fresh)  # generate.num_samples_per_prompt, not the log's
    assert all(r["finish_reasons"][0] != "logged" for r in fresh)
    assert "logged" not in read_rows(run / "iter_0001" / "scores")[0]["reward_names"]
    assert {r["policy_version"] for r in read_rows(run / "iter_0000" / "rollouts")} == {-1}


def test_a_log_without_responses_is_a_data_error_naming_the_file(tmp_path, pipeline, toy_prompts_dir):
    result = cli("run", pipeline({"generate.logged": "all"}))
    assert result.returncode == 3, result.stderr[-2000:]
    assert "has no 'responses' (or 'response') column" in result.stderr
    assert "Traceback" not in result.stderr


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
