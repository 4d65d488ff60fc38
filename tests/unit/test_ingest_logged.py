"""The logged fields of an input record (training on logged data): normalised into per-response lists, or
rejected with a reason; responses tokenized with EOS appended; log-probs that do not count the tokens rejected."""

from __future__ import annotations

import pytest

from batchrl.stages.ingest_logged import check_logged, logged_fields, rewards_complete, tokenize_responses


def checked(**fields):
    row = {"logged_raw": logged_fields(fields)}
    return check_logged(row), row


def test_a_group_with_rewards_and_some_logprobs_is_kept_per_response():
    problem, row = checked(responses=["a", "b"], rewards=[1, None], response_logprobs=[[-0.5], None])
    assert problem is None
    assert row["logged_responses"] == ["a", "b"]
    assert row["logged_rewards"] == [1.0, None] and not rewards_complete(row)
    assert row["logged_logprobs"] == [[-0.5], []]  # a response without: an empty list, recomputed later
    assert row["logged_response_token_ids"] is None


def test_a_flat_record_is_a_group_of_one():
    problem, row = checked(response="a", reward=0.5, response_logprobs=[-0.1, -0.2], response_token_ids=[3, 4])
    assert problem is None
    assert row["logged_responses"] == ["a"] and row["logged_rewards"] == [0.5] and rewards_complete(row)
    assert row["logged_logprobs"] == [[-0.1, -0.2]] and row["logged_response_token_ids"] == [[3, 4]]


@pytest.mark.parametrize(
    ("fields", "reason", "detail"),
    [
        ({}, "missing_responses", "no responses"),
        ({"responses": []}, "bad_responses", "non-empty list"),
        ({"responses": "a"}, "bad_responses", "non-empty list"),
        ({"responses": ["a", 3]}, "bad_responses", "must be a string"),
        ({"responses": ["a", "b"], "rewards": [1.0]}, "bad_rewards", "list of 2 numbers"),
        ({"responses": ["a", "b"], "reward": 1.0}, "bad_rewards", "give rewards"),
        ({"responses": ["a"], "rewards": [float("nan")]}, "bad_rewards", "not a finite number"),
        ({"responses": ["a"], "rewards": [True]}, "bad_rewards", "not a finite number"),
        ({"responses": ["a"], "rewards": ["1"]}, "bad_rewards", "not a finite number"),
        ({"responses": ["a", "b"], "response_logprobs": [[-1.0]]}, "bad_logprobs", "1 lists for 2 responses"),
        ({"responses": ["a"], "response_logprobs": [["x"]]}, "bad_logprobs", "not a list of numbers"),
        ({"responses": ["a"], "response_logprobs": -1.0}, "bad_logprobs", "is not a list"),
        ({"responses": ["a"], "response_token_ids": [[-1]]}, "bad_token_ids", "not a list of numbers"),
        ({"responses": ["a", "b"], "response_token_ids": [[1], None]}, "bad_token_ids", "of every response"),
    ],
)
def test_bad_logged_fields_are_rejected_with_a_reason(fields, reason, detail):
    problem, _ = checked(**fields)
    assert problem is not None and problem[0] == reason and detail in problem[1], problem


class FakeTokenizer:
    """One id per character (ord), EOS 0; records how many texts each call encoded."""

    eos_token_id = 0

    def __init__(self):
        self.calls = []

    def __call__(self, texts, **kwargs):
        self.calls.append(len(texts))
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def rows_of(*records):
    rows = []
    for record in records:
        row = {"logged_raw": logged_fields(record)}
        assert check_logged(row) is None
        rows.append(row)
    return rows


def test_responses_are_tokenized_in_one_call_with_eos_and_token_ids_given_are_kept():
    tokenizer = FakeTokenizer()
    rows = rows_of({"responses": ["ab", "c"]}, {"response": "zz", "response_token_ids": [7, 8, 9]})
    assert tokenize_responses(rows, tokenizer, max_tokens=8) == []
    assert rows[0]["logged_response_token_ids"] == [[97, 98, 0], [99, 0]]
    assert rows[1]["logged_response_token_ids"] == [[7, 8, 9]]  # not re-tokenized, no EOS added
    assert tokenizer.calls == [2]


def test_an_overlong_response_or_logprobs_that_do_not_count_the_tokens_reject_the_row():
    rows = rows_of(
        {"responses": ["abcdefgh"]},  # 8 characters + EOS > 8
        {"responses": ["ab"], "response_logprobs": [[-1.0, -1.0]]},  # 2 log-probs for 3 tokens (EOS appended)
        {"responses": ["ab"], "response_logprobs": [[-1.0, -1.0, -1.0]]},
    )
    rejects = tokenize_responses(rows, FakeTokenizer(), max_tokens=8)
    assert [(rows.index(row), reason) for row, reason, _ in rejects] == [(0, "response_too_long"), (1, "bad_logprobs")]
    assert "9 tokens > generate.max_new_tokens=8" in rejects[0][2]
    assert "2 log-probs for 3 tokens" in rejects[1][2] and "response_token_ids" in rejects[1][2]
