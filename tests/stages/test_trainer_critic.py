"""The critic's part of an update (batchrl.trainer.critic) on gloo ranks: it trains, saves an HF token-classification
checkpoint and its optimizer state, gives the same weights on 1 and 2 processes, and a warm-up update trains it
alone, saving the policy as it was loaded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import load_weights, make_spec, synthetic_rows, tiny_policy_at

from batchrl.config.models import CriticConfig
from batchrl.trainer import run_update

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("critic")


@pytest.fixture(scope="module")
def tiny_policy(workdir) -> Path:
    return tiny_policy_at(workdir / "policy_in")


@pytest.fixture(scope="module")
def advantages_files(workdir, tiny_policy) -> list[str]:
    """A GAE advantages table: per-token advantages, values and returns beside the usual columns."""
    from transformers import AutoConfig

    rows = synthetic_rows(vocab_size=AutoConfig.from_pretrained(str(tiny_policy)).vocab_size)
    rng = np.random.default_rng(1)
    for row in rows:
        n = len(row["response_token_ids"])
        row["values"] = rng.normal(size=n).tolist()
        row["returns"] = (np.asarray(row["values"]) + rng.normal(size=n)).tolist()
        row["token_advantages"] = rng.normal(size=n).tolist()
        row["advantage"] = row["token_advantages"][0] if n else 0.0
    paths = []
    for index, part in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2 :])):
        table = pa.Table.from_pylist(part)
        for name, lists in (("prompt_length", "prompt_token_ids"), ("response_length", "response_token_ids")):
            table = table.append_column(name, pa.compute.list_value_length(table.column(lists)).cast(pa.int32()))
        for name in ("values", "returns", "token_advantages", "response_logprobs"):
            table = table.set_column(
                table.schema.get_field_index(name), name, table.column(name).cast(pa.list_(pa.float32()))
            )
        path = workdir / "advantages" / f"part-{index:05d}.parquet"
        path.parent.mkdir(exist_ok=True)
        pq.write_table(table, path)
        paths.append(str(path))
    return paths


def update(workdir, tiny_policy, advantages_files, name: str, **options) -> tuple[dict, Path]:
    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(workdir / name / "policy"),
        advantages_files=advantages_files,
        metrics_path=str(workdir / name / "metrics.json"),
        trainer_state_out=str(workdir / name / "state"),
        backend="gloo",
        lr=1e-4,
        critic=CriticConfig(lr=1e-3, max_tokens_per_micro_batch=64),
        **options,
    )
    return run_update(spec, timeout_s=TIMEOUT_S), Path(spec.policy_out)


def critic_weights(policy_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(str(policy_dir / "critic"), dtype=torch.float32)
    assert model.config.num_labels == 1
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_the_critic_trains_the_same_on_one_and_two_processes(workdir, tiny_policy, advantages_files):
    metrics_1, policy_1 = update(workdir, tiny_policy, advantages_files, "one", num_processes=1)
    metrics_2, policy_2 = update(workdir, tiny_policy, advantages_files, "two", num_processes=2)
    for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert math.isfinite(metrics_1[name]) and metrics_2[name] == pytest.approx(metrics_1[name], rel=1e-4), name
    assert metrics_1["critic/num_optimizer_steps"] == 1 and metrics_1["critic/optimizer_state_restored"] == 0
    w1, w2 = critic_weights(policy_1), critic_weights(policy_2)
    assert max((w1[n] - w2[n]).abs().max().item() for n in w1) <= 1e-5
    # the critic moved from its start: the policy's body and a fresh head
    body = load_weights(tiny_policy)
    assert any(not torch.equal(w1[n], body[n]) for n in w1 if n in body)
    assert (workdir / "one" / "state" / "critic" / "trainer_state.json").is_file()


def test_a_warm_up_update_trains_the_critic_and_saves_the_policy_it_loaded(workdir, tiny_policy, advantages_files):
    metrics, policy = update(workdir, tiny_policy, advantages_files, "warmup", num_processes=1, train_actor=False)
    assert metrics["actor/warmup"] == 1.0 and metrics["critic/num_optimizer_steps"] == 1
    before, after = load_weights(tiny_policy), load_weights(policy)
    assert all(torch.equal(before[n], after[n]) for n in before)
    state = workdir / "warmup" / "state"
    assert not (state / "trainer_state.json").exists()  # the actor took no step: no state of its own
    assert (state / "critic" / "trainer_state.json").is_file()
