"""code_tests: run the response's program against the row's tests in the sandbox; the reward is the fraction passed.

The program is the last fenced ```python block of the response (or the last fenced block of any language, an
unclosed one at the end of a truncated response included), else the whole response.

Where the tests are: the row's ``ground_truth``, else its ``extra_info`` under ``input_output``, ``tests``,
``test_cases``, ``test_list`` or ``test`` (the first present). A value may be JSON text (or a Python literal),
or already a list or dict, in one of the shapes code-RL datasets ship:

- stdin/stdout pairs, a list: ``[{"input": "2 3\\n", "output": "5\\n"}, ...]`` (open-r1 codeforces, DeepCoder's
  stdin tests). The program reads the input; its stdout must equal the output, compared line by line after
  stripping each line's surrounding whitespace and collapsing inner runs, trailing blank lines ignored; tokens
  that both read as numbers compare within 1e-6 (relative or absolute), so "1.0000000" equals "1";
- verl / PRIME / APPS / TACO: ``{"inputs": [...], "outputs": [...]}``, the same pairs by position (an input or
  output that is a list of lines is joined with newlines). With ``"fn_name": "add"`` (APPS's call-based
  problems) each input is the list of arguments and the output the return value (or a one-element list of it):
  the program's function ``add`` (or ``Solution().add``) is called and its JSON-converted result compared;
- assert-style test code, a string of Python appended to the program (MBPP, KodCode): each top-level ``assert``
  is one test, run with the statements before it (imports, helpers); code without top-level asserts (a
  ``check(candidate)`` function, unittest) is one all-or-nothing test. HumanEval's layout, ``test`` with a
  ``def check(candidate)`` and ``extra_info.entry_point``, calls ``check(<entry_point>)``;
- a list of such strings (MBPP's ``test_list``): one test each.

A test passes when its program exits 0 within the limits and (stdin/stdout) prints the expected output, or
(code) reaches the end: the test code prints a random token after its last assert, so a program that exits 0
before its tests run (``sys.exit(0)``, ``os._exit(0)``) fails them. A timeout, a crash, a memory or output limit
fails that test only and never raises: the value is the fraction passed (``mode: fraction``, the default) or 1/0
(``mode: all``), and the failures go to the scores table's ``score_details`` with their kind and stderr's end.
A row with no tests in any known place raises ValueError (the sample's component fails, naming the layouts).

Timing: the tests of a sample run ``max_parallel`` at a time, each with ``timeout_s`` CPU seconds and a wall clock
of ``wall_timeout_s`` (default 3 x timeout_s: a right program waiting for a busy CPU is not failed), all within
``budget_s`` (a test gets at most what is left of it; one not started by then fails as a timeout). The score
stage gives each reward call ``score.timeout_s`` (10 s by default) before it kills it and fails the component:
keep ``budget_s`` below it (the default 8 s is), or raise both for large test suites.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchrl.rewards.detail import RewardWithDetail
from batchrl.rewards.labels import label_free
from batchrl.sandbox import Program, SandboxLimits, SandboxResult, run_programs

EXTRA_INFO_KEYS = ("input_output", "tests", "test_cases", "test_list", "test")
MAX_DETAIL_CHARS = 480  # combine.MAX_ERROR_CHARS is 500: a detail reads like an error message
MAX_FAILURES_SHOWN = 3
# A test's wall clock by default, per CPU second: programs share the actor's CPUs with the other tests and reward
# processes, and a right one waiting for a CPU must not fail; a sleeping or blocked one is stopped there.
WALL_PER_CPU = 3.0
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


@dataclass(frozen=True)
class CodeTest:
    """One test: ``stdin`` and ``expected`` stdout, or ``code`` appended to the program (which must reach its end)."""

    stdin: str = ""
    expected: str | None = None
    code: str | None = None


@label_free  # the tests may be in extra_info: a row without a ground_truth fails at scoring, naming the layouts
def code_tests(
    response: str,
    ground_truth: str | None,
    *,
    extra_info: Mapping[str, Any] | None = None,
    mode: str = "fraction",
    timeout_s: float = 2.0,
    wall_timeout_s: float | None = None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1 << 20,
    max_parallel: int = 4,
    budget_s: float = 8.0,
    isolation: str = "auto",
    **row: Any,
) -> float:
    """The fraction of the row's tests the response's program passes (``mode="all"``: 1.0 only if all pass)."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests: mode={mode!r} must be 'fraction' or 'all'")
    tests = parse_tests(ground_truth, extra_info)
    program = extract_program(response)
    token = secrets.token_hex(8)
    wall_s = wall_timeout_s or WALL_PER_CPU * timeout_s
    limits = SandboxLimits(wall_s=wall_s, cpu_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    results = run_programs(
        [Program(_with_test(program, test, token), stdin=test.stdin) for test in tests],
        limits=limits,
        max_parallel=max_parallel,
        isolation=isolation,
        deadline_s=budget_s,
    )
    failures = [
        (i, why) for i, (test, result) in enumerate(zip(tests, results)) if (why := _failure(test, result, token))
    ]
    passed = len(tests) - len(failures)
    value = passed / len(tests) if mode == "fraction" else float(passed == len(tests))
    if not failures:
        return value
    shown = "; ".join(f"test {i + 1}: {why}" for i, why in failures[:MAX_FAILURES_SHOWN])
    more = f"; {len(failures) - MAX_FAILURES_SHOWN} more" if len(failures) > MAX_FAILURES_SHOWN else ""
    return RewardWithDetail(value, f"{passed}/{len(tests)} tests passed; {shown}{more}"[:MAX_DETAIL_CHARS])


POSITIVE_PARAMS = ("timeout_s", "wall_timeout_s", "memory_mb", "max_output_bytes", "max_parallel", "budget_s")
CHOICES = {"mode": ("fraction", "all"), "isolation": ("auto", "required", "off")}


def check_code_params(params: Mapping[str, Any]) -> None:
    """ValueError naming the param whose value code_tests cannot use; read when the job starts (check_reward_params)."""
    for key, allowed in CHOICES.items():
        if key in params and params[key] not in allowed:
            raise ValueError(f"params.{key}={params[key]!r} must be one of {list(allowed)}")
    for key in POSITIVE_PARAMS:
        value = params.get(key)
        if key == "wall_timeout_s" and value is None:
            continue  # the default: 3 x timeout_s
        if key in params and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise ValueError(f"params.{key}={value!r} must be a positive number")


code_tests.check_params = check_code_params  # type: ignore[attr-defined]


def extract_program(response: str) -> str:
    """The last fenced python block, else the last fenced block, else the whole response."""
    blocks = _FENCE.findall(response)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    if python or blocks:
        return (python or [body for _, body in blocks])[-1]
    return response


def parse_tests(ground_truth: Any, extra_info: Mapping[str, Any] | None) -> list[CodeTest]:
    """The tests of a row (see the module docstring for the layouts); ValueError if there are none."""
    extra = extra_info if isinstance(extra_info, Mapping) else {}
    for value in (ground_truth, *(extra.get(key) for key in EXTRA_INFO_KEYS)):
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        tests = _tests_from(_decoded(value), extra)
        if tests:
            return tests
    raise ValueError(
        "code_tests: no tests in ground_truth or extra_info (" + ", ".join(EXTRA_INFO_KEYS) + "); expected a list "
        'of {"input", "output"}, {"inputs": [...], "outputs": [...]} or Python assert code (README: Code rewards)'
    )


def _decoded(value: Any) -> Any:
    """JSON text, or a Python literal (a dict that went through str()), else the string itself (test code)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text[:1] in ("[", "{", '"'):
        try:
            return json.loads(text)
        except ValueError:
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass
    return value


def _tests_from(data: Any, extra: Mapping[str, Any]) -> list[CodeTest]:
    if isinstance(data, str):
        return assert_tests(data, entry_point=extra.get("entry_point"))
    if isinstance(data, Mapping):
        if "inputs" in data and "outputs" in data:
            fn_name = data.get("fn_name") or extra.get("fn_name")
            pairs = list(zip(data["inputs"], data["outputs"]))
            return [_call_test(fn_name, i, o) if fn_name else _stdio_test(i, o) for i, o in pairs]
        if "input" in data and "output" in data:
            return [_stdio_test(data["input"], data["output"])]
        raise ValueError(f"code_tests: a dict of tests needs 'inputs' and 'outputs'; found keys {sorted(data)[:8]}")
    if isinstance(data, list) and data:
        if all(isinstance(t, Mapping) and "input" in t and "output" in t for t in data):
            return [_stdio_test(t["input"], t["output"]) for t in data]
        if all(isinstance(t, str) for t in data):
            return [CodeTest(code=t) for t in data if t.strip()]
    raise ValueError(f"code_tests: tests of an unknown shape: {str(data)[:120]!r}")


def _lines(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _stdio_test(stdin: Any, expected: Any) -> CodeTest:
    return CodeTest(stdin=_lines(stdin), expected=_lines(expected))


def _call_test(fn_name: str, arguments: Any, expected: Any) -> CodeTest:
    """Calls ``fn_name`` (a function of the program, or a method of its ``Solution`` class) with ``arguments``."""
    arguments = arguments if isinstance(arguments, list) else [arguments]
    code = f"""
import json as _batchrl_json
_fn = globals().get({fn_name!r}) or getattr(globals()["Solution"](), {fn_name!r})
_got = _batchrl_json.loads(_batchrl_json.dumps(_fn(*_batchrl_json.loads({json.dumps(arguments)!r}))))
_want = _batchrl_json.loads({json.dumps(expected)!r})
assert _got == _want or [_got] == _want, f"expected {{_want!r}}, got {{_got!r}}"[:200]
"""
    return CodeTest(code=code)


def assert_tests(code: str, *, entry_point: str | None = None) -> list[CodeTest]:
    """One test per top-level assert, each after the statements before it; else the whole code as one test."""
    if entry_point and "def check(" in code:
        return [CodeTest(code=f"{code}\n\ncheck({entry_point})\n")]  # HumanEval: the asserts are inside check
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return [CodeTest(code=code)]  # run as it is: the failure is then the program's to report
    asserts = [node for node in tree.body if isinstance(node, ast.Assert)]
    if len(asserts) < 2:
        return [CodeTest(code=code)]
    tests, setup = [], []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            tests.append(CodeTest(code="\n".join([*setup, ast.unparse(node)])))
        else:
            setup.append(ast.unparse(node))
    return tests


def _with_test(program: str, test: CodeTest, token: str) -> str:
    if test.code is None:
        return program
    return f"{program}\n\n# --- tests ---\n{test.code}\nprint({token!r})\n"


def _failure(test: CodeTest, result: SandboxResult, token: str) -> str | None:
    """Why ``result`` fails ``test`` ('timeout', 'error: <stderr's end>', 'wrong answer ...'), or None."""
    if not result.ok:
        return result.describe(max_chars=160)
    if test.code is not None:
        lines = result.stdout.rstrip().splitlines()
        return None if lines and lines[-1].strip() == token else "exited before its tests ran"
    if outputs_match(result.stdout, test.expected):
        return None
    return f"wrong answer (expected {_clip(test.expected)!r}, got {_clip(result.stdout)!r})"


def outputs_match(got: str, expected: str) -> bool:
    """Line by line, whitespace-normalised, trailing blank lines ignored; numbers within 1e-6."""
    got_lines, want_lines = _normalised(got), _normalised(expected)
    if got_lines == want_lines:
        return True
    if len(got_lines) != len(want_lines):
        return False
    for got_line, want_line in zip(got_lines, want_lines):
        got_tokens, want_tokens = got_line.split(), want_line.split()
        if len(got_tokens) != len(want_tokens):
            return False
        if not all(a == b or _close(a, b) for a, b in zip(got_tokens, want_tokens)):
            return False
    return True


def _normalised(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in text.strip().splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isfinite(x) and math.isfinite(y) and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def _clip(text: str, chars: int = 40) -> str:
    text = text.strip()
    return text if len(text) <= chars else text[:chars] + "..."
