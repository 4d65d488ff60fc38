"""RL from a reward model alone on prompts that have no labels (issue 14, label-free prompts): ingest keeps them,
the tiny local reward model scores every sample, and the update trains on its scores."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import cli_ok, read_manifest, read_rows

pytestmark = pytest.mark.slow


def tiny_reward_model(path: Path) -> str:
    """A random Qwen2ForSequenceClassification (num_labels=1) with the toy tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from batchrl_toy import build_toy_tokenizer

    tokenizer = build_toy_tokenizer(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return str(path)


def test_a_reward_model_alone_trains_on_prompts_without_labels(tmp_path, pipeline, toy_prompts_dir):
    first = sorted(Path(toy_prompts_dir).glob("*.parquet"))[0]
    table = pq.read_table(first).drop_columns(["ground_truth"])
    table = table.set_column(table.column_names.index("data_source"), "data_source", [["chat"] * table.num_rows])
    prompts = tmp_path / "unlabelled.parquet"
    pq.write_table(table, prompts)
    path = pipeline(
        {
            "data.train_files": [str(prompts)],
            # no rule reward (and no default reward exists for data_source "chat"): the reward model alone
            "score": {"rewards": [], "reward_model": {"path": tiny_reward_model(tmp_path / "rm"), "batch_size": 4}},
        }
    )
    cli_ok("run", path)
    run = tmp_path / "runs" / "tiny"
    manifest = read_manifest(run / "prompts")
    assert manifest["counts"]["prompts"] == 8 and manifest["counts"]["rejected"] == 0
    assert all(row["ground_truth"] is None for row in read_rows(run / "prompts"))
    scores = read_rows(run / "iter_0000" / "scores")
    assert {tuple(row["reward_names"]) for row in scores} == {("reward_model",)}
    values = [s for row in scores for s in row["scores"]]
    assert len(values) == 16 and all(math.isfinite(v) for v in values) and len(set(values)) > 1
    assert {p["name"] for p in read_manifest(run / "iter_0000" / "policy")["parts"]} >= {"model.safetensors"}
