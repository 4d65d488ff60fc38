"""Tools a policy can call in a multi-turn rollout: plain functions, each with a JSON schema derived from its
signature and docstring, as TRL derives one for ``tools=`` (transformers' ``get_json_schema``; written here, not
imported, so that a tool needs no transformers import and the rules are ours to document).

A tool is named in ``generate.tools`` either as a built-in (`BUILTIN_TOOLS`: ``calculator``, ``python``) or as a
``package.module:function`` reference to user code. The schema rules, for a function to be usable:
- every parameter has a type hint (str, int, float, bool, list[...], dict, Literal[...], X | None);
- the docstring's first paragraph describes the tool; its ``Args:`` section describes every parameter
  (``name: description`` or ``name (type): description``, Google style);
- no ``*args``; ``**kwargs`` is ignored (it has no schema).
A function that breaks a rule is a config error naming ``generate.tools[i]`` (`tool_problems`), found where the
pipeline is loaded, before any work.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrl.config.rollout import BUILTIN_TOOLS
from batchrl.errors import ConfigError, type_phrase
from batchrl.references import import_reference, source_digest

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


@dataclass(frozen=True)
class Tool:
    """A callable tool: its name (what a call names), the function, and the schema shown to the policy."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


def json_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI/Hermes function schema of ``function``; ValueError saying what is missing when it has none."""
    doc = inspect.getdoc(function)
    if not doc:
        raise ValueError("has no docstring: its first paragraph describes the tool to the policy")
    description, arg_docs = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # a hint naming something undefined
        raise ValueError(f"has type hints that cannot be resolved: {error}") from error
    properties: dict[str, Any] = {}
    required = []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            continue
        if parameter.kind is parameter.VAR_POSITIONAL:
            raise ValueError(f"takes *{name}: a tool's arguments are named (a JSON object)")
        if name not in hints:
            raise ValueError(f"parameter {name!r} has no type hint")
        if name not in arg_docs:
            raise ValueError(f"parameter {name!r} is not described in the docstring's Args: section")
        properties[name] = _type_schema(hints[name], where=name) | {"description": arg_docs[name]}
        if parameter.default is parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": function.__name__, "description": description, "parameters": parameters},
    }


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description} from a Google-style ``Args:`` section)."""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n(.*?)(?:^\s*\w+:\s*$|\Z)", doc, re.M | re.S)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if match:
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current and line.strip():  # a description continued on the next line
                args[current] += " " + line.strip()
    return description, args


def _type_schema(hint: Any, *, where: str) -> dict[str, Any]:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(arguments[0]), "string"), "enum": list(arguments)}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in arguments if a is not type(None)]
        if len(kept) == 1:
            return _type_schema(kept[0], where=where) | {"nullable": True}
        return {"anyOf": [_type_schema(a, where=where) for a in kept]}
    if origin is list:
        return {"type": "array"} | ({"items": _type_schema(arguments[0], where=where)} if arguments else {})
    if origin is dict:
        return {"type": "object"}
    raise ValueError(
        f"parameter {where!r} has type {hint!r}, which has no JSON schema (use str, int, float, bool, list, dict)"
    )


# --- built-in tools -----------------------------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000  # 10**1000 is cheap; 9**9**9 would run for minutes, hence the cap
_MAX_DIGITS = 4300  # Python's own int-to-str limit


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 3) * 4".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        return repr(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic syntax tree: walked here (never eval), numbers and the operators above only."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {_MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
            raise ValueError("the result is too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: only numbers and + - * / // % ** ( )")


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed (stdout, then stderr).

    Args:
        code: The program's source code; print what you want to see.
    """
    from batchrl.sandbox import run_program  # bubblewrap and rlimits (batchrl.sandbox); loaded when first called

    result = run_program(code)
    output = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
    if not result.ok:  # a failed program is a failed call (counted), its output still shown to the policy
        raise RuntimeError(f"{result.describe()}\n{output}".strip())
    return output


BUILTINS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
assert set(BUILTINS) == set(BUILTIN_TOOLS), "config.rollout.BUILTIN_TOOLS lists the built-ins the config accepts"


def load_tool(entry: str) -> Tool:
    """The tool a ``generate.tools`` entry names; ValueError saying why it is not usable."""
    function = BUILTINS.get(entry)
    if function is None:
        function = import_reference(entry, what="tool")
        if not inspect.isroutine(function):  # a class, an instance, a partial: no name and docstring of its own
            raise ValueError(f"is {type_phrase(function)}, not a function")
    return Tool(
        name=function.__name__ if entry not in BUILTINS else entry, function=function, schema=json_schema(function)
    )


def load_tools(entries: list[str]) -> dict[str, Tool]:
    """The tools of ``generate.tools`` by the name a call uses."""
    tools = [load_tool(entry) for entry in entries]
    return {tool.name: tool for tool in tools}


def tool_problems(entries: list[str]) -> list[str]:
    """One line per unusable ``generate.tools`` entry, naming ``generate.tools[i]`` (imports the references)."""
    problems, names = [], {}
    for index, entry in enumerate(entries):
        try:
            tool = load_tool(entry)
        except ValueError as error:
            problems.append(f"generate.tools[{index}]={entry!r}: {error}")
            continue
        if tool.name in names:
            problems.append(
                f"generate.tools[{index}]={entry!r}: a second tool named "
                f"{tool.name!r} (first: generate.tools[{names[tool.name]}])"
            )
        names.setdefault(tool.name, index)
    return problems


def check_tools(entries: list[str], *, source: str | None = None) -> None:
    """ConfigError (exit 2), a line per problem, when a ``generate.tools`` entry is not a usable tool."""
    problems = tool_problems(entries)
    if problems:
        raise ConfigError("\n".join(f"{source}: {line}" if source else line for line in problems))


def tool_digests(entries: list[str]) -> dict[str, str]:
    """The source digest of each user tool's module, for generate's fingerprint: editing a tool regenerates."""
    return {entry: source_digest(entry) for entry in entries if entry not in BUILTINS}
