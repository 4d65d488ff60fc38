"""Rule rewards: plain functions ``fn(response, ground_truth, **row) -> float | None``, chosen by data_source.

Why plain functions: a reward is the part users most often replace, and a function they can unit-test on a
string is the smallest thing to write (the same shape as TRL's reward functions). `row` carries the prompt row's
other fields (data_source, prompt_id, extra_info, ...); a function takes what it needs and ignores the rest.
Returning None means "cannot score this sample" (e.g. no ground truth); the score stage records it as a failure.
A reward that never reads its ground truth is marked ``@label_free``: prompts without a label may then reach it
(LabelRule; ingest rejects a row that lacks the label a reward running on it needs).

Which reward scores a row: `score.reward_by_data_source` in the config first, then DATA_SOURCE_DEFAULTS.
A reward is named either by its key in REWARDS or as ``"package.module:function"``.

Row fields (ROW_FIELDS) that the score stage passes to every call: prompt_id, data_source, prompt_text,
extra_info (the input's extra_info, parsed), sample_idx (0..n-1 within the group), response_length (response
tokens) and finish_reason ("stop" or "length"); with a judge: section also judge_score (the judge's verdict, None
where it failed) and judge_error (why it failed), read by the ``judge`` term (batchrl.rewards.judge); with
generate.environment also environment_reward, read by the ``environment`` term. A term's
``params`` (config) are passed as further keyword arguments; each must be a named parameter of the function and must
not reuse a row field's name. A reward may carry a ``check_params(params)`` attribute raising ValueError for a bad
value, so that a wrong value is a config error when the job starts, not a failure on every sample (code_tests has one).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from batchrl.errors import type_phrase
from batchrl.references import import_reference, source_digest
from batchrl.rewards.basic import exact_match, format_hash, format_think
from batchrl.rewards.boxed import format_boxed, math_boxed
from batchrl.rewards.code import code_tests
from batchrl.rewards.environment import environment
from batchrl.rewards.gsm8k import gsm8k_flexible, gsm8k_strict
from batchrl.rewards.judge import judge
from batchrl.rewards.labels import label_free, needs_ground_truth
from batchrl.rewards.shaping import overlong_penalty, truncation_penalty

logger = logging.getLogger(__name__)

RewardFn = Callable[..., "float | None"]  # fn(response: str, ground_truth: str | None, **row) -> float | None

REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_strict,
    "gsm8k_flexible": gsm8k_flexible,
    "exact_match": exact_match,
    "format_hash": format_hash,
    "math": math_boxed,
    "format_boxed": format_boxed,
    "format_think": format_think,
    "overlong_penalty": overlong_penalty,
    "truncation_penalty": truncation_penalty,
    "code_tests": code_tests,  # runs the response's program against the row's tests in batchrl.sandbox
    "judge": judge,  # the judge stage's verdict (judge: section)
    "environment": environment,  # the reward generate.environment gave the sample
}

DATA_SOURCE_DEFAULTS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",  # verl's data_source name for GSM8K
    "gsm8k": "gsm8k",
    "arith": "gsm8k",  # our synthetic arithmetic set answers with "#### N"
    "math": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",  # verl's data_source name for MATH
    "lighteval/MATH": "math",
    "HuggingFaceH4/MATH-500": "math",
}

ROW_FIELDS = ("prompt_id", "data_source", "prompt_text", "extra_info", "sample_idx", "response_length", "finish_reason")
JUDGE_ROW_FIELDS = ("judge_score", "judge_error")  # row fields too, in a pipeline with a judge: section
ENVIRONMENT_ROW_FIELDS = ("environment_reward",)  # a row field too, in rollouts played against generate.environment

__all__ = [
    "DATA_SOURCE_DEFAULTS",
    "REWARDS",
    "ROW_FIELDS",
    "LabelRule",
    "RewardFn",
    "check_reward_params",
    "default_term_name",
    "label_free",
    "needs_ground_truth",
    "resolve_reward",
    "reward_code",
    "reward_name_for",
]


def resolve_reward(name_or_ref: str) -> RewardFn:
    """The reward function named by a REWARDS key or a ``"package.module:function"`` reference.

    A reference is imported here, once, so that a typo fails when the job starts, not on every sample.
    """
    if name_or_ref in REWARDS:
        return REWARDS[name_or_ref]
    if ":" not in name_or_ref:
        raise ValueError(
            f"unknown reward {name_or_ref!r}; known rewards: {', '.join(sorted(REWARDS))}. "
            "For your own function write 'package.module:function' (importable from the job's Python path), "
            "e.g. 'my_rewards.math:boxed_answer'."
        )
    reward_fn = import_reference(name_or_ref, what="reward reference")
    _check_reward_signature(reward_fn, name_or_ref=name_or_ref)
    return reward_fn


def reward_name_for(data_source: str, *, overrides: Mapping[str, str] | None = None) -> str:
    """The reward name or reference for rows of `data_source`: `overrides` first, then DATA_SOURCE_DEFAULTS."""
    for table in (overrides or {}, DATA_SOURCE_DEFAULTS):
        if data_source in table:
            return table[data_source]
    raise ValueError(
        f"no reward for data_source {data_source!r}; add `score.reward_by_data_source: "
        f"{{{data_source}: <reward>}}` to the config, where <reward> is one of {', '.join(sorted(REWARDS))} "
        "or 'package.module:function'"
    )


class LabelRule:
    """Which reward that runs on a row needs its ground truth, from the score config (``score``: ScoreConfig).

    What runs on a row: every ``score.rewards`` term (and the reward model) when terms are listed; the reward
    model alone when it is set without terms; otherwise the reward of the row's data_source. A reward needs a
    ground truth unless it is marked ``@label_free`` (batchrl.rewards.labels); the reward model needs none.
    Resolving a reward imports a user's module: an unknown reward raises ValueError here, as at scoring."""

    def __init__(self, score: Any, *, sources: Any = None):
        """``sources``: data.sources, whose own reward terms (``rewards``) run on their rows instead of score's
        (`for_source`)."""
        self.score = score
        self.overrides = dict(score.reward_by_data_source)
        self.by_source = not score.rewards and score.reward_model is None
        needing = [t.component_name for t in score.rewards if needs_ground_truth(resolve_reward(t.reward))]
        self.term = needing[0] if needing else None
        self._cache: dict[str, str | None] = {}
        self._own_terms = {s.name: s.rewards for s in sources or [] if s.rewards}
        self._of_source: dict[str, LabelRule] = {}

    def for_source(self, source: str | None) -> LabelRule:
        """The rule of the rows of data.sources ``source``: its own terms' (with the reward model) if it has any,
        else this one."""
        if source not in self._own_terms:
            return self
        if source not in self._of_source:
            own = SimpleNamespace(
                rewards=self._own_terms[source], reward_model=self.score.reward_model, reward_by_data_source={}
            )
            self._of_source[source] = LabelRule(own)
        return self._of_source[source]

    def needing_label(self, data_source: str) -> str | None:
        """The name of a reward that runs on rows of ``data_source`` and needs a ground truth; None if none does."""
        if not self.by_source:
            return self.term
        if data_source not in self._cache:
            try:
                name = reward_name_for(data_source, overrides=self.overrides)
            except ValueError:  # no reward for it: the score stage's preflight says so; a label cannot hurt
                self._cache[data_source] = f"the reward of data_source {data_source!r}"
            else:
                self._cache[data_source] = name if needs_ground_truth(resolve_reward(name)) else None
        return self._cache[data_source]

    @property
    def every_row(self) -> bool:
        """Whether every row needs a ground truth, whatever its data_source (an input file must then have the
        column)."""
        if not self.by_source:
            return self.term is not None
        names = {*self.overrides.values(), *DATA_SOURCE_DEFAULTS.values()}
        return all(needs_ground_truth(resolve_reward(name)) for name in names)


def reward_code(score: Any) -> dict[str, str]:
    """Custom reward references of a score config (terms and reward_by_data_source) -> the digest of their
    module's source (`source_digest`): part of the fingerprints of the stages that score, so that editing a reward's
    code re-scores (and re-runs what follows) without --from-stage. Empty without custom rewards, so the
    fingerprints of runs with built-in rewards only are unchanged. Only the module of the function is read: a
    helper it imports from another module is not covered (edit that and use --from-stage score)."""
    references = [t.reward for t in score.rewards] + list(score.reward_by_data_source.values())
    return {ref: source_digest(ref) for ref in sorted(set(references)) if ref not in REWARDS and ":" in ref}


def default_term_name(name_or_ref: str) -> str:
    """A reward's component name when the config gives none: the registry key, or a reference's function name."""
    return name_or_ref.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if ":" in name_or_ref else name_or_ref


def check_reward_params(reward_fn: RewardFn, params: Mapping[str, Any], *, name: str) -> None:
    """ValueError unless `params` are named parameters of `reward_fn` that, with the row fields, bind fully.

    Catches a mistyped or missing parameter when the job starts rather than as a failure on every sample.
    """
    try:
        parameters = inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        return
    named = {
        p.name
        for p in parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    shadowing = sorted(set(params) & {*ROW_FIELDS, *JUDGE_ROW_FIELDS, *ENVIRONMENT_ROW_FIELDS})
    if shadowing:
        raise ValueError(f"reward {name!r}: params {shadowing} would replace row fields of the same name; rename them")
    unknown = sorted(set(params) - named)
    if unknown:
        raise ValueError(
            f"reward {name!r} has no parameter(s) {unknown}; its parameters: "
            f"{sorted(named - {'response', 'ground_truth'})}"
        )
    missing = sorted(
        p.name
        for p in parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.default is inspect.Parameter.empty
        and p.name not in params
        and p.name not in ROW_FIELDS
        and p.name not in JUDGE_ROW_FIELDS
        and p.name not in ENVIRONMENT_ROW_FIELDS
    )
    if missing:
        raise ValueError(f"reward {name!r} needs params {missing}; set them in the term's `params:`")
    check_values = getattr(reward_fn, "check_params", None)  # the reward's own rules for its params' values
    if callable(check_values):
        try:
            check_values(dict(params))
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward {name!r}: {err}") from None


def _check_reward_signature(candidate: Any, *, name_or_ref: str) -> None:
    """Fail at startup if `candidate` cannot be called as fn(response, ground_truth, **row)."""
    if not callable(candidate):
        raise ValueError(f"reward reference {name_or_ref!r} names {type_phrase(candidate)}, not a function")
    try:
        signature = inspect.signature(candidate)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; let the call decide
    accepts_row = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    try:
        bound = signature.bind_partial("response", None)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        unbound_positional = [
            p
            for p in signature.parameters.values()
            if p.name not in bound.arguments and p.default is inspect.Parameter.empty and p.kind in positional
        ]
        accepts_response_and_ground_truth = not unbound_positional  # required keyword-only: row fields or params
    except TypeError:
        accepts_response_and_ground_truth = False
    if not (accepts_row and accepts_response_and_ground_truth):
        raise ValueError(
            f"reward {name_or_ref!r} has signature {signature}; a reward must accept "
            "(response, ground_truth, **row) and may ignore the row fields it does not need"
        )
