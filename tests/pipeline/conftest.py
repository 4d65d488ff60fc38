"""A real S3 endpoint for pipeline tests: moto's server on 127.0.0.1.

CI (.ci/run) starts one and exports BATCHRL_TEST_S3_ENDPOINT; otherwise the fixture starts its own.
"""

from __future__ import annotations

import os
import socket
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    endpoint = os.environ.get("BATCHRL_TEST_S3_ENDPOINT")
    server = None
    if not endpoint:
        from moto.server import ThreadedMotoServer

        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
    yield endpoint
    if server is not None:
        server.stop()


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
