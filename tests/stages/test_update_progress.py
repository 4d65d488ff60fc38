"""A real update (2 gloo ranks on the tiny Qwen2 of test_trainer) reports its optimizer steps to the launching
process while it runs: rank 0 alone, in order, ending at the planned total, with the step losses."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console
from trainer_helpers import make_spec, synthetic_rows, write_advantages

from batchrl.stages.update import _progress_display
from batchrl.tracking.progress import progress
from batchrl.trainer import run_update


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    from batchrl_toy import build_toy_model

    out = tmp_path_factory.mktemp("update_progress") / "policy_in"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


def test_a_two_rank_update_reports_every_step_once_and_ends_at_the_total(tiny_policy, tmp_path):
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(tiny_policy)).vocab_size
    files = write_advantages(synthetic_rows(vocab_size=vocab_size), tmp_path / "advantages")
    # 4 prompts in mini-batches of 2 prompts, 2 epochs: 4 optimizer steps.
    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "policy"),
        advantages_files=files,
        metrics_path=str(tmp_path / "metrics.json"),
        num_processes=2,
        backend="gloo",
        lr=1e-4,
        micro_batch_size=2,
        ppo_mini_batch_size=2,
        ppo_epochs=2,
    )
    records = []
    metrics = run_update(spec, timeout_s=120, on_progress=records.append)

    assert [r["phase"] for r in records] == ["logprobs"] + ["train"] * 5 + ["save"]
    train = [r for r in records if r["phase"] == "train"]
    assert [(r["done"], r["total"]) for r in train] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert [r["global_step"] for r in train[1:]] == [1, 2, 3, 4]
    assert all(math.isfinite(r["pg_loss"]) and r["grad_norm"] > 0 for r in train[1:])
    assert metrics["actor/num_optimizer_steps"] == 4
    assert math.isclose(sum(r["pg_loss"] for r in train[1:]) / 4, metrics["actor/pg_loss"], rel_tol=1e-9)

    terminal = io.StringIO()
    with progress(None, "update: loading", console=Console(file=terminal, force_terminal=True, width=120)) as bar:
        show = _progress_display(bar)
        for record in records + [{"phase": "finished"}]:
            show(record)
    assert (bar.completed, bar.total) == (4, 4) and "update: steps  pg_loss" in terminal.getvalue()
