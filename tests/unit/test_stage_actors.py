"""How many actors a sharded stage's pool asks for (issue 35, item 3): the count its config sets, else one per
cpus_per_actor CPUs (and gpus_per_actor GPUs) of the Ray cluster, not a constant."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrl.config import ConfigError
from batchrl.config.models import AdvantageConfig, CriticConfig, ScoreConfig, UserStageConfig
from batchrl.pipeline.shards import PoolActors, derived_actors

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_count_a_pool_takes_one_actor_per_cpu_of_the_cluster():
    assert derived_actors(None, {"CPU": 64.0}, num_cpus=1, num_gpus=0) == 64
    assert derived_actors(None, {"CPU": 2.0}, num_cpus=1, num_gpus=0) == 2  # the 2 it always was, on 2 cores
    assert derived_actors(None, {"CPU": 64.0}, num_cpus=4, num_gpus=0) == 16


def test_actors_that_take_gpus_are_as_many_as_the_gpus_hold():
    assert derived_actors(None, {"CPU": 64.0, "GPU": 8.0}, num_cpus=1, num_gpus=1) == 8
    assert derived_actors(None, {"CPU": 64.0, "GPU": 8.0}, num_cpus=1, num_gpus=0.5) == 16
    assert derived_actors(None, {"CPU": 4.0, "GPU": 8.0}, num_cpus=1, num_gpus=1) == 4  # the CPUs bound it too


def test_a_cluster_too_small_for_one_actor_still_gets_one():
    assert derived_actors(None, {"CPU": 1.0}, num_cpus=2, num_gpus=0) == 1
    assert derived_actors(None, {}, num_cpus=1, num_gpus=0) == 1


def test_a_count_the_config_sets_wins_over_the_cluster():
    assert derived_actors(3, {"CPU": 64.0}, num_cpus=1, num_gpus=0) == 3
    assert derived_actors(12, {"CPU": 4.0}, num_cpus=1, num_gpus=0) == 12  # pool_size caps it by what is free


@pytest.mark.parametrize("section", [ScoreConfig, AdvantageConfig, CriticConfig])
def test_score_advantage_and_values_derive_their_count_unless_set(section):
    assert section().num_actors is None
    assert section(num_actors=6).num_actors == 6


def test_a_user_stage_derives_its_count_unless_set():
    stage = {"name": "shaping", "after": "score", "call": "m:f", "outputs": ["scores"]}
    assert UserStageConfig(**stage).num_actors is None
    assert UserStageConfig(**stage, num_actors=2).num_actors == 2


def test_a_count_below_one_names_its_field():
    from batchrl.config import load_pipeline

    with pytest.raises(ConfigError, match="advantage.num_actors"):
        load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides=["advantage.num_actors=0"], run_id="actors")


def test_stages_without_a_section_of_actor_resources_take_one_cpu_per_actor():
    assert PoolActors() == PoolActors(num_actors=None, cpus_per_actor=1.0, gpus_per_actor=0.0)
