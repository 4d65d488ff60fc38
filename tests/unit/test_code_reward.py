"""code_tests on a toy task ("read n and k, print n+k") and an assert-style one ("def add(n, k)"), with hand-written
right, wrong, partly right, hanging, crashing and hostile responses; the test layouts datasets ship; extraction."""

from __future__ import annotations

import json
import pickle
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.rewards import REWARDS
from batchrl.rewards.code import code_tests, extract_program, outputs_match, parse_tests
from batchrl.rewards.combine import ResolvedTerm, call_reward
from batchrl.rewards.detail import RewardWithDetail
from batchrl.sandbox import isolation_available
from batchrl.stages.ingest_rows import normalized_row

STDIO_TESTS = json.dumps(
    [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}, {"input": "0 0\n", "output": "0\n"}]
)
ASSERT_TESTS = "import math\nassert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(math.floor(2.5), 2) == 4\n"
RIGHT = "Read both numbers.\n```python\nn, k = map(int, input().split())\nprint(n + k)\n```\nDone."
WRONG = "```python\nn, k = map(int, input().split())\nprint(n + k + 1)\n```"
PARTLY = "```python\nn, k = map(int, input().split())\nprint(n + k if n > 0 else 1)\n```"  # 2 + 3, 10 - 4 only
# Limits no right program misses on a loaded host (a wall clock of 3 x 2 s); the tests of hung programs set short
# wall clocks and wait them out.
FAST = {"timeout_s": 2.0, "budget_s": 30.0}


def score(response: str, tests: str | None = STDIO_TESTS, extra_info: dict | None = None, **params) -> float:
    return code_tests(response, tests, extra_info=extra_info, **(FAST | params))


def test_a_right_program_scores_one_and_leaves_no_detail():
    value = score(RIGHT)
    assert value == 1.0 and type(value) is float


def test_a_wrong_program_scores_zero_and_the_detail_shows_what_it_printed():
    value = score(WRONG)
    assert value == 0.0
    assert value.detail.startswith("0/3 tests passed; test 1: wrong answer (expected '5', got '6')")


def test_a_partly_right_program_scores_the_fraction_passed_or_zero_when_all_must_pass():
    assert score(PARTLY) == pytest.approx(2 / 3)
    assert "1 more" not in score(PARTLY).detail and "test 3: wrong answer" in score(PARTLY).detail
    assert score(PARTLY, mode="all") == 0.0
    assert score(RIGHT, mode="all") == 1.0


def test_a_hanging_program_fails_each_test_as_a_timeout_within_the_budget():
    started = time.monotonic()
    value = score("```python\nimport time\ntime.sleep(60)\n```", max_parallel=3, wall_timeout_s=2.0)
    assert time.monotonic() - started < 5.0  # three 2 s timeouts side by side, not 6 s in series
    assert value == 0.0 and value.detail == "0/3 tests passed; test 1: timeout; test 2: timeout; test 3: timeout"


def test_tests_not_started_within_the_budget_fail_as_timeouts():
    started = time.monotonic()
    value = score("import time\ntime.sleep(60)", max_parallel=1, wall_timeout_s=1.0, budget_s=1.5)
    assert time.monotonic() - started < 3.0
    assert value == 0.0 and value.detail.count("timeout") == 3


def test_a_crashing_program_scores_zero_with_its_exception_in_the_detail():
    value = score("```python\nn, k = input().split()\nprint(n / k)\n```")
    assert value == 0.0
    assert "test 1: error: TypeError: unsupported operand type(s) for /: 'str' and 'str'" in value.detail


def test_a_program_that_eats_memory_scores_zero_as_a_memory_error():
    value = score("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert value == 0.0 and "test 1: memory: MemoryError" in value.detail


@pytest.mark.skipif(not isolation_available(), reason="bubblewrap is missing: hostile programs are not isolated")
@pytest.mark.parametrize(
    ("hostile", "complaint"),
    [
        ("print(open('/etc/shadow').read())", "Error"),  # absent from the sandbox, or not readable by its uid
        ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", "error: OSError"),
        ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    ],
)
def test_hostile_programs_score_zero_and_the_caller_goes_on(hostile, complaint):
    value = score(f"```python\n{hostile}\n```")
    assert value == 0.0 and complaint in value.detail
    assert score(RIGHT) == 1.0  # the next sample is scored as usual


def test_the_assert_task_counts_each_top_level_assert_as_a_test():
    assert score("def add(n, k):\n    return n + k", ASSERT_TESTS) == 1.0
    assert score("def add(n, k):\n    return n - k", ASSERT_TESTS) == 0.0
    partly = score("def add(n, k):\n    return abs(n) + k", ASSERT_TESTS)
    assert partly == pytest.approx(2 / 3) and "test 2: error: AssertionError" in partly.detail


def test_a_program_that_exits_before_the_asserts_run_passes_none_of_them():
    value = score("import os\nos._exit(0)", ASSERT_TESTS)
    assert value == 0.0 and "exited before its tests ran" in value.detail


def test_the_test_layouts_of_common_datasets_are_read():
    pairs = {"inputs": ["2 3\n", ["10 -4"]], "outputs": ["5\n", ["6"]]}
    assert [t.stdin for t in parse_tests(json.dumps(pairs), None)] == ["2 3\n", "10 -4"]
    assert len(parse_tests(str(pairs), None)) == 2  # a dict that went through str(): a Python literal
    assert len(parse_tests(None, {"input_output": pairs})) == 2  # APPS / TACO keep them in extra_info
    assert len(parse_tests(None, {"test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]})) == 2  # MBPP
    humaneval = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}
    assert score("def add(a, b):\n    return a + b", None, extra_info=humaneval) == 1.0
    call_based = {"inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]], "fn_name": "add"}  # APPS call-based
    assert score("class Solution:\n    def add(self, a, b):\n        return a + b", json.dumps(call_based)) == 1.0
    assert score("def add(a, b):\n    return a * b", json.dumps(call_based)) == 0.0


def test_a_row_without_tests_is_an_error_naming_the_layouts():
    with pytest.raises(ValueError, match=r"no tests in ground_truth or extra_info \(input_output, tests"):
        parse_tests(None, {"split": "train"})
    with pytest.raises(ValueError, match="'inputs' and 'outputs'"):
        parse_tests('{"cases": []}', None)


def test_the_program_is_the_last_python_block_else_the_last_block_else_the_whole_response():
    assert extract_program("```python\na = 1\n```\ntext\n```py\nb = 2\n```\n```text\nout\n```") == "b = 2\n"
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("Here:\n```python\nd = 4\nprint(d)") == "d = 4\nprint(d)"  # cut off by the length limit
    assert extract_program("print(5)") == "print(5)"


def test_outputs_compare_line_by_line_with_whitespace_and_float_noise_ignored():
    assert outputs_match("1  2\n3 \n\n", "1 2\n3")
    assert outputs_match("0.3333333\n", "0.33333333333")
    assert not outputs_match("1 2\n", "1 2 3\n")
    assert not outputs_match("0.34\n", "0.33\n")


def test_a_value_with_a_detail_survives_the_reward_process_and_the_score_checks():
    value = RewardWithDetail(0.5, "test 2: timeout")
    copied = pickle.loads(pickle.dumps(value))
    assert (copied, copied.detail) == (0.5, "test 2: timeout")
    term = ResolvedTerm(name="code_tests", fn=REWARDS["code_tests"], weight=1.0, params=FAST)
    result, error = call_reward(term, WRONG, STDIO_TESTS, {"extra_info": None})
    assert error is None and result == 0.0 and result.detail.startswith("0/3 tests passed")


@pytest.mark.parametrize("as_json_text", [True, False], ids=["json-string", "struct"])
def test_verl_parquet_rows_reach_the_reward_with_their_tests(tmp_path, as_json_text):
    tests = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
    label = json.dumps(tests) if as_json_text else tests  # PRIME ships JSON text; a struct column arrives as a dict
    path = tmp_path / "code.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": [[{"role": "user", "content": "Read n and k, print n+k."}]],
                "data_source": ["code"],
                "reward_model": [{"style": "rule", "ground_truth": label}],
            }
        ),
        path,
    )
    raw = pq.read_table(path).to_pylist()[0]
    row = normalized_row(raw, uri=str(path), stem="code", row=0)
    assert row["ground_truth_problem"] is None
    assert score(RIGHT, row["ground_truth"]) == 1.0 and score(WRONG, row["ground_truth"]) == 0.0


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"mode": "most"}, "params.mode"),
        ({"timeout_s": 0}, "params.timeout_s"),
        ({"max_parallel": "4"}, "params.max_parallel"),
        ({"isolation": "none"}, "params.isolation"),
    ],
)
def test_a_bad_param_value_is_refused_when_the_reward_set_is_built_not_on_every_sample(params, named):
    from batchrl.rewards.combine import RewardSet, TermSpec

    with pytest.raises(ValueError, match=rf"reward 'code_tests': {named}="):
        RewardSet(terms=[TermSpec("code_tests", 1.0, params=params)], by_data_source={}, failure_reward=0.0)
    RewardSet(
        terms=[TermSpec("code_tests", 1.0, params={"mode": "all", "timeout_s": 0.5})],
        by_data_source={},
        failure_reward=0.0,
    )
