"""ingest: prompt Parquet files -> the validated, tokenized, sharded prompts table of the run.

Accepts two layouts, per file:
- batchrl's: ``prompt`` (string or chat messages), ``ground_truth``, optional ``data_source``, ``prompt_id``,
  ``extra_info``;
- verl's: ``data_source``, ``prompt`` (chat messages), ``reward_model.ground_truth``, ``extra_info``.
A missing ``prompt_id`` becomes ``<file stem>-<row>``; a missing ``data_source`` becomes ``unknown``, which is
allowed only when the config does not choose rewards by data_source (score.rewards or a reward model alone):
otherwise a file without the column is a data error, raised before anything is written. A numeric ground truth
is written as text without a spurious ``.0`` (see ground_truth_text). Bad rows are not dropped silently: each goes
to the rejects table (``prompts/_rejects/``) with a reason (empty_prompt, bad_prompt, bad_messages, bad_role,
bad_ground_truth, missing_ground_truth, duplicate_prompt_id, prompt_too_long), and the counts go into the manifest.
An unreadable file, or one without a required column, stops the stage (DataError, exit 3) before it writes a part.
Rows are re-sharded into parts of ``data.shard_size`` prompts, in input order, so shards are deterministic.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.config import ConfigError, PipelineConfig
from batchrl.errors import DataError
from batchrl.pipeline.stage import Stage, StageContext, StageOutput, register
from batchrl.storage import (
    StorageError,
    expand_parquet_files,
    is_local,
    join,
    read_parquet,
    resolve,
    write_parquet_atomic,
)
from batchrl.storage.layout import part_name
from batchrl.storage.manifest import PartInfo
from batchrl.storage.schemas import load_schema
from batchrl.storage.sources import check_checkpoint_source

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render (OpenAI's, verl's data)
HUB_EXAMPLE = "Qwen/Qwen2.5-0.5B-Instruct"


@dataclass(frozen=True)
class Reject:
    source_file: str
    source_row: int
    prompt_id: str | None
    reason: str
    detail: str


@register
class IngestStage(Stage):
    name = "ingest"
    table = "prompts"
    schema = "prompts"
    per_iteration = False
    reads_train_files = True

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        return [("data.train_files", uri) for uri in cfg.data.train_files]

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        data = cfg.data.model_dump(exclude_defaults=True, exclude={"prompts_per_iteration"})  # read by generate
        return {"data": data, "tokenizer": cfg.model.tokenizer or cfg.model.path}

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: the inputs exist, local ones are Parquet files with the needed columns and
        not all empty (footers only: a handful of local files costs little, while an object-store prefix of many
        files would be read twice, so those are checked as ingest reads them, before it writes a part), and the
        model and tokenizer can be found."""
        try:
            files = expand_parquet_files(cfg.data.train_files)
        except StorageError as err:
            raise ConfigError(f"{err}; fix data.train_files") from None
        local = [uri for uri in files if is_local(uri)]
        num_rows = 0
        for uri in local:
            columns, rows = _read_footer(uri)
            _check_columns(uri, columns, needs_data_source=rewards_need_data_source(cfg))
            num_rows += rows
        if local and len(local) == len(files) and num_rows == 0:
            raise DataError(f"data.train_files: every input file is empty (0 rows): {_listing(files)}")
        model = cfg.model
        check_checkpoint_source(model.path, field="model.path", example=HUB_EXAMPLE)
        if model.tokenizer is not None:
            check_checkpoint_source(model.tokenizer, field="model.tokenizer", example=HUB_EXAMPLE)

    def run(self, ctx: StageContext) -> StageOutput:
        cfg = ctx.cfg
        try:
            files = expand_parquet_files(cfg.data.train_files)
        except StorageError as err:
            raise DataError(str(err)) from None
        tokenizer = load_tokenizer(cfg)
        if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tokenizer of {cfg.model.tokenizer or cfg.model.path} has no chat template; "
                f"set data.apply_chat_template: false to feed prompts as plain text"
            )
        rows, rejects, truncated, empty_files = _read_prompts(files, tokenizer, cfg)
        if not rows:
            empty = f"; with no rows: {_listing(empty_files)}" if empty_files else ""
            raise DataError(
                f"no valid prompts in {_listing(files)}: {len(rejects)} row(s) rejected "
                f"({_reason_counts(rejects)}){empty}; check data.train_files and the column layout"
            )
        output = _write(ctx.output_dir, rows, rejects, shard_size=cfg.data.shard_size)
        output.counts["truncated_prompts"] = truncated
        return output


def _read_prompts(files: list[str], tokenizer, cfg: PipelineConfig) -> tuple[list[dict], list[Reject], int, list[str]]:
    """(valid tokenized rows, rejects, number truncated, files without rows), in input order, up to data.max_prompts."""
    rows, rejects, seen, truncated, empty_files = [], [], set(), 0, []
    needs_data_source = rewards_need_data_source(cfg)
    for uri in files:
        num_read = 0
        for row in _normalized_rows(uri, needs_data_source=needs_data_source):
            num_read += 1
            reject = _validate(row, seen=seen)
            if reject is None:
                _tokenize_into(row, tokenizer, apply_template=cfg.data.apply_chat_template)
                reject = _fit_length(
                    row, tokenizer, max_tokens=cfg.data.max_prompt_tokens, policy=cfg.data.overlong_prompts
                )
                truncated += row.get("truncated", False)
            if reject is not None:
                rejects.append(reject)
                continue
            seen.add(row["prompt_id"])
            rows.append(row)
            if cfg.data.max_prompts is not None and len(rows) >= cfg.data.max_prompts:
                return rows, rejects, truncated, empty_files
        if num_read == 0:
            logger.warning("ingest: %s has no rows", uri)
            empty_files.append(uri)
    return rows, rejects, truncated, empty_files


def load_tokenizer(cfg: PipelineConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise DataError(
            f"cannot load the tokenizer from {source!r} (model.tokenizer / model.path): {str(err).splitlines()[0]}"
        ) from None


def _normalized_rows(uri: str, *, needs_data_source: bool):
    try:
        table = read_parquet(uri)
    except StorageError as err:
        raise DataError(str(err)) from None
    _check_columns(uri, set(table.column_names), needs_data_source=needs_data_source)
    stem = uri.rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
    for index, raw in enumerate(table.to_pylist()):
        reward_model = raw.get("reward_model") or {}
        ground_truth = raw.get(
            "ground_truth", reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        )
        ground_truth, ground_truth_problem = ground_truth_text(ground_truth)
        yield {
            "prompt_id": str(raw["prompt_id"]) if raw.get("prompt_id") is not None else f"{stem}-{index}",
            "data_source": str(raw.get("data_source") or "unknown"),
            "prompt": raw.get("prompt"),
            "ground_truth": ground_truth,
            "ground_truth_problem": ground_truth_problem,
            "extra_info_json": json.dumps(raw["extra_info"], default=str)
            if raw.get("extra_info") is not None
            else None,
            "source_file": uri,
            "source_row": index,
        }


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


def _read_footer(uri: str) -> tuple[set[str], int]:
    """(column names, number of rows) from a Parquet file's footer; DataError naming the file if unreadable."""
    try:
        fs, path = resolve(uri)
        with fs.open(path, "rb") as f:
            metadata = pq.read_metadata(f)
    except (OSError, pa.ArrowInvalid) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.train_files: {uri} is not a readable Parquet file ({reason})") from None
    return set(metadata.schema.to_arrow_schema().names), metadata.num_rows


def rewards_need_data_source(cfg: PipelineConfig) -> bool:
    """Whether each row's reward is chosen by its data_source (no score.rewards terms, no reward model alone)."""
    return not cfg.score.rewards and cfg.score.reward_model is None


def _check_columns(uri: str, columns: set[str], *, needs_data_source: bool) -> None:
    """DataError naming the file and the first required column it lacks."""
    layouts = (
        "use batchrl's layout (prompt, ground_truth[, data_source, prompt_id]) or verl's "
        "(prompt, reward_model.ground_truth, data_source)"
    )
    if "prompt" not in columns:
        missing, hint = "'prompt'", layouts
    elif "ground_truth" not in columns and "reward_model" not in columns:
        missing, hint = "'ground_truth' (or verl's 'reward_model')", layouts
    elif needs_data_source and "data_source" not in columns:
        missing, hint = (
            "'data_source'",
            (
                "it chooses each row's reward while score.rewards is empty: add the column "
                "(e.g. openai/gsm8k) or list the rewards in score.rewards"
            ),
        )
    else:
        return
    raise DataError(f"data.train_files: {uri} has no {missing} column (columns: {sorted(columns)}); {hint}")


def _listing(uris: list[str], *, limit: int = 3) -> str:
    more = f" and {len(uris) - limit} more" if len(uris) > limit else ""
    return ", ".join(uris[:limit]) + more


def _validate(row: dict[str, Any], *, seen: set[str]) -> Reject | None:
    def reject(reason: str, detail: str) -> Reject:
        return Reject(row["source_file"], row["source_row"], row["prompt_id"], reason, detail)

    messages, problem = prompt_messages(row["prompt"])
    if problem is not None:
        return reject(*problem)
    if row["ground_truth_problem"] is not None:
        return reject("bad_ground_truth", row["ground_truth_problem"])
    if row["ground_truth"] is None or not row["ground_truth"].strip():
        return reject("missing_ground_truth", "no ground_truth / reward_model.ground_truth")
    if row["prompt_id"] in seen:
        return reject("duplicate_prompt_id", f"prompt_id {row['prompt_id']!r} seen before")
    row["messages"] = messages
    return None


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
            f"prompt is a {type(prompt).__name__} ({str(prompt)[:80]}); expected a string "
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


def _fit_length(row: dict[str, Any], tokenizer, *, max_tokens: int, policy: str) -> Reject | None:
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


def _tokenize_into(row: dict[str, Any], tokenizer, *, apply_template: bool) -> None:
    if apply_template:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in row["messages"])
    row["prompt_text"] = text
    row["messages_json"] = json.dumps(row["messages"], ensure_ascii=False)
    row["prompt_token_ids"] = tokenizer(text, add_special_tokens=not apply_template)["input_ids"]


def _write(output_dir: str, rows: list[dict], rejects: list[Reject], *, shard_size: int) -> StageOutput:
    schema = load_schema("prompts")
    parts = []
    for shard_index, start in enumerate(range(0, len(rows), shard_size)):
        chunk = rows[start : start + shard_size]
        table = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in chunk], schema=schema)
        name = part_name(shard_index)
        num_bytes, digest = write_parquet_atomic(table, join(output_dir, name))
        parts.append(PartInfo(name=name, rows=table.num_rows, sha256=digest, num_bytes=num_bytes))
    reject_schema = load_schema("prompt_rejects")
    reject_table = pa.Table.from_pylist([r.__dict__ for r in rejects], schema=reject_schema)
    reject_name = "_rejects/" + part_name(0)
    num_bytes, digest = write_parquet_atomic(reject_table, join(output_dir, reject_name))
    counts = {"prompts": len(rows), "rejected": len(rejects)}
    counts.update({f"rejected/{reason}": n for reason, n in _reason_counter(rejects).items()})
    for row in rows:
        key = f"data_source/{row['data_source']}"
        counts[key] = counts.get(key, 0) + 1
    if rejects:
        logger.warning(
            "ingest rejected %d row(s): %s (see %s)",
            len(rejects),
            _reason_counts(rejects),
            join(output_dir, reject_name),
        )
    return StageOutput(
        parts=parts, counts=counts, extra_parts={"rejects": [PartInfo(reject_name, len(rejects), digest, num_bytes)]}
    )


def _reason_counter(rejects: list[Reject]) -> dict[str, int]:
    counter: dict[str, int] = {}
    for r in rejects:
        counter[r.reason] = counter.get(r.reason, 0) + 1
    return counter


def _reason_counts(rejects: list[Reject]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(_reason_counter(rejects).items())) or "none"
