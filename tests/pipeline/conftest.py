"""A real S3 endpoint for pipeline tests: moto's server on 127.0.0.1.

CI (.ci/run) starts one and exports BATCHRL_TEST_S3_ENDPOINT; otherwise the fixture starts its own, in a
separate process: importing moto.server (Flask) into the test process breaks vLLM's in-process engine,
whose kernel registration touches every module's attributes, including Flask's context proxies.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    endpoint = os.environ.get("BATCHRL_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint
        return
    port = _free_port()
    moto_server = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen([str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
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
    """Environment for a process that talks to the test S3 (credentials are moto's dummies)."""
    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def s3_bucket(s3_env):
    import boto3

    name = f"batchrl-test-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket=name)
    return name
