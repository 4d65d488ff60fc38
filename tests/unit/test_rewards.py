"""Rule rewards: verl-compatible GSM8K extraction, exact match, the format reward, and reward resolution."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchrl.rewards import DATA_SOURCE_DEFAULTS, REWARDS, resolve_reward, reward_name_for
from batchrl.rewards.basic import exact_match, format_hash, parse_plain_number
from batchrl.rewards.gsm8k import (
    SEARCH_WINDOW_CHARS,
    extract_gsm8k_answer,
    gsm8k_score,
    normalise_gsm8k_ground_truth,
)

# (response, expected strict answer, expected flexible answer).
# These expected values follow verl's scorer (verl/utils/reward_score/gsm8k.py, commit b178a3c): search the last
# 300 chars; strict = last "#### (-?[0-9.,]+)" with commas removed; flexible = last "-?[0-9.,]+" that is not ".",
# commas kept, "." if every candidate is ".". They were worked out by hand from that code.
VERL_EXTRACTION_CASES = [
    ("#### 72", "72", "72"),
    ("The answer is 72", None, "72"),
    ("Total: 1,234 apples\n#### 1,234", "1234", "1,234"),
    ("#### $5", None, "5"),  # strict needs a digit, '.', ',' or '-' right after "#### "
    ("She owes #### -3", "-3", "-3"),
    ("#### 3.50", "3.50", "3.50"),  # no numeric normalisation: "3.50" != "3.5"
    ("#### 72.", "72.", "72."),  # a trailing period is part of the answer, so it no longer equals "72"
    ("#### 7\n#### 8", "8", "8"),  # last answer wins
    ("#### 10 or #### 20.", "20.", "20."),
    ("####72", None, "72"),  # strict needs exactly one space after the marker
    ("####  72", None, "72"),
    ("#### 5\nThe end.", "5", "5"),  # the final "." is skipped in flexible mode
    ("Answer: 12 apples and 3 pears", None, "3"),
    ("x = -5 - 3 = -8", None, "-8"),
    ("3-4", None, "-4"),
    ("#### -1,000.5", "-1000.5", "-1,000.5"),
    ("no digits here", None, None),
    ("", None, None),
    ("Hi. Bye.", None, "."),  # every candidate is ".", and verl then returns "." rather than None
    ("5 apples, 3 pears, ok", None, ","),  # a lone comma counts as a number in flexible mode
    ("#### .", ".", "."),
    ("#### ,,,", "", ",,,"),  # strict strips the commas and returns "" (an answer, not None)
    ("答案是 #### 42 ✓", "42", "42"),
    ("答案：72。", None, "72"),  # the ideographic full stop is not "."
    ("答案是 ٧٢", None, None),  # only ASCII digits count
]


@pytest.mark.parametrize(("response", "strict", "flexible"), VERL_EXTRACTION_CASES)
def test_extraction_matches_verls_scorer_on_tricky_strings(response, strict, flexible):
    assert extract_gsm8k_answer(response, method="strict") == strict
    assert extract_gsm8k_answer(response, method="flexible") == flexible


def test_an_answer_before_the_last_300_characters_is_not_seen():
    response = "#### 72\n" + "I double-checked everything. " * 20
    assert len(response) > SEARCH_WINDOW_CHARS == 300
    assert extract_gsm8k_answer(response, method="strict") is None
    assert extract_gsm8k_answer(response, method="flexible") == "."
    assert gsm8k_score(response, "72") == 0.0


def test_a_long_response_ending_with_the_answer_is_scored():
    response = "Let me think. " * 500 + "#### 72"
    assert gsm8k_score(response, "72") == 1.0
    assert gsm8k_score(response, "72", method="flexible") == 1.0


def test_the_search_window_is_exactly_300_characters_counted_as_characters_not_bytes():
    exactly_300 = "#### 7" + "é" * 294  # 300 characters, 600 UTF-8 bytes
    one_over = "#### 7" + "é" * 295  # the window now starts at "### 7"
    assert extract_gsm8k_answer(exactly_300, method="strict") == "7"
    assert extract_gsm8k_answer(one_over, method="strict") is None
    assert extract_gsm8k_answer(one_over, method="flexible") == "7"


def test_the_window_can_cut_a_number_and_flexible_mode_then_reads_only_its_tail():
    response = "#### 123456" + "b" * 297  # 308 characters: the window starts at "456"
    assert extract_gsm8k_answer(response, method="strict") is None
    assert extract_gsm8k_answer(response, method="flexible") == "456"


def test_an_unknown_extraction_method_is_rejected():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_gsm8k_answer("#### 1", method="loose")


def test_score_is_correct_score_on_a_match_format_score_on_a_wrong_answer_and_zero_without_answer():
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("I give up", "72", format_score=0.1) == 0.0
    assert gsm8k_score("#### 72", "72", correct_score=2.0) == 2.0
    assert gsm8k_score("#### 72.", "72") == 0.0


def test_flexible_scoring_keeps_commas_so_a_comma_grouped_answer_misses_verls_comma_free_truth():
    assert gsm8k_score("It is 1,234", "1234", method="flexible") == 0.0
    assert gsm8k_score("It is 1234", "1234", method="flexible") == 1.0


@pytest.mark.parametrize(
    ("ground_truth", "normalised"),
    [
        ("72", "72"),
        ("  72\n", "72"),
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72", "72"),
        ("She pays $1,234 in total.\n#### 1,234", "1234"),
        ("#### -3", "-3"),
    ],
)
def test_ground_truth_may_be_the_bare_answer_or_a_full_gsm8k_solution(ground_truth, normalised):
    assert normalise_gsm8k_ground_truth(ground_truth) == normalised


def test_a_full_solution_ground_truth_scores_like_its_extracted_answer():
    solution = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10"
    assert REWARDS["gsm8k"]("So she earned #### 10", solution) == 1.0
    assert REWARDS["gsm8k_flexible"]("So she earned 10 dollars.", solution) == 1.0


def test_gsm8k_rewards_ignore_row_fields_and_return_none_without_a_ground_truth():
    row = {"data_source": "openai/gsm8k", "prompt_id": "p0", "extra_info": {"split": "train"}}
    assert REWARDS["gsm8k"]("#### 72", "72", **row) == 1.0
    assert REWARDS["gsm8k_flexible"]("72", "72", **row) == 1.0
    for name in ("gsm8k", "gsm8k_flexible"):
        assert REWARDS[name]("#### 72", None, **row) is None
        assert REWARDS[name]("#### 72", "   ", **row) is None


def test_a_non_string_ground_truth_is_reported_with_the_fix():
    with pytest.raises(ValueError, match="store answers as strings"):
        REWARDS["gsm8k"]("#### 72", 72)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,000", Decimal(1000)),
        ("$5", Decimal(5)),
        ("5.0", Decimal(5)),
        ("5.", Decimal(5)),
        (".5", Decimal("0.5")),
        ("-$3", Decimal(-3)),
        ("$-3", Decimal(-3)),
        ("+2", Decimal(2)),
        ("1,234,567.25", Decimal("1234567.25")),
    ],
)
def test_plain_numbers_are_read_by_value(text, value):
    assert parse_plain_number(text) == value


@pytest.mark.parametrize("text", ["", ".", "$", "-", "10,00", "1,0000", "5%", "1e3", "-$-5", "five", "٧٢", "1 000"])
def test_text_that_is_not_a_plain_number_is_not_read_as_one(text):
    assert parse_plain_number(text) is None


@pytest.mark.parametrize(
    ("response", "ground_truth", "score"),
    [
        ("Paris", "Paris", 1.0),
        ("  Paris\n", "Paris", 1.0),
        ("paris", "Paris", 0.0),
        ("The answer is Paris", "Paris", 0.0),
        ("1,000", "1000", 1.0),
        ("$5", "5", 1.0),
        ("5.0", "5", 1.0),
        ("0.10", "0.1", 1.0),
        ("-$3", "-3", 1.0),
        ("5", "6", 0.0),
        ("10,00", "1000", 0.0),
    ],
)
def test_exact_match_compares_stripped_text_and_numbers_by_value(response, ground_truth, score):
    assert exact_match(response, ground_truth, data_source="qa", prompt_id="p1") == score


def test_exact_match_cannot_score_without_a_ground_truth():
    assert exact_match("Paris", None) is None


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Reasoning...\n#### 72", 1.0),
        ("Reasoning...\n#### 72\n\n  ", 1.0),
        ("#### -1,234.5", 1.0),
        ("#### 72.", 0.0),
        ("#### $72", 0.0),
        ("####72", 0.0),
        ("####  72", 0.0),
        ("#### 72 apples", 0.0),
        ("#### 10,00", 0.0),
        ("#### 72\nHope this helps!", 0.0),
        ("The answer is 72", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward_wants_a_well_formed_hash_answer_as_the_last_line(response, score):
    assert format_hash(response, None, prompt_id="p2") == score


@pytest.mark.parametrize("number", ["72", "-3", "1,234", "0.5", "-1,000.25"])
def test_a_well_formed_hash_line_is_exactly_what_strict_extraction_reads(number):
    response = f"Some steps.\n#### {number}\n"
    assert format_hash(response) == 1.0
    assert extract_gsm8k_answer(response, method="strict") == number.replace(",", "")


def test_the_registry_has_the_documented_rewards_and_every_default_source_names_one():
    assert {
        "gsm8k",
        "gsm8k_flexible",
        "exact_match",
        "format_hash",
        "math",
        "format_boxed",
        "format_think",
        "overlong_penalty",
        "truncation_penalty",
    } <= REWARDS.keys()
    assert set(DATA_SOURCE_DEFAULTS.values()) <= REWARDS.keys()


def test_reward_names_come_from_overrides_first_then_defaults():
    assert reward_name_for("openai/gsm8k") == "gsm8k"
    assert reward_name_for("arith", overrides={}) == "gsm8k"
    assert reward_name_for("arith", overrides={"arith": "gsm8k_flexible"}) == "gsm8k_flexible"
    assert reward_name_for("trivia", overrides={"trivia": "my_pkg.rewards:trivia"}) == "my_pkg.rewards:trivia"


def test_an_unknown_data_source_says_which_config_key_to_add():
    with pytest.raises(ValueError, match=r"score\.reward_by_data_source: \{trivia: <reward>\}"):
        reward_name_for("trivia", overrides={"arith": "gsm8k"})


def test_a_registry_name_resolves_to_its_function():
    assert resolve_reward("gsm8k") is REWARDS["gsm8k"]


def test_a_module_function_reference_is_imported():
    assert resolve_reward("batchrl.rewards.basic:exact_match") is exact_match
    assert resolve_reward("batchrl.rewards.gsm8k:gsm8k_flexible") is REWARDS["gsm8k_flexible"]


def test_an_unknown_name_lists_the_known_rewards_and_the_reference_form():
    with pytest.raises(ValueError) as error:
        resolve_reward("gsm9k")
    message = str(error.value)
    assert "'gsm9k'" in message
    assert f"known rewards: {', '.join(sorted(REWARDS))}." in message
    assert "exact_match, format_boxed, format_hash, format_think, gsm8k, gsm8k_flexible" in message
    assert "package.module:function" in message


@pytest.mark.parametrize(
    ("reference", "complaint"),
    [
        ("batchrl.no_such_module:reward", "cannot import module 'batchrl.no_such_module'"),
        ("batchrl.rewards.basic:no_such_reward", "has no attribute 'no_such_reward'"),
        (":exact_match", "must look like 'package.module:function'"),
        ("batchrl.rewards.basic:", "must look like 'package.module:function'"),
        ("batchrl.rewards.gsm8k:SEARCH_WINDOW_CHARS", "not a function"),
        ("batchrl.rewards.gsm8k:normalise_gsm8k_ground_truth", r"must accept \(response, ground_truth, \*\*row\)"),
        ("batchrl.rewards.gsm8k:gsm8k_score", r"must accept \(response, ground_truth, \*\*row\)"),
    ],
)
def test_a_bad_reference_is_a_value_error_naming_it(reference, complaint):
    with pytest.raises(ValueError, match=complaint) as error:
        resolve_reward(reference)
    assert repr(reference) in str(error.value)


def test_a_decimal_response_to_an_integer_answer_is_wrong_for_gsm8k_as_in_verl_but_right_for_exact_match():
    # ingest writes a numeric ground truth 19.0 as "19"; the response side is verl's: "19.0" is another string
    assert gsm8k_score("#### 19.0", "19") == 0.0
    assert exact_match("19.0", "19") == 1.0
