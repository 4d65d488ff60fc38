"""evaluate: held-out prompts + a policy -> one result row per prompt, and val-core/* metrics per data_source.

Why a stage: "does reward go up" must be answered on prompts the run never trains on, with the same engines
and rewards as training, and the answer must be a table one can inspect (which prompts flipped), not only a
number. The stage reads the held-out prompts that the heldout stage ingested once per run from ``evaluate.files``
(``evaluation_prompts/``: same validation, chat template and tokenizer as training prompts), generates with the
run's engine pool (``StageContext.engines``, the generate stage's actors: no second engine is built, and
evaluating the policy that the next iteration generates with costs no extra weight push), and scores with the
score stage's workers and ``score`` config. Its manifest's ``stats`` hold the metrics; the evaluation table holds
every response, reward and extracted answer.

It runs for ``iteration=None`` on the initial policy (before iteration 0) and for iteration i on the policy
that iteration i's update wrote; ``ctx.policy_in`` is the policy evaluated (see ``evaluated_iterations``).

Metrics, named as verl's validation (``val-core/<data_source>/reward/<metric>``; aux ones under ``val-aux/``):
mean@1 (greedy), mean@k, pass@k (reward >= ``evaluate.pass_threshold``) and maj@k, computed by
batchrl.algorithms.evaluation, whose docstring lists them and their departures from verl. For maj@k, answers
are extracted as the row's first reward reads them: ``#### n`` for gsm8k, the last ``\\boxed{}`` for math,
else the stripped response. Held-out rows of a data.sources entry's eval_files (``source`` set by the heldout
stage) are scored by that source's own terms, as in training, and reported again per source as
``val-source/<source>/reward/<metric>`` (aux: ``val-source-aux/<source>/...``), the same metrics over its rows
alone; val-core stays per data_source over every row. Sampled responses use the same seeds for every policy
evaluated (common random numbers), so a change between two evaluations is the policy's, not the dice's. With tools
or an environment, the held-out samples' (greedy and sampled together) tool use is generate's tools/* or
environment/* metrics under ``val-aux/`` (`loop_stats`: val-aux/tools/use_rate, val-aux/tools/turns_mean, ...),
from the shards' counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.agents.columns import tool_stats
from batchrl.agents.environment import environment_stats
from batchrl.algorithms.batches import Slice
from batchrl.algorithms.evaluation import evaluation_metrics, majority_vote
from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.models import fingerprint_dump
from batchrl.pipeline.shards import ShardRun, add_counts, part_info, process_in_driver, run_sharded
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.rewards import reward_code, reward_name_for
from batchrl.stages.generate_jobs import part_pieces
from batchrl.stages.heldout import eval_files_fingerprint, overlong_prompts, tool_schema_fingerprint
from batchrl.stages.score_sources import source_rewards_fingerprint
from batchrl.storage import join, read_parquet, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import load_schema

logger = logging.getLogger(__name__)

EVAL_SEED_ITERATION = -1  # sampled eval responses: seeds from (run seed, -1, prompt_id, sample_idx), every policy
MODES = ("greedy", "sampled")


def evaluated_iterations(cfg: PipelineConfig) -> list[int | None]:
    """Where the evaluate stage runs: None (the initial policy) and the iterations whose policy is evaluated."""
    e = cfg.evaluate
    if e is None:
        return []
    last = cfg.run.iterations - 1
    after = [i for i in range(cfg.run.iterations) if (i + 1) % e.every == 0 or i == last]
    return ([None] if e.before_training else []) + after


@register
class EvaluateStage(Stage):
    name = "evaluate"
    table = "evaluation"
    schema = "evaluations"
    # the held-out prompts, and the policy EVALUATED: the initial one (iteration None) or iteration i's output
    inputs = ("evaluation_prompts", "policy")
    # made from fields fingerprint_config holds (heldout_fingerprint_config): evaluations made before the held-out
    # prompts were a table of their own keep their fingerprints
    covered_inputs = ("evaluation_prompts",)
    reads_policy = "new"  # at iteration i, "policy" is what iteration i's update wrote (not what it started from)
    config_section = "evaluate"
    timing_name = "eval"
    in_step_time = False
    summary_key = "evaluations"

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        from batchrl.stages.generate import generation_actor_need
        from batchrl.stages.score import reward_model_actor_need

        # the engines and the reward models it uses: the generate and score stages' actors
        reward_models = [] if cfg.score.reward_model is None else [reward_model_actor_need(cfg)]
        return [generation_actor_need(cfg), *reward_models]

    def planned_iterations(self, cfg: PipelineConfig) -> list[int | None]:
        return evaluated_iterations(cfg)

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        from batchrl.stages.generate import agent_code, loop_settings
        from batchrl.stages.generate_adapter import push_fingerprint

        e = cfg.evaluate
        code = reward_code(cfg.score)  # editing a custom reward's module re-evaluates
        return (
            ({"reward_code": code} if code else {})
            | overlong_prompts(cfg)
            | {
                "evaluate": None if e is None else fingerprint_dump(e),
                "max_new_tokens": None if e is None else max_new_tokens(cfg),
                "score": fingerprint_dump(cfg.score),  # as it always was, less its Placement fields
                "tokenizer": cfg.model.tokenizer or cfg.model.path,
                "max_prompt_tokens": cfg.data.max_prompt_tokens,
                "apply_chat_template": cfg.data.apply_chat_template,
                "engine": cfg.generate.engine,
                "stop": list(cfg.generate.stop),
                "dtype": cfg.model.dtype,
                "seed": cfg.run.seed,
            }
            # with tools or an environment the held-out samples are conversations too (absent without: as they were)
            | ({"tools": loop_settings(cfg.generate)} if loop_settings(cfg.generate) else {})
            | tool_schema_fingerprint(cfg)  # as the held-out prompts' (heldout_fingerprint_config)
            | agent_code(cfg)  # editing a user tool or the environment re-evaluates, as it regenerates
            | push_fingerprint(cfg)  # update.lora.push: adapter, as generate's (absent with the merged push)
            # data.sources' own rewards and eval sets (absent without: as they were)
            | source_rewards_fingerprint(cfg)
            | eval_files_fingerprint(cfg)
        )

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: the evaluation fits the engines' budget (the heldout stage checks the files)."""
        if cfg.evaluate is None:
            return
        e, g = cfg.evaluate, cfg.generate
        if e.max_new_tokens is not None and e.max_new_tokens > g.max_new_tokens and g.max_model_len is None:
            raise ConfigError(
                f"evaluate.max_new_tokens={e.max_new_tokens} exceeds generate.max_new_tokens="
                f"{g.max_new_tokens}, which sizes the shared engines; lower it or raise "
                "generate.max_new_tokens"
            )

    def run(self, ctx: StageContext) -> StageOutput:
        cfg = ctx.cfg
        if cfg.evaluate is None:
            raise AssertionError("the evaluate stage was planned for a config without an evaluate: section")
        prompts_dir, prompts = ctx.input_dirs["evaluation_prompts"], ctx.inputs["evaluation_prompts"]
        rollouts, rollout_counts, pieces = generate_eval_rollouts(ctx, prompts_dir, prompts)
        scores_dir = join(ctx.output_dir, "_scores")
        score_parts = score_eval_rollouts(
            cfg, join(ctx.output_dir, "_rollouts"), rollouts, scores_dir, embedded_ray=ctx.embedded_ray
        )
        extract = answer_extractor(cfg)
        parts, tables = [], []
        for part in prompts.parts:
            names = [name for name, _ in pieces[part.name]]  # the part, or its row ranges in order
            table = evaluation_table(
                _scored(scores_dir, "greedy", names, cfg),
                _scored(scores_dir, "sampled", names, cfg),
                policy=ctx.policy_in,
                extract_answer=extract,
            )
            num_bytes, digest = write_parquet_atomic(table, join(ctx.output_dir, part.name))
            parts.append(PartInfo(name=part.name, rows=table.num_rows, sha256=digest, num_bytes=num_bytes))
            tables.append(table)
        results = pa.concat_tables(tables)
        stats = evaluation_metrics_from_table(results, pass_threshold=cfg.evaluate.pass_threshold)
        stats |= loop_stats(rollout_counts)
        logger.info("evaluated %s on %d held-out prompts: %s", ctx.policy_in, results.num_rows, headline(stats))
        extra = {"rollouts": rollouts.parts, "scores": score_parts}
        return StageOutput(
            parts=parts,
            counts=_counts(results),
            stats=stats,
            extra_parts={k: [_prefixed(p, f"_{k}/") for p in v] for k, v in extra.items()},
        )


# ------------------------------------------------------------------------------------------ steps


def max_new_tokens(cfg: PipelineConfig) -> int:
    return cfg.evaluate.max_new_tokens or cfg.generate.max_new_tokens


def generate_eval_rollouts(
    ctx: StageContext, prompts_dir: str, prompts: Manifest
) -> tuple[Manifest, list[dict[str, float]], dict[str, list[tuple[str, Slice]]]]:
    """Greedy and sampled rollouts of every prompt part, as ``_rollouts/{greedy,sampled}-part-*.parquet``, each
    shard's counts (generate's: samples, and the loop's with tools or an environment), and the pieces each part was
    generated in (`part_pieces`: a part cut into row ranges so that every live engine has work)."""
    from batchrl.stages.generate import ShardSettings, engine_actors, generate_shards, loop_settings

    cfg, e = ctx.cfg, ctx.cfg.evaluate
    # Any live pool of this engine, whatever its size, else one of full size (generate.num_actors), not sized to the
    # eval shards: the generate stage then finds these engines and reuses them instead of rebuilding them.
    actors = engine_actors(ctx, num_actors=1, build_actors=cfg.generate.num_actors)
    modes = {
        "greedy": (1, {"temperature": 0.0, "top_p": 1.0}) if e.greedy else None,
        "sampled": (e.num_samples, {"temperature": e.temperature, "top_p": e.top_p}) if e.num_samples else None,
    }
    pieces = part_pieces([(p.name, p.rows) for p in prompts.parts], len(actors))
    parts, counts = [], []
    for mode, setting in modes.items():
        if setting is None:
            continue
        num_samples, sampling = setting
        settings = ShardSettings(
            policy=ctx.policy_in,
            num_samples_per_prompt=num_samples,
            run_seed=cfg.run.seed,
            iteration=EVAL_SEED_ITERATION,
            sampling=sampling | {"top_k": -1, "max_new_tokens": max_new_tokens(cfg), "stop": tuple(cfg.generate.stop)},
            **loop_settings(cfg.generate),  # with tools, held-out samples run the agent loop as training's do
        )
        jobs = [
            {
                "input_uri": join(prompts_dir, part),
                "output_uri": join(ctx.output_dir, "_rollouts", f"{mode}-{name}"),
                "name": f"{mode}-{name}",
            }
            | ({} if piece.row_ids is None else {"row_ids": list(piece.row_ids)})
            for part, cut in pieces.items()
            for name, piece in cut
        ]
        for row in generate_shards(actors, jobs, settings, timeout_s=cfg.generate.shard_timeout_s, progress_bars=False):
            parts.append(part_info(row))
            counts.append(json.loads(row["counts_json"]))
    ctx.engines.end_stage(cfg.generate.engine_lifetime)
    return _manifest(sorted(parts, key=lambda p: p.name), schema="rollouts"), counts, pieces


def score_eval_rollouts(
    cfg: PipelineConfig, rollouts_dir: str, rollouts: Manifest, scores_dir: str, *, embedded_ray: bool = False
) -> list[PartInfo]:
    """Scores with the score stage's worker and config: in this process for rule rewards, on actors with a
    reward model (which may need a GPU).

    Why in process: an evaluation is a few hundred samples, and a Ray Data actor pool needs a free CPU while
    the engine actors hold theirs; measured on 2 cores, a pool started right after the score stage's sometimes
    waited forever for a CPU that the previous pool's actor had not yet released.
    """
    from batchrl.stages.score import ScoreStage, ScoreWorker

    if cfg.score.reward_model is not None:
        rm = cfg.score.reward_model
        parts, _ = run_sharded(
            ShardRun(
                rollouts_dir,
                rollouts,
                scores_dir,
                description="evaluate: score",
                progress_bars=False,
                embedded_ray=embedded_ray,
            ),
            worker_cls=ScoreWorker,
            worker_kwargs=ScoreStage.reward_kwargs(cfg, judged=False),
            actors=rm,
        )
        return parts
    jobs = [
        {
            "input_uri": join(rollouts_dir, p.name),
            "output_uri": join(scores_dir, p.name),
            "name": p.name,
            "input_sha256": p.sha256,
        }
        for p in rollouts.parts
    ]
    return [part_info(row) for row in process_in_driver(ScoreWorker, ScoreStage.reward_kwargs(cfg, judged=False), jobs)]


def _scored(scores_dir: str, mode: str, names: list[str], cfg: PipelineConfig) -> pa.Table | None:
    """A held-out part's scored rollouts of ``mode``: its pieces' (``names``), in row order."""
    enabled = cfg.evaluate.greedy if mode == "greedy" else cfg.evaluate.num_samples > 0
    return pa.concat_tables([read_parquet(join(scores_dir, f"{mode}-{name}")) for name in names]) if enabled else None


def _manifest(parts: list[PartInfo], *, schema: str) -> Manifest:
    return Manifest(
        stage="evaluate",
        table="",
        iteration=None,
        fingerprint="",
        parts=parts,
        schema=schema,
        started_at=0.0,
        finished_at=0.0,
    )


def _prefixed(part: PartInfo, prefix: str) -> PartInfo:
    return PartInfo(name=prefix + part.name, rows=part.rows, sha256=part.sha256, num_bytes=part.num_bytes)


# ------------------------------------------------------------------------------------- answers


def answer_extractor(cfg: PipelineConfig) -> Callable[[str, str, str | None], str | None]:
    """(response, data_source, source) -> the answer the row's first reward reads (its source's own first term, else
    score.rewards' first, else its data_source's default), for majority voting."""
    from batchrl.rewards.boxed import last_boxed_content
    from batchrl.rewards.gsm8k import extract_gsm8k_answer

    readers: dict[str, Callable[[str], str | None]] = {
        "gsm8k": lambda text: extract_gsm8k_answer(text, method="strict"),
        "gsm8k_flexible": lambda text: extract_gsm8k_answer(text, method="flexible"),
        "math": last_boxed_content,
    }
    first_term = cfg.score.rewards[0].reward if cfg.score.rewards else None
    source_first = {s.name: s.rewards[0].reward for s in cfg.data.sources or [] if s.rewards}

    def extract(response: str, data_source: str, source: str | None = None) -> str | None:
        try:
            reward = source_first.get(source) or first_term
            reward = reward or reward_name_for(data_source, overrides=cfg.score.reward_by_data_source)
        except ValueError:
            reward = None
        reader = readers.get(reward)
        answer = reader(response) if reader is not None else response.strip()
        return answer.strip() if answer and answer.strip() else None

    return extract


# ------------------------------------------------------------------------------------- results


def evaluation_table(
    greedy: pa.Table | None,
    sampled: pa.Table | None,
    *,
    policy: str,
    extract_answer: Callable[[str, str, str | None], str | None],
) -> pa.Table:
    """One row per prompt from the scored greedy and sampled rollouts of one prompt part (same rows, same order)."""
    base = greedy if greedy is not None else sampled
    columns = base.select(["prompt_id", "data_source", "prompt_text", "ground_truth"]).to_pydict()
    num_rows = base.num_rows
    # data.sources' name of a row of a source's eval_files (null for evaluate.files' rows)
    columns["source"] = base.column("source").to_pylist() if "source" in base.column_names else [None] * num_rows
    keys = list(zip(columns["data_source"], columns["source"]))  # what picks a row's reward, and its answer
    out: dict[str, list] = dict(columns, policy=[policy] * num_rows)
    if greedy is not None:
        g = greedy.select(["response_texts", "scores", "response_lengths", "score_errors"]).to_pydict()
        out["greedy_response"] = [texts[0] for texts in g["response_texts"]]
        out["greedy_score"] = [scores[0] for scores in g["scores"]]
        out["greedy_answer"] = [extract_answer(t, *key) for t, key in zip(out["greedy_response"], keys)]
        out["greedy_length"] = [lengths[0] for lengths in g["response_lengths"]]
        errors = [[e[0]] for e in g["score_errors"]]
    else:
        for name in ("greedy_response", "greedy_score", "greedy_answer", "greedy_length"):
            out[name] = [None] * num_rows
        errors = [[None] for _ in range(num_rows)]
    s = (
        sampled.select(["response_texts", "scores", "response_lengths", "score_errors"]).to_pydict()
        if sampled is not None
        else {
            "response_texts": [[]] * num_rows,
            "scores": [[]] * num_rows,
            "response_lengths": [[]] * num_rows,
            "score_errors": [[]] * num_rows,
        }
    )
    out["sample_responses"], out["sample_scores"] = s["response_texts"], s["scores"]
    out["sample_lengths"] = s["response_lengths"]
    out["sample_answers"] = [[extract_answer(t, *key) for t in texts] for texts, key in zip(s["response_texts"], keys)]
    votes = [majority_vote(a, sc) for a, sc in zip(out["sample_answers"], out["sample_scores"])]
    out["majority_answer"] = [answer for answer, _ in votes]
    out["majority_score"] = [score for _, score in votes]
    out["score_errors"] = [e + list(se) for e, se in zip(errors, s["score_errors"])]
    schema = load_schema("evaluations")
    return pa.Table.from_pydict({name: out[name] for name in schema.names}, schema=schema)


def evaluation_metrics_from_table(table: pa.Table, *, pass_threshold: float) -> dict[str, float]:
    """val-core / val-aux metrics of an evaluations table (all its rows), per data_source; and the same per
    data.sources name, val-source/<source>/reward/<metric> (val-source-aux/<source>/...), of the rows that have
    one (a source's eval_files)."""
    metrics = _metrics_of(table, "data_source", pass_threshold=pass_threshold)
    if "source" in table.column_names and table.column("source").null_count < table.num_rows:
        sourced = table.filter(pc.is_valid(table.column("source")))
        metrics |= _metrics_of(
            sourced, "source", pass_threshold=pass_threshold, core="val-source", aux="val-source-aux"
        )
    return metrics


def _metrics_of(
    table: pa.Table, key: str, *, pass_threshold: float, core: str = "val-core", aux: str = "val-aux"
) -> dict[str, float]:
    """evaluation_metrics of ``table``'s rows grouped by the column ``key``, named ``core``/<key>/reward/... and
    ``aux``/<key>/..."""
    d = table.select(
        [
            key,
            "greedy_score",
            "greedy_answer",
            "greedy_length",
            "sample_scores",
            "sample_answers",
            "sample_lengths",
            "majority_score",
        ]
    ).to_pydict()
    has_greedy = any(score is not None for score in d["greedy_score"])
    num_samples = len(d["sample_scores"][0]) if d["sample_scores"] else 0

    def floats(rows: list) -> np.ndarray:
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), -1)

    return evaluation_metrics(
        np.asarray(d[key], dtype=object),
        greedy_score_P=floats(d["greedy_score"])[:, 0] if has_greedy else None,
        greedy_answered_P=np.asarray([a is not None for a in d["greedy_answer"]]) if has_greedy else None,
        greedy_length_P=floats(d["greedy_length"])[:, 0] if has_greedy else None,
        sample_scores_PK=floats(d["sample_scores"]) if num_samples else None,
        sample_answered_PK=np.asarray([[a is not None for a in row] for row in d["sample_answers"]])
        if num_samples
        else None,
        sample_lengths_PK=floats(d["sample_lengths"]) if num_samples else None,
        majority_score_P=floats(d["majority_score"])[:, 0] if num_samples else None,
        pass_threshold=pass_threshold,
        core=core,
        aux=aux,
    )


def loop_stats(shard_counts: list[dict[str, float]]) -> dict[str, float]:
    """The held-out samples' tool use as generate's tools/* and environment/* metrics, under val-aux/ (e.g.
    val-aux/tools/use_rate, val-aux/tools/turns_mean, val-aux/environment/turns_mean), from their shards' counts,
    greedy and sampled samples together; empty for single-turn samples."""
    total: dict[str, float] = {}
    for counts in shard_counts:
        add_counts(total, counts)
    return {f"val-aux/{name}": value for name, value in (tool_stats(total) | environment_stats(total)).items()}


def _counts(table: pa.Table) -> dict[str, int]:
    errors = sum(e is not None for row in table.column("score_errors").to_pylist() for e in row)
    return {"prompts": table.num_rows, "failed_samples": errors}


def headline(stats: dict[str, float]) -> str:
    """The core metrics on one line, e.g. 'arith: mean@1 0.312, mean@8 0.280, pass@8 0.688, maj@8 0.344'."""
    by_source: dict[str, list[str]] = {}
    for name, value in stats.items():
        if name.startswith("val-core/"):
            source, metric = name.removeprefix("val-core/").rsplit("/reward/", 1)
            by_source.setdefault(source, []).append(f"{metric} {value:.3f}")
    return "; ".join(f"{source}: {', '.join(parts)}" for source, parts in sorted(by_source.items())) or "no metrics"


def compare(before: dict[str, float], after: dict[str, float]) -> list[str]:
    """Lines 'val-core/arith/reward/mean@1: 0.312 -> 0.625 (+31.3 points)' for the core metrics in both."""
    return [
        f"{name}: {before[name]:.3f} -> {after[name]:.3f} ({100 * (after[name] - before[name]):+.1f} points)"
        for name in sorted(after)
        if name.startswith("val-core/") and name in before
    ]


__all__ = [
    "EvaluateStage",
    "answer_extractor",
    "compare",
    "evaluated_iterations",
    "evaluation_metrics_from_table",
    "evaluation_table",
    "headline",
    "loop_stats",
]
