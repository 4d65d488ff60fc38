"""Held-out evaluation metrics (batchrl.algorithms.evaluation): pass@k against enumeration, the majority vote's
ties and abstentions, and the per-data_source metrics of hand-made arrays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchrl.algorithms.evaluation import evaluation_metrics, majority_vote, pass_at_k


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_pass():
    for n, c, k in [(4, 1, 2), (5, 2, 3), (8, 3, 4), (6, 0, 3), (3, 3, 1)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="between 1 and"):
        pass_at_k(4, 1, 5)


def test_majority_vote_breaks_ties_by_first_answer_and_ignores_abstentions():
    assert majority_vote(["3", None, "5", "5", "3"], [0.0, 0.0, 1.0, 1.0, 0.0]) == ("3", 0.0)
    assert majority_vote([None, None, "5"], [0.0, 0.0, 1.0]) == ("5", 1.0)
    assert majority_vote([None, None], [0.2, 0.0]) == (None, 0.2)
    assert majority_vote([], []) == (None, None)


def test_metrics_of_hand_made_sampled_results_are_exact_per_data_source_without_greedy_ones():
    scores_PK = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.5]])
    metrics = evaluation_metrics(
        np.array(["a", "a", "b"], dtype=object),
        greedy_score_P=None,
        greedy_answered_P=None,
        greedy_length_P=None,
        sample_scores_PK=scores_PK,
        sample_answered_PK=np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], bool),
        sample_lengths_PK=np.array([[2, 4, 6, 8], [1, 1, 1, 1], [3, 3, 3, 3]], float),
        majority_score_P=np.array([1.0, 0.0, 1.0]),
        pass_threshold=1.0,
    )
    assert not any(name.endswith("@1") and "pass@" not in name for name in metrics)  # no greedy: no mean@1
    assert metrics["val-core/a/reward/mean@4"] == pytest.approx(2 / 8)
    assert metrics["val-core/a/reward/pass@4"] == pytest.approx(0.5)  # one prompt of two has a pass
    assert metrics["val-aux/a/reward/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert metrics["val-aux/a/reward/pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # C(2,2)/C(4,2) fail
    assert metrics["val-core/a/reward/maj@4"] == pytest.approx(0.5)
    assert metrics["val-aux/a/answered/mean@4"] == pytest.approx(3 / 8)
    assert metrics["val-aux/a/response_length/mean@4"] == pytest.approx((20 + 4) / 8)
    assert metrics["val-aux/a/num_prompts"] == 2 and metrics["val-aux/b/num_prompts"] == 1
    assert metrics["val-core/b/reward/pass@4"] == 1.0 and metrics["val-aux/b/reward/pass@1"] == pytest.approx(3 / 4)
