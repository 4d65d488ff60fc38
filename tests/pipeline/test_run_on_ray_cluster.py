"""`batchrl run` against a real Ray cluster (a head node started with `ray start`, as on a cluster): the update runs
as Ray actors that stage their own inputs from and upload their outputs to a run directory on S3 (moto)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import cli_ok, free_port, pythonpath, read_json, s3_environment
from test_run_end_to_end import E2E, ITERATIONS, check_run

from batchrl.storage import resolve

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def ray_head(temp_dir: Path, *, num_cpus: int, env: dict[str, str]) -> Iterator[str]:
    """A one-node Ray cluster started with `ray start --head` in ``temp_dir``, where it records its address as it does
    in /tmp/ray by default, and in its own process group (so stopping it touches no other Ray instance); yields
    that address."""
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray_cli),
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            f"--num-cpus={num_cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address_file = temp_dir / "ray_current_cluster"
    deadline = time.monotonic() + 300  # a bound on a hung start only: `ray start` takes long on a loaded host
    while not address_file.exists():
        if time.monotonic() > deadline or head.poll() is not None:
            _stop(head)
            raise RuntimeError(f"the Ray head node did not start (exit code {head.poll()}); logs in {temp_dir}")
        time.sleep(0.2)
    try:
        yield address_file.read_text().strip()
    finally:
        _stop(head)


@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint) -> dict[str, str]:
    """The environment that connects to a one-node Ray cluster of 4 CPUs (RAY_ADDRESS and its own auth token), in
    its own temp dir (so no other `ray.init()` on this machine finds it). Its workers see the test S3 and the test
    reward module, as a configured cluster's nodes would. One cluster for the module's runs, one after the other,
    as a real cluster serves its jobs (a `ray start` and its stop cost ~10 s on 2 cores)."""
    temp_dir = tempfile.mkdtemp(prefix="brl-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    env = {**os.environ, **s3_environment(s3_endpoint), **auth, "PYTHONPATH": pythonpath()}
    with ray_head(Path(temp_dir), num_cpus=4, env=env) as address:
        yield {"RAY_ADDRESS": address, **auth}
    shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` stops the node's processes; then anything left in its process group dies
    (Ray would wait up to 30 s for the node to drain)."""
    head.terminate()
    try:
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()


@pytest.fixture
def two_node_cluster(monkeypatch) -> dict[str, str]:
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster), 2 CPUs each: a cluster of several nodes whose
    local filesystem is, trivially, shared. The nodes' workers see the test reward module."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield {"RAY_ADDRESS": cluster.address}
    cluster.shutdown()


def test_run_on_two_nodes_with_a_shared_local_run_directory(tmp_path, pipeline, two_node_cluster):
    path = pipeline(E2E | {"generate.engine": "hf"})

    result = cli_ok("run", path, env=two_node_cluster)
    check_run(str(tmp_path / "runs" / "e2e"))
    assert result.stderr.count("on 2 Ray worker(s)") == ITERATIONS  # the update ran as Ray actors, not refused
    assert not any(p.name.startswith(".batchrl-shared-probe-") for p in tmp_path.rglob("*"))


@pytest.fixture
def ray_started_on_this_machine() -> dict[str, str | None]:
    """The environment of a run on a machine where `ray start --head --num-cpus=1` was run: the cluster's address is
    recorded in $RAY_TMPDIR/ray/ray_current_cluster, where ray.init() looks (here a directory of the test's own, not
    /tmp/ray, which other Ray users of this machine read), and RAY_ADDRESS is not set."""
    temp_root = tempfile.mkdtemp(prefix="brl-ray-", dir="/tmp")
    with ray_head(Path(temp_root) / "ray", num_cpus=1, env={**os.environ, "PYTHONPATH": pythonpath()}):
        yield {"RAY_TMPDIR": temp_root, "RAY_ADDRESS": None}
    shutil.rmtree(temp_root, ignore_errors=True)


def test_a_run_on_the_embedded_ray_is_not_disturbed_by_a_ray_cluster_started_on_the_same_machine(
    tmp_path, pipeline, ray_started_on_this_machine
):
    result = cli_ok("run", pipeline(), env=ray_started_on_this_machine)
    assert (tmp_path / "runs" / "tiny" / "iter_0000" / "policy" / "_MANIFEST.json").exists()
    assert "Ray worker(s)" not in result.stderr  # its own Ray: the update's ranks are local processes


# The runs on the module's cluster come last: `ray_cluster` stays up from the first of them to the module's end.


def test_run_on_a_ray_cluster_updates_with_ray_actors_that_write_the_policy_to_object_storage(
    pipeline, s3_env, s3_bucket, s3_prompts, ray_cluster
):
    path = pipeline(
        E2E | {"data.train_files": [s3_prompts], "run.root": f"s3://{s3_bucket}/runs", "generate.engine": "hf"}
    )  # the transformers engine: quicker to start than vLLM

    result = cli_ok("run", path, env={**s3_env, **ray_cluster})
    run_dir = f"s3://{s3_bucket}/runs/e2e"
    check_run(run_dir)
    assert result.stderr.count("on 2 Ray worker(s)") == ITERATIONS  # update.launcher: auto chose the Ray actors
    second = read_json(f"{run_dir}/iter_0001/metrics.json")
    assert second["actor/optimizer_state_restored"] == 1.0  # every rank's optimizer shards went to S3 and back
    fs, _ = resolve(f"s3://{s3_bucket}")
    assert fs.exists(f"{s3_bucket}/runs/e2e/iter_0001/policy/_trainer_state/optimizer/__1_0.distcp")

    # The launcher is not part of the update's fingerprint: running it locally instead redoes nothing.
    plan = cli_ok("plan", path, sets=["update.launcher=local"], env=s3_env)
    assert plan.stdout.count("skip (complete)") == 1 + 4 * ITERATIONS


def test_ppo_on_a_ray_cluster_moves_the_critic_and_its_optimizer_state_through_object_storage(
    pipeline, s3_env, s3_bucket, s3_prompts, ray_cluster
):
    path = pipeline(
        E2E
        | {
            "data.train_files": [s3_prompts],
            "run.root": f"s3://{s3_bucket}/runs",
            "generate.engine": "hf",
            "advantage": {"estimator": "gae"},
            "critic": {"lr": 1.0e-3},
        }
    )
    result = cli_ok("run", path, env={**s3_env, **ray_cluster})
    assert result.stderr.count("on 2 Ray worker(s)") == ITERATIONS
    run_dir = f"s3://{s3_bucket}/runs/e2e"
    second = read_json(f"{run_dir}/iter_0001/metrics.json")
    assert second["critic/optimizer_state_restored"] == 1.0  # both ranks' critic shards went to S3 and back
    assert second["critic/num_optimizer_steps"] > 0
    fs, _ = resolve(f"s3://{s3_bucket}")
    policy = f"{s3_bucket}/runs/e2e/iter_0001/policy"
    assert fs.exists(f"{policy}/critic/model.safetensors") and fs.exists(f"{policy}/critic/config.json")
    assert fs.exists(f"{policy}/_trainer_state/critic/optimizer/__1_0.distcp")
    manifest = read_json(f"{run_dir}/iter_0001/policy/_MANIFEST.json")
    assert "critic/model.safetensors" in {part["name"] for part in manifest["parts"]}
