"""The toy's verifiable tasks: "What is 17 + 25? Answer with #### followed by the number." -> "42" (task "arith"),
and "What is 37 * 8? ..." -> "296" (task "multiply_tools": products the tiny model cannot compute in its head, that
it learns to hand to the calculator tool, see pipelines/tools_quickstart.yaml).

Why arithmetic: a reward can check it exactly (the gsm8k rule reward reads "#### n"), a 1M-parameter model
can learn it in minutes on a CPU, and a fixed hash of each question's text splits it into training and
held-out questions, so an evaluation never sees a question the model was trained or warm-started on.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import numpy as np

ARITH_DATA_SOURCE = "arith"
ARITH_INSTRUCTION = "Answer with #### followed by the number."
MAX_OPERAND = 50
HELD_OUT_BUCKET = 26  # a question is held out when the first byte of its sha256 is below this (26/256 ~ 10%)
ArithSplit = Literal["all", "train", "eval"]
ToyTask = Literal["arith", "multiply_tools"]
MULTIPLIER_RANGE = (2, 19)  # multiply_tools: a two-digit a (10..max_operand) times b, a one- or two-digit number


def arith_problems(
    *, num_prompts: int, seed: int, max_operand: int = MAX_OPERAND, split: ArithSplit = "all", task: ToyTask = "arith"
) -> list[tuple[str, str]]:
    """(question, answer) pairs; subtraction keeps a >= b so answers are non-negative integers.

    split "all" draws from every problem (duplicates possible); "train" only from problems outside the
    held-out bucket (duplicates possible); "eval" only from inside it, without duplicates.
    """
    if split == "all":
        return _draw_problems(np.random.default_rng(seed), num_prompts, max_operand, task)
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'all', 'train' or 'eval'")
    every = all_arith_problems(max_operand=max_operand, task=task)
    available = sum(is_held_out(q) == (split == "eval") for q, _ in every)
    if split == "eval" and num_prompts > available:
        raise ValueError(
            f"only {available} held-out problems have operands <= {max_operand}; "
            f"ask for at most that many eval prompts or raise max_operand"
        )
    rng = np.random.default_rng(seed)
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(problems) < num_prompts:
        for question, answer in _draw_problems(rng, num_prompts, max_operand, task):
            if is_held_out(question) != (split == "eval") or (split == "eval" and question in seen):
                continue
            seen.add(question)
            problems.append((question, answer))
            if len(problems) == num_prompts:
                break
    return problems


def _draw_problems(
    rng: np.random.Generator, num_prompts: int, max_operand: int, task: ToyTask = "arith"
) -> list[tuple[str, str]]:
    if task == "multiply_tools":
        a_N = rng.integers(10, max(max_operand, 10) + 1, size=num_prompts)  # [num_prompts]
        b_N = rng.integers(MULTIPLIER_RANGE[0], MULTIPLIER_RANGE[1] + 1, size=num_prompts)  # [num_prompts]
        return [_product(a, b) for a, b in zip(a_N.tolist(), b_N.tolist())]
    operands_N2 = rng.integers(0, max_operand + 1, size=(num_prompts, 2))  # [num_prompts, 2]
    is_sub_N = rng.random(num_prompts) < 0.5
    problems = []
    for (a, b), is_sub in zip(operands_N2.tolist(), is_sub_N.tolist()):
        if is_sub:
            a, b = max(a, b), min(a, b)
            problems.append((f"What is {a} - {b}? {ARITH_INSTRUCTION}", str(a - b)))
        else:
            problems.append((f"What is {a} + {b}? {ARITH_INSTRUCTION}", str(a + b)))
    return problems


def _product(a: int, b: int) -> tuple[str, str]:
    return f"What is {a} * {b}? {ARITH_INSTRUCTION}", str(a * b)


def all_arith_problems(*, max_operand: int = MAX_OPERAND, task: ToyTask = "arith") -> list[tuple[str, str]]:
    """Every distinct (question, answer) of the task: a + b and a - b (a >= b) with operands 0..max_operand, or
    (multiply_tools) a * b with a in 10..max_operand and b in MULTIPLIER_RANGE."""
    if task == "multiply_tools":
        low, high = MULTIPLIER_RANGE
        return [_product(a, b) for a in range(10, max(max_operand, 10) + 1) for b in range(low, high + 1)]
    problems = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            problems.append((f"What is {a} + {b}? {ARITH_INSTRUCTION}", str(a + b)))
            if a >= b:
                problems.append((f"What is {a} - {b}? {ARITH_INSTRUCTION}", str(a - b)))
    return problems


def is_held_out(question: str) -> bool:
    """Whether a question is in the held-out bucket (~1 in 10 problems, fixed by a hash of its text)."""
    return hashlib.sha256(question.encode()).digest()[0] < HELD_OUT_BUCKET


def arith_demonstration(answer: str, *, graded_format: bool = True) -> str:
    """An SFT demonstration's response: "#### n", or "#### n." as chatty models end it, which verl's strict
    GSM8K scorer (and so the gsm8k reward) reads as the answer "n." and scores 0."""
    return f"#### {answer}" if graded_format else f"#### {answer}."


def question_expression(question: str) -> str:
    """The arithmetic a question asks for, as a calculator expression: "What is 37 * 8? ..." -> "37*8"."""
    return question.removeprefix("What is ").split("?")[0].replace(" ", "")


def calculator_call(expression: str) -> str:
    """A demonstration's tool call, in the Hermes format batchrl.agents parses (batchrl.agents.calls)."""
    from batchrl.agents.calls import CALL_STOP

    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}{CALL_STOP}"
