"""Driver work grows with tables, not parts (issue 13 item 4).

(a) S3 requests at a resumed stage start. A moto server (its own, started here) holds a run whose scores table
is committed and whose advantage stage was interrupted with half its shards done and recorded in its journal, at
two part counts (1k and 4k; --quick 200 and 800). Counted: every request that reaches the server while the driver
plans the run (`build_plan`, as `batchrl run` / `plan` / `status` start) and starts the advantage stage
(`Runner._prepare_output_dir`, `pending_shards`) up to handing the remaining jobs to workers, in a fresh process.
Target: the same count at both sizes, up to S3's list pagination (one request per 1000 keys listed). Journal
segment reads grow too, one per FLUSH_RECORDS (512) shards recorded at once, up to MAX_SEGMENTS (64), after which
loading compacts them into one; they are reported apart, and so is the ratio of every other request.

(b) `batchrl plan` on a run whose tables have 40k parts each (--quick: 10k): synthetic manifests and empty part
files of their recorded size on local disk, every stage done, 2 iterations (7 tables of 40k parts). Target: < 5 s
wall and < 300 MB peak RSS of the CLI process (resource.getrusage(RUSAGE_CHILDREN) around it); its CPU time is
printed too, which is what the wall time comes to on an idle machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import REPO, TEST_PYTHONPATH, cli_ok, environment, free_port, write_pipeline

from batchrl.api import PlannedStage, build_plan
from batchrl.config import load_pipeline
from batchrl.pipeline.lineage import fresh_lineage
from batchrl.pipeline.plan import current_input_digest
from batchrl.pipeline.shards import job_input
from batchrl.pipeline.stage import STAGES
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

# The tests' pipeline scores with custom_rewards:digit_count (tests/stages): the fingerprints this process writes
# into the synthetic manifests must hold its code digest as the measured processes compute it, or the committed
# score is stale to them (it was: every run of this benchmark failed at the resumed stage start).
sys.path[:0] = [str(p) for p in TEST_PYTHONPATH]


def pipeline(tmp: Path, *, root: str, iterations: int) -> Path:
    """The tests' tiny pipeline (its model and prompts need not exist: nothing here runs a stage's work)."""
    return write_pipeline(
        tmp,
        {"name": "bench-driver", "run.root": root, "run.iterations": iterations},
        model=str(tmp / "model"),
        prompts=str(tmp / "prompts"),
    )


def write_parts(table_dir: str, names: list[str]) -> list[PartInfo]:
    """Empty files under ``names`` (a local directory or s3://), as parts of their recorded size 0."""
    from batchrl.storage import resolve

    fs, path = resolve(table_dir)
    if table_dir.startswith("s3://"):
        fs.pipe({f"{path}/{name}": b"" for name in names})  # concurrent PUTs
    else:
        os.makedirs(path, exist_ok=True)
        for name in names:
            open(f"{path}/{name}", "wb").close()
    return [PartInfo(name=name, rows=1, sha256=EMPTY_SHA256, num_bytes=0) for name in names]


def commit(step: PlannedStage, parts: list[PartInfo], *, by_dir: dict, lineage) -> None:
    """Writes ``step``'s manifest as the runner would (its fingerprint, its inputs' content digests)."""
    stage = STAGES[step.name]
    step.manifest = Manifest(
        stage=step.name,
        table=stage.table,
        iteration=step.iteration,
        fingerprint=step.fingerprint,
        config_fingerprint=step.config_fingerprint,
        parts=parts,
        schema=stage.schema or "",
        started_at=0.0,
        finished_at=1.0,
        counts={"num_samples": len(parts)},
        inputs={table: current_input_digest(step, table, by_dir, lineage) for table in stage.inputs},
    )
    write_manifest(step.output_dir, step.manifest)


def synthetic_run(path: Path, *, num_parts: int, stop_before: tuple[str, int] | None = None) -> list[PlannedStage]:
    """Commits every stage of the pipeline at ``path`` (until ``stop_before``, a (stage, iteration)) with
    ``num_parts`` empty parts per table (a policy: 2 files); returns the plan."""
    cfg = load_pipeline(path)
    lineage = fresh_lineage(cfg)
    steps = build_plan(cfg, check_storage=False, lineage=lineage)
    names = [f"part-{k:05d}.parquet" for k in range(num_parts)]
    by_dir = {step.output_dir: step for step in steps}
    for step in steps:
        if (step.name, step.iteration) == stop_before:
            break
        table_names = names if STAGES[step.name].schema else ["model.safetensors", "config.json"]
        commit(step, write_parts(step.output_dir, table_names), by_dir=by_dir, lineage=lineage)
    return steps


def plan_cost(tmp: Path, *, num_parts: int, iterations: int) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of `batchrl plan` on a synthetic run of ``num_parts``-part tables."""
    path = pipeline(tmp, root=str(tmp / "runs"), iterations=iterations)
    started = time.perf_counter()
    synthetic_run(path, num_parts=num_parts)
    written = time.perf_counter() - started
    print(f"plan: a run of {iterations} iteration(s), {num_parts} parts per table (written in {written:.0f} s)")
    out = cli_free([sys.executable, __file__, "--measure-plan", str(path)], env={})
    wall, cpu, peak_mb, plan = out.split("\n", 3)
    if plan.count("skip (complete)") != 1 + 4 * iterations:
        raise SystemExit(f"the synthetic run is not complete in the plan:\n{plan}")
    return float(wall), float(cpu), float(peak_mb)


def measure_plan(path: str) -> None:
    """Prints the wall seconds, CPU seconds (user + system) and peak RSS (MB) of `batchrl plan PATH`, then its
    output. Run in a process of its own (--measure-plan), whose only child is the CLI: RUSAGE_CHILDREN is then the
    CLI's. The CPU time tells what the wall time would be on an idle machine when other work shares the cores."""
    started = time.perf_counter()
    result = cli_ok("plan", path, timeout=None)
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{wall:.3f}\n{usage.ru_utime + usage.ru_stime:.3f}\n{usage.ru_maxrss / 1024:.1f}\n{result.stdout}")


class MotoServer:
    """moto's S3 server on 127.0.0.1 in its own process, its request log (werkzeug's, one line per request) in a
    file: the requests made during a span are the lines the log gained."""

    def __init__(self, log: Path):
        self.log = log
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            moto = Path(sys.executable).with_name("moto_server")
            self.process = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(self.port)], stderr=out)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise SystemExit("moto_server did not start") from None
                time.sleep(0.2)

    def requests(self) -> list[str]:
        """'METHOD /path?query' of every S3 request logged so far (moto's own API left out)."""
        time.sleep(0.5)  # the server logs a request after answering it
        lines = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace")).splitlines()  # no colours
        found = [line.split('"')[1].split(" ")[:2] for line in lines if '] "' in line and " HTTP/1.1" in line]
        return [f"{method} {target}" for method, target in found if not target.startswith("/moto-api")]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def request_kind(request: str) -> str:
    """list (a page of up to 1000 keys), journal (a GET of one journal segment), or the method."""
    method, target = request.split(" ", 1)
    if method == "GET" and ("list-type=" in target or "prefix=" in target):
        return "list"
    if method == "GET" and "/_journal/seg-" in target:
        return "journal"
    return method.lower()


def partial_s3_run(tmp: Path, bucket: str, *, num_parts: int) -> Path:
    """A run on S3 whose ingest, generate and score are committed with ``num_parts`` parts each, and whose
    advantage stage was interrupted with half its shards done and recorded in its journal, as a run killed
    mid-stage leaves it (segments of FLUSH_RECORDS records)."""
    from batchrl.pipeline.plan import STARTED_MARKER
    from batchrl.storage import join, resolve, write_bytes_atomic
    from batchrl.storage.journal import FLUSH_RECORDS, Journal, record

    path = pipeline(tmp / f"parts-{num_parts}", root=f"s3://{bucket}/runs-{num_parts}", iterations=1)
    steps = synthetic_run(path, num_parts=num_parts, stop_before=("advantage", 0))
    advantage = next(step for step in steps if step.name == "advantage")
    done = [f"part-{k:05d}.parquet" for k in range(num_parts // 2)]
    parts = write_parts(advantage.output_dir, done)
    write_bytes_atomic(
        join(advantage.output_dir, STARTED_MARKER), json.dumps({"fingerprint": advantage.fingerprint}).encode()
    )
    jobs = {job["name"]: job for job in shard_jobs_of(steps, advantage)}
    journal = Journal(advantage.output_dir)
    for first in range(0, len(parts), FLUSH_RECORDS):
        chunk = parts[first : first + FLUSH_RECORDS]
        journal.append([record(p.name, [p], counts={"num_samples": 2.0}, input=job_input(jobs[p.name])) for p in chunk])
    resolve(advantage.output_dir)[0].invalidate_cache()
    return path


def shard_jobs_of(steps: list[PlannedStage], step: PlannedStage) -> list[dict]:
    from batchrl.pipeline.shards import shard_jobs

    (input_dir,) = step.input_dirs.values()
    (upstream,) = [s for s in steps if s.output_dir == input_dir]
    return shard_jobs(input_dir=input_dir, input_manifest=upstream.manifest, output_dir=step.output_dir)


class HandedToWorkers(Exception):
    """Raised where the resumed stage would start its workers: the stage start is over."""


def resumed_stage_start(path: str) -> None:
    """What `batchrl run` does up to handing a resumed stage's remaining shards to workers: plan the run (manifests,
    one listing per table, lineage), then start the advantage stage (prepare its output directory, find its done
    shards). Run in a fresh process (--resume-start), so that no cache of this one hides a request."""
    from batchrl.api import Runner
    from batchrl.pipeline import shards

    def stop(worker_cls, worker_kwargs, jobs, **kwargs):
        print(f"jobs handed to workers: {len(jobs)}")
        raise HandedToWorkers

    shards.map_shards = stop
    runner = Runner(load_pipeline(path))
    print("statuses:", ", ".join(f"{s.label}={s.status}" for s in runner.steps))
    try:
        runner.stage("advantage", 0)
    except HandedToWorkers:
        return
    raise SystemExit("the advantage stage did not reach its workers")


def resume_requests(tmp: Path, sizes: tuple[int, int]) -> dict[int, dict[str, int]]:
    """Requests by kind at the resumed stage start of a run of each size, against a moto server of our own."""
    import boto3

    server = MotoServer(tmp / "moto.log")
    env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    os.environ.update(env | {"AWS_DEFAULT_REGION": "us-east-1"})
    try:
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(Bucket="bench-driver")
        counts = {}
        for num_parts in sizes:
            started = time.perf_counter()
            path = partial_s3_run(tmp, "bench-driver", num_parts=num_parts)
            print(
                f"resume: a run with {num_parts}-part tables on S3 (written in {time.perf_counter() - started:.0f} s)"
            )
            before = len(server.requests())
            start = cli_free([sys.executable, __file__, "--resume-start", str(path)], env=env)
            print("  " + start.replace("\n", "\n  ").rstrip())
            made = server.requests()[before:]
            counts[num_parts] = {
                kind: sum(request_kind(r) == kind for r in made) for kind in sorted(set(map(request_kind, made)))
            }
            print(f"  {len(made)} requests: {counts[num_parts]}")
    finally:
        server.stop()
    return counts


def cli_free(command: list[str], *, env: dict) -> str:
    """Runs a Python command from the repository root (the test harness on its path); returns its stdout."""
    result = subprocess.run(command, cwd=REPO, env=environment(env), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="resume at 200 vs 800 parts, plan at 10k parts")
    parser.add_argument("--plan-parts", type=int, default=None, help="parts per table for the plan (40000)")
    parser.add_argument("--no-resume", action="store_true", help="only the plan (no moto server)")
    parser.add_argument("--iterations", type=int, default=2, help="iterations of the planned run")
    parser.add_argument("--resume-start", metavar="PIPELINE", help=argparse.SUPPRESS)  # the measured processes
    parser.add_argument("--measure-plan", metavar="PIPELINE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume_start:
        resumed_stage_start(args.resume_start)
        return
    if args.measure_plan:
        measure_plan(args.measure_plan)
        return
    if not args.no_resume:
        sizes = (200, 800) if args.quick else (1000, 4000)
        with tempfile.TemporaryDirectory(prefix="bench_driver_") as tmp:
            report_resume(resume_requests(Path(tmp), sizes), *sizes)
    plan_parts = args.plan_parts or (10_000 if args.quick else 40_000)
    with tempfile.TemporaryDirectory(prefix="bench_driver_") as tmp:
        wall, cpu, peak_mb = plan_cost(Path(tmp), num_parts=plan_parts, iterations=args.iterations)
    print(
        f"RESULT plan_{plan_parts // 1000}k_parts_wall_s={wall:.2f} (target < 5; CPU {cpu:.2f} s; {args.iterations} "
        f"iterations, {1 + 3 * args.iterations} tables of {plan_parts} parts)"
    )
    print(f"RESULT plan_{plan_parts // 1000}k_parts_peak_rss_mb={peak_mb:.0f} (target < 300)")


def report_resume(counts: dict[int, dict[str, int]], small: int, large: int) -> None:
    total = {size: sum(kinds.values()) for size, kinds in counts.items()}
    other = {size: total[size] - kinds.get("list", 0) - kinds.get("journal", 0) for size, kinds in counts.items()}
    tables = 5  # ingest, generate, score, advantage, update
    grew = ", ".join(
        f"{kind} {counts[small].get(kind, 0)} -> {counts[large].get(kind, 0)}" for kind in ("list", "journal")
    )
    print(
        f"RESULT resume_s3_requests_per_table={total[large] / tables:.1f} ({large} parts; {total[small] / tables:.1f} "
        f"at {small} parts)"
    )
    print(
        f"RESULT resume_s3_requests_ratio={total[large] / total[small]:.2f} ({large} vs {small} parts: {grew}; target: "
        "only list pages, 1 per 1000 keys, grow)"
    )
    print(
        f"RESULT resume_s3_other_requests_ratio={other[large] / other[small]:.2f} (not lists or journal; target 1.00)"
    )


if __name__ == "__main__":
    main()
