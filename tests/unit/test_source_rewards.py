"""data.sources' own reward terms and eval sets (issue 37, item 1): config mistakes are field-named config errors, a
shard mixing sources is scored by each source's own terms with its rows kept in order, per-component metrics stay
right when rows carry different components, and the fields change only the fingerprints of the stages they feed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from harness import cli, write_yaml

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import ConfigError, load_pipeline, validate_dict
from batchrl.pipeline.plan import build_plan
from batchrl.rewards import LabelRule
from batchrl.rewards.combine import TermSpec
from batchrl.stages.code_checks import check_code_references
from batchrl.stages.score import ScoreStage, ScoreWorker, score_stats
from batchrl.stages.score_sources import data_sources_scored_as_before, rows_by_source
from batchrl.storage.schemas import conform

ROOT = Path(__file__).resolve().parents[2]
HEALTHY_CALL_S = 120.0  # no call should time out (a loaded host's first math call took seconds)


def sources_config(*, sources: list[dict], evaluate: dict | None = None, score: dict | None = None):
    raw = {
        "name": "mix",
        "model": {"path": "m"},
        "data": {"sources": sources, "prompts_per_iteration": 4},
        "score": score or {"rewards": [{"reward": "gsm8k"}]},
    }
    return validate_dict(raw | ({"evaluate": evaluate} if evaluate is not None else {}))


def source(name: str, **fields) -> dict:
    return {"name": name, "files": [f"{name}.parquet"], "weight": 1} | fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rewards": [{"reward": "gsm8k"}, {"reward": "gsm8k_flexible", "name": "gsm8k"}]},
            r"data\.sources\[chat\]\.rewards: component names \['gsm8k'\] are not unique",
        ),
        ({"rewards": []}, r"data\.sources\.1\.rewards: List should have at least 1 item"),
        ({"eval_files": []}, r"data\.sources\.1\.eval_files: List should have at least 1 item"),
        ({"eval_files": ["e.parquet"]}, r"data\.sources\[chat\]\.eval_files needs an evaluate: section"),
        ({"rewards": [{"reward": "judge"}]}, r"data\.sources\[chat\]\.rewards\[0\] has reward: judge but there is no"),
        ({"rewards": [{"reward": "environment"}]}, r"data\.sources\[chat\]\.rewards\[0\] has reward: environment"),
    ],
)
def test_a_sources_reward_and_eval_set_mistakes_are_config_errors_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        sources_config(sources=[source("math"), source("chat", **fields)])


def test_a_term_named_reward_model_clashes_with_the_reward_model_only_when_there_is_one():
    chat = source("chat", rewards=[{"reward": "format_hash", "name": "reward_model"}])
    sources_config(sources=[source("math"), chat])
    with pytest.raises(ConfigError, match=r"data\.sources\[chat\]\.rewards\[0\] is named 'reward_model'"):
        sources_config(sources=[source("math"), chat], score={"reward_model": {"path": "rm"}})


def test_an_evaluate_section_needs_held_out_files_in_evaluate_files_or_a_sources_eval_files():
    with pytest.raises(ConfigError, match="evaluate.files is empty and no data.sources entry has eval_files"):
        sources_config(sources=[source("math")], evaluate={})
    cfg = sources_config(sources=[source("math"), source("chat", eval_files=["c.parquet"])], evaluate={})
    assert cfg.evaluate.files == [] and cfg.eval_files_by_source() == {"chat": ["c.parquet"]}


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ({"reward": "no_such_reward"}, r"^data\.sources\[chat\]\.rewards: .*no_such_reward"),
        ({"reward": "gsm8k", "params": {"nonsense": 1}}, r"^data\.sources\[chat\]\.rewards: .*nonsense"),
        ({"reward": "no_such_module_xyz:fn"}, r"^data\.sources\[chat\]\.rewards: .*no_such_module_xyz"),
    ],
)
def test_a_sources_reward_that_does_not_resolve_or_bind_is_named_where_the_pipeline_loads(term, message):
    cfg = sources_config(sources=[source("math"), source("chat", rewards=[term])])
    with pytest.raises(ConfigError, match=message):
        check_code_references(cfg)


def test_validate_refuses_a_sources_bad_reward_param_with_exit_2_and_one_line_before_any_work(tmp_path):
    raw = {
        "name": "p",
        "run": {"root": str(tmp_path / "runs")},
        "model": {"path": "m"},
        "data": {
            "sources": [
                source("math"),
                source("chat", rewards=[{"reward": "code_tests", "params": {"mode": "most"}}]),
            ],
            "prompts_per_iteration": 2,
        },
    }
    path = write_yaml(tmp_path / "p.yaml", raw)
    result = cli("validate", path)
    assert result.returncode == 2, result.stderr
    message = "data.sources[chat].rewards: reward 'code_tests': params.mode='most' must be one of"
    assert result.stderr.startswith(f"config error: {path}: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ scoring


def rollouts(groups: list[tuple[str, str | None, str, list[str]]]) -> pa.Table:
    """(prompt_id, source, ground truth, responses) per group, of data_source arith."""
    rows = [
        {
            "prompt_id": prompt_id,
            "data_source": "arith",
            "messages_json": json.dumps([{"role": "user", "content": "q"}]),
            "prompt_text": "q",
            "prompt_token_ids": [1, 2],
            "ground_truth": truth,
            "extra_info_json": None,
            "source_file": "f",
            "source_row": 0,
            "source": source_name,
            "response_texts": responses,
            "response_token_ids": [[3] for _ in responses],
            "response_logprobs": [[-0.5] for _ in responses],
            "finish_reasons": ["stop"] * len(responses),
            "response_lengths": [1] * len(responses),
            "sample_seeds": list(range(len(responses))),
            "policy_version": 0,
        }
        for prompt_id, source_name, truth, responses in groups
    ]
    return conform(pa.Table.from_pylist(rows), "rollouts")


CHAT_TERMS = [TermSpec("format_hash", 0.5, name="fmt"), TermSpec("exact_match", 2.0)]


@pytest.mark.parametrize("timeout_s", [None, HEALTHY_CALL_S])
def test_a_shard_mixing_sources_is_scored_by_each_sources_own_terms_with_its_rows_in_order(timeout_s):
    table = rollouts(
        [
            ("m0", "math", "7", ["#### 7", "#### 8"]),
            ("c0", "chat", "hi", ["hi", "#### 3"]),
            ("h0", None, "5", ["#### 5", "no"]),  # a held-out row of evaluate.files: no source
            ("c1", "chat", "yo", ["x\n#### 1", "yo"]),
            ("m1", "math", "2", ["#### 2", "#### 2"]),
        ]
    )
    worker = ScoreWorker(
        terms=[TermSpec("gsm8k", 1.0)],
        by_data_source={},
        failure_reward=0.0,
        timeout_s=timeout_s,
        source_terms={"chat": CHAT_TERMS},
    )
    try:
        out, counts = worker.process(table)
        assert list(worker.source_workers) == ["chat"]  # made for the source the shard holds
        if timeout_s:  # each reward set has its own reward child process
            assert worker.source_workers["chat"].isolated is not worker.isolated
    finally:
        worker.close()
    out = conform(out, "scores")
    assert out.column("prompt_id").to_pylist() == ["m0", "c0", "h0", "c1", "m1"]
    assert out.column("source").to_pylist() == ["math", "chat", None, "chat", "math"]
    gsm8k, chat = ["gsm8k"], ["fmt", "exact_match"]
    assert out.column("reward_names").to_pylist() == [gsm8k, chat, gsm8k, chat, gsm8k]
    assert out.column("reward_weights").to_pylist() == [[1.0], [0.5, 2.0], [1.0], [0.5, 2.0], [1.0]]
    assert out.column("reward_values").to_pylist() == [
        [[1.0], [0.0]],
        [[0.0, 1.0], [1.0, 0.0]],
        [[1.0], [0.0]],
        [[1.0, 0.0], [0.0, 1.0]],
        [[1.0], [1.0]],
    ]
    assert out.column("scores").to_pylist() == [[1.0, 0.0], [2.0, 0.5], [1.0, 0.0], [0.5, 2.0], [1.0, 1.0]]
    # the shard's counters, of its rows together: each component's mean over the samples that have it
    assert counts["num_samples"] == 10 and counts["score_sum"] == pytest.approx(9.0)
    stats = score_stats(counts)
    assert stats["critic/rewards/gsm8k/mean"] == pytest.approx(4 / 6)
    assert stats["critic/rewards/fmt/mean"] == pytest.approx(2 / 4)
    assert stats["critic/rewards/exact_match/mean"] == pytest.approx(2 / 4)
    assert stats["critic/score/mean"] == pytest.approx(0.9)


def test_a_shard_of_one_source_with_its_own_terms_is_scored_without_a_split():
    table = rollouts([("c0", "chat", "hi", ["hi"]), ("c1", "chat", "yo", ["no"])])
    worker = ScoreWorker(terms=[], by_data_source={}, failure_reward=0.0, source_terms={"chat": CHAT_TERMS})
    out, counts = worker.process(table)
    assert out.column("reward_names").to_pylist() == [["fmt", "exact_match"]] * 2
    assert out.column("scores").to_pylist() == [[2.0], [0.0]]
    assert counts["component_count/fmt"] == 2 and "component_count/gsm8k" not in counts


def test_rows_are_grouped_by_source_with_their_own_terms_and_the_rest_together_in_first_seen_order():
    groups = rows_by_source(["b", None, "a", "b", "c", None], own={"a", "b"})
    assert [(key, rows.tolist()) for key, rows in groups] == [("b", [0, 3]), (None, [1, 4, 5]), ("a", [2])]


def test_the_score_stage_hands_its_workers_the_sources_terms_without_the_judge_term_for_held_out_rows():
    sources = [source("math"), source("chat", rewards=[{"reward": "format_hash", "weight": 0.5, "name": "fmt"}])]
    cfg = sources_config(sources=sources)
    assert ScoreStage.reward_kwargs(cfg)["source_terms"] == {"chat": [TermSpec("format_hash", 0.5, name="fmt")]}
    assert ScoreStage.reward_kwargs(sources_config(sources=[source("math")]))["source_terms"] == {}


def test_a_sources_own_terms_decide_which_of_its_rows_need_a_label():
    chat = source("chat", rewards=[{"reward": "format_hash"}])
    cfg = sources_config(sources=[source("math"), chat])
    rule = LabelRule(cfg.score, sources=cfg.data.sources)
    assert rule.for_source("math").needing_label("arith") == "gsm8k" and rule.for_source(None) is rule
    assert rule.for_source("chat").needing_label("arith") is None and not rule.for_source("chat").every_row


def test_the_preflight_asks_a_reward_only_of_data_sources_with_rows_no_sources_own_terms_score():
    cfg = sources_config(sources=[source("math"), source("chat", rewards=[{"reward": "format_hash"}])])
    counts = {
        "data_source/arith": 5,
        "data_source/chat": 4,
        "data_source/mixed": 3,
        "source_data_source/math/arith": 5,
        "source_data_source/chat/chat": 4,
        "source_data_source/chat/mixed": 2,
        "source_data_source/math/mixed": 1,
    }
    assert data_sources_scored_as_before(cfg, counts) == ["arith", "mixed"]
    # a table ingested before the per-source counts: every data_source, as before
    assert data_sources_scored_as_before(cfg, {"data_source/chat": 4}) == ["chat"]


# ------------------------------------------------------------------------------------------ fingerprints


def fingerprints(overrides: list[str]) -> dict[str, str]:
    base = [
        "data.train_files=null",
        "data.sources=[{name: easy, files: [e.parquet], weight: 3}, {name: hard, files: [h.parquet], weight: 1}]",
        "data.prompts_per_iteration=8",
        "run.iterations=1",
    ]
    cfg = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides=base + overrides, run_id="fp")
    return {step.label: step.fingerprint for step in build_plan(cfg, check_storage=False)}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {label for label in before if before[label] != after[label]}


def test_a_sources_rewards_change_the_scoring_stages_fingerprints_and_its_eval_files_the_held_out_ones():
    plain = fingerprints([])  # the overrides below restate the sources: a list is replaced whole
    with_rewards = fingerprints(
        [
            "data.sources=[{name: easy, files: [e.parquet], weight: 3}, "
            "{name: hard, files: [h.parquet], weight: 1, rewards: [{reward: format_hash}]}]"
        ]
    )
    assert {"ingest", "iter 0 generate", "heldout"}.isdisjoint(changed(plain, with_rewards))
    assert {"iter 0 score", "evaluate", "iter 0 evaluate"} <= changed(plain, with_rewards)
    with_eval = fingerprints(
        [
            "data.sources=[{name: easy, files: [e.parquet], weight: 3, eval_files: [ee.parquet]}, "
            "{name: hard, files: [h.parquet], weight: 1}]"
        ]
    )
    assert {"ingest", "iter 0 generate", "iter 0 score"}.isdisjoint(changed(plain, with_eval))
    assert {"heldout", "evaluate", "iter 0 evaluate"} <= changed(plain, with_eval)


def test_scoring_a_table_without_sources_is_as_before():
    table = rollouts([("m0", None, "7", ["#### 7"])]).drop_columns(["source"])
    worker = ScoreWorker(terms=[TermSpec("gsm8k", 1.0)], by_data_source={}, failure_reward=0.0)
    out, _ = worker.process(table)
    assert np.allclose(out.column("scores").to_pylist(), [[1.0]])
