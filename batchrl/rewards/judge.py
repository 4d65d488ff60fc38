"""An LLM judge's side of a reward: its prompt from a sample's fields, its verdict from its text, and the term.

Pure functions, so that the judge stage (which calls the judge) and the tests share them: ``render_judge_prompt``
fills the configured template, ``parse_verdict`` reads a score from the judge's text or says why it cannot, and
``judge`` is the score.rewards term that turns the judgements table's verdict into a reward component.

Parsers take the LAST match in the text: a judge that reasons first ("a 3 would be too harsh... Score: 7") states
its verdict at the end. A number out of range, a grade not in the map or a JSON without the key is unparsable (the
stage retries with another seed), never clamped: a judge that answers off the scale is not giving the verdict asked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from batchrl.config.judge import JsonVerdict, LetterVerdict, NumberVerdict
from batchrl.rewards.labels import label_free

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
JSON_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


def render_judge_prompt(template: str, fields: Mapping[str, Any]) -> str:
    """``template`` with its {field}s replaced by ``fields``' values; a ValueError names a field the sample lacks
    (None: e.g. no ground truth, or no rubric in its extra_info)."""
    missing = sorted(name for name in _names(template) if fields.get(name) is None)
    if missing:
        raise ValueError(f"the judge template names {{{'}, {'.join(missing)}}}, which this sample does not have")
    return template.format_map({name: str(value) for name, value in fields.items() if value is not None})


def _names(template: str) -> list[str]:
    import string

    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def parse_verdict(text: str, verdict: NumberVerdict | LetterVerdict | JsonVerdict) -> tuple[float | None, str | None]:
    """(score, None), or (None, why the text holds no valid verdict)."""
    if isinstance(verdict, NumberVerdict):
        return _number(text, verdict)
    if isinstance(verdict, LetterVerdict):
        return _letter(text, verdict)
    return _json(text, verdict)


def _last_group(pattern: str, text: str) -> str | None:
    matches = list(re.finditer(pattern, text))
    return (matches[-1].group(1) if matches[-1].groups() else matches[-1].group(0)) if matches else None


def _number(text: str, verdict: NumberVerdict) -> tuple[float | None, str | None]:
    found = _last_group(verdict.pattern, text) if verdict.pattern else _last_group(NUMBER.pattern, text)
    if found is None:
        return None, "no number" if not verdict.pattern else f"no match of {verdict.pattern!r}"
    try:
        value = float(found)
    except ValueError:
        return None, f"{found!r} is not a number"
    if not verdict.min <= value <= verdict.max:
        return None, f"{value:g} is outside [{verdict.min:g}, {verdict.max:g}]"
    return ((value - verdict.min) / (verdict.max - verdict.min) if verdict.normalize else value), None


def _letter(text: str, verdict: LetterVerdict) -> tuple[float | None, str | None]:
    if verdict.pattern:
        found = _last_group(verdict.pattern, text)
    else:  # each grade as a whole word; longer first, so that "A+" is not read as "A"
        grades = sorted(verdict.grades, key=len, reverse=True)
        found = _last_group(r"(?<!\w)(" + "|".join(map(re.escape, grades)) + r")(?!\w)", text)
    if found is None or found not in verdict.grades:
        return None, f"no grade of {sorted(verdict.grades)}" if found is None else f"{found!r} is not a grade"
    return float(verdict.grades[found]), None


def _json(text: str, verdict: JsonVerdict) -> tuple[float | None, str | None]:
    candidates = JSON_FENCE.findall(text) + re.findall(r"\{[^{}]*\}", text)  # fenced first; flat objects after
    objects = []
    for candidate in candidates:
        try:
            parsed = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            objects.append(parsed)
    if not objects:
        return None, "no JSON object"
    chosen = next((o for o in reversed(objects) if verdict.key in o), None)
    if chosen is None:
        return None, f"no key {verdict.key!r} in the JSON object"
    value = chosen[verdict.key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{verdict.key}={value!r} is not a number"
    low = float("-inf") if verdict.min is None else verdict.min
    high = float("inf") if verdict.max is None else verdict.max
    if not low <= value <= high:
        return None, f"{verdict.key}={value:g} is outside [{low:g}, {high:g}]"
    return float(value), None


@label_free
def judge(
    response: str,
    ground_truth: str | None,
    *,
    judge_score: float | None = None,
    judge_error: str | None = None,
    failure_score: float | None = None,
    **_: Any,
) -> float | None:
    """The judge stage's verdict of this sample (the row fields judge_score and judge_error, from the judgements
    table). A sample without a verdict scores ``failure_score`` when the term's params set it; otherwise the
    component fails (score.failure_reward, with the judge's error kind in score_errors). Why the failure value is a
    param of the term and not of the judge: it decides a reward, not a verdict, so changing it re-scores without
    re-judging."""
    if judge_score is not None:
        return float(judge_score)
    if failure_score is not None:
        return float(failure_score)
    raise ValueError(f"no judge verdict ({judge_error or 'the rows carry no judge columns: is judge: set?'})")
