"""Several reward terms per sample: resolve them once, call each one safely, and combine them by weight.

A sample's reward components are the values of its terms: the configured ``score.rewards`` terms, or (when none
are configured) the one default reward of its data_source. Each call is checked: a term that raises, returns
None, or returns something that is not a finite real number has no value and an error message instead. The
total is the weighted sum of the component values, or ``failure_reward`` when any component failed (a partly
scored sample is not silently rewarded by its remaining terms).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchrl.rewards import (
    RewardFn,
    check_reward_params,
    default_term_name,
    resolve_reward,
    reward_name_for,
)
from batchrl.rewards.detail import RewardWithDetail

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class TermSpec:
    """A configured reward term: `reward` (registry name or module:function), its weight, name and params."""

    reward: str
    weight: float = 1.0
    name: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def component_name(self) -> str:
        return self.name or default_term_name(self.reward)


@dataclass(frozen=True)
class ResolvedTerm:
    name: str
    fn: RewardFn
    weight: float
    params: Mapping[str, Any]


def as_term_spec(term: TermSpec | Mapping[str, Any] | Sequence[Any]) -> TermSpec:
    """A TermSpec from a TermSpec, a dict of its fields, or a (reward, weight[, params]) tuple."""
    if isinstance(term, TermSpec):
        return term
    if isinstance(term, Mapping):
        return TermSpec(**term)
    reward, weight, *rest = term
    return TermSpec(reward=reward, weight=weight, params=rest[0] if rest else {})


class RewardSet:
    """The reward terms of a score stage, resolved once; ``evaluate`` scores one sample with every term."""

    def __init__(self, *, terms: Sequence[Any], by_data_source: Mapping[str, str], failure_reward: float):
        self.specs = [as_term_spec(t) for t in terms]
        names = [s.component_name for s in self.specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward terms share the name(s) {duplicates}; give each term a distinct `name:`")
        self.terms = [self._resolve(s) for s in self.specs]
        self.by_data_source = dict(by_data_source)
        self.failure_reward = float(failure_reward)
        self._defaults: dict[str, list[ResolvedTerm]] = {}

    @staticmethod
    def _resolve(spec: TermSpec) -> ResolvedTerm:
        fn = resolve_reward(spec.reward)
        check_reward_params(fn, spec.params, name=spec.reward)
        return ResolvedTerm(name=spec.component_name, fn=fn, weight=float(spec.weight), params=dict(spec.params))

    def terms_for(self, data_source: str) -> list[ResolvedTerm]:
        """The configured terms, or the default reward of `data_source` (ValueError if it has none)."""
        if self.terms:
            return self.terms
        if data_source not in self._defaults:
            reference = reward_name_for(data_source, overrides=self.by_data_source)
            self._defaults[data_source] = [self._resolve(TermSpec(reward=reference))]
        return self._defaults[data_source]

    def evaluate(
        self, response: str, ground_truth: str | None, row: Mapping[str, Any], *, skip: Mapping[int, str] | None = None
    ) -> tuple[list[float | None], list[str | None]]:
        """Per term of the row's data_source: (value or None, error or None). `skip`: term index -> preset error."""
        values: list[float | None] = []
        errors: list[str | None] = []
        for index, term in enumerate(self.terms or self.terms_for(row["data_source"])):
            if skip and index in skip:
                value, error = None, skip[index]
            else:
                value, error = call_reward(term, response, ground_truth, row)
            values.append(value)
            errors.append(error)
        return values, errors


def call_reward(
    term: ResolvedTerm, response: str, ground_truth: str | None, row: Mapping[str, Any]
) -> tuple[float | None, str | None]:
    """(value, None) for a finite real result; (None, why) when the reward raised, returned None or not a number."""
    try:
        if term.params:
            value = term.fn(response, ground_truth, **row, **term.params)
        else:
            value = term.fn(response, ground_truth, **row)
    except Exception as err:
        return None, f"{term.name} raised {type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
    if type(value) is float and math.isfinite(value):  # the common case, without the slower ABC check below
        return value, None
    if type(value) is RewardWithDetail and math.isfinite(value):  # kept as it is: score_details shows its detail
        return value, None
    if value is None:
        return None, f"{term.name} returned None"
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value), None
    return None, f"{term.name} returned {value!r} (not a finite number)"[:MAX_ERROR_CHARS]


def sample_row(base: Mapping[str, Any], sample_idx: int, response_length: int, finish_reason: str) -> dict[str, Any]:
    """The row fields of one sample: its group's fields (prompt_id, data_source, ...) plus its own."""
    return {**base, "sample_idx": sample_idx, "response_length": response_length, "finish_reason": finish_reason}


def combine_components(values_SK: np.ndarray, weights_K: np.ndarray, *, failure_reward: float) -> np.ndarray:
    """Total reward per sample: the weighted sum of its components, or failure_reward if any of them is NaN.

    values_SK: [num_samples, num_terms] component values, NaN where a term failed. Returns [num_samples].
    """
    failed_S = np.isnan(values_SK).any(axis=1)
    total_S = np.nan_to_num(values_SK, nan=0.0) @ weights_K
    return np.where(failed_S, failure_reward, total_S)
