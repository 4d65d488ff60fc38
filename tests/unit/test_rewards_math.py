"""The math reward (last \\boxed{} answer checked by math-verify) and the format_boxed reward, on tricky strings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from batchrl.rewards import REWARDS, reward_name_for
from batchrl.rewards.boxed import format_boxed, last_boxed_content, math_boxed, math_ground_truth


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
        ("first \\boxed{2}, finally \\boxed{3}", "3"),  # the last box wins
        ("\\fbox{7}", "7"),
        ("\\boxed {7}", "7"),
        ("$\\boxed{-3}$", "-3"),
        ("答案是 \\boxed{七}。", "七"),
        ("\\boxed{}", ""),
        ("\\boxed{3", None),  # never closed: a truncated response has no answer
        ("\\boxed{3} and then \\boxed{4", None),  # the last box is unclosed: the earlier one is not used
        ("\\boxed 5", None),  # no braces, no answer
        ("the answer is 5", None),
        ("", None),
    ],
)
def test_the_answer_is_the_content_of_the_last_box_up_to_its_matching_brace(text, content):
    assert last_boxed_content(text) == content


@pytest.mark.parametrize(
    ("response", "ground_truth", "score"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # \frac vs decimal
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "1/2", 1.0),
        ("\\boxed{-0.5}", "-\\frac{1}{2}", 1.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),  # math-verify rounds to 6 decimals: 0.333 != 1/3
        ("\\boxed{1,000}", "1000", 1.0),  # commas
        ("\\boxed{1000}", "1,000", 1.0),
        ("\\boxed{\\$5}", "5", 1.0),  # dollars
        ("\\boxed{5}", "\\$5", 1.0),
        ("\\boxed{-3}", "-3", 1.0),  # negatives
        ("\\boxed{3}", "-3", 0.0),
        ("\\boxed{−3}", "-3", 1.0),  # unicode minus sign
        ("答案是 \\boxed{7}。", "7", 1.0),  # unicode text around the box
        ("first \\boxed{2}, on reflection \\boxed{3}", "3", 1.0),  # multiple answers: the last counts
        ("first \\boxed{2}, on reflection \\boxed{3}", "2", 0.0),
        ("\\boxed{2, 3}", "3, 2", 1.0),  # an unordered answer set
        ("\\boxed{2}", "2, 3", 0.0),  # part of a set is not the set
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
        ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\fbox{7}", "7", 1.0),
        ("The answer is 7", "7", 0.0),  # no box, no answer
        ("\\boxed{}", "7", 0.0),
        ("\\boxed{7", "7", 0.0),  # unclosed
        ("\\boxed{\\text{(B)}}", "B", 1.0),
    ],
)
def test_math_checks_the_last_boxed_answer_with_math_verify(response, ground_truth, score):
    assert math_boxed(response, ground_truth, data_source="math", prompt_id="p") == score


@pytest.mark.parametrize(
    ("ground_truth", "answer"),
    [
        ("So the probability is $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),  # a full MATH solution
        ("$\\frac{3}{4}$", "\\frac{3}{4}"),
        ("  0.75\n", "0.75"),
        ("\\$5", "\\$5"),  # an escaped dollar is part of the answer
    ],
)
def test_the_ground_truth_may_be_a_solution_with_a_box_or_a_bare_answer(ground_truth, answer):
    assert math_ground_truth(ground_truth) == answer


def test_a_solution_ground_truth_scores_like_its_boxed_answer():
    solution = "Half of 3/2 is $\\frac{3}{4}$, so the answer is $\\boxed{\\frac{3}{4}}$."
    assert math_boxed("I get \\boxed{0.75}", solution) == 1.0
    assert math_boxed("I get \\boxed{\\frac{3}{2}}", solution) == 0.0


def test_math_cannot_score_without_a_ground_truth_and_rejects_a_non_string_one():
    assert math_boxed("\\boxed{1}", None) is None
    assert math_boxed("\\boxed{1}", "  ") is None
    assert math_boxed("\\boxed{1}", "\\boxed{}") is None
    with pytest.raises(ValueError, match="store answers as strings"):
        math_boxed("\\boxed{1}", 1)


def test_math_runs_outside_the_main_thread_where_math_verify_cannot_use_signal_timeouts():
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_boxed, "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("so the answer is \\boxed{3}.", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("\\fbox{3}", 1.0),
        ("\\boxed{2} or maybe \\boxed{3}", 0.0),  # two answers
        ("\\boxed{\\boxed{3}}", 0.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{  }", 0.0),
        ("\\boxed{3", 0.0),
        ("\\boxed 3", 0.0),
        ("the answer is 3", 0.0),
        ("", 0.0),
    ],
)
def test_format_boxed_wants_exactly_one_closed_non_empty_box(response, score):
    assert format_boxed(response, None, prompt_id="p") == score


@pytest.mark.parametrize(
    "data_source", ["math", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "lighteval/MATH"]
)
def test_math_data_sources_default_to_the_math_reward(data_source):
    assert reward_name_for(data_source) == "math"
    assert REWARDS["math"] is math_boxed
