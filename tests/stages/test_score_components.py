"""ScoreWorker on hand-made rollout groups: components kept per sample, metrics per component, per-call
timeouts and crashes isolated in the reward child process, and the reward-model component."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from batchrl.pipeline.stage import StageContext
from batchrl.rewards.combine import TermSpec
from batchrl.stages.score import ScoreStage, ScoreWorker, score_stats, summarize_scores
from batchrl.storage import RunLayout, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import conform

# The per-call deadline where no call should time out: one no healthy call misses on a loaded host (math-verify's
# first call took 2-4 s at a load of 11 on 2 cores). The tests of hung calls set short ones: they wait them out.
HEALTHY_CALL_S = 120.0


def rollouts(groups: list[dict]) -> pa.Table:
    """groups: {prompt_id, truth, responses[, data_source, lengths, finish_reasons, prompt_text, messages]}."""
    rows = []
    for g in groups:
        n = len(g["responses"])
        lengths = g.get("lengths", [len(r) for r in g["responses"]])
        rows.append(
            {
                "prompt_id": g["prompt_id"],
                "data_source": g.get("data_source", "arith"),
                "messages_json": json.dumps(g.get("messages", [{"role": "user", "content": "q"}])),
                "prompt_text": g.get("prompt_text", "q"),
                "prompt_token_ids": [1, 2],
                "ground_truth": g["truth"],
                "extra_info_json": None,
                "source_file": "f",
                "source_row": 0,
                "response_texts": g["responses"],
                "response_token_ids": [[3] * k for k in lengths],
                "response_logprobs": [[-0.5] * k for k in lengths],
                "finish_reasons": g.get("finish_reasons", ["stop"] * n),
                "response_lengths": lengths,
                "sample_seeds": list(range(n)),
                "policy_version": 0,
            }
        )
    return conform(pa.Table.from_pylist(rows), "rollouts")


def run_score_stage(cfg, tables: list[pa.Table], tmp_path, *, embedded_ray: bool = False) -> tuple[Any, str]:
    """The score stage's output and output directory, run over rollouts parts holding ``tables`` (with
    ``embedded_ray``, a lone CPU shard is scored in this process)."""
    in_dir, out_dir = str(tmp_path / "rollouts"), str(tmp_path / "scores")
    ctx = StageContext(
        cfg=cfg,
        layout=RunLayout.for_run(cfg.run.root, cfg.run_id),
        iteration=0,
        output_dir=out_dir,
        fingerprint="s",
        inputs={"rollouts": committed_rollouts(tables, in_dir)},
        input_dirs={"rollouts": in_dir},
        policy_in=cfg.model.path,
        embedded_ray=embedded_ray,
    )
    return ScoreStage().run(ctx), out_dir


def committed_rollouts(tables: list[pa.Table], in_dir: str) -> Manifest:
    """``tables`` written as the rollouts parts of ``in_dir``, and the manifest generate would have committed."""
    parts = []
    for k, table in enumerate(tables):
        num_bytes, digest = write_parquet_atomic(table, f"{in_dir}/part-{k:05d}.parquet")
        parts.append(PartInfo(name=f"part-{k:05d}.parquet", rows=table.num_rows, sha256=digest, num_bytes=num_bytes))
    return Manifest(
        stage="generate", table="rollouts", iteration=0, fingerprint="g", parts=parts, schema="rollouts",
        started_at=0, finished_at=0,
    )  # fmt: skip


def score(table: pa.Table, **kwargs) -> tuple[pa.Table, dict]:
    worker = ScoreWorker(**({"terms": [], "by_data_source": {}, "failure_reward": 0.0} | kwargs))
    try:
        out, counts = worker.process(table)
    finally:
        if worker.isolated is not None:
            worker.isolated.close()
    return conform(out, "scores"), counts


def column(table: pa.Table, name: str) -> list:
    return table.column(name).to_pylist()


@pytest.mark.parametrize("timeout_s", [None, HEALTHY_CALL_S])
def test_each_component_is_kept_per_sample_with_its_name_and_weight(timeout_s):
    table = rollouts(
        [{"prompt_id": "p0", "truth": "7", "responses": ["#### 7", "#### 8", "seven"], "lengths": [10, 90, 100]}]
    )
    terms = [
        TermSpec("gsm8k", 1.0),
        TermSpec("format_hash", 0.5, name="format"),
        TermSpec("overlong_penalty", 2.0, params={"max_length": 100, "buffer_length": 20}),
    ]
    out, counts = score(table, terms=terms, timeout_s=timeout_s)
    assert column(out, "reward_names") == [["gsm8k", "format", "overlong_penalty"]]
    assert column(out, "reward_weights") == [[1.0, 0.5, 2.0]]
    # overlong: length 10 -> 0; 90 -> -(90-80)/20 = -0.5; 100 -> -1
    assert column(out, "reward_values") == [[[1.0, 1.0, 0.0], [0.0, 1.0, -0.5], [0.0, 0.0, -1.0]]]
    # totals: 1 + 0.5 + 0 = 1.5; 0 + 0.5 - 1 = -0.5; 0 + 0 - 2 = -2
    assert column(out, "scores") == [[1.5, -0.5, -2.0]]
    stats = score_stats(counts)
    assert stats["critic/rewards/gsm8k/mean"] == pytest.approx(1 / 3)
    assert stats["critic/rewards/format/mean"] == pytest.approx(2 / 3)
    assert stats["critic/rewards/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert stats["critic/score/mean"] == pytest.approx(-1 / 3)


def test_without_terms_each_row_is_scored_by_its_data_sources_reward_under_that_name():
    table = rollouts(
        [
            {"prompt_id": "a", "truth": "7", "responses": ["#### 7", "#### 1"]},
            {
                "prompt_id": "m",
                "truth": "\\frac{1}{2}",
                "responses": ["\\boxed{0.5}", "\\boxed{2}"],
                "data_source": "math",
            },
            {"prompt_id": "m2", "truth": "3", "responses": ["\\boxed{3}", "\\boxed{3}"], "data_source": "math"},
        ]
    )
    out, counts = score(table, timeout_s=HEALTHY_CALL_S)
    assert column(out, "reward_names") == [["gsm8k"], ["math"], ["math"]]
    assert column(out, "scores") == [[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    stats = score_stats(counts)
    assert stats["critic/rewards/gsm8k/mean"] == 0.5 and stats["critic/rewards/math/mean"] == 0.75


def test_row_fields_reach_the_reward_per_sample():
    table = rollouts([{"prompt_id": "p0", "truth": "7", "responses": ["a", "b"], "finish_reasons": ["stop", "length"]}])
    out, _ = score(
        table, terms=[TermSpec("truncation_penalty", 1.0, params={"penalty": -0.5})], timeout_s=HEALTHY_CALL_S
    )
    assert column(out, "scores") == [[0.0, -0.5]]


def test_a_reward_that_never_returns_times_out_and_the_other_components_still_score():
    table = rollouts([{"prompt_id": "p0", "truth": "7", "responses": ["#### 7", "#### 8"]}])
    out, counts = score(
        table, terms=[("gsm8k", 1.0), ("custom_rewards:sleeps_forever", 1.0)], timeout_s=0.3, failure_reward=-1.0
    )
    assert column(out, "scores") == [[-1.0, -1.0]]
    assert column(out, "score_errors") == [["sleeps_forever timed out after 0.3s"] * 2]
    assert column(out, "reward_values") == [[[1.0, None], [0.0, None]]]
    assert counts["timed_out_samples"] == 2 and counts["failed/sleeps_forever"] == 2
    assert score_stats(counts)["critic/rewards/gsm8k/mean"] == 0.5


@pytest.mark.parametrize("samples_per_message", [4096, 2])
def test_after_a_hung_call_the_next_samples_are_scored_by_a_fresh_reward_process(samples_per_message, monkeypatch):
    from batchrl.rewards import isolation

    # 2: five messages, the next one pickled while the child scores; hangs in the first, middle and last message.
    monkeypatch.setattr(isolation, "SAMPLES_PER_MESSAGE", samples_per_message)
    groups = [{"prompt_id": f"p{i}", "truth": "1", "responses": ["a", "bb", "ccc"]} for i in range(3)]
    worker = ScoreWorker(
        terms=[("custom_rewards:hangs_on_second_sample", 1.0)], by_data_source={}, failure_reward=-1.0, timeout_s=0.5
    )
    try:
        out, counts = worker.process(rollouts(groups))
        num_starts = worker.isolated.num_starts
    finally:
        worker.isolated.close()
    assert column(out, "scores") == [[1.0, -1.0, 3.0]] * 3  # sample 1 of every group busy-loops
    assert column(out, "score_errors") == [[None, "hangs_on_second_sample timed out after 0.5s", None]] * 3
    assert counts["failed_samples"] == 3 and num_starts == 4  # the first start, then one per timeout


def test_samples_spread_over_many_messages_come_back_in_order():
    from batchrl.rewards import isolation

    groups = [
        {"prompt_id": f"p{i}", "truth": str(i), "responses": [f"#### {i}", f"#### {i + 1}", "x" * i]} for i in range(7)
    ]
    table = rollouts(groups)
    expected, _ = score(table, terms=[("gsm8k", 1.0), ("custom_rewards:length_bonus", 0.5)], timeout_s=None)
    original = isolation.SAMPLES_PER_MESSAGE
    try:
        isolation.SAMPLES_PER_MESSAGE = 4  # 21 samples: six messages, the last one short
        out, counts = score(
            table, terms=[("gsm8k", 1.0), ("custom_rewards:length_bonus", 0.5)], timeout_s=HEALTHY_CALL_S
        )
    finally:
        isolation.SAMPLES_PER_MESSAGE = original
    assert out.equals(expected) and counts["failed_samples"] == 0


def test_a_reward_that_kills_its_process_fails_only_that_sample():
    table = rollouts([{"prompt_id": "p0", "truth": "7", "responses": ["ok", "hang", "ok"]}])
    out, counts = score(
        table, terms=[("custom_rewards:dies_on_hang", 1.0)], timeout_s=HEALTHY_CALL_S, failure_reward=-2.0
    )
    assert column(out, "scores") == [[1.0, -2.0, 1.0]]
    assert column(out, "score_errors")[0][1] == "dies_on_hang crashed the reward process (exit code 7)"
    assert counts["failed_samples"] == 1


@pytest.mark.parametrize("timeout_s", [None, HEALTHY_CALL_S])
def test_raising_nan_and_none_are_recorded_the_same_way_inline_and_isolated(timeout_s):
    table = rollouts([{"prompt_id": "p0", "truth": "7", "responses": ["x"]}])
    terms = [("custom_rewards:explodes", 1.0), ("custom_rewards:not_a_number", 1.0), ("custom_rewards:gives_up", 1.0)]
    out, counts = score(table, terms=terms, timeout_s=timeout_s, failure_reward=-1.0)
    assert column(out, "score_errors") == [
        ["explodes raised RuntimeError: boom; not_a_number returned nan (not a finite number); gives_up returned None"]
    ]
    assert column(out, "scores") == [[-1.0]] and counts["failed_samples"] == 1


def test_summaries_of_committed_parts_rebuild_the_same_counters():
    table = rollouts([{"prompt_id": "p0", "truth": "7", "responses": ["#### 7", "no"]}])
    out, counts = score(table, terms=[("gsm8k", 2.0), ("format_hash", 1.0)])
    assert summarize_scores(out) == counts


# ------------------------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2ForSequenceClassification (num_labels=1) with the toy tokenizer."""
    from batchrl_toy import build_toy_reward_model

    return build_toy_reward_model(tmp_path_factory.mktemp("reward_model"))


def direct_logits(model_dir: str, texts: list[str]) -> np.ndarray:
    """The classifier's logit for each text alone (no batching, no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return np.array(
            [model(**tokenizer(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item() for t in texts]
        )


RM_GROUPS = [
    {
        "prompt_id": "p0",
        "truth": "7",
        "prompt_text": "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n",
        "responses": ["#### 7", "It is seven, so the answer is #### 7", "", "#### 8"],
    },
    {"prompt_id": "p1", "truth": "2", "prompt_text": "1+1?", "responses": ["2", "#### 2", "two", "#### 2 ✓"]},
]


def test_the_reward_model_component_is_the_classifiers_logit_for_prompt_plus_response(reward_model_dir):
    out, counts = score(
        rollouts(RM_GROUPS),
        terms=[("gsm8k", 1.0)],
        timeout_s=None,
        reward_model={"path": reward_model_dir, "batch_size": 3, "weight": 0.5, "device": "cpu"},
    )
    texts = [g["prompt_text"] + r for g in RM_GROUPS for r in g["responses"]]
    expected_S = direct_logits(reward_model_dir, texts)
    values_SK = np.array([s for group in column(out, "reward_values") for s in group], dtype=np.float64)
    assert column(out, "reward_names") == [["gsm8k", "reward_model"]] * 2
    np.testing.assert_allclose(values_SK[:, 1], expected_S, rtol=1e-4, atol=1e-5)  # batched+padded vs alone
    totals_S = np.array([s for group in column(out, "scores") for s in group])
    np.testing.assert_allclose(totals_S, values_SK[:, 0] + 0.5 * values_SK[:, 1], rtol=1e-5, atol=1e-6)
    assert score_stats(counts)["critic/rewards/reward_model/mean"] == pytest.approx(expected_S.mean(), abs=1e-5)
    assert counts["reward_model_truncated"] == 0


def test_without_rule_terms_the_reward_model_scores_alone_with_the_chat_template(reward_model_dir):
    from transformers import AutoTokenizer

    groups = [
        {
            "prompt_id": "p0",
            "truth": None,
            "data_source": "chat",
            "responses": ["Hi!", "Go away."],
            "messages": [{"role": "user", "content": "Hello"}],
        }
    ]
    out, _ = score(
        rollouts(groups),
        reward_model={"path": reward_model_dir, "input_format": "chat", "device": "cpu"},
        timeout_s=HEALTHY_CALL_S,
    )
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": r}], tokenize=False
        )
        for r in groups[0]["responses"]
    ]
    assert texts[0].endswith("<|im_start|>assistant\nHi!<|im_end|>\n")
    assert column(out, "reward_names") == [["reward_model"]]
    np.testing.assert_allclose(column(out, "scores")[0], direct_logits(reward_model_dir, texts), rtol=1e-4, atol=1e-5)


def test_texts_longer_than_max_length_keep_their_last_tokens_and_are_counted(reward_model_dir):
    groups = [{"prompt_id": "p0", "truth": "7", "prompt_text": "q", "responses": ["#### 7" * 10, "#### 7"]}]
    out, counts = score(
        rollouts(groups),
        terms=[("gsm8k", 1.0)],
        reward_model={"path": reward_model_dir, "max_length": 8, "device": "cpu"},
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    ids = tokenizer("q" + "#### 7" * 10, add_special_tokens=False)["input_ids"][-8:]
    expected = direct_logits(reward_model_dir, [tokenizer.decode(ids)])[0]
    assert counts["reward_model_truncated"] == 1
    assert column(out, "reward_values")[0][0][1] == pytest.approx(expected, abs=1e-5)


def test_logged_rewards_are_kept_and_only_the_samples_without_one_are_scored(reward_model_dir):
    """Training on logged data: a logged reward is the sample's score (component 'logged'); the rule reward and the
    reward model run on the other samples only, which a reward model that saw the logged ones would not match."""
    table = rollouts(RM_GROUPS)
    logged = [[None, 3.0, None, -1.0], [5.0, 5.0, 5.0, 5.0]]
    table = table.set_column(
        table.schema.get_field_index("logged_rewards"), "logged_rewards", pa.array(logged, pa.list_(pa.float32()))
    )
    out, counts = score(
        table,
        terms=[("gsm8k", 1.0)],
        timeout_s=None,
        reward_model={"path": reward_model_dir, "batch_size": 3, "weight": 0.5, "device": "cpu"},
    )
    assert column(out, "reward_names") == [["gsm8k", "reward_model", "logged"]] * 2
    texts = [RM_GROUPS[0]["prompt_text"] + RM_GROUPS[0]["responses"][i] for i in (0, 2)]
    model_S = direct_logits(reward_model_dir, texts)
    gsm8k_S = np.array([1.0, 0.0])  # "#### 7" is right, "" is not
    values = column(out, "reward_values")
    scored = [values[0][0], values[0][2]]
    np.testing.assert_allclose([v[1] for v in scored], model_S, rtol=1e-4, atol=1e-5)
    assert [v[0] for v in scored] == list(gsm8k_S) and [v[2] for v in scored] == [None, None]
    assert values[0][1] == [None, None, 3.0] and values[1] == [[None, None, 5.0]] * 4  # nothing else ran
    np.testing.assert_allclose(
        column(out, "scores")[0], [gsm8k_S[0] + 0.5 * model_S[0], 3.0, gsm8k_S[1] + 0.5 * model_S[1], -1.0], rtol=1e-5
    )
    assert column(out, "score_errors") == [[None] * 4] * 2
    assert counts["failed_samples"] == 0 and counts["failed/gsm8k"] == 0 and counts["failed/logged"] == 0
    assert counts["component_count/reward_model"] == 2 and counts["component_count/logged"] == 6
    assert score_stats(counts)["critic/rewards/logged/mean"] == pytest.approx((3.0 - 1.0 + 20.0) / 6)
