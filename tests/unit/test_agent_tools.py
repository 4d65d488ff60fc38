"""The tool layer of multi-turn rollouts, without an engine: Hermes call parsing (good, malformed, several), the
tool turn's text, the calculator (arithmetic by syntax tree, never eval), a tool's JSON schema from its signature
and docstring, and the config errors that name generate.tools[i]."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from batchrl.agents.calls import ToolTurnFormat, parse_calls
from batchrl.agents.loop import run_calls
from batchrl.agents.tools import calculator, check_tools, json_schema, load_tools
from batchrl.config import ConfigError, validate_dict
from batchrl.config.rollout import GenerateConfig


def lookup(city: str, units: Literal["metric", "imperial"] = "metric", days: list[int] | None = None) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        units (str): Metric or imperial
            units.
        days: Days ahead.
    """
    return f"{city}:{units}:{days}"


def undocumented(x: int) -> int:
    return x


def unhinted(x) -> int:
    """Doubles.

    Args:
        x: A number.
    """
    return 2 * x


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return "woke"


def test_a_hermes_call_parses_into_its_name_and_arguments():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    [call] = parse_calls(text)
    assert (call.name, call.arguments, call.malformed) == ("calculator", {"expression": "2*3"}, None)


def test_a_call_cut_at_the_stop_string_and_arguments_as_a_json_string_still_parse():
    [call] = parse_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert (call.name, call.arguments) == ("f", {"a": 1})


def test_several_calls_parse_in_order_and_text_without_calls_has_none():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b"}</tool_call>'
    assert [c.name for c in parse_calls(text)] == ["a", "b"]
    assert parse_calls("The answer is 6.") == []


def test_malformed_calls_are_reported_by_kind_not_raised():
    kinds = [
        parse_calls(text)[0].malformed
        for text in (
            "<tool_call>{not json}</tool_call>",
            '<tool_call>["calculator"]</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        )
    ]
    assert kinds == ["invalid_json", "no_name", "bad_arguments"]


def test_unknown_tools_wrong_arguments_raising_and_hanging_tools_become_counted_errors():
    tools = load_tools(["calculator", "tests.unit.test_agent_tools:slow"])
    calls = parse_calls(
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    )
    records = run_calls(calls, tools=tools, timeout_s=0.5, parallel=2)
    assert [r["error"] for r in records] == ["unknown_tool", "bad_arguments", "exception", "timeout", None]
    assert records[-1]["output"] == "42"
    assert "division by zero" in records[2]["detail"]


def test_the_tool_turn_is_qwens_for_a_chatml_template_with_tool_responses_and_plain_otherwise():
    qwen = ToolTurnFormat.for_chat_template("{{'<|im_start|>'}} ... <tool_response> ...")
    assert qwen.render(["42"]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ToolTurnFormat.for_chat_template("{{'<|im_start|>'}}").render(["42"]) == (
        "\n<tool_response>\n42\n</tool_response>\n"
    )


def test_the_calculator_does_arithmetic_and_refuses_anything_else():
    assert calculator("(12 + 3) * 4") == "60"
    assert calculator("7 / 2") == "3.5"
    assert calculator("2 ** 10 - -1") == "1025"
    assert calculator("8 / 4") == "2"
    for hostile in ("__import__('os').system('true')", "x + 1", "9 ** 9 ** 9", "1 / 0", "[1] * 3", "'a' * 3"):
        with pytest.raises(ValueError):
            calculator(hostile)


def test_a_schema_is_derived_from_the_signature_and_the_docstring():
    schema = json_schema(lookup)["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Look up the weather of a city."
    assert schema["parameters"]["required"] == ["city"]
    properties = schema["parameters"]["properties"]
    assert properties["city"] == {"type": "string", "description": "The city's name."}
    assert properties["units"] == {
        "type": "string",
        "enum": ["metric", "imperial"],
        "description": "Metric or imperial units.",
    }
    assert properties["days"]["type"] == "array" and properties["days"]["nullable"] is True


def test_functions_without_a_docstring_or_hints_are_config_errors_naming_the_entry():
    with pytest.raises(ConfigError) as error:
        check_tools(
            [
                "calculator",
                "tests.unit.test_agent_tools:undocumented",
                "tests.unit.test_agent_tools:unhinted",
                "no_such_module_xyz:f",
                "tests.unit.test_agent_tools:Literal",
            ]
        )
    lines = str(error.value).splitlines()
    where = [line.split("=")[0] for line in lines]
    assert where == ["generate.tools[1]", "generate.tools[2]", "generate.tools[3]", "generate.tools[4]"]
    assert "docstring" in lines[0] and "type hint" in lines[1] and "cannot import" in lines[2]
    assert "not a function" in lines[3]


def test_an_unknown_built_in_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"generate.tools\[1\]='calc' is no tool"):
        validate_dict(
            {
                "name": "t",
                "model": {"path": "m"},
                "data": {"train_files": ["x"]},
                "generate": {"tools": ["calculator", "calc"]},
            }
        )


def test_a_loop_setting_without_tools_is_refused_naming_it():
    with pytest.raises(ConfigError, match="generate.max_turns is set but generate.tools is empty"):
        validate_dict(
            {"name": "t", "model": {"path": "m"}, "data": {"train_files": ["x"]}, "generate": {"max_turns": 8}}
        )


def test_the_token_budget_is_max_new_tokens_unless_tools_set_their_own():
    assert GenerateConfig(max_new_tokens=32, tools=["calculator"]).response_token_budget() == 32
    assert (
        GenerateConfig(max_new_tokens=32, tools=["calculator"], max_response_tokens=100).response_token_budget() == 100
    )


def test_a_conversation_splits_into_its_turns_for_reading_in_both_tool_turn_forms():
    from batchrl.agents.columns import conversation_lines

    call = {"name": "calculator", "arguments": {"expression": "1/0"}, "output": None, "error": "exception"}
    calls = json.dumps([call | {"detail": "ZeroDivisionError", "turn": 0}])
    for form in ("", "{{'<|im_start|>'}} <tool_response>"):
        text = "call" + ToolTurnFormat.for_chat_template(form).render(["error: ZeroDivisionError"]) + "done"
        assert conversation_lines(text, calls, status="completed") == [
            "  [turn 0] policy: 'call'",
            '  [tool] calculator({"expression": "1/0"}) -> \'ERROR exception: ZeroDivisionError\'',
            "  [turn 1] policy: 'done'",
            "  [end] completed",
        ]


def test_the_python_tool_returns_what_the_program_printed_and_a_failing_program_is_a_counted_error():
    tools = load_tools(["python"])
    calls = parse_calls(
        '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"code": "1 / 0"}}</tool_call>'
    )
    printed, failed = run_calls(calls, tools=tools, timeout_s=30, parallel=2)
    assert (printed["output"], printed["error"]) == ("42\n", None)
    assert failed["error"] == "exception" and "ZeroDivisionError" in failed["detail"]
