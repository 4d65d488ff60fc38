"""Runs every bench/bench_*.py (or those named: `run_all.py memory resume`) and writes their RESULT lines to
bench/RESULTS.md. Rows of benchmarks not run this time are kept from the previous RESULTS.md.

Each row records the commit it was measured at (`+local` when batchrl/, bench/ or batchrl_toy/ had uncommitted
changes), the machine's 1-minute load average when its benchmark started and ended (timings on shared cores
depend on it), and a check: a digest of the row as written here. tests/unit/test_bench_results.py fails for a row whose
check does not match (a value or note edited by hand) or whose text its benchmark's code cannot print (a RESULT
f-string of the bench at HEAD). Rows from before commits were recorded say `unrecorded` and have no check.

Benchmarks in OPT_IN run only when named (`run_all.py trl`, `make bench BENCH=trl`): they need an extra
install or take much longer than the others."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = ["| benchmark | metric | value (target) | commit | load | check |", "|---|---|---|---|---|---|"]
UNRECORDED = "unrecorded"
OPT_IN = {  # stem -> why it is not in the default run
    "bench_trl": "needs the bench extra (pip install -e '.[bench]') and takes ~5 min on 2 idle cores (12 iterations "
    "of batchrl and of TRL's GRPOTrainer, 3 evaluations; 2-3x that on a busy machine)",
    "bench_soak": "22 quickstart runs in a row (20 plain, 1 overlapped, 1 PPO): about an hour on 2 idle cores",
    "bench_curriculum": "4 toy runs of 20 iterations (uniform and data.curriculum sampling, 2 seeds each) after a "
    "probe of the warm model: ~8 min on 2 cores",
    "bench_ingest_stream": "ingests a 1 GB .jsonl.gz (~30M prompts) and a 2M-row Parquet group at its default sizes: "
    "hours on 2 cores (`python bench/bench_ingest_stream.py --help` for smaller sizes)",
}


def row_check(bench: str, metric: str, value: str, commit: str, load: str) -> str:
    """The digest a row written by this script carries: a value, note, commit or load edited by hand no longer
    matches."""
    return hashlib.sha256(f"{bench}|{metric}|{value}|{commit}|{load}".encode()).hexdigest()[:12]


def read_rows(path: Path) -> list[tuple[str, str, str, str, str, str]]:
    """(benchmark, metric, value and target, commit, load, check) of each row of a RESULTS.md; rows of the older
    three-column table have no commit (UNRECORDED), load or check."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| bench_"):
            continue
        if len(cells) == 3:
            rows.append((*cells, UNRECORDED, "", ""))
        elif len(cells) == 6:
            rows.append(tuple(cells))
    return rows


def measured_at() -> str:
    """HEAD's short hash, `+local` if the measured code (batchrl/, bench/, batchrl_toy/) had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=10", "HEAD") or UNRECORDED
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "batchrl", "bench", "batchrl_toy")
    changed = [line for line in changed.splitlines() if not line.endswith("bench/RESULTS.md")]
    return commit + ("+local" if changed and commit != UNRECORDED else "")


def main(names: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if names:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in names}
        unknown = wanted - {s.stem for s in scripts}
        if unknown:
            sys.stderr.write(f"no benchmark {sorted(unknown)}; there are {[s.stem for s in scripts]}\n")
            return 2
        scripts = [s for s in scripts if s.stem in wanted]
    else:
        for stem, why in OPT_IN.items():
            print(f"== {stem}: skipped, run it by name ({why})", flush=True)
        scripts = [s for s in scripts if s.stem not in OPT_IN]
    rows, failed, commit = [], False, measured_at()
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        sys.stdout.write(result.stdout)
        print(f"   ({time.perf_counter() - started:.0f} s)", flush=True)
        load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
        if result.returncode != 0:
            failed = True
            sys.stderr.write(result.stderr[-3000:])
            rows.append((script.stem, "FAILED", "", commit, load, row_check(script.stem, "FAILED", "", commit, load)))
            continue
        for line in result.stdout.splitlines():
            if line.startswith("RESULT "):
                name, _, rest = line.removeprefix("RESULT ").partition("=")
                value, _, target = rest.partition(" ")
                text = f"{value} {target}".strip()
                rows.append((script.stem, name, text, commit, load, row_check(script.stem, name, text, commit, load)))
    ran = {s.stem for s in scripts}
    kept = [r for r in read_rows(HERE / "RESULTS.md") if r[0] not in ran]
    rows = sorted(kept + rows, key=lambda r: r[0])  # stable: metric order
    table = HEADER + ["| " + " | ".join(row) + " |" for row in rows]
    (HERE / "RESULTS.md").write_text("# Benchmark results\n\nWritten by `make bench`.\n\n" + "\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
