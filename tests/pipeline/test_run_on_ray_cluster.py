"""`batchrl run` against a real Ray cluster (a head node started with `ray start`, as on a cluster): the update runs
as Ray actors that stage their own inputs from and upload their outputs to a run directory on S3 (moto)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from test_run_end_to_end import ITERATIONS, REPO, SAMPLES, batchrl, check_run, pipeline_file, read_json

from batchrl.storage import resolve

pytestmark = pytest.mark.slow


@pytest.fixture
def ray_cluster(s3_env) -> dict[str, str]:
    """The environment that connects to a one-node Ray cluster of 4 CPUs (RAY_ADDRESS and its own auth token), in
    its own temp dir (so no other `ray.init()` on this machine finds it) and process group (so stopping it touches
    no other Ray instance). Its workers see the test S3 and the test reward module, as a configured cluster's
    nodes would."""
    temp_dir = tempfile.mkdtemp(prefix="brl-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_cli = Path(sys.executable).with_name("ray")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests" / "stages"), os.environ.get("PYTHONPATH")]))
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=4",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env={**os.environ, **s3_env, **auth, "PYTHONPATH": pythonpath}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address_file = Path(temp_dir) / "ray_current_cluster"
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if time.monotonic() > deadline or head.poll() is not None:
            _stop(head)
            raise RuntimeError(f"the Ray head node did not start (exit code {head.poll()}); logs in {temp_dir}")
        time.sleep(0.2)
    yield {"RAY_ADDRESS": address_file.read_text().strip(), **auth}
    _stop(head)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def test_run_on_a_ray_cluster_updates_with_ray_actors_that_write_the_policy_to_object_storage(
        tmp_path, toy_model_dir, toy_prompts_dir, s3_env, s3_bucket, ray_cluster):
    fs, _ = resolve(f"s3://{s3_bucket}")
    for local in sorted(Path(toy_prompts_dir).glob("*.parquet")):
        fs.put_file(str(local), f"{s3_bucket}/prompts/{local.name}")
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[f"s3://{s3_bucket}/prompts/"],
                         root=f"s3://{s3_bucket}/runs",  # the transformers engine: quicker to start than vLLM
                         generate={"engine": "hf", "num_samples_per_prompt": SAMPLES, "max_new_tokens": 12})

    result = batchrl("run", str(path), env={**s3_env, **ray_cluster})
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = f"s3://{s3_bucket}/runs/e2e"
    check_run(run_dir)
    assert result.stderr.count("on 2 Ray worker(s)") == ITERATIONS  # update.launcher: auto chose the Ray actors
    second = read_json(f"{run_dir}/iter_0001/metrics.json")
    assert second["actor/optimizer_state_restored"] == 1.0  # every rank's optimizer shards went to S3 and back
    assert fs.exists(f"{s3_bucket}/runs/e2e/iter_0001/policy/_trainer_state/optimizer/__1_0.distcp")

    # The launcher is not part of the update's fingerprint: running it locally instead redoes nothing.
    raw = yaml.safe_load(path.read_text())
    raw["update"]["launcher"] = "local"
    path.write_text(yaml.safe_dump(raw))
    plan = batchrl("plan", str(path), env=s3_env)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("skip (complete)") == 1 + 4 * ITERATIONS


@pytest.fixture
def two_node_cluster(monkeypatch) -> dict[str, str]:
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster), 2 CPUs each: a cluster of several nodes whose
    local filesystem is, trivially, shared. The nodes' workers see the test reward module."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(REPO / "tests" / "stages"), os.environ.get("PYTHONPATH")])))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield {"RAY_ADDRESS": cluster.address}
    cluster.shutdown()


def test_run_on_two_nodes_with_a_shared_local_run_directory(tmp_path, toy_model_dir, toy_prompts_dir,
                                                            two_node_cluster):
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[toy_prompts_dir],
                         root=str(tmp_path / "runs"),
                         generate={"engine": "hf", "num_samples_per_prompt": SAMPLES, "max_new_tokens": 12})

    result = batchrl("run", str(path), env=two_node_cluster)
    assert result.returncode == 0, result.stderr[-4000:]
    check_run(str(tmp_path / "runs" / "e2e"))
    assert result.stderr.count("on 2 Ray worker(s)") == ITERATIONS  # the update ran as Ray actors, not refused
    assert not any(p.name.startswith(".batchrl-shared-probe-") for p in tmp_path.rglob("*"))
