"""Soak: the quickstart N times in a row, each in fresh processes, counting the runs that a process's signal ended.

Why (issue 30): a fresh clone's `make demo` once died at iteration 9 of 12 of "free(): invalid size" in an update
rank (SIGABRT), and five later runs did not; native crashes that rare are found by repetition, not by one run. Every
run is the quickstart as `make demo` runs it (`batchrl run pipelines/quickstart.yaml`, a fresh run id), plus one run
with `run.max_staleness: 1` (the update in a thread beside the next generation) and one PPO run
(pipelines/ppo_quickstart.yaml). The toy model is built once, by the first run's setup step, as `make demo` does.

What a run counts as a crash: its command died of a signal, or printed the one line a run prints when one of its
processes did ("... died of SIGABRT in iter 9 update; details in ..."), or any process wrote a native abort's words
("free():", "double free", "corrupted", "terminate called", "Segmentation fault", "Fatal Python error"). For each
crash the table below the result names the run, the signal and the stage, and the crash log's path. A run that
exits non-zero otherwise is reported on a second line (other_failures), not as a crash: in one soak a quickstart
started beside a test run and its Ray timed out during startup (exit 1 then, exit 4 since).

Environment: every process of the runs gets MALLOC_PERTURB_=165 (freed and new memory filled, so a use after free
reads garbage rather than the old values) and MALLOC_CHECK_=3 with glibc's debug allocator preloaded where it
exists (libc_malloc_debug.so.0: since glibc 2.34, MALLOC_CHECK_ alone does nothing). Whether the check mode is
really on is tested, not assumed: a child with the same environment frees one block twice, and the bench prints
"heap checks: on" only if glibc's check mode caught it ("free(): invalid pointer"), "off" if only glibc's always-on
tcache check did (with the venv's pyenv Python 3.11 the preload did not switch it on; Debian's python3 it did).
An earlier version of this docstring said the checks were on: they were not, in the 0/22 soak of issue 30.
Every Python process of a run (the CLI, the update ranks) enables faulthandler, so a native abort prints every
thread's Python stack into the run's log or the rank's crash log. Core dumps are enabled (RLIMIT_CORE) and land
where the kernel's core_pattern says.

Target: 0 crashes in N (N=20 by default: `python bench/bench_soak.py 20`; `make bench BENCH=soak` runs the
default, `BATCHRL_SOAK_RUNS=5 make bench BENCH=soak` another N). It takes N times a quickstart run: ~2-4 min
each on 2 idle cores, so about an hour for the default; it is opt-in in run_all.py for that reason.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import REPO

NATIVE_WORDS = re.compile(
    r"free\(\):|double free|corrupted|terminate called|Segmentation fault|Fatal Python error|died of (SIG[A-Z]+)"
)
DEBUG_MALLOC = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")
HEAP_CHECKS = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"} | (
    {"LD_PRELOAD": str(DEBUG_MALLOC)} if DEBUG_MALLOC.exists() else {}
)
DOUBLE_FREE = (
    "import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
    "libc.free.argtypes = [ctypes.c_void_p]; p = libc.malloc(64); libc.free(p); libc.free(p)"
)


def heap_checks() -> str:
    """Whether glibc's check mode is on in a Python child of the soak's environment: it frees a block twice."""
    child = subprocess.run([sys.executable, "-c", DOUBLE_FREE], env=os.environ | HEAP_CHECKS, capture_output=True)
    said = child.stderr.decode(errors="replace").strip().splitlines()
    words = said[-1] if said else f"exit {child.returncode}"
    return ("on" if "invalid pointer" in words else "off, glibc's always-on checks only") + f" ({words})"


def runs(n: int) -> list[tuple[str, str, list[str]]]:
    """(run id, pipeline, --set overrides) of the soak: n quickstarts, one overlapped, one PPO."""
    quick = "pipelines/quickstart.yaml"
    return (
        [(f"quickstart-{i:02d}", quick, []) for i in range(n)]
        + [("overlap", quick, ["run.max_staleness=1", "evaluate.every=12"])]
        + [("ppo", "pipelines/ppo_quickstart.yaml", [])]
    )


def one_run(root: Path, run_id: str, pipeline: str, sets: list[str], *, logs: Path) -> dict:
    log = logs / f"{run_id}.log"
    args = [a for s in [f"run.root={root}", *sets] for a in ("--set", s)]
    command = [str(REPO / ".venv" / "bin" / "batchrl"), "run", pipeline, "--run-id", run_id, *args]
    started = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.run(
            command,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | HEAP_CHECKS,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2),
        )
    text = log.read_text(errors="replace")
    words = sorted({m.group(0) for m in NATIVE_WORDS.finditer(text)})
    crash_logs = sorted(str(p) for p in (root / run_id / "_logs").glob("*.log"))
    for crash_log in crash_logs:  # the ranks' and actors' own words
        words += sorted({m.group(0) for m in NATIVE_WORDS.finditer(Path(crash_log).read_text(errors="replace"))})
    stage = re.search(r"died of \S+ in ([^;]+);", text)
    return {
        "run": run_id,
        "code": process.returncode,
        "signal": _signal(process.returncode) or next((w for w in words if w.startswith("SIG")), None),
        "stage": stage.group(1) if stage else None,
        "words": words,
        "log": str(log),
        "crash_logs": crash_logs,
        "seconds": time.perf_counter() - started,
    }


def _signal(code: int) -> str | None:
    import signal

    return signal.Signals(-code).name if code < 0 else None


def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        root, logs = Path(tmp) / "runs", Path(os.environ.get("BATCHRL_SOAK_LOGS", tmp)) / "soak-logs"
        logs.mkdir(parents=True, exist_ok=True)
        results = []
        print(f"heap checks: {heap_checks()}; environment {HEAP_CHECKS}", flush=True)
        for run_id, pipeline, sets in runs(n):
            result = one_run(root, run_id, pipeline, sets, logs=logs)
            results.append(result)
            failed = result["code"] != 0 or result["words"]
            print(f"{run_id}: exit {result['code']}, {result['seconds']:.0f} s" + (f", {result}" if failed else ""))
            sys.stdout.flush()
        crashes = [r for r in results if crashed(r)]
        print(f"RESULT crashes={len(crashes)}/{len(results)} (target 0; {n} quickstarts, 1 overlapped, 1 PPO)")
        for r in crashes:
            print(f"  {r['run']}: exit {r['code']}, signal {r['signal']}, stage {r['stage']}, {r['words']}, {r['log']}")
        others = [r for r in results if r["code"] != 0 and not crashed(r)]
        print(f"RESULT other_failures={len(others)}/{len(results)} (exits without a signal or a native abort's words)")
        for r in others:
            print(f"  {r['run']}: exit {r['code']}, {r['log']}")


def crashed(result: dict) -> bool:
    """A native crash: a signal ended a process of the run (the command, or one it named in its one line), or a
    native abort's words are in a log. A run that failed otherwise (e.g. exit 4: Ray did not start on an
    overloaded machine) is counted apart, as another failure."""
    return bool(result["signal"] or result["stage"] or result["words"])


if __name__ == "__main__":
    # N: the argument, else BATCHRL_SOAK_RUNS (how `make bench BENCH=soak` takes another N), else 20
    main(int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("BATCHRL_SOAK_RUNS", "20")))
