"""The update as Ray actors in a placement group (`ray_launch`) computes what local processes compute, stages its
own inputs, uploads what every rank wrote, and cleans up after a failure. 2 gloo ranks on the tiny Qwen2 of
test_trainer, on a local Ray instance (the launcher cannot tell it from a one-node cluster)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import load_weights, make_spec, synthetic_rows, write_advantages

from batchrl.trainer import run_update
from batchrl.trainer.ray_launch import run_update_on_ray

TIMEOUT_S = 180
# Two mini-batches, a reference that differs from the policy (KL loss): the second update's steps depend on the
# Adam moments the first one saved, so a rank's optimizer shard that was not uploaded would change the result.
OPTIONS = dict(num_processes=2, backend="gloo", lr=1e-4, micro_batch_size=2, ppo_mini_batch_size=2, kl_loss_coef=0.1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer_ray")


@pytest.fixture(scope="module")
def policies(workdir) -> tuple[Path, Path]:
    """(reference, policy): the tiny model and a perturbed copy of it."""
    from transformers import AutoModelForCausalLM

    from batchrl_toy import build_toy_model

    reference, policy = workdir / "reference", workdir / "policy_in"
    build_toy_model(
        reference, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0
    )
    model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(str(policy))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (policy / name).write_bytes((reference / name).read_bytes())
    return reference, policy


@pytest.fixture(scope="module")
def advantages_files(workdir, policies) -> list[str]:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(policies[0])).vocab_size
    return write_advantages(synthetic_rows(vocab_size=vocab_size, seed=3), workdir / "advantages")


def two_updates(launch, *, out: Path, policies, advantages_files) -> list[Path]:
    """Two consecutive updates, the second from the first's policy and optimizer state; their output dirs."""
    reference, policy_in = policies
    outs = [out / "update-0", out / "update-1"]
    for index, update_out in enumerate(outs):
        spec = make_spec(
            policy_in=str(policy_in if index == 0 else outs[0] / "policy"),
            policy_out=str(update_out / "policy"),
            advantages_files=advantages_files,
            metrics_path=str(update_out / "metrics.json"),
            reference_policy=str(reference),
            trainer_state_in=None if index == 0 else str(outs[0] / "trainer_state"),
            trainer_state_out=str(update_out / "trainer_state"),
            logprobs_dir=str(update_out / "logprobs"),
            seed=index,
            **OPTIONS,
        )
        launch(spec)
    return outs


# Ranks with other thread counts reduce in another order, so a float32 log-prob may differ in its last bits:
# ~8 ulps of float32 (eps 1.19e-7) of the value, or of the logits (~1) it was computed from near 0.
LOGPROB_RTOL = LOGPROB_ATOL = 8 * float(np.finfo(np.float32).eps)


def same_logprobs(table_a: pa.Table, table_b: pa.Table) -> bool:
    """Equal keys and counts; log-probs equal to float32 rounding, per token, and their float64 sums over a sample's
    loss tokens to the same bound times the number of tokens summed (each term brings its own rounding)."""
    if table_a.schema != table_b.schema or table_a.num_rows != table_b.num_rows:
        return False
    terms = table_a["num_loss_tokens"].to_numpy()
    for name in table_a.column_names:
        a, b = table_a[name].combine_chunks(), table_b[name].combine_chunks()
        if pa.types.is_list(a.type):
            if a.value_lengths() != b.value_lengths():
                return False
            a, b = a.flatten(), b.flatten()
        if pa.types.is_floating(a.type):
            a, b = a.to_numpy(zero_copy_only=False), b.to_numpy(zero_copy_only=False)
            scale = np.maximum(terms, 1) if name.endswith("_sum") else 1
            if not np.all(
                np.isclose(a, b, rtol=LOGPROB_RTOL, atol=0, equal_nan=True) | (np.abs(a - b) <= LOGPROB_ATOL * scale)
            ):
                return False
        elif a != b:
            return False
    return True


def test_ray_actors_train_the_same_weights_as_local_processes_and_upload_every_ranks_files(
    ray_session, workdir, policies, advantages_files, monkeypatch
):
    # One thread per rank in both launchers (a Ray actor with 1 CPU gets OMP_NUM_THREADS=1).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    local = two_updates(
        lambda spec: run_update(spec, timeout_s=TIMEOUT_S),
        out=workdir / "local",
        policies=policies,
        advantages_files=advantages_files,
    )
    results = []
    on_ray = two_updates(
        lambda spec: results.append(run_update_on_ray(spec, timeout_s=TIMEOUT_S)),
        out=workdir / "ray",
        policies=policies,
        advantages_files=advantages_files,
    )

    for local_out, ray_out in zip(local, on_ray):
        weights_local, weights_ray = load_weights(local_out / "policy"), load_weights(ray_out / "policy")
        assert max((weights_local[k] - weights_ray[k]).abs().max().item() for k in weights_local) <= 1e-6
        assert same_logprobs(pq.read_table(local_out / "logprobs"), pq.read_table(ray_out / "logprobs"))
        assert sorted(p.relative_to(local_out).as_posix() for p in local_out.rglob("*") if p.is_file()) == sorted(
            p.relative_to(ray_out).as_posix() for p in ray_out.rglob("*") if p.is_file()
        )
    assert {Path(f.uri).name for f in results[0].uploaded} >= {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "trainer_state.json",
        "model.safetensors",
        "part-00000.parquet",  # each rank's part of the log-probs table
        "part-00001.parquet",
    }
    assert all(Path(f.uri).stat().st_size == f.num_bytes for f in results[0].uploaded)
    assert results[1].metrics["actor/optimizer_state_restored"] == 1.0 and results[1].metrics["actor/kl_loss"] > 0
    assert results[1].metrics["actor/global_step"] == 4


def placement_groups_left() -> list[dict]:
    import ray

    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_a_failing_rank_raises_its_error_and_leaves_no_placement_group(ray_session, tmp_path, policies):
    from transformers import AutoConfig

    rows = synthetic_rows(vocab_size=AutoConfig.from_pretrained(str(policies[0])).vocab_size, seed=4)
    rows[3]["advantage"] = float("nan")
    spec = make_spec(
        policy_in=str(policies[1]),
        policy_out=str(tmp_path / "policy"),
        advantages_files=write_advantages(rows, tmp_path / "advantages"),
        metrics_path=str(tmp_path / "metrics.json"),
        num_processes=2,
        backend="gloo",
    )

    with pytest.raises(RuntimeError, match=r"update rank \d failed on Ray(.|\n)*NaN"):
        run_update_on_ray(spec, timeout_s=TIMEOUT_S)
    assert placement_groups_left() == []
    assert not (tmp_path / "policy").exists() and not (tmp_path / "metrics.json").exists()

    with pytest.raises(RuntimeError, match="timed out after 0.5 s"):
        run_update_on_ray(spec, timeout_s=0.5)
    assert placement_groups_left() == []


def test_auto_launches_on_ray_only_on_a_cluster_and_the_launcher_is_not_in_the_fingerprint(ray_session, tmp_path):
    from batchrl.config import ConfigError, load_pipeline
    from batchrl.config.models import PipelineConfig
    from batchrl.stages.update import UpdateStage, _launcher

    def config(**update) -> PipelineConfig:
        return PipelineConfig(name="t", model={"path": "m"}, data={"train_files": ["x.parquet"]}, update=update)

    # the runner's own local Ray
    assert _launcher(config(), embedded_ray=True) == "local"
    assert _launcher(config(launcher="ray"), embedded_ray=True) == "ray"
    # connected to a cluster (this test's Ray stands in for one)
    assert _launcher(config(), embedded_ray=False) == "ray"
    assert _launcher(config(launcher="local"), embedded_ray=False) == "local"
    fingerprint = UpdateStage().fingerprint_config
    assert (
        fingerprint(config(launcher="ray", cpus_per_rank=4))
        == fingerprint(config(launcher="local"))
        == fingerprint(config())
    )
    (tmp_path / "p.yaml").write_text("name: t\nmodel: {path: m}\ndata: {train_files: [x]}\nupdate: {launcher: slurm}\n")
    with pytest.raises(ConfigError, match=r"update\.launcher"):
        load_pipeline(tmp_path / "p.yaml")


def test_ranks_the_cluster_cannot_place_fail_with_what_was_asked_and_what_the_cluster_has(
    ray_session, tmp_path, policies, monkeypatch
):
    from batchrl.trainer import ray_launch

    monkeypatch.setattr(ray_launch, "PLACEMENT_TIMEOUT_S", 1.0)
    spec = make_spec(
        policy_in=str(policies[1]),
        policy_out=str(tmp_path / "policy"),
        advantages_files=[str(tmp_path / "part-00000.parquet")],
        metrics_path=str(tmp_path / "metrics.json"),
        num_processes=2,
        backend="gloo",
    )
    with pytest.raises(RuntimeError, match=r"could not place 2 rank\(s\) of \{'CPU': 3.0\}(.|\n)*'CPU': 2.0"):
        run_update_on_ray(spec, cpus_per_rank=3, timeout_s=TIMEOUT_S)
    assert placement_groups_left() == []


def tampered_trainer_state(root: Path, marker: Path) -> tuple[Path, dict[str, str]]:
    """A trainer-state directory whose `.metadata` was replaced by a pickle that creates `marker` when loaded, and
    the sha256 its writer recorded (the files need not be a loadable state: a refused one is never opened)."""
    import pickle

    from test_trainer_resume import CreatesAFileWhenUnpickled

    from batchrl.trainer.integrity import file_sha256

    files = {
        "trainer_state.json": b'{"global_step": 1}',
        "optimizer/.metadata": b"metadata as DCP wrote it",
        "optimizer/__0_0.distcp": b"moments",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    recorded = {name: file_sha256(root / name) for name in files}
    (root / "optimizer" / ".metadata").write_bytes(pickle.dumps(CreatesAFileWhenUnpickled(marker)))
    return root, recorded


def test_ray_ranks_refuse_a_trainer_state_that_does_not_hash_as_recorded_before_loading_it(
    ray_session, tmp_path, policies, advantages_files
):
    from batchrl.trainer.integrity import TrainerStateError

    marker = tmp_path / "code-ran"
    state, recorded = tampered_trainer_state(tmp_path / "state", marker)
    spec = make_spec(
        policy_in=str(policies[1]),
        policy_out=str(tmp_path / "policy"),
        advantages_files=advantages_files,
        metrics_path=str(tmp_path / "metrics.json"),
        reference_policy=str(policies[0]),
        trainer_state_in=str(state),
        trainer_state_sha256=recorded,
        **OPTIONS,
    )
    with pytest.raises(TrainerStateError, match=r"optimizer/\.metadata: sha256"):
        run_update_on_ray(spec, timeout_s=TIMEOUT_S)
    assert not marker.exists() and placement_groups_left() == []


def test_a_ray_actor_checks_the_whole_trainer_state_it_downloads(tmp_path, policies, advantages_files):
    """Each node downloads its own copy: the worker's check, shared out among the ranks, would vouch for one copy's
    files by another's hashes; so the actor checks all of its copy first."""
    import fsspec

    from batchrl.trainer.integrity import TrainerStateError
    from batchrl.trainer.ray_launch import stage_inputs

    marker = tmp_path / "code-ran"
    state, recorded = tampered_trainer_state(tmp_path / "state", marker)
    remote = fsspec.filesystem("memory")
    for path in state.rglob("*"):
        if path.is_file():
            remote.pipe_file(f"/{tmp_path.name}/state/{path.relative_to(state).as_posix()}", path.read_bytes())
    spec = make_spec(
        policy_in=str(policies[1]),
        policy_out=str(tmp_path / "policy"),
        advantages_files=advantages_files,
        metrics_path=str(tmp_path / "metrics.json"),
        trainer_state_in=f"memory://{tmp_path.name}/state",
        trainer_state_sha256=recorded,
    )
    with pytest.raises(TrainerStateError, match=r"optimizer/\.metadata: sha256"):
        stage_inputs(spec, tmp_path / "scratch")
    assert not marker.exists()
