"""ingest, row by row: an input record -> a validated prompt row, or a reject with its reason; templating and
tokenizing in batches.

Accepts two layouts, per record: batchrl's (``prompt`` as a string or chat messages, ``ground_truth``, optional
``data_source``, ``prompt_id``, ``extra_info``) and verl's (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info``). A missing ``prompt_id`` becomes ``<file stem>-<row>``, a missing
``data_source`` becomes ``unknown``. Reject reasons: empty_prompt, bad_prompt, bad_messages, bad_role,
bad_ground_truth (NaN, a boolean, a ``reward_model`` that is not a dict), missing_ground_truth (only where a
reward that runs on the row needs a label: LabelRule; a prompt may have none when its rewards are label-free,
e.g. a reward model alone), prompt_too_long (here),
bad_json (a JSONL line that is not a JSON object, found by the reader), duplicate_prompt_id (found across the
whole input, see ingest_duplicates), and with generate.logged those of the logged responses (ingest_logged).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from batchrl.agents.prompt_tools import prompt_tool_schemas, render_with_tools
from batchrl.config import ConfigError, PipelineConfig
from batchrl.errors import DataError, type_phrase
from batchrl.rewards import LabelRule
from batchrl.stages.ingest_logged import LOGGED_INPUT_COLUMNS, check_logged, logged_fields, rewards_complete
from batchrl.storage import StorageError, expand_input_files

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render (OpenAI's, verl's data)
INPUT_COLUMNS = [
    "prompt_id",
    "data_source",
    "prompt",
    "ground_truth",
    "reward_model",
    "extra_info",
    *LOGGED_INPUT_COLUMNS,
]
LOGGED_COLUMNS = ("logged_responses", "logged_response_token_ids", "logged_rewards", "logged_logprobs")


@dataclass(frozen=True)
class Reject:
    source_file: str
    source_row: int
    prompt_id: str | None
    reason: str
    detail: str


def load_tokenizer(cfg: PipelineConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise DataError(
            f"cannot load the tokenizer from {source!r} (model.tokenizer / model.path): {str(err).splitlines()[0]}"
        ) from None


def normalized_row(raw: dict[str, Any], *, uri: str, stem: str, row: int) -> dict[str, Any]:
    """The fields of an input record in batchrl's layout (either input layout in)."""
    ground_truth, ground_truth_problem = label_of(raw)
    if ground_truth_problem is None:
        ground_truth, ground_truth_problem = ground_truth_text(ground_truth)
    return {
        "prompt_id": str(raw["prompt_id"]) if raw.get("prompt_id") is not None else f"{stem}-{row}",
        "data_source": str(raw.get("data_source") or "unknown"),
        "prompt": raw.get("prompt"),
        "ground_truth": ground_truth,
        "ground_truth_problem": ground_truth_problem,
        "extra_info_json": json.dumps(raw["extra_info"], default=str) if raw.get("extra_info") is not None else None,
        "source_file": uri,
        "source_row": row,
        "logged_raw": logged_fields(raw),
    } | dict.fromkeys(LOGGED_COLUMNS)


def label_of(raw: dict[str, Any]) -> tuple[Any, str | None]:
    """(the record's ground truth as given, None), or (None, why verl's ``reward_model`` holds none).

    Why a plain ``reward_model`` string is rejected, not taken for the answer: verl's datasets store
    ``{"style": "rule", "ground_truth": ...}`` and its reward managers read ``reward_model["ground_truth"]``, so a
    string there is a file verl itself could not score (and a JSON text of that dict is no dict either)."""
    if "ground_truth" in raw:
        return raw["ground_truth"], None
    reward_model = raw.get("reward_model")
    if reward_model is None or isinstance(reward_model, dict):
        return (reward_model or {}).get("ground_truth"), None
    shape, found = '{"ground_truth": ...}', f"{type_phrase(reward_model)}: {str(reward_model)[:80]!r}"
    return None, f"reward_model must be a dict with a ground_truth key ({shape}, verl's layout); found {found}"


def ground_truth_text(value: Any) -> tuple[str | None, str | None]:
    """(the ground truth as the text rewards compare with, None) or (None, why it cannot be one).

    Why numbers are normalised here: rule rewards compare strings (verl's gsm8k scorer does), and a float column
    turns 19 into "19.0", which never equals the "19" extracted from a response, so every correct answer would
    score 0 without an error. An integral number becomes its digits (19.0 -> "19"), any other its shortest
    decimal form without an exponent (2.5 -> "2.5", 1e-05 -> "0.00001"); NaN, inf and booleans are rejected.
    Strings are kept as they are: what a dataset spells out is the answer it means.
    """
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, bool):
        return None, f"ground truth is a boolean ({value}); store it as a string if it is the answer"
    if isinstance(value, int):
        return str(value), None
    if isinstance(value, (float, Decimal)):
        number = Decimal(repr(value)) if isinstance(value, float) else value
        if not number.is_finite():
            return None, f"ground truth is {value}, not a number an answer can equal"
        return _plain_decimal(number), None
    return str(value), None


def _plain_decimal(number: Decimal) -> str:
    """19.0 -> "19", 2.50 -> "2.5", 1E+20 -> "100000000000000000000", -0.0 -> "0"."""
    if number.is_zero():
        return "0"
    integral = number.to_integral_value()
    return format(integral if number == integral else number.normalize(), "f")


def validate(row: dict[str, Any], labels: LabelRule, *, logged: str | list[int] | None = None) -> Reject | None:
    """The reject of a row whose prompt, ground truth or logged responses (with ``logged``, generate.logged) are
    unusable, or that lacks the ground truth a reward that runs on it needs (``labels``; none runs on a row whose
    every logged response has its reward when every iteration is logged); None (and its ``messages`` set)
    otherwise."""

    def reject(reason: str, detail: str) -> Reject:
        return Reject(row["source_file"], row["source_row"], row["prompt_id"], reason, detail)

    messages, problem = prompt_messages(row["prompt"])
    if problem is None and logged is not None:
        problem = check_logged(row)
    row.pop("logged_raw", None)
    if problem is not None:
        return reject(*problem)
    if row["ground_truth_problem"] is not None:
        return reject("bad_ground_truth", row["ground_truth_problem"])
    if row["ground_truth"] is not None and not row["ground_truth"].strip():
        row["ground_truth"] = None  # a blank label is no label
    if row["ground_truth"] is None and not (logged == "all" and rewards_complete(row)):
        needing = labels.needing_label(row["data_source"])
        if needing is not None:
            detail = f"no ground_truth / reward_model.ground_truth, which reward {needing!r} needs"
            return reject("missing_ground_truth", detail)
    row["messages"] = messages
    return None


def duplicate_reject(row: dict[str, Any]) -> Reject:
    """The reject of a later row with a prompt id a valid row before it has."""
    prompt_id = row["prompt_id"]
    return Reject(
        row["source_file"], row["source_row"], prompt_id, "duplicate_prompt_id", f"prompt_id {prompt_id!r} seen before"
    )


def prompt_messages(prompt: Any) -> tuple[list[dict[str, str]], tuple[str, str] | None]:
    """(the chat messages of a prompt cell, None) or ([], (reject reason, detail)).

    A number is not stringified into a prompt: a numeric prompt column is a mistake in the data, not a question.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            return [], ("empty_prompt", "prompt is empty or blank")
        return [{"role": "user", "content": prompt}], None
    if prompt is None:
        return [], ("empty_prompt", "prompt is null")
    if not isinstance(prompt, list):
        return [], (
            "bad_prompt",
            f"prompt is {type_phrase(prompt)} ({str(prompt)[:80]}); expected a string "
            f"or a list of {{role, content}} chat messages",
        )
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [], ("bad_messages", "prompt messages must be {role: str, content: str}")
    roles = sorted({m["role"] for m in prompt} - set(CHAT_ROLES))
    if roles:
        return [], ("bad_role", f"message role(s) {roles} are not one of {list(CHAT_ROLES)}")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt if m["content"].strip()]
    if not messages:
        return [], ("empty_prompt", "every prompt message is empty")
    return messages, None


def render_texts(
    conversations: list[list[dict[str, str]]], tokenizer, *, apply_template: bool, tools: Any = None
) -> list[str]:
    """The text the model is fed for each conversation: the chat template with the generation prompt (one call for
    all), or the messages' contents joined by newlines. ``tools``: the generate section, whose tools' schemas the
    template renders (generate.tools_in_prompt; batchrl.agents.prompt_tools)."""
    if not conversations:
        return []
    schemas = prompt_tool_schemas(tools) if apply_template and tools is not None else None
    if schemas:
        required = tools.tools_in_prompt == "always"
        return render_with_tools(conversations, tokenizer, schemas, required=required)
    if apply_template:
        return tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return ["\n".join(m["content"] for m in messages) for messages in conversations]


def encode(texts: list[str], tokenizer, *, add_special_tokens: bool) -> list[list[int]]:
    """The token ids of each text, in one call (a fast tokenizer encodes the batch in Rust). Only the ids are asked
    for: building the attention masks too cost a quarter of the encoding time."""
    if not texts:
        return []
    encoded = tokenizer(
        texts, add_special_tokens=add_special_tokens, return_attention_mask=False, return_token_type_ids=False
    )
    return encoded["input_ids"]


def tokenize_rows(rows: list[dict[str, Any]], tokenizer, *, apply_template: bool, tools: Any = None) -> None:
    """Sets prompt_text, messages_json and prompt_token_ids of validated rows: the texts are encoded in one call
    (the fast tokenizer's batch path). ``tools``: as `render_texts`."""
    texts = render_texts([row["messages"] for row in rows], tokenizer, apply_template=apply_template, tools=tools)
    token_ids = encode(texts, tokenizer, add_special_tokens=not apply_template)
    for row, text, ids in zip(rows, texts, token_ids):
        row["prompt_text"] = text
        row["messages_json"] = json.dumps(row["messages"], ensure_ascii=False)
        row["prompt_token_ids"] = ids


def fit_length(row: dict[str, Any], tokenizer, *, max_tokens: int, policy: str) -> Reject | None:
    """Rejects an overlong prompt, or truncates it (token ids and the text decoded from them)."""
    ids = row["prompt_token_ids"]
    if len(ids) <= max_tokens:
        return None
    if policy == "reject":
        return Reject(
            row["source_file"],
            row["source_row"],
            row["prompt_id"],
            "prompt_too_long",
            f"{len(ids)} tokens > data.max_prompt_tokens={max_tokens}",
        )
    row["prompt_token_ids"] = ids[-max_tokens:] if policy == "truncate_left" else ids[:max_tokens]
    row["prompt_text"] = tokenizer.decode(row["prompt_token_ids"], skip_special_tokens=False)
    row["truncated"] = True
    return None


def count_truncated(rows: list[dict[str, Any]], tokenizer: Callable[[], Any], *, cfg: PipelineConfig) -> int:
    """How many of these written prompt rows were truncated: those whose ids are exactly data.max_prompt_tokens
    long and whose messages encode to more (a row removed after it was written takes its count along).
    ``tokenizer()`` returns the tokenizer: it is loaded only when a row may have been truncated."""
    data = cfg.data
    full = [row for row in rows if len(row["prompt_token_ids"]) == data.max_prompt_tokens]
    if data.overlong_prompts == "reject" or not full:
        return 0
    tokenizer = tokenizer()
    conversations = [json.loads(row["messages_json"]) for row in full]
    texts = render_texts(conversations, tokenizer, apply_template=data.apply_chat_template, tools=cfg.generate)
    ids = encode(texts, tokenizer, add_special_tokens=not data.apply_chat_template)
    return sum(len(one) > data.max_prompt_tokens for one in ids)


def rewards_need_data_source(cfg: PipelineConfig, *, source: str | None = None) -> bool:
    """Whether each row's reward (of data.sources ``source``) is chosen by its data_source (no score.rewards terms,
    no reward model alone, no terms of its source's own)."""
    own = any(s.name == source and s.rewards for s in cfg.data.sources or [])
    return not own and not cfg.score.rewards and cfg.score.reward_model is None


def check_columns(
    uri: str,
    columns: set[str],
    *,
    needs_data_source: bool,
    needs_ground_truth: bool = True,
    needs_responses: bool = False,
    field: str = "data.train_files",
) -> None:
    """DataError naming the file (and ``field``, the config field that lists it) and the first required column it
    lacks (the ground truth only when every row needs one: LabelRule.every_row; the logged responses with
    generate.logged)."""
    layouts = (
        "use batchrl's layout (prompt, ground_truth[, data_source, prompt_id]) or verl's "
        "(prompt, reward_model.ground_truth, data_source)"
    )
    if "prompt" not in columns:
        missing, hint = "'prompt'", layouts
    elif needs_ground_truth and "ground_truth" not in columns and "reward_model" not in columns:
        missing, hint = (
            "'ground_truth' (or verl's 'reward_model')",
            f"{layouts}; every reward that runs needs it, unless marked @label_free (batchrl.rewards)",
        )
    elif needs_data_source and "data_source" not in columns:
        missing, hint = (
            "'data_source'",
            (
                "it chooses each row's reward while score.rewards is empty: add the column "
                "(e.g. openai/gsm8k) or list the rewards in score.rewards"
            ),
        )
    elif needs_responses and "responses" not in columns and "response" not in columns:
        missing, hint = (
            "'responses' (or 'response')",
            "generate.logged trains on the responses logged with each prompt: add them (a list of strings, or one "
            "string), or unset generate.logged to generate them",
        )
    else:
        return
    raise DataError(f"{field}: {uri} has no {missing} column (columns: {sorted(columns)}); {hint}")


def files_by_source(cfg: PipelineConfig) -> dict[str, str]:
    """The source of each input file of data.sources (expanded URI -> source name; {} without sources).
    ConfigError naming the field when a file is in two sources: its rows would be both's."""
    sources = tuple((s.name, tuple(s.files)) for s in cfg.data.sources or [])
    return dict(_owners(sources))


def source_of_file(cfg: PipelineConfig, uri: str) -> str | None:
    """The data.sources name of input file ``uri`` (None without sources, or for a file of no source: held-out)."""
    return files_by_source(cfg).get(uri) if cfg.data.sources else None


@functools.lru_cache(maxsize=4)  # once per worker and config: a glob or an s3:// prefix is listed once, not per chunk
def _owners(sources: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[tuple[str, str], ...]:
    owner: dict[str, str] = {}
    for index, (name, patterns) in enumerate(sources):
        field = f"data.sources[{index}].files"
        try:
            uris = expand_input_files(list(patterns), field=field)
        except StorageError as err:
            raise ConfigError(f"{err}; fix {field}") from None
        for uri in uris:
            if owner.setdefault(uri, name) != name:
                raise ConfigError(f"{field}: {uri} is in sources {owner[uri]!r} and {name!r}; list it in one")
    return tuple(owner.items())
