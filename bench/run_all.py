"""Runs every bench/bench_*.py (or those named: `run_all.py memory resume`) and writes their RESULT lines to
bench/RESULTS.md. Rows of benchmarks not run this time are kept from the previous RESULTS.md.

Benchmarks in OPT_IN run only when named (`run_all.py trl`, `make bench BENCH=trl`): they need an extra
install or take much longer than the others."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = ["| benchmark | metric | value (target) |", "|---|---|---|"]
OPT_IN = {  # stem -> why it is not in the default run
    "bench_trl": "needs the bench extra (pip install -e '.[bench]') and takes ~5 min on 2 idle cores (12 iterations "
    "of batchrl and of TRL's GRPOTrainer, 3 evaluations; 2-3x that on a busy machine)",
    "bench_soak": "22 quickstart runs in a row (20 plain, 1 overlapped, 1 PPO): about an hour on 2 idle cores",
}


def previous_rows() -> list[tuple[str, str, str]]:
    path = HERE / "RESULTS.md"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| bench_") and len(cells) == 3:
            rows.append((cells[0], cells[1], cells[2]))
    return rows


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
    rows, failed = [], False
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        started = time.perf_counter()
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        sys.stdout.write(result.stdout)
        print(f"   ({time.perf_counter() - started:.0f} s)", flush=True)
        if result.returncode != 0:
            failed = True
            sys.stderr.write(result.stderr[-3000:])
            rows.append((script.stem, "FAILED", ""))
            continue
        for line in result.stdout.splitlines():
            if line.startswith("RESULT "):
                name, _, rest = line.removeprefix("RESULT ").partition("=")
                value, _, target = rest.partition(" ")
                rows.append((script.stem, name, f"{value} {target}".strip()))
    ran = {s.stem for s in scripts}
    rows = sorted([r for r in previous_rows() if r[0] not in ran] + rows, key=lambda r: r[0])  # stable: metric order
    table = HEADER + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    (HERE / "RESULTS.md").write_text("# Benchmark results\n\nWritten by `make bench`.\n\n" + "\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
