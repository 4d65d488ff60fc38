"""The judge over HTTP (judge.endpoint) against a local OpenAI-compatible server: verdicts, the concurrency limit,
retries with backoff on 429, timeouts, bodies that are no completion, and unparsable verdicts retried with new seeds."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from chat_server import ChatServer, verdict_for

from batchrl.config.judge import JudgeConfig
from batchrl.rewards.judge import parse_verdict
from batchrl.stages.judge_calls import JudgeCalls, judge_group_columns

RESPONSES = [f"answer {i}" for i in range(8)]


@pytest.fixture(scope="module")
def server():
    chat = ChatServer(delay_s=0.05)
    yield chat
    chat.close()


def judge(server: ChatServer, mode: str, **endpoint) -> JudgeCalls:
    config = JudgeConfig(
        endpoint={"base_url": server.url(mode), "model": "judge", "backoff_s": 0.01} | endpoint,
        template="{prompt} -> {response}",
        verdict={"kind": "number", "min": 0, "max": 9, "normalize": False},
        max_retries=2,
    )
    return JudgeCalls(config, run_seed=3, iteration=0)


def groups(responses: list[str]) -> pa.Table:
    return pa.table(
        {
            "prompt_id": ["p0"],
            "data_source": ["d"],
            "messages_json": [json.dumps([{"role": "user", "content": "q"}])],
            "prompt_text": ["<|im_start|>user\nq<|im_end|>"],  # the judge reads the messages' text, not this
            "ground_truth": [None],
            "extra_info_json": [json.dumps({})],
            "response_texts": [responses],
        }
    )


def judged(calls: JudgeCalls, responses: list[str] = RESPONSES) -> tuple[dict, dict]:
    columns, counts = judge_group_columns(calls, groups(responses))
    return {name: column.to_pylist()[0] for name, column in columns.items()}, counts


def test_verdicts_come_from_the_endpoint_with_at_most_max_concurrency_requests_in_flight(server):
    server.max_in_flight = 0
    row, counts = judged(judge(server, "ok", max_concurrency=2))
    seeds = [judge(server, "ok").seed("p0", i, 0) for i in range(len(RESPONSES))]
    assert row["judge_texts"] == [verdict_for(f"q -> {r}", seed) for r, seed in zip(RESPONSES, seeds)]
    assert row["judge_scores"] == [parse_verdict(t, judge(server, "ok").judge.verdict)[0] for t in row["judge_texts"]]
    assert row["judge_attempts"] == [1] * 8 and counts["failed"] == 0 and server.max_in_flight == 2


def test_a_rate_limited_request_is_retried_until_it_is_answered(server):
    row, counts = judged(judge(server, "flaky"), ["only one"])
    assert row["judge_errors"] == [None] and row["judge_attempts"] == [1]
    assert sum(r["content"] == "q -> only one" for r in server.requests) == 3  # two 429s, then the verdict


@pytest.mark.parametrize(
    ("mode", "endpoint", "error"),
    [
        ("slow", {"timeout_s": 0.2, "max_request_retries": 1}, "request: no answer within 0.2 s"),
        ("garbage", {}, "request: not a chat completion: JSONDecodeError"),
        ("reject", {}, "request: HTTP 400"),
    ],
)
def test_a_request_that_fails_after_its_retries_is_a_recorded_failure_not_an_error(server, mode, endpoint, error):
    before = len(server.requests)
    row, counts = judged(judge(server, mode, **endpoint), ["x"])
    assert row["judge_scores"] == [None] and row["judge_errors"][0].startswith(error)
    assert row["judge_attempts"] == [1] and counts["failed"] == 1
    sent = {"slow": 2, "garbage": 1, "reject": 1}[mode]  # retried: a timeout; not retried: what a retry won't fix
    assert len(server.requests) - before == sent


def test_an_unparsable_verdict_is_asked_again_with_another_seed_and_the_retry_temperature(server):
    before = len(server.requests)
    row, counts = judged(judge(server, "babble"), ["y"])
    seeds = [r["seed"] for r in server.requests[before:]]
    assert row["judge_attempts"] == [3] and len(set(seeds)) == 3 and counts["attempts"] == 3
    assert [r["temperature"] for r in server.requests[before:]] == [0.0, 0.7, 0.7]  # greedy, then sampled retries
    assert row["judge_texts"] == ["I cannot say."] and row["judge_errors"] == ["unparsable: no number"]


def test_an_api_key_variable_that_is_not_set_is_named(server, monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="JUDGE_TEST_KEY"):
        judge(server, "ok", api_key_env="JUDGE_TEST_KEY")
