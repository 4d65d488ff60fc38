"""The tools' JSON schemas in the prompt (generate.tools_in_prompt), as the chat templates users have render them.

Qwen2.5's, Llama 3.1's and the Hermes templates write the schemas of ``apply_chat_template(..., tools=[...])`` into
the system prompt, with the call format the policy is expected to use. With generate.tools set, ingest (and the
held-out prompts) pass the tools' schemas (`batchrl.agents.tools.json_schema`) to the template, so that the model
sees the tools without the dataset describing them. The rule, per generate.tools_in_prompt:

- ``auto`` (default): pass the schemas; a template that does not render them (the rendered prompt is the same as
  without them, or the template fails given them) leaves the prompts as they are, said once at INFO: the toy
  tokenizer's template is such a template, and its prompts stay as they were.
- ``always``: as auto, but a template that does not render them is a data error (exit 1) naming the field.
- ``never``: no schemas (the prompts describe the tools themselves).

Prompts fed as plain text (data.apply_chat_template: false) never carry the schemas. The schemas enter the prompts
tables' fingerprints only where they can change the prompts (`tool_schema_fingerprint`): a pipeline without tools
fingerprints as before.
"""

from __future__ import annotations

import logging
from typing import Any

from batchrl.errors import DataError

logger = logging.getLogger(__name__)
_said_ignored = False  # the INFO line about a template that ignores the schemas, once per process


def prompt_tool_schemas(generate: Any) -> list[dict[str, Any]] | None:
    """The schemas the prompts are templated with (generate.tools, in order), or None (no tools, or ``never``)."""
    if not generate.tools or generate.tools_in_prompt == "never":
        return None
    from batchrl.agents.tools import load_tools

    return [tool.schema for tool in load_tools(list(generate.tools)).values()]


def tool_schema_fingerprint(cfg: Any) -> dict[str, Any]:
    """The schemas for the fingerprint of a prompts table (and of what templates as it does): {} where the prompts
    cannot carry them, so that configs without tools fingerprint as they always did."""
    schemas = prompt_tool_schemas(cfg.generate) if cfg.data.apply_chat_template else None
    return {} if schemas is None else {"tool_schemas": schemas}


def render_with_tools(
    conversations: list[list[dict[str, str]]], tokenizer: Any, schemas: list[dict[str, Any]], *, required: bool
) -> list[str]:
    """Each conversation through the chat template with the generation prompt and the tools' schemas (one call for
    all); the plain rendering where the template does not render them (DataError instead when ``required``)."""
    global _said_ignored
    plain = tokenizer.apply_chat_template(conversations[:1], add_generation_prompt=True, tokenize=False)
    try:
        texts = tokenizer.apply_chat_template(conversations, tools=schemas, add_generation_prompt=True, tokenize=False)
        problem = None if texts[0] != plain[0] else "renders the same prompt with and without them"
    except Exception as error:  # a template's own Jinja error, given a tools list it does not expect
        problem = f"fails given them ({type(error).__name__}: {error})"
    if problem is None:
        return texts
    names = [schema["function"]["name"] for schema in schemas]
    if required:
        raise DataError(
            f"generate.tools_in_prompt=always: the tokenizer's chat template does not render the tools {names}: it "
            f"{problem}; use a template that renders tools (Qwen2.5's, Llama 3.1's, Hermes), or set "
            "generate.tools_in_prompt: auto (or never) and describe the tools in the prompts"
        )
    if not _said_ignored:
        _said_ignored = True
        logger.info(
            "generate.tools: the chat template does not render the tools' schemas (%s); the prompts are templated "
            "without them (generate.tools_in_prompt=auto), so they must describe the tools %s themselves",
            problem,
            names,
        )
    return tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
