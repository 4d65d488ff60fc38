"""Which rewards need a ground truth: every reward compares a response with a reference answer unless it is marked
``@label_free`` (format rewards, length shaping, and, outside this module, the reward model).

Why a mark on the function rather than a config field: whether a reward reads its ``ground_truth`` argument is a
fact about its code, true in every pipeline that uses it. Unmarked functions, a user's included, are taken to need
one: a row without a label is then rejected at ingest rather than scored as a failure on every sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def label_free(fn: F) -> F:
    """Marks a reward function that never reads ``ground_truth``: prompts without a label may reach it."""
    fn.needs_ground_truth = False  # type: ignore[attr-defined]
    return fn


def needs_ground_truth(fn: Callable) -> bool:
    return getattr(fn, "needs_ground_truth", True)
