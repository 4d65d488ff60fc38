"""Fixtures of the pipeline tests: `pipeline` (the tiny toy pipeline with overrides, in the test's tmp_path; see
tests/harness.py for running and reading it). The S3 fixtures are in tests/conftest.py."""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import time

import pytest
from harness import free_port, s3_environment, write_pipeline


@pytest.fixture
def pipeline(tmp_path, toy_model_dir, toy_prompts_dir):
    """pipeline(overrides) -> the path of the tiny toy pipeline with ``overrides`` (see harness.merged), written in
    tmp_path; its runs go under tmp_path/runs. Another ``file_name=`` writes a second pipeline beside it."""
    return functools.partial(write_pipeline, tmp_path, model=toy_model_dir, prompts=toy_prompts_dir)


_FORWARDER = """
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()

async def handle(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection(sys.argv[2], int(sys.argv[3]))
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), reuse_address=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


class RestartableS3:
    """An S3 endpoint that can be stopped and restarted on the same port: a TCP forwarder process in front of
    the moto server. Stopping it kills the forwarder (open connections reset, new ones refused), exactly what a
    client sees of a server that goes down; moto itself keeps its state, which a real moto restart would lose."""

    def __init__(self, backend: str):
        self.backend = backend
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        host, port = self.backend.rsplit("//", 1)[1].split(":")
        self.process = subprocess.Popen([sys.executable, "-c", _FORWARDER, str(self.port), host, port])
        deadline = time.monotonic() + 120  # a bound on a hung start only (a loaded host starts Python slowly)
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 forwarder did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def restartable_s3(s3_endpoint, monkeypatch):
    """A RestartableS3 (started) and the environment for processes that talk to it through the forwarder."""
    endpoint = RestartableS3(s3_endpoint)
    endpoint.start()
    env = s3_environment(endpoint.endpoint)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield endpoint, env
    endpoint.stop()
