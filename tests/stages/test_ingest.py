"""ingest: both input layouts, chat template, deterministic shards, and counted rejects."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.config import validate_dict
from batchrl.config.models import ScoreConfig
from batchrl.errors import DataError
from batchrl.pipeline.stage import StageContext
from batchrl.rewards.gsm8k import gsm8k_strict
from batchrl.stages.ingest import IngestStage
from batchrl.stages.ingest_rows import ground_truth_text
from batchrl.storage import RunLayout, read_parquet
from batchrl_toy import build_toy_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_toy_tokenizer(path)
    return str(path)


def make_ctx(tmp_path, tokenizer_dir, files, **data):
    cfg = validate_dict(
        {"name": "t", "model": {"path": tokenizer_dir}, "data": {"train_files": [str(f) for f in files], **data}}
    )
    layout = RunLayout.for_run(str(tmp_path / "runs"), "t")
    return StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=layout.table_dir("prompts", None),
        fingerprint="x",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,  # as under the runner: a small input is ingested in this process
    )


def read_rejects(ctx, out) -> list[dict]:
    """Every rejects part's rows (one part per input chunk that rejected something), in table order."""
    return [
        row for part in out.extra_parts["rejects"] for row in read_parquet(f"{ctx.output_dir}/{part.name}").to_pylist()
    ]


def write_ours(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_batchrl_layout_is_tokenized_with_the_chat_template_and_sharded_in_order(tmp_path, tokenizer_dir):
    rows = [
        {"prompt_id": f"p{i}", "data_source": "arith", "prompt": f"What is {i} + 1?", "ground_truth": str(i + 1)}
        for i in range(5)
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "a.parquet", rows)], shard_size=2)
    out = IngestStage().run(ctx)
    assert [p.name for p in out.parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [p.rows for p in out.parts] == [2, 2, 1]
    table = read_parquet(f"{ctx.output_dir}/part-00000.parquet")
    first = table.to_pylist()[0]
    assert first["prompt_id"] == "p0"
    assert first["prompt_text"].startswith("<|im_start|>user\n") and first["prompt_text"].endswith(
        "<|im_start|>assistant\n"
    )
    assert json.loads(first["messages_json"]) == [{"role": "user", "content": "What is 0 + 1?"}]
    assert len(first["prompt_token_ids"]) > 5
    assert out.counts["prompts"] == 5 and out.counts["rejected"] == 0


def test_verl_layout_takes_ground_truth_from_reward_model_and_keeps_extra_info(tmp_path, tokenizer_dir):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"split": "train", "index": 7},
        }
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "verl.parquet", rows)])
    IngestStage().run(ctx)
    row = read_parquet(f"{ctx.output_dir}/part-00000.parquet").to_pylist()[0]
    assert row["ground_truth"] == "4"
    assert row["data_source"] == "openai/gsm8k"
    assert row["prompt_id"] == "verl-0"
    assert json.loads(row["extra_info_json"]) == {"split": "train", "index": 7}


def test_a_verl_reward_model_that_is_not_a_dict_is_rejected_saying_what_it_must_be_and_what_was_found(
    tmp_path, tokenizer_dir
):
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    records = [
        {"prompt_id": "dict", "data_source": "openai/gsm8k", "prompt": prompt, "reward_model": {"ground_truth": "4"}},
        {"prompt_id": "text", "data_source": "openai/gsm8k", "prompt": prompt, "reward_model": "4"},
    ]
    path = tmp_path / "verl.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    ctx = make_ctx(tmp_path, tokenizer_dir, [path])
    out = IngestStage().run(ctx)
    assert out.counts["prompts"] == 1
    (reject,) = read_rejects(ctx, out)
    assert (reject["prompt_id"], reject["reason"]) == ("text", "bad_ground_truth")
    assert reject["detail"] == (
        """reward_model must be a dict with a ground_truth key ({"ground_truth": ...}, verl's layout); """
        """found a string: '4'"""
    )


def test_malformed_rows_are_counted_into_the_rejects_table_with_reasons(tmp_path, tokenizer_dir):
    rows = [
        {"prompt_id": "ok", "data_source": "arith", "prompt": "What is 1 + 1?", "ground_truth": "2"},
        {"prompt_id": "null", "data_source": "arith", "prompt": None, "ground_truth": "2"},
        {"prompt_id": "blank", "data_source": "arith", "prompt": "   ", "ground_truth": "2"},
        {"prompt_id": "nogt", "data_source": "arith", "prompt": "What is 1 + 2?", "ground_truth": None},
        {"prompt_id": "long", "data_source": "arith", "prompt": "What is 1 + 1? " * 40, "ground_truth": "2"},
        {"prompt_id": "ok", "data_source": "arith", "prompt": "What is 3 + 3?", "ground_truth": "6"},
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "bad.parquet", rows)], max_prompt_tokens=64)
    out = IngestStage().run(ctx)
    assert out.counts["prompts"] == 1
    assert out.counts["rejected"] == 5
    rejects = read_rejects(ctx, out)
    assert {(r["prompt_id"], r["reason"]) for r in rejects} == {
        ("null", "empty_prompt"),
        ("blank", "empty_prompt"),
        ("nogt", "missing_ground_truth"),
        ("long", "prompt_too_long"),
        ("ok", "duplicate_prompt_id"),
    }
    assert out.counts["rejected/empty_prompt"] == 2


def test_a_file_without_a_prompt_column_is_a_data_error_naming_the_column(tmp_path, tokenizer_dir):
    path = write_ours(tmp_path / "x.parquet", [{"question": "hi", "ground_truth": "1"}])
    with pytest.raises(DataError, match="no 'prompt' column"):
        IngestStage().run(make_ctx(tmp_path, tokenizer_dir, [path]))


def test_missing_input_path_is_a_data_error(tmp_path, tokenizer_dir):
    with pytest.raises(DataError, match="does not exist"):
        IngestStage().run(make_ctx(tmp_path, tokenizer_dir, [tmp_path / "missing"]))


def test_all_rows_rejected_is_a_data_error_not_an_empty_table(tmp_path, tokenizer_dir):
    path = write_ours(tmp_path / "e.parquet", [{"prompt": "", "ground_truth": "1", "data_source": "arith"}])
    with pytest.raises(DataError, match="no valid prompts"):
        IngestStage().run(make_ctx(tmp_path, tokenizer_dir, [path]))


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right"])
def test_overlong_prompts_can_be_truncated_and_are_counted(tmp_path, tokenizer_dir, policy):
    rows = [
        {"prompt_id": "long", "data_source": "arith", "prompt": "What is 1 + 1? " * 40, "ground_truth": "2"},
        {"prompt_id": "short", "data_source": "arith", "prompt": "What is 1 + 1?", "ground_truth": "2"},
    ]
    ctx = make_ctx(
        tmp_path,
        tokenizer_dir,
        [write_ours(tmp_path / "t.parquet", rows)],
        max_prompt_tokens=32,
        overlong_prompts=policy,
    )
    out = IngestStage().run(ctx)
    assert out.counts["prompts"] == 2 and out.counts["rejected"] == 0 and out.counts["truncated_prompts"] == 1
    long_row = read_parquet(f"{ctx.output_dir}/part-00000.parquet").to_pylist()[0]
    assert len(long_row["prompt_token_ids"]) == 32
    if policy == "truncate_left":  # the generation prompt at the end survives
        assert long_row["prompt_text"].endswith("<|im_start|>assistant\n")
    else:
        assert long_row["prompt_text"].startswith("<|im_start|>user\n")


def test_a_float_ground_truth_is_written_without_a_trailing_zero_so_a_correct_answer_scores_1(tmp_path, tokenizer_dir):
    rows = [
        {"prompt_id": "a", "data_source": "arith", "prompt": "What is 12 + 7?", "ground_truth": 19.0},
        {"prompt_id": "b", "data_source": "arith", "prompt": "What is 5 / 2?", "ground_truth": 2.5},
        {"prompt_id": "c", "data_source": "arith", "prompt": "What is 0 / 0?", "ground_truth": float("nan")},
        {"prompt_id": "d", "data_source": "arith", "prompt": "What is 1 / 0?", "ground_truth": float("inf")},
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "f.parquet", rows)])
    out = IngestStage().run(ctx)
    written = read_parquet(f"{ctx.output_dir}/part-00000.parquet").to_pylist()
    assert [(r["prompt_id"], r["ground_truth"]) for r in written] == [("a", "19"), ("b", "2.5")]
    assert gsm8k_strict("12 + 7 = 19\n#### 19", written[0]["ground_truth"]) == 1.0
    assert out.counts["rejected/bad_ground_truth"] == 2
    rejects = read_rejects(ctx, out)
    assert {r["prompt_id"]: r["detail"] for r in rejects} == {
        "c": "ground truth is nan, not a number an answer can equal",
        "d": "ground truth is inf, not a number an answer can equal",
    }


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (19, "19"),
        (19.0, "19"),
        (-0.0, "0"),
        (2.5, "2.5"),
        (1e-05, "0.00001"),
        (1e20, "100000000000000000000"),
        (Decimal("7.50"), "7.5"),
        ("19.0", "19.0"),
    ],
)
def test_numeric_ground_truths_become_the_text_a_response_would_write(value, text):
    assert ground_truth_text(value) == (text, None)


def test_an_int_ground_truth_column_in_verls_layout_is_kept_as_its_digits(tmp_path, tokenizer_dir):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
            "reward_model": {"style": "rule", "ground_truth": 4},
        }
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "verl.parquet", rows)])
    IngestStage().run(ctx)
    assert read_parquet(f"{ctx.output_dir}/part-00000.parquet").to_pylist()[0]["ground_truth"] == "4"


def test_unknown_roles_and_non_text_prompts_are_rejected_with_an_accurate_reason(tmp_path, tokenizer_dir):
    chat = [
        {
            "prompt_id": "ok",
            "data_source": "arith",
            "ground_truth": "2",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
        },
        {
            "prompt_id": "robot",
            "data_source": "arith",
            "ground_truth": "2",
            "prompt": [{"role": "robot", "content": "beep"}, {"role": "user", "content": "1 + 1?"}],
        },
    ]
    numbers = [{"prompt_id": "n", "data_source": "arith", "ground_truth": "2", "prompt": 42}]
    files = [write_ours(tmp_path / "chat.parquet", chat), write_ours(tmp_path / "numbers.parquet", numbers)]
    ctx = make_ctx(tmp_path, tokenizer_dir, files)
    out = IngestStage().run(ctx)
    assert out.counts["prompts"] == 1
    rejects = read_rejects(ctx, out)
    assert {(r["prompt_id"], r["reason"]) for r in rejects} == {("robot", "bad_role"), ("n", "bad_prompt")}
    detail = {r["prompt_id"]: r["detail"] for r in rejects}
    assert "'robot'" in detail["robot"] and detail["n"].startswith("prompt is an integer (42); expected a string")


def test_a_file_without_rows_is_named_when_no_prompt_is_left(tmp_path, tokenizer_dir):
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": pa.array([], pa.string()),
                "ground_truth": pa.array([], pa.string()),
                "data_source": pa.array([], pa.string()),
            }
        ),
        empty,
    )
    with pytest.raises(DataError, match=f"no valid prompts in {empty}: 0 row.*with no rows: {empty}"):
        IngestStage().run(make_ctx(tmp_path, tokenizer_dir, [empty]))
    with pytest.raises(DataError, match=f"every input file is empty \\(0 rows\\): {empty}"):
        IngestStage().check_inputs(make_ctx(tmp_path, tokenizer_dir, [empty]).cfg)


def test_without_a_data_source_column_rewards_by_data_source_are_a_data_error_naming_file_and_column(
    tmp_path, tokenizer_dir
):
    path = write_ours(tmp_path / "nods.parquet", [{"prompt": "What is 1 + 1?", "ground_truth": "2"}])
    ctx = make_ctx(tmp_path, tokenizer_dir, [path])
    for check in (lambda: IngestStage().check_inputs(ctx.cfg), lambda: IngestStage().run(ctx)):
        with pytest.raises(DataError, match=f"{path} has no 'data_source' column.*score.rewards"):
            check()
    listed = ctx.cfg.model_copy(update={"score": ScoreConfig(rewards=[{"reward": "gsm8k"}])})
    IngestStage().check_inputs(listed)  # with the rewards listed, data_source picks nothing: not needed
    out = IngestStage().run(dataclasses.replace(ctx, cfg=listed))
    assert out.counts["data_source/unknown"] == 1


@pytest.mark.parametrize("content", [b"", b"prompt,ground_truth\n1+1?,2\n"], ids=["zero_bytes", "csv"])
def test_an_unreadable_input_file_is_a_data_error_naming_it_before_anything_is_written(
    tmp_path, tokenizer_dir, content
):
    path = tmp_path / "bad.parquet"
    path.write_bytes(content)
    ctx = make_ctx(tmp_path, tokenizer_dir, [path])
    with pytest.raises(DataError, match=f"data.train_files: {path} is not a readable Parquet file"):
        IngestStage().check_inputs(ctx.cfg)
    with pytest.raises(DataError, match=f"{path} is not a readable Parquet file"):
        IngestStage().run(ctx)
    assert not (tmp_path / "runs").exists()


def test_prompts_without_labels_are_kept_when_no_reward_that_runs_on_them_needs_one(tmp_path, tokenizer_dir):
    """Label-free prompts: a reward model alone, or label-free terms, need no ground_truth column; with rewards by
    data_source, a row is rejected only when its own data_source's reward needs the label it lacks."""
    path = write_ours(
        tmp_path / "nolabels.parquet",
        [{"prompt_id": f"c{i}", "data_source": "chat", "prompt": f"Say hello {i}"} for i in range(3)],
    )
    ctx = make_ctx(tmp_path, tokenizer_dir, [path])
    with pytest.raises(DataError, match="no 'ground_truth' .* column.*@label_free"):  # the defaults need labels
        IngestStage().check_inputs(ctx.cfg)
    for score in (
        ScoreConfig(reward_model={"path": tokenizer_dir}),
        ScoreConfig(rewards=[{"reward": "format_think"}, {"reward": "overlong_penalty", "params": {"max_length": 9}}]),
    ):
        cfg = ctx.cfg.model_copy(update={"score": score})
        IngestStage().check_inputs(cfg)
        out = IngestStage().run(dataclasses.replace(ctx, cfg=cfg, output_dir=f"{ctx.output_dir}-{len(score.rewards)}"))
        assert out.counts["prompts"] == 3 and out.counts["rejected"] == 0
        table = read_parquet(f"{ctx.output_dir}-{len(score.rewards)}/{out.parts[0].name}")
        assert table.column("ground_truth").to_pylist() == [None] * 3
    # a term that needs a label, beside the reward model: every row needs one
    both = ctx.cfg.model_copy(
        update={"score": ScoreConfig(rewards=[{"reward": "gsm8k"}], reward_model={"path": tokenizer_dir})}
    )
    with pytest.raises(DataError, match="no 'ground_truth'"):
        IngestStage().check_inputs(both)


def test_by_data_source_a_row_lacking_the_label_its_reward_needs_is_rejected_naming_the_reward(tmp_path, tokenizer_dir):
    rows = [
        {"prompt_id": "a0", "data_source": "arith", "prompt": "What is 1 + 1?", "ground_truth": "2"},
        {"prompt_id": "a1", "data_source": "arith", "prompt": "What is 1 + 2?", "ground_truth": None},
        {"prompt_id": "c0", "data_source": "chat", "prompt": "Think, then greet me", "ground_truth": None},
        {"prompt_id": "c1", "data_source": "chat", "prompt": "Greet me", "ground_truth": "  "},
    ]
    ctx = make_ctx(tmp_path, tokenizer_dir, [write_ours(tmp_path / "mixed.parquet", rows)])
    cfg = ctx.cfg.model_copy(update={"score": ScoreConfig(reward_by_data_source={"chat": "format_think"})})
    IngestStage().check_inputs(cfg)
    out = IngestStage().run(dataclasses.replace(ctx, cfg=cfg))
    kept = read_parquet(f"{ctx.output_dir}/{out.parts[0].name}").to_pylist()
    assert [(r["prompt_id"], r["ground_truth"]) for r in kept] == [("a0", "2"), ("c0", None), ("c1", None)]
    assert [(r["prompt_id"], r["reason"], r["detail"]) for r in read_rejects(ctx, out)] == [
        ("a1", "missing_ground_truth", "no ground_truth / reward_model.ground_truth, which reward 'gsm8k' needs")
    ]


def test_label_rule_follows_what_runs_on_a_row_and_each_rewards_mark():
    from batchrl.rewards import REWARDS, LabelRule, label_free, needs_ground_truth

    assert sorted(n for n, fn in REWARDS.items() if not needs_ground_truth(fn)) == [
        "code_tests",  # its tests may be in extra_info: a row without any fails its samples at scoring, naming why
        "environment",  # the environment's reward
        "format_boxed",
        "format_hash",
        "format_think",
        "judge",  # the judge's verdict (its template may read {ground_truth}: a missing one is the sample's error)
        "overlong_penalty",
        "truncation_penalty",
    ]
    by_source = LabelRule(ScoreConfig())
    assert by_source.needing_label("arith") == "gsm8k" and by_source.needing_label("math") == "math"
    assert by_source.needing_label("nobody") == "the reward of data_source 'nobody'" and by_source.every_row
    mixed = LabelRule(ScoreConfig(reward_by_data_source={"chat": "format_hash"}))
    assert mixed.needing_label("chat") is None and mixed.needing_label("arith") == "gsm8k" and not mixed.every_row
    terms = LabelRule(ScoreConfig(rewards=[{"reward": "format_hash"}, {"reward": "math", "name": "acc"}]))
    assert terms.needing_label("anything") == "acc" and terms.every_row
    assert LabelRule(ScoreConfig(reward_model={"path": "rm"})).needing_label("x") is None
    # a user's function needs a label unless marked
    assert needs_ground_truth(lambda response, ground_truth, **row: 1.0)
    assert not needs_ground_truth(label_free(lambda response, ground_truth=None, **row: 1.0))
