"""Held-out evaluation metrics: pure functions of the per-prompt results of an evaluation.

What they compute, per data_source, named as verl's validation metrics (``val-core/<data_source>/reward/<metric>``,
auxiliary ones under ``val-aux/``), for P held-out prompts with one greedy and K sampled responses each:
- ``mean@1``: greedy accuracy (the mean reward of the greedy responses, as verl's do_sample=False validation);
- ``mean@k``: mean reward of the k sampled responses; ``std@k`` (aux): the mean per-prompt std;
- ``pass@k``: probability that at least one of k responses passes (reward >= a threshold), `pass_at_k`;
  ``pass@j`` for j = 1, 2, 4, ... < k are aux;
- ``maj@k``: reward of the majority answer of the k responses (`majority_vote`);
- aux: ``answered/mean@1`` and ``answered/mean@k`` (share of responses with an extractable answer),
  ``response_length/mean@1`` and ``response_length/mean@k``, ``num_prompts``.

Departures from verl's val-core metrics: pass@k is the unbiased estimator of Chen et al. (2021,
https://arxiv.org/abs/2107.03374) over the n = k responses, exact, where verl reports ``best@k/mean`` by
bootstrap; maj@k is the exact vote over the k responses (no bootstrap), and a response without an answer
abstains instead of voting for "no answer".

The evaluate stage also groups the same metrics by data.sources name, for the held-out rows of a source's
eval_files: ``val-source/<source>/reward/<metric>`` and ``val-source-aux/<source>/...`` (the ``core``/``aux``
arguments).

Extracting answers, generating and scoring are the evaluate stage's (batchrl/stages/evaluate.py); this module
sees only answers, rewards and lengths.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def majority_vote(answers: list[str | None], scores: list[float]) -> tuple[str | None, float | None]:
    """The most frequent answer (ties: the one given first) and the reward of its first response.

    Responses without an answer abstain; when all abstain, the answer is None and the score is that of the
    first response (a failure, whatever the reward gave it). (None, None) for no responses.
    """
    if not answers:
        return None, None
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None, float(scores[0])
    top = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == top)
    return winner, float(scores[answers.index(winner)])


def pass_at_k(num_samples: int, num_passed: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): P(at least one of k responses drawn from the n passes)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"k={k} must be between 1 and the number of samples {num_samples}")
    if num_samples - num_passed < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_passed, k) / math.comb(num_samples, k)


def evaluation_metrics(
    data_source_P: np.ndarray,
    *,
    greedy_score_P: np.ndarray | None,
    greedy_answered_P: np.ndarray | None,
    greedy_length_P: np.ndarray | None,
    sample_scores_PK: np.ndarray | None,
    sample_answered_PK: np.ndarray | None,
    sample_lengths_PK: np.ndarray | None,
    majority_score_P: np.ndarray | None,
    pass_threshold: float,
    core: str = "val-core",
    aux: str = "val-aux",
) -> dict[str, float]:
    """Per data_source: greedy mean@1 and sampled mean@k, pass@k, maj@k (core), std@k, pass@j, answered,
    response length and num_prompts (aux). P prompts, K sampled responses each. ``core``/``aux``: the names' first
    part (the evaluate stage groups the same metrics by data.sources name as val-source/, val-source-aux/)."""
    metrics: dict[str, float] = {}
    core_prefix, aux_prefix = core, aux
    for source in sorted(set(data_source_P.tolist())):
        rows = data_source_P == source
        core, aux = f"{core_prefix}/{source}/reward", f"{aux_prefix}/{source}"
        metrics[f"{aux}/num_prompts"] = float(rows.sum())
        if greedy_score_P is not None:
            metrics[f"{core}/mean@1"] = float(greedy_score_P[rows].mean())
            metrics[f"{aux}/answered/mean@1"] = float(greedy_answered_P[rows].mean())
            metrics[f"{aux}/response_length/mean@1"] = float(greedy_length_P[rows].mean())
        if sample_scores_PK is None:
            continue
        scores_pK, k = sample_scores_PK[rows], sample_scores_PK.shape[1]
        metrics[f"{core}/mean@{k}"] = float(scores_pK.mean())
        metrics[f"{aux}/reward/std@{k}"] = float(scores_pK.std(axis=1).mean())
        passed_p = (scores_pK >= pass_threshold).sum(axis=1)
        for j in _pass_ks(k):
            name = f"{core}/pass@{j}" if j == k else f"{aux}/reward/pass@{j}"
            metrics[name] = float(np.mean([pass_at_k(k, int(c), j) for c in passed_p]))
        metrics[f"{core}/maj@{k}"] = float(majority_score_P[rows].mean())
        metrics[f"{aux}/answered/mean@{k}"] = float(sample_answered_PK[rows].mean())
        metrics[f"{aux}/response_length/mean@{k}"] = float(sample_lengths_PK[rows].mean())
    return metrics


def _pass_ks(k: int) -> list[int]:
    """1, 2, 4, ... below k, then k (verl's ladder of @n)."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]
