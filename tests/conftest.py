"""Session fixtures shared by all test suites: the toy model and toy prompts, built once per session, and a real S3
endpoint, moto's server on 127.0.0.1.

CI (.ci/run) starts one and exports BATCHRL_TEST_S3_ENDPOINT; otherwise `s3_endpoint` starts its own, in a
separate process: importing moto.server (Flask) into the test process breaks vLLM's in-process engine,
whose kernel registration touches every module's attributes, including Flask's context proxies.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from harness import free_port, s3_environment

from batchrl_toy import ensure_toy_assets


@pytest.fixture(scope="session")
def toy_assets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding model/ (tiny random Qwen2 + tokenizer) and prompts/ (256 arith prompts, 4 shards)."""
    root = tmp_path_factory.mktemp("toy_assets")
    ensure_toy_assets(root / "model", root / "prompts", num_prompts=256, num_shards=4, seed=0)
    return root


@pytest.fixture(scope="session")
def toy_model_dir(toy_assets_dir: Path) -> str:
    """A float32 Qwen2ForCausalLM (2 layers, hidden 256, vocab ~343) loadable by transformers and vLLM."""
    return str(toy_assets_dir / "model")


@pytest.fixture(scope="session")
def toy_prompts_dir(toy_assets_dir: Path) -> str:
    """batchrl-format arithmetic prompts: part-00000.parquet .. part-00003.parquet, 256 rows in all."""
    return str(toy_assets_dir / "prompts")


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray of 2 CPUs for one test module, whose workers can import tests/stages (the custom rewards); the
    Ray this process is already connected to when there is one."""
    import os

    import ray

    if ray.is_initialized():
        yield
        return
    stages_dir = str(Path(__file__).parent / "stages")
    pythonpath = os.pathsep.join(filter(None, [stages_dir, os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def engine_pool(ray_session):
    """The generation engines a test's stages share (`StageContext.engines`), as a run's session owns them: shut
    down when the test ends."""
    from batchrl.engines.pool import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def s3_endpoint():
    endpoint = os.environ.get("BATCHRL_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint
        return
    port = free_port()
    moto_server = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen(
        [str(moto_server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a bound on a hung start only: Flask and moto import slowly on a busy host
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"moto_server did not start on port {port}") from None
            time.sleep(0.2)
    yield endpoint
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Environment for a process that talks to the test S3, set in this process too."""
    env = s3_environment(s3_endpoint)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def s3_bucket(s3_env):
    import boto3

    name = f"batchrl-test-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_prompts(s3_bucket, toy_prompts_dir) -> str:
    """The toy prompts copied to s3://<s3_bucket>/prompts/: that URI, for data.train_files."""
    from batchrl.storage import resolve

    fs, _ = resolve(f"s3://{s3_bucket}")
    for local in sorted(Path(toy_prompts_dir).glob("*.parquet")):
        fs.put_file(str(local), f"{s3_bucket}/prompts/{local.name}")
    return f"s3://{s3_bucket}/prompts/"


class UnreachableEndpoint:
    """An http:// endpoint on 127.0.0.1 that reads each request's first line and closes the connection without an
    answer: a server that cannot be reached, whose tries a test counts (`requests_for`; a closed port's refusals
    leave nothing to count)."""

    def __init__(self):
        self.paths: list[str] = []  # the path of each request, in order
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def requests_for(self, path: str) -> int:
        return sum(one.split("?")[0] == path for one in self.paths)

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            with connection:
                connection.settimeout(30)
                request = b""
                with contextlib.suppress(OSError):
                    while b"\r\n" not in request and len(request) < 65536:
                        chunk = connection.recv(4096)
                        if not chunk:
                            break
                        request += chunk
                # recorded before the close: a client sees the close only once its request is counted
                self.paths.append((request.split(b" ") + [b"", b""])[1].decode(errors="replace"))

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def unreachable_endpoint():
    """An UnreachableEndpoint, e.g. for a hub that must be asked once, never retried."""
    endpoint = UnreachableEndpoint()
    yield endpoint
    endpoint.close()
