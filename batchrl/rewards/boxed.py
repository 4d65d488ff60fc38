"""Math rewards for ``\\boxed{...}`` answers: correctness checked by math-verify, and a format reward.

Why math-verify (HuggingFace's ``math-verify`` package) and not string matching: MATH-style answers are LaTeX
expressions that are equal in many spellings (``\\frac{1}{2}`` = ``0.5`` = ``\\dfrac12``; ``\\{2,1\\}`` =
``\\{1,2\\}``; ``x^2+1`` = ``1+x^2``; ``1,000`` = ``1000``). math-verify parses both sides into sympy and
compares them symbolically, numerically (6 decimals) and as sets/intervals/matrices.

Extraction (ours, not math-verify's): the answer is the content of the LAST ``\\boxed{`` or ``\\fbox{`` in the
response, up to its matching ``}``. Braces nest (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``), and escaped
braces ``\\{`` ``\\}`` do not count as grouping. If that last box is never closed (a truncated response) there is
no answer, as in verl's ``last_boxed_only_string``: an earlier box is NOT used instead. ``\\boxed 5`` (no braces)
is not an answer. The ground truth may be a full solution (its last box is taken, as for MATH's ``solution``
column) or a bare answer (``"\\frac{1}{2}"``, ``"0.5"``; surrounding ``$...$`` is removed).

Scores: 1.0 if math-verify finds the answer equal to the ground truth, else 0.0 (also for a response without a
box); None (a recorded failure) when the row has no ground truth or math-verify cannot read the ground truth.
Known math-verify behaviours worth knowing: ``5\\%`` equals ``5`` and ``0.05``; ``0.333`` does not equal
``\\frac13`` (6-decimal rounding) but ``0.3333333`` does; ``3.`` and unicode ``½`` are not parsed; ``1e3`` is
read as ``e*3``; text answers are compared as symbols, so ``\\text{(A)}`` equals ``A``.

Timeouts: math-verify bounds its own parsing/comparison with ``signal.alarm``, which works only in a process's
main thread. The score stage calls rewards in the main thread of a child process (see
``batchrl.rewards.isolation``), so there they apply; in any other thread they are switched off (math-verify
would refuse to run) and only the score stage's own per-call deadline protects the run.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from batchrl.errors import type_phrase
from batchrl.rewards.labels import label_free

logger = logging.getLogger(__name__)

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# math-verify's own timeouts per parse / verify (main thread only). Three calls of 3 s stay under the score
# stage's default 10 s deadline, so math-verify gives up gracefully (0.0) before the stage kills the call.
MATH_VERIFY_TIMEOUT_S = 3


def _matching_brace_end(text: str, start: int) -> int | None:
    """Index just past the ``}`` closing the group whose content starts at `start`; None if never closed."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ \} \\ : an escaped character never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in `text`, or None if absent or never closed."""
    openers = list(_BOX_OPENER.finditer(text))
    if not openers:
        return None
    content_start = openers[-1].end()
    end = _matching_brace_end(text, content_start)
    return None if end is None else text[content_start : end - 1]


def math_ground_truth(ground_truth: str) -> str:
    """The answer of a ground truth given as a full solution (its last box) or as a bare answer."""
    if not isinstance(ground_truth, str):
        raise ValueError(
            f"ground_truth must be a string, got {type_phrase(ground_truth)} ({ground_truth!r}); "
            "store answers as strings in the prompts table"
        )
    boxed = last_boxed_content(ground_truth)
    answer = (boxed if boxed is not None else ground_truth).strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$") and not answer.endswith("\\$"):
        answer = answer.strip("$").strip()
    return answer


def math_answers_equal(answer: str, ground_truth_answer: str) -> bool | None:
    """math-verify's verdict on two bare LaTeX answers; None when the ground truth cannot be parsed."""
    from math_verify import parse, verify

    timeout_s = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"$\\boxed{{{ground_truth_answer}}}$", parsing_timeout=timeout_s)
    if not gold:
        return None
    predicted = parse(f"$\\boxed{{{answer}}}$", parsing_timeout=timeout_s)
    return bool(verify(gold, predicted, timeout_seconds=timeout_s))


def math_boxed(response: str, ground_truth: str | None, **row: Any) -> float | None:
    """Registry reward "math": 1.0 if the last box of the response equals the ground truth (math-verify)."""
    if ground_truth is None:
        return None
    truth = math_ground_truth(ground_truth)
    if not truth:
        return None
    answer = last_boxed_content(response)
    if answer is None or not answer.strip():
        return 0.0
    equal = math_answers_equal(answer, truth)
    return None if equal is None else float(equal)


@label_free
def format_boxed(response: str, ground_truth: str | None = None, **row: Any) -> float:
    """Registry reward "format_boxed": 1.0 if the response has exactly one box, closed and non-empty, else 0.0.

    Two boxes (even nested, ``\\boxed{\\boxed{3}}``), an unclosed box or ``\\boxed{}`` give 0.0. Text after the
    box is allowed (``... \\boxed{3}.``). Ignores the ground truth.
    """
    if len(_BOX_COMMAND.findall(response)) != 1:
        return 0.0
    content = last_boxed_content(response)
    return 1.0 if content is not None and content.strip() else 0.0
