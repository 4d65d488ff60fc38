"""The one harness for pipeline tests and benchmarks: the repository root, the tiny toy pipeline written with
overrides, the `batchrl` command line run as a subprocess, and readers for what a run wrote.

A pipeline test reads as three lines: a config override, a run, an assertion on a table::

    path = pipeline({"run.iterations": 2, "advantage": {"filter_groups": True}})
    cli_ok("run", path)
    assert len(read_rows(tmp_path / "runs" / "tiny" / "iter_0000" / "scores")) == 8

Imported as `harness`, a top-level module: pytest's default ("prepend") import mode puts tests/ on sys.path, as
the directory of tests/conftest.py, and the processes a test starts get tests/ on PYTHONPATH (`environment`), so
a Ray worker that imports a test module as a reward module (`test_faults:...`) imports the harness too. bench/
scripts run as plain scripts (`python bench/x.py`, and so from bench/run_all.py) add tests/ to sys.path in one
line. (Not a `tests` package: that would rename every test module and the reward modules workers import.)
Nothing else computes the repository root: paths a test or a benchmark needs are REPO-relative.

The command line always runs in a subprocess, as a user or a scheduler runs it: embedded Ray, vLLM and the
update's process group keep process-wide state that one test must not leave to the next.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

# Where a run's subprocesses find test code by module name: custom_rewards (tests/stages), reward functions
# defined in test modules (tests/pipeline) and this harness (tests), which those test modules import.
TEST_PYTHONPATH = (TESTS / "stages", TESTS / "pipeline", TESTS)


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()
"""An override value that removes the key from the base config: the field takes its documented default."""


def tiny_pipeline(*, model: str, prompts: str | Sequence[str], root: str) -> dict:
    """The tiny toy pipeline the pipeline tests share: 8 prompts in shards of 4, 2 samples of at most 8 tokens from
    the transformers engine (quick to start), a reward that varies within groups (so advantages are non-zero and
    the update moves the policy: a random toy model never answers correctly), a 1-process update on gloo."""
    return {
        "name": "tiny",
        "run": {"root": str(root), "seed": 5, "iterations": 1},
        "model": {"path": str(model), "dtype": "float32"},
        "data": {
            "train_files": [str(prompts)] if isinstance(prompts, (str, Path)) else [str(p) for p in prompts],
            "shard_size": 4,
            "max_prompt_tokens": 96,
            "max_prompts": 8,
        },
        "generate": {"engine": "hf", "num_samples_per_prompt": 2, "max_new_tokens": 8},
        "score": {"rewards": [{"reward": "custom_rewards:digit_count", "weight": 1.0}]},
        "update": {"num_processes": 1, "backend": "gloo", "lr": 1e-3, "micro_batch_size": 8},
        "ray": {"num_cpus": 2},
    }


def merged(base: Mapping, overrides: Mapping | None) -> dict:
    """``base`` with ``overrides`` deep-merged in: mappings merge key by key, any other value (lists included)
    replaces; a dotted key ("run.iterations") is the nested one, as in `--set`; DEFAULT removes the key."""
    out = {key: dict(value) if isinstance(value, Mapping) else value for key, value in base.items()}
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            child = node.get(key)
            node[key] = dict(child) if isinstance(child, Mapping) else {}
            node = node[key]
        if value is DEFAULT:
            node.pop(leaf, None)
        elif isinstance(value, Mapping) and isinstance(node.get(leaf), Mapping):
            node[leaf] = merged(node[leaf], value)
        else:
            node[leaf] = _without_defaults(value)
    return out


def _without_defaults(value):
    if isinstance(value, Mapping):
        return {k: _without_defaults(v) for k, v in value.items() if v is not DEFAULT}
    return value


def write_yaml(path: Path, raw: Mapping) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(raw)))
    return path


def write_pipeline(
    directory: Path,
    overrides: Mapping | None = None,
    *,
    model: str,
    prompts: str | Sequence[str],
    file_name: str = "pipeline.yaml",
) -> Path:
    """The tiny pipeline with ``overrides`` as ``directory``/``file_name``, its run root ``directory``/runs (the
    run directory is ``directory``/runs/<name>, name "tiny" unless overridden); returns the file's path."""
    base = tiny_pipeline(model=model, prompts=prompts, root=str(Path(directory) / "runs"))
    return write_yaml(Path(directory) / file_name, merged(base, overrides))


def pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a run: ``first`` (ahead, so it shadows), the test code, then the inherited PYTHONPATH."""
    return os.pathsep.join(filter(None, [*map(str, first), *map(str, TEST_PYTHONPATH), os.environ.get("PYTHONPATH")]))


def environment(env: Mapping[str, str | None] | None = None, *, path_first: Iterable[str | Path] = ()) -> dict:
    """This process's environment with the test PYTHONPATH and ``env`` applied (a None value removes a variable)."""
    merged_env = {**os.environ, "PYTHONPATH": pythonpath(*path_first), **(env or {})}
    return {key: value for key, value in merged_env.items() if value is not None}


def _command(args: Sequence, sets: Iterable[str]) -> list[str]:
    return [sys.executable, "-m", "batchrl.cli", *map(str, args), *(a for s in sets for a in ("--set", s))]


def cli(
    *args: str | Path,
    sets: Iterable[str] = (),
    env: Mapping[str, str | None] | None = None,
    path_first: Iterable[str | Path] = (),
    timeout: float | None = 900,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
) -> subprocess.CompletedProcess:
    """`batchrl ARGS... [--set S]...` run from the repository root. Its stdout and stderr are captured as text
    unless ``stdout``/``stderr`` say otherwise (None: this process's own, as a benchmark shows a long run's log)."""
    return subprocess.run(
        _command(args, sets),
        cwd=REPO,
        stdout=stdout,
        stderr=stderr,
        text=True,
        timeout=timeout,
        env=environment(env, path_first=path_first),
    )


class CommandFailed(AssertionError):
    pass


def cli_ok(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    """`cli`, asserting exit 0; a failure shows the command, its exit code and the end of what it printed."""
    result = cli(*args, **kwargs)
    if result.returncode != 0:
        raise CommandFailed(
            f"batchrl {' '.join(result.args[3:])} exited {result.returncode}\n--- stdout\n"
            f"{(result.stdout or '')[-2000:]}\n--- stderr\n{(result.stderr or '')[-4000:]}"
        )
    return result


def start_cli(
    *args: str | Path,
    log: Path,
    sets: Iterable[str] = (),
    env: Mapping[str, str | None] | None = None,
    path_first: Iterable[str | Path] = (),
) -> subprocess.Popen:
    """`batchrl ARGS...` started in its own session (process group = its pid, so that what a killed driver leaves
    behind can be found and stopped), stdout and stderr appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            _command(args, sets),
            cwd=REPO,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=environment(env, path_first=path_first),
        )


PAUSING_STAGE = """
import os, time
from pathlib import Path

import pyarrow as pa


def {function}(table):
    pause = os.environ.get("{env}")
    if pause:
        with open(Path(pause, "calls"), "a") as f:
            f.write("x")
        if len(Path(pause, "calls").read_text()) == {call}:
            Path(pause, "reached").write_text("")
            while not Path(pause, "go").exists():
                time.sleep(0.1)
    return table.append_column("probed", pa.array([True] * table.num_rows))
"""


def pausing_stage(directory: Path, module: str, *, function: str, env: str, call: int) -> dict:
    """Writes ``module``.py into ``directory``: a user stage ``function`` that adds a column "probed" and, when the
    environment variable ``env`` names a directory, counts its calls there (across processes) and at the ``call``-th
    writes ``reached`` and waits for ``go`` (the moment `kill_run_when` kills the run). Returns the stage's entry
    for `stages:`, placed after score."""
    (directory / f"{module}.py").write_text(PAUSING_STAGE.format(function=function, env=env, call=call))
    return {"name": "probe", "after": "score", "call": f"{module}:{function}", "outputs": ["probed"]}


def kill_run_when(flag: Path, process: subprocess.Popen, *, log: Path, timeout_s: float = 600) -> None:
    """Waits until ``flag`` exists (a test hook inside the run says it reached the moment to kill it), then kills the
    run's whole process group with SIGKILL; fails with the end of ``log`` if the run ends or times out first."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and everything it started
    process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_environment(endpoint: str) -> dict[str, str]:
    """The environment of a process that talks to the S3 at ``endpoint`` (credentials are moto's dummies)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


# Reading what a run wrote, local or on object storage (a str URI or a Path).


def read_bytes(uri: str | Path) -> bytes:
    from batchrl.storage import resolve

    fs, path = resolve(str(uri))
    return fs.cat_file(path)


def read_json(uri: str | Path) -> dict:
    return json.loads(read_bytes(uri).decode())


def read_manifest(table_dir: str | Path) -> dict:
    """A stage's _MANIFEST.json."""
    return read_json(f"{table_dir}/_MANIFEST.json")


def num_rows(table_dir: str | Path) -> int:
    """The rows a stage's manifest counts."""
    return sum(part["rows"] for part in read_manifest(table_dir)["parts"])


def read_table(table_dir: str | Path, *, sort_by: Sequence[str] = ()):
    """A stage's committed table: every part its manifest lists, concatenated in the manifest's order (or sorted
    ascending by the ``sort_by`` columns)."""
    import pyarrow as pa

    from batchrl.storage import read_parquet

    parts = [read_parquet(f"{table_dir}/{part['name']}") for part in read_manifest(table_dir)["parts"]]
    out = pa.concat_tables(parts)
    return out.sort_by([(column, "ascending") for column in sort_by]) if sort_by else out


def read_rows(table_dir: str | Path, *, sort_by: Sequence[str] = ()) -> list[dict]:
    """`read_table` as a list of rows."""
    return read_table(table_dir, sort_by=sort_by).to_pylist()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per iteration."""
    return [json.loads(line) for line in read_bytes(f"{run_dir}/metrics.jsonl").decode().splitlines()]


def rewrite_at_the_same_size(path: Path, table) -> None:
    """Writes ``table`` over the Parquet file ``path``, padded to exactly the old file's size (zero bytes before the
    footer, which readers find from the end of the file): a change that a listing of sizes cannot see, only a hash."""
    import io
    import struct

    import pyarrow.parquet as pq

    size = path.stat().st_size
    row_group_size = pq.ParquetFile(path).metadata.row_group(0).num_rows
    for compression in ("snappy", "zstd", "gzip"):
        sink = io.BytesIO()
        pq.write_table(table, sink, compression=compression, row_group_size=row_group_size)
        data = sink.getvalue()
        if len(data) <= size:
            break
    else:
        raise AssertionError(f"the new table does not fit in the {size} bytes of {path}")
    footer = struct.unpack("<I", data[-8:-4])[0] + 8  # footer, its length and the closing magic
    path.write_bytes(data[:-footer] + b"\0" * (size - len(data)) + data[-footer:])
