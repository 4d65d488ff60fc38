"""update.num_processes: auto resolves to one rank per GPU (nccl) or per update.cpus_per_rank usable CPUs (gloo),
or to what a Ray cluster has free; an explicit count above this host's GPUs is a configuration error."""

from __future__ import annotations

import pytest

from batchrl.config import ConfigError
from batchrl.config.models import UpdateConfig
from batchrl.stages.update import check_rank_devices, rank_count


def update(**fields) -> UpdateConfig:
    return UpdateConfig(**fields)


def test_auto_and_counts_are_the_accepted_values():
    assert update(num_processes="auto").num_processes == "auto" and update(num_processes=3).num_processes == 3
    for bad in (0, -1, "eight"):
        with pytest.raises(ValueError, match="num_processes"):
            update(num_processes=bad)


def test_auto_counts_gpus_on_nccl_and_cpu_budgets_on_gloo(monkeypatch):
    import torch

    import batchrl.trainer.launch as launch

    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    assert rank_count(update(num_processes=3, backend="gloo"), on_ray=False) == 3  # a count is kept as it is
    assert rank_count(update(num_processes="auto", backend="gloo"), on_ray=False) == 8
    assert rank_count(update(num_processes="auto", backend="gloo", cpus_per_rank=3), on_ray=False) == 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_count(update(num_processes="auto", backend="nccl"), on_ray=False) == 1  # a one-GPU host
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert rank_count(update(num_processes="auto", backend="nccl"), on_ray=False) == 8


def test_auto_on_a_ray_cluster_takes_what_is_free_when_the_update_starts(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 10.0, "GPU": 4.0})
    assert rank_count(update(num_processes="auto"), on_ray=True) == 4
    assert rank_count(update(num_processes="auto", backend="gloo", cpus_per_rank=2), on_ray=True) == 5
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 6.0})
    assert rank_count(update(num_processes="auto"), on_ray=True) == 6


def test_more_nccl_ranks_than_gpus_on_this_host_is_a_config_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"num_processes=8 .* this host has 1 \(CUDA_VISIBLE_DEVICES=3\).*at most 1"):
        check_rank_devices(update(num_processes=8, backend="nccl"), cluster=False)
    check_rank_devices(update(num_processes=1, backend="nccl"), cluster=False)
    check_rank_devices(update(num_processes="auto", backend="nccl"), cluster=False)
    check_rank_devices(update(num_processes=8, backend="nccl"), cluster=True)  # the cluster's GPUs, not this host's
    check_rank_devices(update(num_processes=8, backend="gloo"), cluster=False)


def test_the_fingerprint_keeps_auto_so_a_run_moved_to_another_host_resumes():
    from batchrl.config import validate_dict
    from batchrl.stages.update import UpdateStage

    cfg = validate_dict(
        {"name": "r", "model": {"path": "m"}, "data": {"train_files": ["x"]}, "update": {"num_processes": "auto"}}
    )
    assert UpdateStage().fingerprint_config(cfg)["update"]["num_processes"] == "auto"
