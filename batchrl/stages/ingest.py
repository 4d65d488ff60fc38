"""ingest: prompt Parquet files -> the validated, tokenized, sharded prompts table of the run.

Accepts two layouts, per file:
- batchrl's: ``prompt`` (string or chat messages), ``ground_truth``, optional ``data_source``, ``prompt_id``,
  ``extra_info``;
- verl's: ``data_source``, ``prompt`` (chat messages), ``reward_model.ground_truth``, ``extra_info``.
A missing ``prompt_id`` becomes ``<file stem>-<row>``. Bad rows are not dropped silently: each goes to the
rejects table (``prompts/_rejects/``) with a reason, and the counts go into the manifest.
Rows are re-sharded into parts of ``data.shard_size`` prompts, in input order, so shards are deterministic.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.config import ConfigError, PipelineConfig
from batchrl.pipeline.manifest import PartInfo
from batchrl.pipeline.schemas import load_schema
from batchrl.pipeline.stage import DataError, StageContext, StageOutput, register
from batchrl.storage import StorageError, expand_parquet_files, join, read_parquet, resolve, write_parquet_atomic
from batchrl.storage.layout import part_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reject:
    source_file: str
    source_row: int
    prompt_id: str | None
    reason: str
    detail: str


@register
class IngestStage:
    name = "ingest"
    table = "prompts"
    schema = "prompts"
    inputs: tuple[str, ...] = ()
    per_iteration = False

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {"data": cfg.data.model_dump(exclude_defaults=True), "tokenizer": cfg.model.tokenizer or cfg.model.path}

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: every input exists and has the needed columns (reads footers only)."""
        try:
            files = expand_parquet_files(cfg.data.train_files)
        except StorageError as err:
            raise ConfigError(f"{err}; fix data.train_files") from None
        for uri in files:
            try:
                fs, path = resolve(uri)
                with fs.open(path, "rb") as f:
                    columns = set(pq.read_schema(f).names)
            except (OSError, pa.ArrowInvalid) as err:
                raise ConfigError(f"data.train_files: {uri} is not a readable Parquet file ({err})") from None
            missing = _missing_columns(columns)
            if missing:
                raise ConfigError(f"data.train_files: {uri} has no {missing} column (columns: {sorted(columns)}); "
                                  f"use batchrl's layout (prompt, ground_truth[, data_source, prompt_id]) or "
                                  f"verl's (prompt, reward_model.ground_truth, data_source)")
        _check_model_path(cfg.model.tokenizer or cfg.model.path, field="model.tokenizer" if cfg.model.tokenizer else "model.path")

    def run(self, ctx: StageContext) -> StageOutput:
        cfg = ctx.cfg
        try:
            files = expand_parquet_files(cfg.data.train_files)
        except StorageError as err:
            raise DataError(str(err)) from None
        tokenizer = load_tokenizer(cfg)
        if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(f"the tokenizer of {cfg.model.tokenizer or cfg.model.path} has no chat template; "
                            f"set data.apply_chat_template: false to feed prompts as plain text")
        rows, rejects, seen, truncated = [], [], set(), 0
        for uri in files:
            for row in _normalized_rows(uri):
                reject = _validate(row, seen=seen)
                if reject is None:
                    _tokenize_into(row, tokenizer, apply_template=cfg.data.apply_chat_template)
                    reject = _fit_length(row, tokenizer, max_tokens=cfg.data.max_prompt_tokens,
                                         policy=cfg.data.overlong_prompts)
                    truncated += row.get("truncated", False)
                if reject is not None:
                    rejects.append(reject)
                    continue
                seen.add(row["prompt_id"])
                rows.append(row)
                if cfg.data.max_prompts is not None and len(rows) >= cfg.data.max_prompts:
                    break
            if cfg.data.max_prompts is not None and len(rows) >= cfg.data.max_prompts:
                break
        if not rows:
            raise DataError(f"no valid prompts in {len(files)} file(s): {len(rejects)} rejected "
                            f"({_reason_counts(rejects)}); check data.train_files and the column layout")
        output = _write(ctx.output_dir, rows, rejects, shard_size=cfg.data.shard_size)
        output.counts["truncated_prompts"] = truncated
        return output


def load_tokenizer(cfg: PipelineConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot load the tokenizer from {source!r} (model.tokenizer / model.path): "
                        f"{str(err).splitlines()[0]}") from None


def _normalized_rows(uri: str):
    try:
        table = read_parquet(uri)
    except StorageError as err:
        raise DataError(str(err)) from None
    columns = set(table.column_names)
    missing = _missing_columns(columns)
    if missing:
        raise DataError(f"{uri}: no {missing} column (columns: {sorted(columns)}); expected batchrl's layout "
                        f"(prompt, ground_truth[, data_source, prompt_id]) or verl's (prompt, reward_model, data_source)")
    stem = uri.rstrip("/").rsplit("/", 1)[-1].removesuffix(".parquet")
    for index, raw in enumerate(table.to_pylist()):
        reward_model = raw.get("reward_model") or {}
        ground_truth = raw.get("ground_truth", reward_model.get("ground_truth") if isinstance(reward_model, dict) else None)
        yield {
            "prompt_id": str(raw["prompt_id"]) if raw.get("prompt_id") is not None else f"{stem}-{index}",
            "data_source": str(raw.get("data_source") or "unknown"),
            "prompt": raw.get("prompt"),
            "ground_truth": None if ground_truth is None else str(ground_truth),
            "extra_info_json": json.dumps(raw["extra_info"], default=str) if raw.get("extra_info") is not None else None,
            "source_file": uri,
            "source_row": index,
        }


def _missing_columns(columns: set[str]) -> str | None:
    if "prompt" not in columns:
        return "'prompt'"
    if "ground_truth" not in columns and "reward_model" not in columns:
        return "'ground_truth' (or verl's 'reward_model')"
    return None


def _check_model_path(path: str, *, field: str) -> None:
    """A local checkpoint directory must exist; a hub id (org/name) is left to the loader."""
    if "://" in path or os.path.isdir(path):
        return
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ConfigError(f"{field}: {path!r} is neither a local checkpoint directory nor a hub id like "
                          f"Qwen/Qwen2.5-0.5B-Instruct; fix the path")


def _validate(row: dict[str, Any], *, seen: set[str]) -> Reject | None:
    def reject(reason: str, detail: str) -> Reject:
        return Reject(row["source_file"], row["source_row"], row["prompt_id"], reason, detail)

    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if prompt.strip() else []
    elif isinstance(prompt, list):
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in prompt):
            return reject("bad_messages", "prompt messages must be {role: str, content: str}")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt if m["content"].strip()]
    else:
        messages = []
    if not messages:
        return reject("empty_prompt", "prompt is null or empty")
    if row["ground_truth"] is None or not row["ground_truth"].strip():
        return reject("missing_ground_truth", "no ground_truth / reward_model.ground_truth")
    if row["prompt_id"] in seen:
        return reject("duplicate_prompt_id", f"prompt_id {row['prompt_id']!r} seen before")
    row["messages"] = messages
    return None


def _fit_length(row: dict[str, Any], tokenizer, *, max_tokens: int, policy: str) -> Reject | None:
    """Rejects an overlong prompt, or truncates it (token ids and the text decoded from them)."""
    ids = row["prompt_token_ids"]
    if len(ids) <= max_tokens:
        return None
    if policy == "reject":
        return Reject(row["source_file"], row["source_row"], row["prompt_id"], "prompt_too_long",
                      f"{len(ids)} tokens > data.max_prompt_tokens={max_tokens}")
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
        chunk = rows[start:start + shard_size]
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
        logger.warning("ingest rejected %d row(s): %s (see %s)", len(rejects), _reason_counts(rejects),
                       join(output_dir, reject_name))
    return StageOutput(parts=parts, counts=counts,
                       extra_parts={"rejects": [PartInfo(reject_name, len(rejects), digest, num_bytes)]})


def _reason_counter(rejects: list[Reject]) -> dict[str, int]:
    counter: dict[str, int] = {}
    for r in rejects:
        counter[r.reason] = counter.get(r.reason, 0) + 1
    return counter


def _reason_counts(rejects: list[Reject]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(_reason_counter(rejects).items())) or "none"
