"""The sandbox with hostile programs: each is contained, reported with the right status, and the caller goes on.

Tests of what only bubblewrap provides (hidden files, no network, a process limit) skip, with the reason shown,
where it is missing; the resource limits and the parent's deadline and output caps are tested in both modes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from batchrl.sandbox import Program, SandboxLimits, SandboxUnavailable, isolation_available, run_program, run_programs

ISOLATED = isolation_available()
needs_bwrap = pytest.mark.skipif(
    not ISOLATED, reason="bubblewrap is not installed or cannot create namespaces here (apt-get install bubblewrap)"
)
# A wall clock no healthy program misses on a loaded host (2 cores at a load of 20 start Python in ~1 s); the tests
# of hung programs set their own short ones and wait them out.
LIMITS = SandboxLimits(wall_s=10.0, cpu_s=2.0, memory_mb=512, max_output_bytes=64 << 10, file_size_mb=8)
MODES = ["auto", "off"]  # "auto" is isolated where bubblewrap works


def run(source: str, *, isolation: str = "auto", limits: SandboxLimits = LIMITS, stdin: str = ""):
    return run_program(textwrap.dedent(source), stdin=stdin, limits=limits, isolation=isolation)


@pytest.mark.parametrize("isolation", MODES)
def test_a_program_reads_its_stdin_and_its_output_comes_back(isolation):
    result = run("n, k = map(int, input().split())\nprint(n + k)", stdin="2 3\n", isolation=isolation)
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "5\n")
    assert result.isolated == (ISOLATED and isolation == "auto")


def test_a_program_that_raises_is_an_error_with_its_traceback_in_stderr():
    result = run("raise ValueError('bad input')")
    assert result.status == "error" and result.exit_code == 1
    assert "ValueError: bad input" in result.stderr
    assert result.describe().startswith("error: ") and result.describe().endswith("ValueError: bad input")


@needs_bwrap
def test_files_outside_the_sandbox_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    result = run(
        f"""
        import os
        print(sorted(os.listdir('/tmp')))
        for path in [{str(secret)!r}, '/etc/shadow', os.path.expanduser('~root/.bashrc')]:
            try:
                print(open(path).read())
            except OSError as err:
                print(type(err).__name__)
        """
    )
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    # the host's /tmp (where tmp_path is) is not there; only the interpreter's own directories when they live under
    # it (a checkout in /tmp: its venv is bound read-only, so its top directory shows through, layout.py says why)
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    shown = {Path(p).relative_to("/tmp").parts[0] for p in prefixes if p.startswith("/tmp/")}
    assert lines[0] == str(sorted({"main.py"} | shown))
    assert "s3cr3t" not in result.stdout
    assert all(line in ("FileNotFoundError", "PermissionError") for line in lines[1:])


@needs_bwrap
def test_the_network_is_unreachable_even_on_the_hosts_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody came
    assert result.status == "error"
    assert "ConnectionRefusedError" in result.stderr or "OSError" in result.stderr


@needs_bwrap
def test_a_fork_bomb_is_stopped_by_the_process_limit_and_leaves_no_process_behind():
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    result = run(
        f"""
        import ctypes, os
        ctypes.CDLL(None).prctl(15, b"{marker}")  # PR_SET_NAME: children inherit the name, the test looks for it
        while True:
            os.fork()
        """
    )
    assert result.status in ("error", "timeout"), result
    assert result.seconds < LIMITS.wall_s + 1.0
    assert result.status == "timeout" or "Resource temporarily unavailable" in result.stderr
    assert not survivors(marker)


@pytest.mark.parametrize("isolation", MODES)
def test_allocating_10_gb_is_a_memory_error(isolation):
    result = run("data = bytearray(10 * 1024**3)\nprint(len(data))", isolation=isolation)
    assert result.status == "memory"
    assert "MemoryError" in result.stderr and result.stdout == ""


@pytest.mark.parametrize("isolation", MODES)
def test_writing_1_gb_to_a_file_stops_at_the_file_size_limit(isolation):
    result = run(
        """
        with open('big.bin', 'wb') as f:
            for _ in range(1024):
                f.write(b'x' * 2**20)
        """,
        isolation=isolation,
    )
    assert result.status == "file_limit"
    assert "File too large" in result.stderr or "No space left" in result.stderr


@pytest.mark.parametrize("isolation", MODES)
def test_printing_forever_is_stopped_at_the_output_cap_without_buffering_it(isolation):
    result = run("while True:\n    print('spam' * 100)", isolation=isolation)
    assert result.status == "output_limit" and result.exit_code is None
    assert len(result.stdout.encode()) == LIMITS.max_output_bytes
    assert result.seconds < LIMITS.wall_s


@pytest.mark.parametrize("isolation", MODES)
def test_sleeping_forever_is_a_timeout_at_the_wall_clock_and_its_children_die_too(isolation):
    limits = SandboxLimits(wall_s=1.0, cpu_s=1.0)
    marker = f"nap{uuid.uuid4().hex[:8]}"
    result = run(
        f"""
        import ctypes, os, time
        ctypes.CDLL(None).prctl(15, b"{marker}")
        os.fork()  # a child sleeping as well: it must die with the program
        time.sleep(3600)
        """,
        isolation=isolation,
        limits=limits,
    )
    assert result.status == "timeout" and result.exit_code is None
    assert limits.wall_s <= result.seconds < limits.wall_s + 3.0
    assert not survivors(marker)


@pytest.mark.parametrize("isolation", MODES)
def test_a_busy_loop_is_a_timeout_at_the_cpu_limit(isolation):
    result = run("while True:\n    pass", isolation=isolation, limits=SandboxLimits(wall_s=60.0, cpu_s=1.0))
    assert result.status == "timeout"
    assert result.exit_code is not None  # it died of SIGXCPU at 1 CPU second; the parent's wall-clock kill has none


def test_a_segfault_is_a_signal():
    result = run("import ctypes\nctypes.string_at(0)")
    assert result.status == "signal"


def test_many_programs_run_in_parallel_and_come_back_in_order():
    programs = [Program(f"import time\ntime.sleep(1.5)\nprint({i})") for i in range(4)]
    started = time.monotonic()
    results = run_programs(programs, limits=LIMITS, max_parallel=4)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
    assert time.monotonic() - started < 4 * 1.5  # they overlapped


def test_programs_not_started_within_the_batch_budget_are_timeouts_without_running():
    programs = [Program("import time\ntime.sleep(5)")] * 3
    started = time.monotonic()
    results = run_programs(programs, limits=SandboxLimits(wall_s=10.0), max_parallel=1, deadline_s=0.8)
    assert time.monotonic() - started < 2.5
    assert [r.status for r in results] == ["timeout"] * 3
    assert results[0].seconds >= 0.7 and results[2].stderr.startswith("not started")


def test_limits_that_are_not_positive_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"SandboxLimits.wall_s=0 must be a positive number"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="language='ruby'"):
        run_program("puts 1", language="ruby")


@needs_bwrap
def test_required_isolation_runs_isolated_where_bubblewrap_works():
    assert run_program("print(1)", isolation="required").isolated


@pytest.mark.skipif(ISOLATED, reason="bubblewrap works here: isolation='required' is satisfied")
def test_required_isolation_is_refused_where_bubblewrap_is_missing():
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_program("print(1)", isolation="required")


def test_without_bubblewrap_programs_run_with_limits_alone_and_a_warning_says_so_once():
    script = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        from batchrl.sandbox import SandboxLimits, run_program
        for _ in range(2):
            r = run_program("print(sum(range(10)))", limits=SandboxLimits(wall_s=5))
            print(r.status, r.stdout.strip(), r.isolated)
        r = run_program("bytearray(10**10)", limits=SandboxLimits(memory_mb=256))
        print(r.status)
        """
    )
    # No bwrap, prlimit or setpriv on PATH: the limits are set by the preexec_fn fallback.
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "PATH": "/nonexistent"}
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["ok 45 False", "ok 45 False", "memory"]
    assert child.stderr.count("SANDBOX ISOLATION IS OFF") == 1
    assert "apt-get install bubblewrap" in child.stderr


def survivors(marker: str, *, wait_s: float = 2.0) -> list[str]:
    """Processes named ``marker`` still there after ``wait_s``: a SIGKILL is delivered, and the killed reaped,
    asynchronously."""
    ends_at = time.monotonic() + wait_s
    while True:
        found = [pid for pid in os.listdir("/proc") if pid.isdigit() and _comm(pid) == marker]
        if not found or time.monotonic() > ends_at:
            return found
        time.sleep(0.05)


def _comm(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None
