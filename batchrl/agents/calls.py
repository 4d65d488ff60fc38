"""The tool-call format: Hermes-style calls, as Qwen2.5's chat template writes them, and the tool's answer as a turn.

A call is JSON between tags, ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``;
generation stops at ``</tool_call>`` (`CALL_STOP`), so a turn holds at most one complete call, and the engines cut
the stop string from their text (both keep the token that completed it in token_ids), so the parser accepts a call
whose closing tag is missing at the end of the text.

The answer goes back as ``<tool_response>\\n{output}\\n</tool_response>``, wrapped in the chat template's tool turn
(`ToolTurnFormat`): for a ChatML template that knows tool responses (Qwen2.5's), the assistant turn is closed and the
answer is a user turn, followed by the next assistant turn's header, exactly the text Qwen2.5's template renders for
a ``tool`` message; for any other tokenizer (the tiny test models), the plain answer between newlines, inside the
assistant's turn. The text is tokenised once, on its own, and its ids are appended: the conversation is never
re-rendered or re-tokenised (see docs/ARCHITECTURE.md, "Multi-turn rollouts").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL_STOP = "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

_RESPONSE = "\n<tool_response>\n{output}\n</tool_response>"


@dataclass(frozen=True)
class ParsedCall:
    """One call found in a turn's text: the tool's name and arguments, or why the call is malformed."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    malformed: str | None = None  # invalid_json, no_name, bad_arguments; None when the call parses
    detail: str = ""  # the parse error, for the error turn the policy reads


def parse_calls(text: str) -> list[ParsedCall]:
    """The calls in a turn's text, in order ([] when it holds none)."""
    return [_parse_one(body.strip()) for body in _CALL.findall(text)]


def _parse_one(body: str) -> ParsedCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ParsedCall(None, malformed="invalid_json", detail=f"the call is not valid JSON: {error.msg}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedCall(None, malformed="no_name", detail='a call is {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ParsedCall(call["name"], malformed="bad_arguments", detail="the call's arguments are not an object")
    return ParsedCall(call["name"], arguments)


@dataclass(frozen=True)
class ToolTurnFormat:
    """How a turn of tool answers is written after the policy's call (see the module docstring): ``opening``, each
    answer as ``<tool_response>`` text, ``closing``."""

    opening: str
    closing: str

    @classmethod
    def for_chat_template(cls, chat_template: str | None) -> ToolTurnFormat:
        """Qwen2.5's tool turn for a ChatML template that renders <tool_response>, else the plain one."""
        if chat_template and "<tool_response>" in chat_template and "<|im_start|>" in chat_template:
            return cls(opening="<|im_end|>\n<|im_start|>user", closing="<|im_end|>\n<|im_start|>assistant\n")
        return cls(opening="", closing="\n")

    def render(self, outputs: list[str]) -> str:
        """The text of a turn answering ``outputs`` (one per call of the turn, in order)."""
        return self.opening + "".join(_RESPONSE.format(output=output) for output in outputs) + self.closing

    def render_observation(self, observation: str) -> str:
        """The text of an environment's observation turn (batchrl.agents.environment): the tool turn's frame around
        the plain text, without <tool_response> tags (it answers the turn, not a call)."""
        return self.opening + "\n" + observation + self.closing
