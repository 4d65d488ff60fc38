"""GSM8K rule reward that gives the same scores as verl's scorer (verl/utils/reward_score/gsm8k.py).

Why copy verl's behaviour? Reward curves are compared across frameworks. A "better" extractor would change the
numbers and hide whether a difference comes from the trainer or the reward. So the response side follows verl
exactly, quirks included (checked against verl at commit b178a3c, 2026-01):

- Only the last 300 characters (Python str characters, not bytes or tokens) of the response are searched, so an
  answer written earlier than that is not seen.
- strict: the last ``"#### <n>"`` where ``<n>`` matches ``-?[0-9.,]+`` directly after ONE space, with commas
  removed. So ``"#### $5"``, ``"####5"`` and ``"####  5"`` have no answer, and ``"#### 72."`` extracts ``"72."``,
  which does not equal ``"72"``.
- flexible: the last run of ``-?[0-9.,]+`` that is not just ``"."``, commas KEPT. A lone comma counts
  (``"3 pears, ok"`` -> ``","``), and if every run is ``"."`` the answer is ``"."``.
- Scoring compares strings exactly: ``correct_score`` if equal, ``format_score`` if an answer was extracted but
  differs, 0 if nothing was extracted.

Departures, all on the ground-truth side (verl expects its preprocessing to have done them already):
- A full GSM8K solution ``"...\\n#### 72"`` is accepted as ground truth: the text after its last ``####`` is
  taken, with commas removed, as verl's data preprocessing does.
- Surrounding whitespace is stripped from the ground truth.
For ground truths that verl's preprocessing produces (e.g. ``"72"``), neither changes anything.

Numbers: a ground truth stored as a number (a float Parquet column holds 72 as 72.0) is written as text by ingest
without a spurious ``.0`` (``"72"``; 2.5 stays ``"2.5"``; NaN/inf rows are rejected), so it matches what a response
writes. verl compares ``str`` against whatever its preprocessing stored, so a float column there scores every
correct answer 0; ingest is where batchrl departs from that. The response side is left exactly as verl's:
``"#### 72.0"`` against ``"72"`` is a wrong answer (format_score), like ``"#### 72."``. Rewards that compare
numbers by value do accept it: exact_match (``"72.0" == "72"``) and math (math-verify).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from batchrl.errors import type_phrase

logger = logging.getLogger(__name__)

SEARCH_WINDOW_CHARS = 300  # verl searches only this tail of the response (an optimisation that affects results).
_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]+")

ExtractionMethod = Literal["strict", "flexible"]


def extract_gsm8k_answer(text: str, *, method: ExtractionMethod) -> str | None:
    """The answer verl's scorer would extract from `text`, or None when it finds none.

    Returned unnormalised on purpose (``"72."``, ``"1,234"`` in flexible mode): verl compares these raw strings.
    """
    window = text[-SEARCH_WINDOW_CHARS:]
    if method == "strict":
        answers = _STRICT_ANSWER.findall(window)
        return answers[-1].replace(",", "") if answers else None
    if method == "flexible":
        candidates = _ANY_NUMBER.findall(window)
        if not candidates:
            return None
        meaningful = [c for c in candidates if c != "."]
        # verl falls back to "." (not None) when every candidate is "."; that still earns format_score.
        return meaningful[-1] if meaningful else "."
    raise ValueError(f"method={method!r} is not an extraction method; use 'strict' or 'flexible'")


def normalise_gsm8k_ground_truth(ground_truth: str) -> str:
    """The bare answer of a ground truth given either as ``"72"`` or as a full solution ending ``"#### 72"``."""
    if not isinstance(ground_truth, str):
        raise ValueError(
            f"ground_truth must be a string, got {type_phrase(ground_truth)} ({ground_truth!r}); "
            "store answers as strings in the prompts table"
        )
    if "####" in ground_truth:
        return ground_truth.rsplit("####", 1)[1].strip().replace(",", "")
    return ground_truth.strip()


def gsm8k_score(
    response: str,
    ground_truth: str,
    *,
    method: ExtractionMethod = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """verl's GSM8K score: `correct_score` on a match, `format_score` for a wrong answer, 0.0 for no answer."""
    answer = extract_gsm8k_answer(response, method=method)
    if answer is None:
        return 0.0
    return float(correct_score) if answer == normalise_gsm8k_ground_truth(ground_truth) else float(format_score)


def gsm8k_strict(response: str, ground_truth: str | None, **row: Any) -> float | None:
    """Registry reward "gsm8k": strict ``#### <n>`` extraction, 1.0 / 0.0; None without a ground truth."""
    return _score_unless_ground_truth_missing(response, ground_truth, method="strict")


def gsm8k_flexible(response: str, ground_truth: str | None, **row: Any) -> float | None:
    """Registry reward "gsm8k_flexible": the last number in the response, 1.0 / 0.0; None without a ground truth."""
    return _score_unless_ground_truth_missing(response, ground_truth, method="flexible")


def _score_unless_ground_truth_missing(
    response: str, ground_truth: str | None, *, method: ExtractionMethod
) -> float | None:
    """None (a recorded failure, not a silent 0.0) when the row has no usable ground truth."""
    if ground_truth is None or not normalise_gsm8k_ground_truth(ground_truth):
        return None
    return gsm8k_score(response, ground_truth, method=method)
