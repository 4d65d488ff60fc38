"""Per-source reward terms (``data.sources[].rewards``): a shard that mixes sources is scored part by part.

Why split the shard rather than give one reward set per-row terms: the scores table already keeps a row's components
per row (``reward_names``, ``reward_weights``), and a ScoreWorker scores the rows of one reward set with every rule
of scoring (timeouts in child processes, failures, details, logged rewards, the reward model's component). Splitting
a shard by source and scoring each part with its source's own worker (its own RewardSet and, with score.timeout_s,
its own reward child processes, made the first time a shard holds that source's rows) reuses all of it unchanged.
The parts are put back in the shard's row order, and the shard's counters are computed on the reassembled table.

Rows of a source without its own terms, and rows without a source (held-out rows of evaluate.files), are scored as
before: by score.rewards, or their data_source's default. score.reward_model scores every row (the source workers
share the actor's one model).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa

from batchrl.config import PipelineConfig
from batchrl.rewards import reward_code
from batchrl.rewards.combine import TermSpec

# (source or None for the rows scored as before, its rows) -> (the scored rows, reward_model_truncated)
ScorePart = Callable[[str | None, pa.Table], tuple[pa.Table, int]]


def source_term_specs(cfg: PipelineConfig, *, judged: bool = True) -> dict[str, list[TermSpec]]:
    """The reward terms of each source that has its own, by name; ``judged`` False: without the judge term
    (held-out rows, which no judge stage judges). A source left with no term then is scored as the other rows."""
    specs = {
        source.name: [
            TermSpec(reward=t.reward, weight=t.weight, name=t.component_name, params=dict(t.params))
            for t in source.rewards
            if judged or t.reward != "judge"
        ]
        for source in cfg.data.sources or []
        if source.rewards
    }
    return {name: terms for name, terms in specs.items() if terms}


def source_rewards_fingerprint(cfg: PipelineConfig) -> dict[str, Any]:
    """The sources' own reward terms for the fingerprints of the stages that score (score, evaluate), with the
    digests of their custom rewards' modules; empty when no source has its own, so those fingerprints are as
    before."""
    terms = {s.name: list(s.rewards) for s in cfg.data.sources or [] if s.rewards}
    if not terms:
        return {}
    rewards = {name: [t.model_dump(exclude_defaults=True) for t in listed] for name, listed in terms.items()}
    all_terms = [t for listed in terms.values() for t in listed]
    code = reward_code(SimpleNamespace(rewards=all_terms, reward_by_data_source={}))
    return {"source_rewards": rewards} | ({"source_reward_code": code} if code else {})


def data_sources_scored_as_before(cfg: PipelineConfig, counts: Mapping[str, int]) -> list[str]:
    """The data_sources of a prompts table (its manifest's ``counts``) with rows that no source's own terms score:
    ingest counts the rows of each data_source (data_source/<name>) and, with sources, of each in each source
    (source_data_source/<source>/<name>; a table ingested before those counts has none: every data_source then)."""
    own = {s.name for s in cfg.data.sources or [] if s.rewards}
    totals = {k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("data_source/")}
    for key, value in counts.items():
        if key.startswith("source_data_source/") and key.split("/", 2)[1] in own:
            name = key.split("/", 2)[2]
            totals[name] = totals.get(name, 0) - value
    return sorted(name for name, rows in totals.items() if rows > 0)


def rows_by_source(source_P: Sequence[str | None], *, own: Collection[str]) -> list[tuple[str | None, np.ndarray]]:
    """The row indices of each source in ``own`` (those with their own terms), and of the other rows (key None), in
    the order each key first appears."""
    groups: dict[str | None, list[int]] = {}
    for row, source in enumerate(source_P):
        groups.setdefault(source if source in own else None, []).append(row)
    return [(key, np.asarray(rows, dtype=np.int64)) for key, rows in groups.items()]


def score_by_source(table: pa.Table, *, own_terms: Mapping[str, Any], score_part: ScorePart) -> tuple[pa.Table, int]:
    """``table`` scored part by part (`score_part` per source), its rows back in their order; the reward model's
    truncated texts summed over the parts."""
    groups = rows_by_source(table.column("source").to_pylist(), own=own_terms.keys())
    if len(groups) == 1:  # one reward set for the whole shard: no split
        return score_part(groups[0][0], table)
    scored, num_truncated = [], 0
    for source, rows_R in groups:
        part, truncated = score_part(source, table.take(pa.array(rows_R)))
        scored.append(part)
        num_truncated += truncated
    rows_R = np.concatenate([rows for _, rows in groups])
    position_P = np.empty(table.num_rows, dtype=np.int64)
    position_P[rows_R] = np.arange(table.num_rows)  # where each original row landed in the concatenation
    return pa.concat_tables(scored).take(pa.array(position_P)), num_truncated
