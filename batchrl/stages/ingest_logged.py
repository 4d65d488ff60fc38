"""ingest of logged data (generate.logged): the responses, rewards and behaviour log-probs a prompt row carries.

Input fields, per record, next to the prompt's (either layout of ingest_rows):
- ``responses``: a list of response strings (one group), or ``response``: one string (a group of one);
- ``rewards`` (a list aligned with the responses; an element may be null) or ``reward`` (a number, with one
  response): optional; a missing reward is computed by the score stage;
- ``response_logprobs``: optional, the behaviour policy's log-prob of every response token (a list per response,
  or one flat list with one response; null or [] for a response without): a missing one is recomputed by the update;
- ``response_token_ids``: optional, the response tokens (a list per response, or one flat list with one
  response). Without them a response is tokenized with the policy's tokenizer and its EOS token appended (the
  logged reply ended there, so the policy learns to stop). Log-probs must count the tokens one for one.

Reject reasons: missing_responses, bad_responses, bad_rewards, bad_logprobs, bad_token_ids, response_too_long
(over generate.max_new_tokens tokens). A row is one group: rows of a flat log (one response per row) are groups of
one, which the group-relative estimators treat as verl does (advantage = the reward).
"""

from __future__ import annotations

import math
from typing import Any

LOGGED_INPUT_COLUMNS = ["responses", "response", "rewards", "reward", "response_logprobs", "response_token_ids"]


def logged_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The logged fields of an input record, as they came (normalised by `check_logged`)."""
    return {name: raw.get(name) for name in LOGGED_INPUT_COLUMNS}


def check_logged(row: dict[str, Any]) -> tuple[str, str] | None:
    """Normalises a row's logged fields into ``logged_*`` lists; returns (reject reason, detail) or None."""
    raw = row.pop("logged_raw")
    single = raw["responses"] is None and raw["response"] is not None
    responses = [raw["response"]] if single else raw["responses"]
    if responses is None:
        return (
            "missing_responses",
            "no responses (a list of strings) or response (a string), which generate.logged needs",
        )
    if not isinstance(responses, list) or not responses:
        return "bad_responses", f"responses is {_short(responses)}; expected a non-empty list of strings"
    if not all(isinstance(r, str) for r in responses):
        return "bad_responses", "every response must be a string"
    n = len(responses)
    rewards, problem = _rewards(raw, n=n, single=single)
    if problem:
        return "bad_rewards", problem
    logprobs, problem = _per_response(raw["response_logprobs"], n=n, single=single, number=_is_number)
    if problem:
        return "bad_logprobs", f"response_logprobs: {problem}"
    token_ids, problem = _per_response(raw["response_token_ids"], n=n, single=single, number=_is_token_id)
    if problem:
        return "bad_token_ids", f"response_token_ids: {problem}"
    if token_ids is not None and any(ids is None for ids in token_ids):
        return "bad_token_ids", "response_token_ids: give the tokens of every response, or of none"
    row["logged_responses"] = responses
    row["logged_rewards"] = rewards
    row["logged_logprobs"] = None if logprobs is None else [lp or [] for lp in logprobs]
    row["logged_response_token_ids"] = token_ids
    return None


def rewards_complete(row: dict[str, Any]) -> bool:
    """Whether every logged response of a checked row has its reward (the score stage computes none for it)."""
    rewards = row.get("logged_rewards")
    return rewards is not None and all(r is not None for r in rewards)


def tokenize_responses(rows: list[dict[str, Any]], tokenizer, *, max_tokens: int) -> list[tuple[dict, str, str]]:
    """Sets ``logged_response_token_ids`` of checked rows (tokenizing the responses that came without, in one call,
    plus the EOS token); returns (row, reason, detail) for the rows to reject: a response over ``max_tokens``
    tokens, or log-probs that do not count its tokens."""
    texts = [r for row in rows if row["logged_response_token_ids"] is None for r in row["logged_responses"]]
    encoded = iter(
        tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"] if texts else []
    )
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rejects = []
    for row in rows:
        if row["logged_response_token_ids"] is None:
            row["logged_response_token_ids"] = [list(next(encoded)) + eos for _ in row["logged_responses"]]
        lengths = [len(ids) for ids in row["logged_response_token_ids"]]
        if max(lengths) > max_tokens:
            rejects.append(
                (
                    row,
                    "response_too_long",
                    f"a response has {max(lengths)} tokens > generate.max_new_tokens={max_tokens}",
                )
            )
            continue
        logprobs = row["logged_logprobs"] or []
        wrong = [(k, len(lp), lengths[k]) for k, lp in enumerate(logprobs) if lp and len(lp) != lengths[k]]
        if wrong:
            k, got, want = wrong[0]
            detail = (
                f"response {k} has {got} log-probs for {want} tokens (the policy's tokens, EOS appended); give "
                "response_token_ids, the tokens the log-probs score"
            )
            rejects.append((row, "bad_logprobs", detail))
    return rejects


def _rewards(raw: dict[str, Any], *, n: int, single: bool) -> tuple[list[float | None] | None, str | None]:
    rewards = raw["rewards"]
    if rewards is None and raw["reward"] is not None:
        if n != 1:
            return None, f"reward (one number) given for {n} responses: give rewards, a list aligned with them"
        rewards = [raw["reward"]]
    if rewards is None:
        return None, None
    if not isinstance(rewards, list) or len(rewards) != n:
        return None, f"rewards is {_short(rewards)}; expected a list of {n} numbers (or nulls), one per response"
    bad = [r for r in rewards if r is not None and not _is_number(r)]
    if bad:
        return None, f"reward {_short(bad[0])} is not a finite number"
    return [None if r is None else float(r) for r in rewards], None


def _per_response(value: Any, *, n: int, single: bool, number) -> tuple[list | None, str | None]:
    """A per-response list of number lists (a flat list with one response is that response's), or a problem."""
    if value is None:
        return None, None
    if not isinstance(value, list):
        return None, f"{_short(value)} is not a list"
    if single and all(number(v) for v in value):
        value = [value]
    if len(value) != n:
        return None, f"{len(value)} lists for {n} responses"
    for item in value:
        if item is not None and not (isinstance(item, list) and all(number(v) for v in item)):
            return None, f"{_short(item)} is not a list of numbers"
    return value, None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
