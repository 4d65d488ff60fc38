"""Resident update ranks (update.trainer_lifetime: run) compute what fresh ones do, bit for bit, and recover from
a rank that dies between updates. 2 gloo ranks on the tiny Qwen2 of test_trainer.

The second update reads copies of what the first wrote (as the pipeline hands the next iteration the published
policy and optimizer state, with a manifest beside them), so the ranks must recognise their own output by
content, not by path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from trainer_helpers import make_spec, synthetic_rows, write_advantages

from batchrl.trainer import launch, run_update, shutdown_trainers

TIMEOUT_S = 120
# Two mini-batches per update, so the second update's steps depend on the Adam moments the first one left.
OPTIONS = dict(
    num_processes=2,
    backend="gloo",
    lr=1e-4,
    micro_batch_size=2,
    ppo_mini_batch_size=2,
    ppo_epochs=1,
    entropy_coeff=0.01,
)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    from batchrl_toy import build_toy_model

    out = tmp_path_factory.mktemp("trainer_resident") / "policy_in"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


@pytest.fixture(scope="module")
def advantages(tiny_policy, tmp_path_factory) -> list[list[str]]:
    """One advantages table per update."""
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(tiny_policy)).vocab_size
    root = tmp_path_factory.mktemp("resident_advantages")
    return [
        write_advantages(synthetic_rows(vocab_size=vocab_size, seed=seed), root / f"update{seed}") for seed in range(2)
    ]


@pytest.fixture(autouse=True)
def no_resident_ranks_left():
    shutdown_trainers()
    yield
    shutdown_trainers()


def publish(src: Path, dst: Path) -> Path:
    """A copy of an update's output under a new path, with a manifest beside the files, as the stage publishes."""
    shutil.copytree(src, dst)
    (dst / "_MANIFEST.json").write_text("{}")
    return dst


def two_updates(root: Path, tiny_policy: Path, advantages: list[list[str]], *, resident: bool, between=None):
    """Update 0 from tiny_policy, update 1 from the published copies of update 0's policy and optimizer state.
    Returns both updates' metrics and the directory of update 1's policy."""
    metrics, policy_in, state_in = [], str(tiny_policy), None
    for index, files in enumerate(advantages):
        out = root / f"update{index}"
        spec = make_spec(
            policy_in=policy_in,
            policy_out=str(out / "policy"),
            advantages_files=files,
            metrics_path=str(out / "metrics.json"),
            trainer_state_in=state_in,
            trainer_state_out=str(out / "trainer_state"),
            seed=index,
            **OPTIONS,
        )
        metrics.append(run_update(spec, timeout_s=TIMEOUT_S, resident=resident))
        policy_in = str(publish(out / "policy", root / f"published{index}"))
        state_in = str(publish(out / "trainer_state", root / f"published{index}" / "_trainer_state"))
        if between is not None and index == 0:
            between()
    return metrics, root / f"update{len(advantages) - 1}" / "policy"


def load_tensors(policy_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(policy_dir / "model.safetensors"))


def test_resident_ranks_reuse_their_model_and_train_the_same_weights_as_fresh_ones(tiny_policy, advantages, tmp_path):
    fresh_metrics, fresh_policy = two_updates(tmp_path / "fresh", tiny_policy, advantages, resident=False)
    assert launch._POOL is None
    resident_metrics, resident_policy = two_updates(tmp_path / "resident", tiny_policy, advantages, resident=True)

    assert [m["actor/trainer_reused"] for m in fresh_metrics] == [0.0, 0.0]
    assert [m["actor/trainer_reused"] for m in resident_metrics] == [0.0, 1.0]
    fresh, resident = load_tensors(fresh_policy), load_tensors(resident_policy)
    assert fresh.keys() == resident.keys()
    assert [name for name in fresh if not torch.equal(fresh[name], resident[name])] == []
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/global_step", "actor/lr"):
        assert resident_metrics[1][name] == fresh_metrics[1][name], name
    assert resident_metrics[1]["perf/load_time_s"] < fresh_metrics[1]["perf/load_time_s"]
    assert launch._POOL is not None and launch._POOL.alive() and launch._POOL.updates == 2


def test_a_resident_rank_killed_between_updates_means_fresh_ranks_for_the_next(tiny_policy, advantages, tmp_path):
    killed = []

    def kill_rank_1():
        process = launch._POOL.workers[1]["process"]
        process.kill()
        process.wait()
        killed.append(process.pid)

    metrics, policy = two_updates(tmp_path, tiny_policy, advantages, resident=True, between=kill_rank_1)

    assert [m["actor/trainer_reused"] for m in metrics] == [0.0, 0.0]  # restarted ranks load from disk
    assert metrics[1]["actor/global_step"] == 4 and (policy / "model.safetensors").is_file()
    assert launch._POOL is not None and killed[0] not in [w["process"].pid for w in launch._POOL.workers]


def test_a_failing_resident_update_drops_the_ranks_and_the_next_starts_fresh(tiny_policy, advantages, tmp_path):
    from transformers import AutoConfig

    rows = synthetic_rows(vocab_size=AutoConfig.from_pretrained(str(tiny_policy)).vocab_size, seed=3)
    rows[3]["advantage"] = float("nan")
    bad = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "bad" / "policy"),
        advantages_files=write_advantages(rows, tmp_path / "bad_advantages"),
        metrics_path=str(tmp_path / "bad" / "metrics.json"),
        **OPTIONS,
    )
    with pytest.raises(RuntimeError, match="NaN"):
        run_update(bad, timeout_s=TIMEOUT_S, resident=True)
    assert launch._POOL is None and not Path(bad.policy_out).exists()

    good = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "good" / "policy"),
        advantages_files=advantages[0],
        metrics_path=str(tmp_path / "good" / "metrics.json"),
        **OPTIONS,
    )
    assert run_update(good, timeout_s=TIMEOUT_S, resident=True)["actor/trainer_reused"] == 0.0


def test_the_trainer_lifetime_is_not_part_of_the_update_fingerprint():
    from batchrl.config.models import PipelineConfig
    from batchrl.stages.update import UpdateStage

    def config(**update) -> PipelineConfig:
        return PipelineConfig(name="t", model={"path": "m"}, data={"train_files": ["x.parquet"]}, update=update)

    def fingerprint(**update) -> dict:
        return UpdateStage().fingerprint_config(config(**update))

    assert config().update.trainer_lifetime == "run"
    assert fingerprint(trainer_lifetime="run") == fingerprint(trainer_lifetime="stage") == fingerprint()
