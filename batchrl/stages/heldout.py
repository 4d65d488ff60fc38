"""heldout: ``evaluate.files`` -> the held-out prompts table (``evaluation_prompts/``), once per run.

Why a stage of its own: the evaluate stage used to ingest its prompts at every evaluation, by building an ingest
stage and a context by hand and rewriting its error messages, and wrote their rejects where no manifest listed them
(so `batchrl inspect` said "no manifest" there). Now they are ingested once, before any iteration, with the ingest
stage's own functions (same validation, chat template and tokenizer as training prompts, and the same journal to
resume from), into a table with its manifest and its rejects side table (``evaluation_prompts/_rejects``), and the
evaluate stage reads that table. Its errors name ``evaluate.files``, the list the user wrote.

With data.sources' ``eval_files`` the table also holds each source's held-out prompts, their ``source`` set to its
name and their parts under a directory of that name (as ingest does for training sources); the rows of
``evaluate.files`` have no source, as before. The evaluate stage reports the sourced rows per source too.

Departures from the ingest of training prompts: plain prompts even when training is on logged data (the policy
answers them), ``evaluate.max_prompts`` in place of ``data.max_prompts``, and no narrowing to new files
(``run.new_files_only`` concerns the training files).

Its fingerprint is made of fields the evaluate stage fingerprints too (``heldout_fingerprint_config``), and the
evaluate stage leaves this table out of its own fingerprint (``covered_inputs``): a change that re-ingests the
held-out prompts re-evaluates through evaluate's own config, and the evaluations made before this table existed
kept their fingerprints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchrl.agents.prompt_tools import tool_schema_fingerprint
from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.models import fingerprint_dump
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.rewards import reward_code
from batchrl.stages.ingest import check_prompt_files, ingest_prompt_files
from batchrl.stages.score_sources import source_rewards_fingerprint
from batchrl.storage import expand_input_files

FIELD = "evaluate.files"


@register
class HeldOutStage(Stage):
    name = "heldout"
    table = "evaluation_prompts"
    schema = "prompts"
    per_iteration = False
    resumes_from_journal = True  # as ingest: its chunks' records say what is done
    config_section = "evaluate"

    def planned_iterations(self, cfg: PipelineConfig) -> list[int | None]:
        return [None] if cfg.evaluate is not None else []  # what the evaluate stage reads, when it runs

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        if cfg.evaluate is None:
            return []
        sourced = [(eval_files_field(name), uri) for name, files in cfg.eval_files_by_source().items() for uri in files]
        return [(FIELD, uri) for uri in cfg.evaluate.files] + sourced

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [ActorNeed.of(cfg.data, field="data")]  # the ingest actors

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return heldout_fingerprint_config(cfg)

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: the held-out files are readable prompt tables."""
        if cfg.evaluate is None:
            return
        heldout = heldout_config(cfg)
        lists = {FIELD: list(cfg.evaluate.files)}
        lists |= {eval_files_field(name): files for name, files in cfg.eval_files_by_source().items()}
        owner: dict[str, str] = {}
        for field, files in lists.items():  # each list on its own: an error names the field that lists the file
            if not files:
                continue
            data = heldout.data.model_copy(update={"train_files": files})
            check_prompt_files(heldout.model_copy(update={"data": data}), field=field)
            for uri in expand_input_files(files, field=field):  # its rows would be ingested twice
                if owner.setdefault(uri, field) != field:
                    raise ConfigError(f"{field}: {uri} is listed in {owner[uri]} too; list it in one of them")

    def run(self, ctx: StageContext) -> StageOutput:
        if ctx.cfg.evaluate is None:
            raise AssertionError("the heldout stage was planned for a config without an evaluate: section")
        field = f"{FIELD} or data.sources[].eval_files" if ctx.cfg.eval_files_by_source() else FIELD
        return ingest_prompt_files(dataclasses.replace(ctx, cfg=heldout_config(ctx.cfg)), field=field)


def eval_files_field(source: str) -> str:
    return f"data.sources[{source}].eval_files"


def heldout_config(cfg: PipelineConfig) -> PipelineConfig:
    """The run's config as the ingest functions read it for the held-out prompts: data.train_files and
    data.max_prompts are evaluate's, and plain prompts even when training is on logged data. With sources' eval_files,
    data.train_files is evaluate.files then those, and data.sources the sources with eval_files, each with them as its
    files (``ingest_rows.source_of_file`` then tags their rows); without, data.sources is left as it was."""
    by_source = cfg.eval_files_by_source()
    update: dict[str, Any] = {"train_files": list(cfg.evaluate.files), "max_prompts": cfg.evaluate.max_prompts}
    if by_source:
        update["train_files"] += [uri for files in by_source.values() for uri in files]
        sources = [s.model_copy(update={"files": by_source[s.name]}) for s in cfg.data.sources if s.name in by_source]
        update["sources"] = sources
    data = cfg.data.model_copy(update=update)
    return cfg.model_copy(update={"data": data, "generate": cfg.generate.model_copy(update={"logged": None})})


def heldout_fingerprint_config(cfg: PipelineConfig) -> dict[str, Any]:
    """What determines the held-out prompts table, each a field the evaluate stage's fingerprint holds as well: the
    files and how many prompts (in its ``evaluate``), the tokenizer and the template and length rules, and the score
    config with the custom rewards' code (which rows need a label or a data_source), and what becomes of an
    overlong prompt (`overlong_prompts`). data.shard_size is not among them: it lays the table out in parts and
    changes no row (so changing it keeps the held-out table, and every evaluation's fingerprint)."""
    e = cfg.evaluate
    code = reward_code(cfg.score)
    return (
        ({"reward_code": code} if code else {})
        | overlong_prompts(cfg)
        | {
            "files": None if e is None else list(e.files),
            "max_prompts": None if e is None else e.max_prompts,
            "score": fingerprint_dump(cfg.score),  # as it always was, less its Placement fields
            "tokenizer": cfg.model.tokenizer or cfg.model.path,
            "max_prompt_tokens": cfg.data.max_prompt_tokens,
            "apply_chat_template": cfg.data.apply_chat_template,
        }
        | tool_schema_fingerprint(cfg)  # with tools, the schemas templated into the prompts
        | eval_files_fingerprint(cfg)
    )


def eval_files_fingerprint(cfg: PipelineConfig) -> dict[str, Any]:
    """data.sources' eval_files for the fingerprints of heldout and evaluate, with the sources' own rewards (which of
    their rows need a label, as score's for the others); empty without, so that those are as before."""
    by_source = cfg.eval_files_by_source()
    return ({"source_eval_files": by_source} | source_rewards_fingerprint(cfg)) if by_source else {}


def overlong_prompts(cfg: PipelineConfig) -> dict[str, Any]:
    """data.overlong_prompts for the fingerprints of heldout and evaluate when it is not the default: truncating
    instead of rejecting keeps other held-out prompts. Left out at the default, as it was before it counted here (an
    evaluation made then was made with the default), so those fingerprints stay as they were."""
    rule = cfg.data.overlong_prompts
    return {} if rule == "reject" else {"overlong_prompts": rule}
