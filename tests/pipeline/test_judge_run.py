"""The judge in a run: killed with kill -9 while its second shard waits on the judge (an OpenAI-compatible server
started by the test), the resumed run makes the same seeded calls and writes the verdicts an uninterrupted run would;
then a changed judge template redoes judge, score and what follows but not generation, and a changed score weight
redoes score but not the judge. Tiny: the toy pipeline (hf engine, 8 prompts in 2 shards, 2 samples each)."""

from __future__ import annotations

import json

import pytest
from chat_server import ChatServer, verdict_for
from harness import cli_ok, kill_run_when, read_manifest, read_rows, start_cli
from test_resume import plan_lines

pytestmark = pytest.mark.slow

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nScore 0-9."


def test_a_run_killed_mid_judge_resumes_to_the_same_verdicts_and_a_changed_judge_redoes_only_what_follows(
    tmp_path, pipeline
):
    pause = tmp_path / "pause"
    pause.mkdir()
    server = ChatServer(pause_at=9, pause_dir=pause)  # the second shard's first request never gets an answer
    try:
        judge = {
            "endpoint": {"base_url": server.url("ok"), "model": "judge", "max_concurrency": 4},
            "template": TEMPLATE,
            "verdict": {"kind": "number", "min": 0, "max": 9},
        }
        rewards = [{"reward": "judge", "weight": 1.0}, {"reward": "custom_rewards:digit_count", "weight": 1.0}]
        path = pipeline({"name": "judged", "judge": judge, "score.rewards": rewards})
        process = start_cli("run", path, log=tmp_path / "killed.log")
        kill_run_when(pause / "reached", process, log=tmp_path / "killed.log")
        it = tmp_path / "runs" / "judged" / "iter_0000"
        assert not (it / "judgements" / "_MANIFEST.json").exists()
        unanswered = {(r["seed"], r["content"]) for r in server.requests[8:]}  # in flight at the kill
        server.pause_at, asked = None, len(server.requests)

        cli_ok("run", path)
        redone = {(r["seed"], r["content"]) for r in server.requests[asked:]}
        assert len(unanswered) == 4 and unanswered <= redone  # the same calls again, with the same seeds
        assert len(redone) in (8, 16)  # the killed shard (and the one before, if the kill beat its journal record)
        answers = {r["content"]: verdict_for(r["content"], r["seed"]) for r in server.requests}
        rows = read_rows(it / "judgements")
        assert len(rows) == 8 and read_manifest(it / "judgements")["counts"]["failed"] == 0
        for row in rows:
            question = json.loads(row["messages_json"])[-1]["content"]  # the question, not the chat-templated prompt
            asked_for = [TEMPLATE.format(prompt=question, response=r) for r in row["response_texts"]]
            assert row["judge_texts"] == [answers[content] for content in asked_for]
            assert row["judge_attempts"] == [1, 1]
        scores = {r["prompt_id"]: r for r in read_rows(it / "scores")}
        for row in rows:
            assert [v[0] for v in scores[row["prompt_id"]]["reward_values"]] == pytest.approx(row["judge_scores"])

        changed = plan_lines(cli_ok("plan", path, sets=["judge.template='Grade {response} for {prompt}'"]))
        assert changed["iter 0 generate"].startswith("done     skip (complete)"), changed
        for stage in ("judge", "score", "advantage", "update"):
            assert changed[f"iter 0 {stage}"].startswith("stale    redo (config changed)"), changed
        reweighted = plan_lines(cli_ok("plan", path, sets=["score.rewards=[{reward: judge, weight: 2.0}]"]))
        assert reweighted["iter 0 judge"].startswith("done     skip (complete)"), reweighted
        assert reweighted["iter 0 score"].startswith("stale    redo (config changed)"), reweighted
    finally:
        server.close()
