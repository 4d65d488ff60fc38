"""score: rollouts -> scores, every sample's reward components and their weighted total, within its group row.

Components of a sample: the ``score.rewards`` terms (rule rewards), or, when none are listed, the default reward
of the row's data_source; plus the reward model's score (component "reward_model") when ``score.reward_model``
is set (alone, if no terms are listed). Each component is kept: ``reward_names`` (per row) and ``reward_values``
([sample][component], unweighted, null where that component failed) and ``reward_weights``; ``scores`` is their
weighted sum. Metrics: ``critic/rewards/<name>/mean`` per component, next to ``score/raw/*`` (the scores this
stage wrote; ``critic/score/*`` are advantage's, of the scores it read after any user stage).

Fault isolation: a rule reward that raises, returns None/NaN, or overruns ``score.timeout_s`` (rule rewards run
in a child process per actor that is killed on a timeout, see batchrl.rewards.isolation) fails that component;
the sample then gets ``score.failure_reward`` and the error in ``score_errors``, and the stage goes on. A reward
model that cannot run is not a per-sample failure: it fails the stage. A reward may leave a note on a value it did
give (``rewards.detail.RewardWithDetail``: code_tests says which tests failed and how); it goes to ``score_details``
and the sample is not a failure.

One actor pool scores everything: with a reward model each actor loads it once (reward_model.num_actors actors),
and its forward passes run while the rule rewards of the same shard are computed (in a thread that mostly waits
on the reward child process). A reward model score that is not finite fails that component like a rule reward.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import queue
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.models import ActorResources, fingerprint_dump
from batchrl.errors import DataError
from batchrl.pipeline.shards import PoolActors, ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.rewards import resolve_reward, reward_code
from batchrl.rewards.combine import RewardSet, TermSpec, as_term_spec, combine_components, sample_row
from batchrl.rewards.detail import RewardWithDetail
from batchrl.rewards.isolation import IsolatedRewards
from batchrl.stages.score_sources import (
    data_sources_scored_as_before,
    score_by_source,
    source_rewards_fingerprint,
    source_term_specs,
)
from batchrl.storage.manifest import Manifest
from batchrl.storage.sources import check_checkpoint_source

logger = logging.getLogger(__name__)

REWARD_MODEL_COMPONENT = "reward_model"
LOGGED_COMPONENT = "logged"  # a logged reward (generate.logged), which replaces the computed ones of its sample
TIMED_OUT = " timed out after "

__all__ = ["RewardSet", "ScoreStage", "ScoreWorker", "summarize_scores"]


class ScoreWorker(ShardWorker):
    """Ray Data actor: rule rewards (in a child process when timeout_s is set) and the reward model, per shard."""

    schema = "scores"

    def __init__(
        self,
        *,
        terms: list[Any],
        by_data_source: Mapping[str, str],
        failure_reward: float,
        timeout_s: float | None = None,
        reward_model: Mapping[str, Any] | None = None,
        reward_processes: int = 1,
        source_terms: Mapping[str, list[Any]] | None = None,
    ):
        """``source_terms``: data.sources' own reward terms by source name, which score the rows of that source
        (score_sources); the other rows are scored with ``terms`` as before."""
        self.failure_reward = float(failure_reward)
        self.source_terms = dict(source_terms or {})
        self.source_workers: dict[str, ScoreWorker] = {}  # made when a shard first holds the source's rows
        self._set_kwargs = {
            "by_data_source": dict(by_data_source),
            "failure_reward": failure_reward,
            "timeout_s": timeout_s,
            "reward_processes": reward_processes,
        }
        specs = [as_term_spec(t) for t in terms]
        self.rewards: RewardSet | None = None
        self.isolated: IsolatedRewards | None = None
        self.isolated_pool: list[IsolatedRewards] = []  # isolated first, then the other reward processes
        if specs or reward_model is None:
            reward_set_kwargs = {
                "terms": [vars(s) | {"params": dict(s.params)} for s in specs],
                "by_data_source": dict(by_data_source),
                "failure_reward": self.failure_reward,
            }
            self.rewards = RewardSet(**reward_set_kwargs)
            if timeout_s:
                self.isolated_pool = [
                    IsolatedRewards(
                        reward_set_kwargs=reward_set_kwargs, timeout_s=timeout_s, term_names_for=self.term_names_for
                    )
                    for _ in range(max(1, reward_processes))
                ]
                self.isolated = self.isolated_pool[0]
        self.reward_model, self.reward_model_weight = None, 0.0
        if reward_model is not None:
            from batchrl.rewards.model import SequenceClassifierReward

            options = dict(reward_model)
            self.reward_model_weight = float(options.pop("weight", 1.0))
            self.reward_model = SequenceClassifierReward(**options)

    def rule_weights(self) -> list[float]:
        """Weights of the rule components: the configured terms', or 1.0 for a data_source's default reward."""
        if self.rewards is None:
            return []
        return [t.weight for t in self.rewards.terms] if self.rewards.terms else [1.0]

    def term_names_for(self, data_source: str) -> list[str]:
        return [t.name for t in self.rewards.terms_for(data_source)] if self.rewards else []

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        if self.source_terms and "source" in table.column_names:
            out, num_truncated = score_by_source(table, own_terms=self.source_terms, score_part=self._score_part)
        else:
            out, num_truncated = self._score(table)
        counts = summarize_scores(out)  # of the whole shard, its sources together
        if self.reward_model is not None:
            counts["reward_model_truncated"] = num_truncated
        return out, counts

    def _score_part(self, source: str | None, table: pa.Table) -> tuple[pa.Table, int]:
        """The rows of ``source`` scored with its own terms (None: with this worker's)."""
        if source is None:
            return self._score(table)
        if source not in self.source_workers:
            worker = ScoreWorker(terms=self.source_terms[source], **self._set_kwargs)
            # the actor's one reward model scores every source's rows
            worker.reward_model, worker.reward_model_weight = self.reward_model, self.reward_model_weight
            self.source_workers[source] = worker
        return self.source_workers[source]._score(table)

    def _score(self, table: pa.Table) -> tuple[pa.Table, int]:
        """The shard with its score columns, scored with this worker's reward set, and the reward model's truncated
        texts."""
        with gc_paused():
            tasks, row_of_sample_S = sample_tasks(table)
        logged_S = logged_rewards(table, num_samples=len(tasks))
        # Only the samples without a logged reward are scored (all of them, unless training on logged data).
        todo = np.arange(len(tasks)) if logged_S is None else np.flatnonzero(np.isnan(logged_S))
        names_of = {ds: self.term_names_for(ds) for ds in table.column("data_source").unique().to_pylist()}
        names_P = [names_of[ds] for ds in table.column("data_source").to_pylist()]
        weights_K = self.rule_weights()
        num_truncated = 0
        todo_tasks = [tasks[i] for i in todo]
        if self.reward_model is None:
            values_TK, errors_T, details_T = self._rule_components(todo_tasks)
        else:  # the rule rewards (mostly waiting on the child process) overlap the reward model's forward passes
            with ThreadPoolExecutor(1, thread_name_prefix="rule-rewards") as pool:
                rules = pool.submit(self._rule_components, todo_tasks)
                model_T, num_truncated = self._reward_model_component(table, row_of_sample_S, todo)
                values_TK, errors_T, details_T = rules.result()
            for i in np.flatnonzero(~np.isfinite(model_T)):
                errors_T[i] = "; ".join(filter(None, [errors_T[i], f"{REWARD_MODEL_COMPONENT} returned {model_T[i]}"]))
                model_T[i] = np.nan
            values_TK = np.concatenate([values_TK, model_T[:, None]], axis=1)
            names_P = [names + [REWARD_MODEL_COMPONENT] for names in names_P]
            weights_K = [*weights_K, self.reward_model_weight]
        values_SK = np.full((len(tasks), values_TK.shape[1]), np.nan)
        values_SK[todo] = values_TK
        errors_S: list[str | None] = [None] * len(tasks)
        details_S: list[str | None] = [None] * len(tasks)
        for i, error, detail in zip(todo, errors_T, details_T):
            errors_S[i], details_S[i] = error, detail
        total_S = combine_components(
            values_SK, np.asarray(weights_K, dtype=np.float64), failure_reward=self.failure_reward
        )
        if logged_S is not None:  # a logged reward is the sample's score, kept as its own component
            has_logged = ~np.isnan(logged_S)
            total_S[has_logged] = logged_S[has_logged]
            values_SK = np.concatenate([values_SK, logged_S[:, None]], axis=1)
            names_P = [names + [LOGGED_COMPONENT] for names in names_P]
            weights_K = [*weights_K, 1.0]
        out = append_score_columns(
            table,
            row_of_sample_S,
            total_S=total_S,
            values_SK=values_SK,
            errors_S=errors_S,
            details_S=details_S,
            names_P=names_P,
            weights_K=weights_K,
        )
        return out, num_truncated

    def _rule_components(self, tasks: list[tuple]) -> tuple[np.ndarray, list[str | None], list[str | None]]:
        """values_SK with NaN where a term failed, each sample's errors joined and its terms' details joined (None
        where it has none; a detail is a note a reward left on a value, rewards.detail)."""
        if self.rewards is None:
            return np.zeros((len(tasks), 0)), [None] * len(tasks), [None] * len(tasks)
        if self.isolated is not None:
            with gc_paused():  # only bookkeeping and pickling here: the reward code runs in the child
                results = self._isolated_results(tasks)
        else:
            results = [
                self.rewards.evaluate(response, truth, sample_row(group, *sample))
                for response, truth, group, *sample in tasks
            ]
        num_terms = len(results[0][0]) if results else len(self.rule_weights())
        values_SK = np.array([values for values, _ in results], dtype=np.float64).reshape(len(tasks), num_terms)
        errors_S = [("; ".join(e for e in errors if e) or None) if any(errors) else None for _, errors in results]
        details_S = [self._details(values, task) for (values, _), task in zip(results, tasks)]
        return values_SK, errors_S, details_S  # np.array turns None (a failed term) into NaN

    def _isolated_results(self, tasks: list[tuple]) -> list[tuple]:
        """The reward processes' results in task order. With several (score.reward_processes), each pulls small
        chunks of samples from one queue, so a slow sample (a program waiting out its timeout) holds one process
        while the others go on; contiguous shares would leave one process with every slow sample of a cluster."""
        if len(self.isolated_pool) == 1 or len(tasks) <= 1:
            return self.isolated.evaluate(tasks)
        size = max(1, min(64, len(tasks) // (8 * len(self.isolated_pool))))
        chunks: queue.SimpleQueue[range] = queue.SimpleQueue()
        for start in range(0, len(tasks), size):
            chunks.put(range(start, min(start + size, len(tasks))))
        results: list[tuple | None] = [None] * len(tasks)

        def drain(process: IsolatedRewards) -> None:
            while True:
                try:
                    chunk = chunks.get_nowait()
                except queue.Empty:
                    return
                for i, result in zip(chunk, process.evaluate([tasks[i] for i in chunk])):
                    results[i] = result

        with ThreadPoolExecutor(len(self.isolated_pool), thread_name_prefix="reward-processes") as pool:
            list(pool.map(drain, self.isolated_pool))
        return results

    def _details(self, values: list[float | None], task: tuple) -> str | None:
        if not any(type(v) is RewardWithDetail for v in values):
            return None
        names = self.term_names_for(task[2]["data_source"])  # [2]: the group fields
        return "; ".join(f"{name}: {v.detail}" for name, v in zip(names, values) if type(v) is RewardWithDetail)

    def _reward_model_component(
        self, table: pa.Table, row_of_sample_S: np.ndarray, samples: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """The reward model's score of the samples ``samples`` (flat positions; logged-reward samples left out)."""
        if not len(samples):
            return np.zeros(0), 0
        row_of_sample_S = row_of_sample_S[samples]
        flat = pc.list_flatten(table.column("response_texts"))
        responses = flat.take(pa.array(samples, pa.int64())).to_pylist()
        prompts = table.column("prompt_text").take(row_of_sample_S).to_pylist()
        messages = table.column("messages_json").take(row_of_sample_S).to_pylist()
        texts = self.reward_model.texts(prompt_texts=prompts, messages_json=messages, responses=responses)
        scores_S, num_truncated = self.reward_model.score(texts)
        return scores_S.astype(np.float64), num_truncated

    def close(self) -> None:
        for worker in getattr(self, "source_workers", {}).values():
            worker.close()
        for process in getattr(self, "isolated_pool", []):
            process.close()
        if getattr(self, "isolated", None) is not None:
            self.isolated.close()
        self.isolated, self.isolated_pool = None, []

    def __del__(self) -> None:
        self.close()


def logged_rewards(table: pa.Table, *, num_samples: int) -> np.ndarray | None:
    """Each sample's logged reward (NaN where it has none), or None when no row of the shard has one (training on
    logged data: generate keeps the logged rewards in the rollouts of a logged iteration only)."""
    if "logged_rewards" not in table.column_names or table.column("logged_rewards").null_count == table.num_rows:
        return None
    rewards_S: list[float] = []
    for rewards, responses in zip(
        table.column("logged_rewards").to_pylist(), table.column("response_texts").to_pylist()
    ):
        rewards = rewards if rewards is not None else [None] * len(responses)
        rewards_S += [np.nan if r is None else r for r in rewards]
    if len(rewards_S) != num_samples:
        raise DataError(
            f"logged_rewards counts {len(rewards_S)} rewards for {num_samples} responses; rerun generate (the "
            "rollouts were not written by this version of it)"
        )
    return np.asarray(rewards_S, dtype=np.float64)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector around allocation-heavy bookkeeping of our own (no user code).

    Why: building ~100k small tuples and dicts triggers repeated full collections that traverse the whole
    heap of an actor that has torch and Ray loaded; measured, this halves the worker's overhead per sample.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def sample_tasks(table: pa.Table) -> tuple[list[tuple], np.ndarray]:
    """One (response, ground_truth, group fields, sample_idx, response_length, finish_reason) per sample (the
    reward's row fields are combine.sample_row of the last four), and the group row index of each sample. A table
    the judge stage wrote adds each sample's verdict to its row fields (judge_score, judge_error); one played against
    generate.environment its environment_reward."""
    judged = "judge_scores" in table.column_names
    played = "environment_rewards" in table.column_names  # rows played against generate.environment, or null
    columns = table.select(
        [
            "prompt_id",
            "data_source",
            "prompt_text",
            "ground_truth",
            "extra_info_json",
            "response_texts",
            "response_lengths",
            "finish_reasons",
        ]
        + (["judge_scores", "judge_errors"] if judged else [])
        + (["environment_rewards"] if played else [])
    ).to_pydict()
    tasks, row_of_sample = [], []
    for r in range(table.num_rows):
        extra = columns["extra_info_json"][r]
        group = {
            "prompt_id": columns["prompt_id"][r],
            "data_source": columns["data_source"][r],
            "prompt_text": columns["prompt_text"][r],
            "extra_info": json.loads(extra) if extra else None,
        }
        truth = columns["ground_truth"][r]
        samples = zip(
            columns["response_texts"][r], columns["response_lengths"][r], columns["finish_reasons"][r], strict=True
        )
        for sample_idx, (response, length, finish_reason) in enumerate(samples):
            fields = group
            if judged:
                verdict = {"judge_score": columns["judge_scores"][r][sample_idx]}
                fields = {**group, **verdict, "judge_error": columns["judge_errors"][r][sample_idx]}
            if played and columns["environment_rewards"][r] is not None:
                fields = {**fields, "environment_reward": columns["environment_rewards"][r][sample_idx]}
            tasks.append((response, truth, fields, sample_idx, length, finish_reason))
            row_of_sample.append(r)
    return tasks, np.asarray(row_of_sample, dtype=np.int64)


def append_score_columns(
    table: pa.Table,
    row_of_sample_S: np.ndarray,
    *,
    total_S: np.ndarray,
    values_SK: np.ndarray,
    errors_S: list[str | None],
    details_S: list[str | None],
    names_P: list[list[str]],
    weights_K: list[float],
) -> pa.Table:
    """The rollouts table plus scores, score_errors, score_details, reward_names, reward_weights and reward_values
    per group."""
    num_samples, num_components = values_SK.shape
    group_offsets = np.concatenate([[0], np.cumsum(np.bincount(row_of_sample_S, minlength=table.num_rows))])
    component_offsets = np.arange(num_samples + 1, dtype=np.int32) * num_components
    flat_values = pa.array(values_SK.reshape(-1), pa.float32(), from_pandas=True)  # NaN (failed) -> null
    per_sample = {
        "scores": pa.array(total_S, pa.float32()),
        "score_errors": pa.array(errors_S, pa.string()),
        "score_details": pa.array(details_S, pa.string()),
        "reward_values": pa.ListArray.from_arrays(pa.array(component_offsets), flat_values),
    }
    out = table
    for name, flat in per_sample.items():
        out = out.append_column(name, pa.ListArray.from_arrays(pa.array(group_offsets.astype(np.int32)), flat))
    out = out.append_column("reward_names", pa.array(names_P, pa.list_(pa.string())))
    return out.append_column("reward_weights", pa.array([weights_K] * table.num_rows, pa.list_(pa.float32())))


def summarize_scores(table: pa.Table) -> dict[str, float]:
    """Per-shard counters (also recomputed from committed parts on resume): totals and per-component sums."""
    scores_S = pc.list_flatten(table.column("scores")).to_numpy()
    errors_S = pc.list_flatten(table.column("score_errors"))
    counts: dict[str, float] = {
        "num_samples": len(scores_S),
        "score_sum": float(scores_S.sum()),
        "score_max": float(scores_S.max(initial=-np.inf)) if len(scores_S) else 0.0,
        "score_min": float(scores_S.min(initial=np.inf)) if len(scores_S) else 0.0,
        "failed_samples": len(errors_S) - errors_S.null_count,
        "timed_out_samples": int(pc.sum(pc.match_substring(errors_S, TIMED_OUT)).as_py() or 0),
    }
    counts.update(_component_counts(table, num_samples=len(scores_S)))
    return counts


def _component_counts(table: pa.Table, *, num_samples: int) -> dict[str, float]:
    """component_sum/<name>, component_count/<name> (samples where it scored) and failed/<name>."""
    names_P = [tuple(names) for names in table.column("reward_names").to_pylist()]
    if not names_P:
        return {}
    # Rows may carry different components (a source's own terms, data.sources[].rewards): each sample's values are
    # read at its own offset, and a component's sums gather the rows that have it, wherever it stands in them.
    per_sample = pc.list_flatten(table.column("reward_values"))
    values_V = pc.list_flatten(per_sample).to_numpy(zero_copy_only=False).astype(np.float64)
    start_S = np.concatenate([[0], np.cumsum(pc.fill_null(pc.list_value_length(per_sample), 0).to_numpy())])[:-1]
    distinct = {names: i for i, names in enumerate(dict.fromkeys(names_P))}
    samples_P = pc.list_value_length(table.column("scores")).to_numpy(zero_copy_only=False)
    names_id_S = np.repeat(np.asarray([distinct[n] for n in names_P]), samples_P)
    if len(names_id_S) != num_samples:
        raise AssertionError(f"{len(names_id_S)} samples in the score lists, {num_samples} scores")
    counts: dict[str, float] = {}
    for names, names_id in distinct.items():
        starts_s = start_S[names_id_S == names_id]
        values_sK = values_V[starts_s[:, None] + np.arange(len(names))] if len(names) else np.zeros((len(starts_s), 0))
        # A sample with a logged reward ran no other component; a sample without one is not a logged failure.
        logged_S = values_sK[:, names.index(LOGGED_COMPONENT)] if LOGGED_COMPONENT in names else None
        for k, name in enumerate(names):
            column_S = values_sK[:, k]
            scored_S = ~np.isnan(column_S)
            ran_S = np.ones_like(scored_S) if logged_S is None else np.isnan(logged_S)
            if name == LOGGED_COMPONENT:
                ran_S = scored_S
            for key, value in (
                (f"component_sum/{name}", float(column_S[scored_S].sum())),
                (f"component_count/{name}", int(scored_S.sum())),
                (f"failed/{name}", int((ran_S & ~scored_S).sum())),
            ):
                counts[key] = counts.get(key, 0) + value
    return counts


def score_stats(counts: Mapping[str, float]) -> dict[str, float]:
    """verl-style metrics: critic/score/{mean,max,min} and critic/rewards/<component>/mean."""
    n = counts.get("num_samples", 0)
    if not n:
        return {}
    stats = {
        "critic/score/mean": counts["score_sum"] / n,
        "critic/score/max": counts["score_max"],
        "critic/score/min": counts["score_min"],
    }
    for key, total in sorted(counts.items()):
        prefix, _, name = key.partition("/")
        if prefix == "component_sum" and counts[f"component_count/{name}"]:  # none if it failed everywhere
            stats[f"critic/rewards/{name}/mean"] = total / counts[f"component_count/{name}"]
    return stats


@register
class ScoreStage(Stage):
    name = "score"
    table = "scores"
    schema = "scores"
    inputs = ("rollouts",)
    timing_name = "score"

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        rm = cfg.score.reward_model
        return [] if rm is None else [("score.reward_model.path", rm.path)]

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [] if cfg.score.reward_model is None else [reward_model_actor_need(cfg)]

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        # critic/score/* is advantage's (the scores it trained on, after any user stage); the score stage's own are
        # score/raw/*, the same numbers when no user stage changes the scores. Its critic/score/* stay as well, for
        # the iterations whose advantage manifest predates advantage's own (a resumed run rewrites metrics.jsonl
        # from the manifests): advantage runs after score, so its metrics replace these where it has them.
        stats = manifest.stats
        raw = {f"score/raw/{key.rpartition('/')[2]}": v for key, v in stats.items() if key.startswith("critic/score/")}
        return {**stats, **raw, "score/failed_samples": manifest.counts.get("failed_samples", 0)}

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        code = reward_code(cfg.score)  # editing a custom reward's module re-scores
        score = fingerprint_dump(cfg.score, exclude_defaults=True)  # without reward_processes: how fast, not what
        return {"score": score} | ({"reward_code": code} if code else {}) | source_rewards_fingerprint(cfg)

    @staticmethod
    def reward_kwargs(cfg: PipelineConfig, *, judged: bool = True) -> dict[str, Any]:
        """ScoreWorker's constructor arguments; ``judged`` False: without the judge term (held-out evaluation, whose
        responses no judge stage judges)."""
        s = cfg.score
        reward_model = None
        if s.reward_model is not None:
            rm = s.reward_model
            reward_model = rm.model_dump(exclude=set(ActorResources.model_fields))
            reward_model["device"] = "cuda" if rm.gpus_per_actor > 0 else "cpu"
        return {
            "terms": [
                TermSpec(reward=t.reward, weight=t.weight, name=t.component_name, params=dict(t.params))
                for t in s.rewards
                if judged or t.reward != "judge"
            ],
            "by_data_source": dict(s.reward_by_data_source),
            "failure_reward": s.failure_reward,
            "timeout_s": s.timeout_s,
            "reward_model": reward_model,
            "reward_processes": s.reward_processes,
            "source_terms": source_term_specs(cfg, judged=judged),
        }

    @staticmethod
    def _rule_reward_set(cfg: PipelineConfig) -> RewardSet | None:
        """The rule rewards, resolved (imports user modules); None when the reward model scores alone."""
        kwargs = ScoreStage.reward_kwargs(cfg)
        if not kwargs["terms"] and kwargs["reward_model"] is not None:
            return None
        return RewardSet(
            terms=kwargs["terms"], by_data_source=kwargs["by_data_source"], failure_reward=kwargs["failure_reward"]
        )

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: every reward named in the config resolves, with valid params, and the reward
        model can be found."""
        check_reward_terms(cfg)
        rm = cfg.score.reward_model
        for path in [rm.path, rm.tokenizer] if rm is not None else []:
            if path is not None:
                _check_reward_model_path(path)

    def preflight(self, cfg: PipelineConfig, *, tables: dict[str, Manifest]) -> None:
        """After ingest, before any generation: every data_source in the prompts has a reward (but those whose rows
        all belong to sources with their own terms)."""
        self.check_data_sources(cfg, data_sources_scored_as_before(cfg, tables["prompts"].counts))

    def check_data_sources(self, cfg: PipelineConfig, data_sources: list[str]) -> None:
        """Every data source has a reward (unless the reward model scores alone): a ConfigError names the first
        one without."""
        rewards = self._rule_reward_set(cfg)
        for data_source in data_sources if rewards is not None else []:
            _as_config_error(lambda data_source=data_source: rewards.terms_for(data_source))

    def run(self, ctx: StageContext) -> StageOutput:
        cfg = ctx.cfg
        rm = cfg.score.reward_model
        parts, counts = run_sharded(
            ShardRun.of(ctx, "rollouts", description="score"),
            worker_cls=ScoreWorker,
            worker_kwargs=self.reward_kwargs(cfg),
            actors=rm or PoolActors(num_actors=cfg.score.num_actors),  # rule rewards: a CPU each
        )
        n = int(counts.get("num_samples", 0))
        if counts.get("failed_samples"):
            logger.warning(
                "%d of %d samples failed to score (%d timed out; see score_errors)",
                counts["failed_samples"],
                n,
                counts.get("timed_out_samples", 0),
            )
        kept = {
            k: int(v)
            for k, v in counts.items()
            if k in ("failed_samples", "timed_out_samples", "reward_model_truncated") or k.startswith("failed/")
        }
        return StageOutput(parts=parts, counts={"num_samples": n, **kept}, stats=score_stats(counts))


def reward_model_actor_need(cfg: PipelineConfig) -> ActorNeed:
    return ActorNeed.of(cfg.score.reward_model, field="score.reward_model")


def check_reward_terms(cfg: PipelineConfig, *, source: str | None = None) -> None:
    """ConfigError unless every reward the score section names resolves and its params bind and hold valid values
    (a reward's ``check_params``); imports custom rewards' modules. Also where a pipeline loads (code_checks)."""
    where = f"{source}: " if source else ""
    _as_config_error(lambda: ScoreStage._rule_reward_set(cfg), where=where)
    for reward in cfg.score.reward_by_data_source.values():
        _as_config_error(lambda reward=reward: resolve_reward(reward), where=where)
    for name, terms in source_term_specs(cfg).items():  # data.sources' own terms, each checked as score.rewards'
        field = f"data.sources[{name}].rewards"
        _as_config_error(
            lambda terms=terms: RewardSet(terms=terms, by_data_source={}, failure_reward=0.0), where=where, field=field
        )


def _as_config_error(check: Callable[[], Any], *, where: str = "", field: str = "score") -> Any:
    try:
        return check()
    except ValueError as err:
        raise ConfigError(f"{where}{field}: {err}") from None


def _check_reward_model_path(path: str) -> None:
    """A local reward model directory must exist; a hub id (owner/name) must be cached or on the hub."""
    check_checkpoint_source(path, field="score.reward_model", example="Skywork/Skywork-Reward-V2-Qwen3-0.6B")
