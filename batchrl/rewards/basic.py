"""Task-agnostic rule rewards: exact match of a short answer, and a format reward for ``#### <number>`` endings.

exact_match is for datasets whose responses ARE the answer (short-answer QA, classification). Both sides are
stripped of surrounding whitespace. If both then read as plain numbers they are compared by value, so
``"1,000" == "1000"``, ``"$5" == "5"``, ``"5.0" == "5"``, ``"5." == "5"`` and ``"-$3" == "-3"``. A number here is:
an optional sign, an optional ``$``, ASCII digits (either plain or grouped in threes by commas), an optional
``.fraction``. Nothing else is normalised: comparison is case-sensitive, and ``"10,00"``, ``"5%"``, ``"1e3"`` are
compared as text. Values are compared as Decimal, so ``"0.1"`` vs ``"0.10"`` is exact, with no float rounding.

format_hash rewards the shape that the strict gsm8k reward can read: the last non-blank line of the response,
stripped, is ``"#### "`` followed by a number (optional ``-``, digits or comma-grouped digits, optional
``.digits``). Whenever it gives 1.0, gsm8k strict extraction finds that number (commas removed), provided the
line lies within the 300 characters that verl searches. A trailing period
(``"#### 72."``), ``$``, a missing or doubled space, or text after the line all give 0.0, because each of them
makes the strict gsm8k reward fail or mis-read the answer. Useful as a small shaping term next to "gsm8k".

format_think rewards the reasoning-model layout ``<think> ... </think>`` followed by an answer: exactly one
``<think>`` and one ``</think>``, the response starts with ``<think>`` (after whitespace), the thinking is not
blank, and some non-blank text follows ``</think>``.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from typing import Any

from batchrl.rewards.labels import label_free

logger = logging.getLogger(__name__)

_DIGITS = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"  # 1,234,567 or 1234567
_PLAIN_NUMBER = re.compile(
    rf"(?P<sign>[-+]?)\$?(?P<sign_after_dollar>[-+]?)(?P<whole>{_DIGITS})?(?:\.(?P<fraction>[0-9]*))?"
)
_HASH_ANSWER_LINE = re.compile(rf"#### -?{_DIGITS}(?:\.[0-9]+)?")
_THINK_THEN_ANSWER = re.compile(r"\s*<think>(?P<thinking>.*?)</think>(?P<answer>.*)", re.DOTALL)


def parse_plain_number(text: str) -> Decimal | None:
    """The value of `text` if it is a plain number as defined in the module docstring, else None."""
    match = _PLAIN_NUMBER.fullmatch(text)
    if match is None:
        return None
    sign, sign_after_dollar = match["sign"], match["sign_after_dollar"]
    whole, fraction = match["whole"] or "", match["fraction"] or ""
    if (sign and sign_after_dollar) or not (whole or fraction):
        return None  # "-$-5", "$", "." and "" are not numbers
    return Decimal(f"{sign or sign_after_dollar}{whole.replace(',', '') or '0'}.{fraction or '0'}")


def exact_match(response: str, ground_truth: str | None, **row: Any) -> float | None:
    """1.0 if the stripped response equals the stripped ground truth (numbers by value), else 0.0.

    None when the row has no ground truth, so the score stage records a failure instead of a wrong 0.0.
    """
    if ground_truth is None:
        return None
    response, ground_truth = response.strip(), ground_truth.strip()
    response_value, truth_value = parse_plain_number(response), parse_plain_number(ground_truth)
    if response_value is not None and truth_value is not None:
        return 1.0 if response_value == truth_value else 0.0
    return 1.0 if response == ground_truth else 0.0


@label_free
def format_hash(response: str, ground_truth: str | None = None, **row: Any) -> float:
    """1.0 if the response's last non-blank line is a well-formed ``#### <number>``, else 0.0.

    Ignores the ground truth, so it scores rows that have none.
    """
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return 1.0 if lines and _HASH_ANSWER_LINE.fullmatch(lines[-1]) else 0.0


@label_free
def format_think(response: str, ground_truth: str | None = None, **row: Any) -> float:
    """1.0 for ``<think>reasoning</think> answer`` (one of each tag, neither part blank), else 0.0."""
    if response.count("<think>") != 1 or response.count("</think>") != 1:
        return 0.0
    match = _THINK_THEN_ANSWER.fullmatch(response)
    return 1.0 if match and match["thinking"].strip() and match["answer"].strip() else 0.0
