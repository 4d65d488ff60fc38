"""The tools' schemas in the prompt (generate.tools_in_prompt): with generate.tools set, ingest templates the prompts
with the tools' JSON schemas where the chat template renders them (a local tokenizer with a Qwen2.5-style tools
section stands in for Qwen's: no downloads here), leaves them as they were with a template that ignores them (the toy
tokenizer's) unless told 'always', and the prompts table's fingerprint changes only where tools are set."""

from __future__ import annotations

import json
import logging

import pytest
from test_generate import config, ingest

from batchrl.agents import prompt_tools
from batchrl.agents.prompt_tools import render_with_tools
from batchrl.agents.tools import load_tools
from batchrl.config import validate_dict
from batchrl.errors import DataError
from batchrl.stages.heldout import heldout_fingerprint_config
from batchrl.stages.ingest import IngestStage
from batchrl.storage import read_parquet

# Qwen2.5's tools section in short: the schemas as JSON lines between <tools> tags in a system turn
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGES = [[{"role": "user", "content": "What is 12 * 34?"}], [{"role": "user", "content": "What is 7 + 5?"}]]


@pytest.fixture(scope="module")
def toy_tokenizer(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture(scope="module")
def tools_tokenizer_dir(tmp_path_factory, toy_model_dir):
    """The toy tokenizer with a chat template that renders tools, saved as a tokenizer of its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE
    path = tmp_path_factory.mktemp("tools_tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


def schemas():
    return [tool.schema for tool in load_tools(["calculator"]).values()]


def test_a_template_that_renders_tools_gets_each_prompt_with_the_schemas(tools_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tools_tokenizer_dir)
    texts = render_with_tools(MESSAGES, tokenizer, schemas(), required=True)
    for text, messages in zip(texts, MESSAGES, strict=True):
        assert "<tools>\n" + json.dumps(schemas()[0]) in text
        assert messages[0]["content"] in text and text.endswith("<|im_start|>assistant\n")


def test_a_template_that_ignores_tools_keeps_its_prompts_under_auto_and_says_so_once(toy_tokenizer, caplog):
    plain = toy_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_tools._said_ignored = False
    with caplog.at_level(logging.INFO, logger="batchrl.agents.prompt_tools"):
        assert render_with_tools(MESSAGES, toy_tokenizer, schemas(), required=False) == plain
        assert render_with_tools(MESSAGES, toy_tokenizer, schemas(), required=False) == plain
    said = [r for r in caplog.records if "does not render the tools' schemas" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_always_with_a_template_that_ignores_tools_is_a_data_error_naming_the_field(toy_tokenizer):
    with pytest.raises(DataError, match=r"generate.tools_in_prompt=always.*\['calculator'\]"):
        render_with_tools(MESSAGES, toy_tokenizer, schemas(), required=True)


def with_tools(cfg, tmp_path, *, tokenizer=None, **generate_fields):
    raw = cfg.model_dump()
    raw["run"]["root"] = str(tmp_path)
    raw["generate"] |= {"tools": ["calculator"]} | generate_fields
    raw["data"]["max_prompt_tokens"] = 1024  # the schemas take a few hundred toy tokens
    if tokenizer:
        raw["model"]["tokenizer"] = tokenizer
    return validate_dict(raw)


@pytest.fixture(scope="module")
def tables(ray_session, tmp_path_factory, toy_model_dir, toy_prompts_dir, tools_tokenizer_dir):
    """Prompts tables ingested without tools, with tools and the toy template, and with tools and the tools
    template (with auto and with never)."""
    tmp = tmp_path_factory.mktemp("tools_in_prompt")
    plain = config(tmp / "plain", toy_model_dir, toy_prompts_dir, "hf")
    configs = {
        "plain": plain,
        "toy": with_tools(plain, tmp / "toy"),
        "rendered": with_tools(plain, tmp / "rendered", tokenizer=tools_tokenizer_dir),
        "never": with_tools(plain, tmp / "never", tokenizer=tools_tokenizer_dir, tools_in_prompt="never"),
    }
    out = {}
    for name, cfg in configs.items():
        out_dir, _ = ingest(cfg)
        out[name] = (cfg, read_parquet(out_dir + "/part-00000.parquet").to_pylist())
    return out


def test_with_a_template_that_renders_tools_the_ingested_prompts_carry_the_schemas(tables):
    _, rows = tables["rendered"]
    _, never = tables["never"]
    for row, plain in zip(rows, never, strict=True):
        assert '"name": "calculator"' in row["prompt_text"] and "calculator" not in plain["prompt_text"]
        assert len(row["prompt_token_ids"]) > len(plain["prompt_token_ids"])


def test_with_the_toy_template_the_prompts_are_those_of_a_run_without_tools(tables):
    _, plain = tables["plain"]
    _, toy = tables["toy"]
    assert [r["prompt_token_ids"] for r in toy] == [r["prompt_token_ids"] for r in plain]


def test_only_a_config_with_tools_in_its_prompts_adds_the_schemas_to_the_prompt_fingerprints(tables):
    stage = IngestStage()
    prints = {name: stage.fingerprint_config(cfg) for name, (cfg, _) in tables.items()}
    assert "tool_schemas" not in prints["plain"] and "tool_schemas" not in prints["never"]
    assert prints["rendered"]["tool_schemas"] == schemas()
    # the held-out prompts are templated the same way, so their fingerprint follows
    assert heldout_fingerprint_config(tables["rendered"][0])["tool_schemas"] == schemas()
    assert "tool_schemas" not in heldout_fingerprint_config(tables["plain"][0])


def test_tools_in_prompt_without_tools_is_a_config_error_naming_it(tables):
    raw = tables["plain"][0].model_dump()
    raw["generate"]["tools_in_prompt"] = "always"
    with pytest.raises(ValueError, match="generate.tools_in_prompt is set but generate.tools is empty"):
        validate_dict(raw)
