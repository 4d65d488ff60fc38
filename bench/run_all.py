"""Runs every bench/bench_*.py and writes their RESULT lines to bench/RESULTS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    rows, failed = [], False
    for script in sorted(HERE.glob("bench_*.py")):
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        sys.stdout.write(result.stdout)
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
    table = ["| benchmark | metric | value (target) |", "|---|---|---|"]
    table += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    (HERE / "RESULTS.md").write_text("# Benchmark results\n\nWritten by `make bench`.\n\n" + "\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
