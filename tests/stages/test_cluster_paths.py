"""Local paths on a Ray cluster of several nodes: every node is asked whether it sees them as the driver does
(`storage.cluster.unshared_paths`); a shared mount is accepted, anything else refused before work starts. The
cluster here is two real Ray nodes on this machine (ray.cluster_utils.Cluster), so every local path is shared;
the refusals are checked with a probe that reports a node that does not see the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import make_spec

from batchrl.storage.cluster import MARKER_PREFIX, unshared_paths
from batchrl.trainer.ray_launch import check_reachable_from_all_nodes


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_every_node_sees_a_directory_on_this_machine_and_the_probe_leaves_nothing_behind(two_nodes, tmp_path):
    from batchrl.storage.cluster import alive_nodes

    assert len(alive_nodes()) == 2
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run_root = tmp_path / "runs" / "r1"  # not created yet: its first existing ancestor is probed
    assert unshared_paths([str(run_root)], [str(model), str(model / "config.json")]) == {}
    assert not any(p.name.startswith(MARKER_PREFIX) for p in tmp_path.rglob("*"))
    assert unshared_paths([], []) == {}


def test_an_input_the_nodes_see_otherwise_is_reported_with_their_ips(two_nodes, tmp_path, monkeypatch):
    """The driver's listing of a directory differs from what the nodes list (patched on the driver only: the nodes'
    tasks run the real code in their own processes)."""
    from batchrl.storage import cluster

    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"x" * 10)
    real_listing = cluster._listing
    monkeypatch.setattr(
        cluster, "_listing", lambda path: [("weights.bin", 999)] if path == str(model) else real_listing(path)
    )  # the driver's view differs from every node's
    unshared = cluster.unshared_paths([], [str(model)])
    assert list(unshared) == [str(model)] and len(unshared[str(model)]) == 1  # two nodes, one IP: this machine's


def test_an_update_on_several_nodes_accepts_a_shared_local_run_directory(two_nodes, tmp_path):
    policy = tmp_path / "policy_in"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    advantages = tmp_path / "advantages" / "part-00000.parquet"
    advantages.parent.mkdir()
    advantages.write_bytes(b"PAR1")
    spec = make_spec(
        policy_in=str(policy),
        policy_out=str(tmp_path / "iter_0000" / "policy"),
        advantages_files=[str(advantages)],
        metrics_path=str(tmp_path / "m.json"),
        trainer_state_out=str(tmp_path / "iter_0000" / "trainer_state"),
    )
    check_reachable_from_all_nodes(spec, num_nodes=2)  # the real probe: both nodes are this machine


def test_an_update_on_several_nodes_refuses_the_paths_a_node_does_not_see():
    spec = make_spec(
        policy_in="Qwen/Qwen2.5-0.5B",
        policy_out="/runs/r/iter_0000/policy",
        advantages_files=["s3://b/r/iter_0000/advantages/part-00000.parquet"],
        metrics_path="m.json",
    )
    asked = []

    def probe(writes, reads):
        asked.append((list(writes), list(reads)))
        return {path: ["10.0.0.2"] for path in writes}

    check_reachable_from_all_nodes(spec, num_nodes=1, probe=probe)
    assert asked == []  # one node: nothing to ask
    with pytest.raises(
        ValueError,
        match=r"policy_out=/runs/r/iter_0000/policy \(not the same on node 10.0.0.2\)"
        r".*object storage.*mounted at the same path",
    ):
        check_reachable_from_all_nodes(spec, num_nodes=2, probe=probe)
    assert asked == [(["/runs/r/iter_0000/policy"], [])]  # the hub id and the s3 parts are not local
    check_reachable_from_all_nodes(
        spec.__class__(**{**spec.__dict__, "policy_out": "s3://b/r/iter_0000/policy"}), num_nodes=2, probe=probe
    )
    assert len(asked) == 1  # nothing local left: not asked


def test_a_run_on_a_cluster_whose_nodes_do_not_see_its_local_root_is_a_config_error(two_nodes, tmp_path, monkeypatch):
    from batchrl.api import Runner
    from batchrl.config import ConfigError
    from batchrl.config.models import PipelineConfig
    from batchrl.pipeline.session import check_cluster_paths
    from batchrl.storage import cluster

    model = tmp_path / "model"
    model.mkdir()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)  # the prompts are on S3: a run needs credentials (nothing is read here)
    cfg = PipelineConfig(
        name="t",
        model={"path": str(model)},
        data={"train_files": ["s3://b/prompts/"]},
        run={"root": str(tmp_path / "runs")},
    )
    runner = Runner(cfg)
    check_cluster_paths(runner.cfg, runner.stages, run_dir=runner.layout.run_dir)  # both nodes are this machine

    asked = []

    def only_the_driver_sees_it(writes, reads):
        asked.append((sorted(writes), sorted(reads)))
        return {path: ["10.0.0.2"] for path in writes}

    monkeypatch.setattr(cluster, "unshared_paths", only_the_driver_sees_it)
    with pytest.raises(
        ConfigError,
        match=r"Ray cluster of 2 nodes, but run.root=.*runs.* \(not the same on node "
        r"10.0.0.2\).*mounted at the same path on every node",
    ):
        check_cluster_paths(runner.cfg, runner.stages, run_dir=runner.layout.run_dir)
    assert asked == [([runner.layout.run_dir], [str(model)])]
    assert Path(runner.layout.run_dir).parent == tmp_path / "runs"
