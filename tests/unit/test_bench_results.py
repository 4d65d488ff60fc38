"""bench/RESULTS.md holds only what `make bench` wrote: every row a line its benchmark's code can print, and every
row with a recorded commit carrying the check bench/run_all.py computed for it (issue 35, item 5)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printable_results(script: Path) -> list[re.Pattern]:
    """The RESULT lines a benchmark can print: each string or f-string of its source that starts with "RESULT ",
    as a pattern in which every interpolated value matches any text."""
    patterns = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.JoinedStr):
            pattern = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".*?" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            pattern = re.escape(node.value)
        else:
            continue
        if pattern.startswith(re.escape("RESULT ")):
            patterns.append(re.compile(pattern, re.DOTALL))
    return patterns


def test_every_row_of_the_results_is_a_line_its_benchmark_can_print():
    rows = run_all().read_rows(BENCH / "RESULTS.md")
    assert len(rows) > 20, "the results table was not read: the test would pass vacuously"
    for bench, metric, value, *_measured in rows:
        script = BENCH / f"{bench}.py"
        assert script.is_file(), f"RESULTS.md has a row of {bench}, which bench/ no longer has"
        if metric == "FAILED":
            continue
        line = f"RESULT {metric}={value}"
        assert any(p.fullmatch(line) for p in printable_results(script)), (
            f"RESULTS.md's row {bench} {metric} is not a line {script.name} can print (edited by hand, or the "
            f"benchmark changed since it ran: `make bench BENCH={bench.removeprefix('bench_')}`): {value}"
        )


def test_every_row_with_a_commit_carries_the_check_run_all_computed():
    module = run_all()
    recorded = [row for row in module.read_rows(BENCH / "RESULTS.md") if row[3] != module.UNRECORDED]
    assert recorded, "no row records its commit: make bench has not written the table since commits were recorded"
    for bench, metric, value, commit, load, check in recorded:
        assert check == module.row_check(bench, metric, value, commit, load), (
            f"RESULTS.md's row {bench} {metric} does not carry the check make bench wrote: edited by hand"
        )


def test_a_row_edited_by_hand_fails_its_check():
    module = run_all()
    check = module.row_check("bench_x", "speed", "1.20 (target >= 1)", "abc", "1.0-1.2")
    assert check == module.row_check("bench_x", "speed", "1.20 (target >= 1)", "abc", "1.0-1.2")
    assert check != module.row_check("bench_x", "speed", "1.30 (target >= 1)", "abc", "1.0-1.2")
    assert check != module.row_check("bench_x", "speed", "1.20 (target >= 1; a note)", "abc", "1.0-1.2")
    assert check != module.row_check("bench_x", "speed", "1.20 (target >= 1)", "abc", "0.1-0.2")
    script = BENCH / "bench_advantage.py"
    assert any(p.fullmatch("RESULT advantage_vs_numpy_ratio=1.95 (target <= 2)") for p in printable_results(script))
    assert not any(p.fullmatch("RESULT advantage_vs_numpy_ratio=1.95 (target <= 3)") for p in printable_results(script))
