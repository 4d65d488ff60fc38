"""The plan of overlapped iterations (run.max_staleness): which policy each stage of an iteration reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import validate_dict
from batchrl.pipeline.plan import build_plan


def config(tmp_path: Path, *, staleness: int, critic: bool = False) -> object:
    raw = {
        "name": "r",
        "run": {"root": str(tmp_path / "runs"), "iterations": 4, "max_staleness": staleness},
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        "data": {"train_files": [str(tmp_path / "in")]},
    }
    if critic:
        raw |= {"advantage": {"estimator": "gae"}, "critic": {}}
    return validate_dict(raw)


@pytest.mark.parametrize("staleness", [1, 2])
def test_iteration_i_generates_with_policy_i_1_k_and_trains_policy_i_1(tmp_path, staleness):
    steps = {step.label: step for step in build_plan(config(tmp_path, staleness=staleness), check_storage=False)}
    initial = "Qwen/Qwen2.5-0.5B-Instruct"
    for i in range(4):
        behaviour = initial if i - 1 - staleness < 0 else steps[f"iter {i - 1 - staleness} update"].output_dir
        trained = initial if i == 0 else steps[f"iter {i - 1} update"].output_dir
        assert steps[f"iter {i} generate"].policy_in == behaviour
        assert steps[f"iter {i} update"].policy_in == trained
        assert steps[f"iter {i} update"].behaviour_policy == behaviour


def test_strict_order_keeps_its_fingerprints_and_staleness_changes_them_from_the_first_lagging_iteration(tmp_path):
    strict = {s.label: s.fingerprint for s in build_plan(config(tmp_path, staleness=0), check_storage=False)}
    lagged = {s.label: s.fingerprint for s in build_plan(config(tmp_path, staleness=1), check_storage=False)}
    assert strict["iter 0 generate"] == lagged["iter 0 generate"]  # both the initial policy
    assert strict["iter 1 generate"] != lagged["iter 1 generate"]  # policy 0 against the initial policy
    assert strict["iter 0 update"] != lagged["iter 0 update"]  # its old log-probs' source is in its config


def test_the_values_stage_reads_the_critic_of_the_behaviour_policy(tmp_path):
    steps = {step.label: step for step in build_plan(config(tmp_path, staleness=1, critic=True), check_storage=False)}
    assert steps["iter 2 values"].policy_in == steps["iter 2 generate"].policy_in == steps["iter 0 update"].output_dir


def with_gpu_engines(cfg, *, ranks, actors=1, gpus=1.0):
    return cfg.model_copy(
        update={
            "generate": cfg.generate.model_copy(update={"gpus_per_actor": gpus, "num_actors": actors}),
            "update": cfg.update.model_copy(update={"num_processes": ranks}),
        }
    )


def test_one_gpu_hosts_gpus_are_split_between_the_engines_and_the_update_ranks(tmp_path):
    from batchrl.config import ConfigError
    from batchrl.pipeline.devices import needs_split, overlap_gpu_split

    cfg = config(tmp_path, staleness=1)
    assert not needs_split(cfg, local_launcher=True)  # CPU engines: the shares are CPUs
    gpu = with_gpu_engines(cfg, ranks=2, actors=2, gpus=0.5)
    assert needs_split(gpu, local_launcher=True) and not needs_split(gpu, local_launcher=False)
    assert overlap_gpu_split(gpu, ["0", "1", "2", "3"]) == (["0", "1"], ["2", "3"])
    assert overlap_gpu_split(gpu, ["4", "6", "7"]) == (["4"], ["6", "7"])  # 2 actors x 0.5 GPU: one GPU
    with pytest.raises(ConfigError, match=r"need 3 GPUs, and this host has 2"):
        overlap_gpu_split(gpu, ["0", "1"])
    with pytest.raises(ConfigError, match="set update.num_processes"):
        overlap_gpu_split(with_gpu_engines(cfg, ranks="auto"), ["0", "1"])
    strict = with_gpu_engines(config(tmp_path, staleness=0), ranks=1)
    assert not needs_split(strict, local_launcher=True)  # strict order: the engines sleep or go while it trains


def test_overlap_with_gpu_engines_on_a_host_without_enough_gpus_is_a_config_error(tmp_path, monkeypatch):
    from batchrl.config import ConfigError
    from batchrl.pipeline.session import check_devices

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this host: no GPU
    cfg = config(tmp_path, staleness=1)
    with pytest.raises(ConfigError, match=r"need 2 GPUs, and this host has 0"):
        check_devices(with_gpu_engines(cfg, ranks=1))  # the runner asks it before the run directory is touched
    assert check_devices(cfg) is None  # CPU engines: the shares are generate.cpus_per_actor and update.cpus_per_rank


def test_the_update_ranks_get_their_share_of_threads_and_gpus():
    from batchrl.trainer.launch import _worker_env

    env = _worker_env(rank=1, world_size=2, port=1234, threads=3, cuda_devices="6,7")
    assert (env["OMP_NUM_THREADS"], env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]) == ("3", "6,7", "1")


def test_the_embedded_ray_sees_only_the_engines_gpus_and_the_session_keeps_the_ranks_for_the_update(
    tmp_path, monkeypatch
):
    import os

    import ray

    from batchrl.pipeline.session import ray_session

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = with_gpu_engines(config(tmp_path, staleness=1), ranks=2)
    cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"num_cpus": 1})})
    before = dict(os.environ)
    with ray_session(cfg) as session:
        # what the runner hands the update stage (StageContext.rank_devices), not an environment variable
        assert (os.environ["CUDA_VISIBLE_DEVICES"], session.rank_devices) == ("0", "1,2") and session.embedded_ray
        assert [name for name in os.environ if name.startswith("BATCHRL") and name not in before] == []
        assert ray.cluster_resources().get("GPU") == 1.0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2" and not session.embedded_ray
