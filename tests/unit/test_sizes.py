"""No module of the package over 600 lines and no function over 100 (house style: a file is a room one can read
through, a function fits on a screen). What grows past either is split along its jobs, not exempted here."""

from __future__ import annotations

import ast
from pathlib import Path

import batchrl

PACKAGE = Path(batchrl.__file__).resolve().parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def oversized_files() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    return found


def oversized_functions() -> list[str]:
    """Functions and methods (nested ones too) by their span, decorators excluded, docstring included."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_file_of_the_package_is_over_600_lines():
    assert oversized_files() == []


def test_no_function_of_the_package_is_over_100_lines():
    assert oversized_functions() == []


def test_the_checks_see_the_package_files_and_their_functions():
    # guards the two tests above against passing vacuously (a wrong root, a walk that finds nothing)
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert "runner.py" in sizes and "worker.py" in sizes and len(sizes) > 50
    functions = [n for n in ast.walk(ast.parse((PACKAGE / "cli.py").read_text())) if isinstance(n, ast.FunctionDef)]
    assert functions and all(n.end_lineno > n.lineno for n in functions)
