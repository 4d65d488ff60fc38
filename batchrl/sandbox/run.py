"""Run one program, or many in parallel, and say how each ended: ``run_program`` and ``run_programs``.

The parent enforces what a limit in the child cannot: the wall clock (a sleeping program uses no CPU) and the
output caps (a program printing forever is stopped once it has written ``max_output_bytes`` to a stream, never
buffered to the parent's memory). Stopping kills the whole process group, and with bubblewrap the whole PID
namespace (its init dies with the group), so no child or grandchild of the program survives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from batchrl.sandbox.layout import PROGRAM_NAME, Launcher, find_launcher, preexec_limits

logger = logging.getLogger(__name__)

# How a program ended. ok: exit 0. error: a non-zero exit (an exception, a failed assert). timeout: the wall clock
# or the CPU limit. memory: the address-space limit (MemoryError, a failed allocation). output_limit: more than
# max_output_bytes on stdout or stderr. file_limit: a file over file_size_mb, or the private /tmp full. signal:
# killed by another signal (a segfault, an abort). sandbox_error: the sandbox itself could not start the program.
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "file_limit", "signal", "sandbox_error")
ISOLATION_MODES = ("auto", "required", "off")
LANGUAGES = ("python",)
READ_BYTES = 1 << 16
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap; dnf install bubblewrap)"

_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "out of memory", "std::bad_alloc")
_FILE_SIGNS = ("File too large", "No space left on device")
_SETUP_PREFIXES = ("bwrap: ", "prlimit: ", "setpriv: ")


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. The defaults suit a test case of a competitive-programming task."""

    wall_s: float = 5.0  # wall-clock deadline, from start to exit, enforced by the parent
    cpu_s: float = 5.0  # CPU seconds (rounded up to whole seconds: the kernel's unit)
    memory_mb: int = 1024  # address space; Python raises MemoryError beyond it
    max_processes: int = 32  # processes and threads of the program's uid (isolated runs only)
    file_size_mb: int = 16  # the largest file it may write
    max_output_bytes: int = 1 << 20  # per stream, stdout and stderr each; more stops the program
    max_open_files: int = 64

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{field.name}={value!r} must be a positive number")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class SandboxResult:
    """How a program ended (``status``, one of STATUSES), what it wrote (each stream at most max_output_bytes,
    decoded as UTF-8 with replacement), its exit code (None if it was stopped or never started; a negative
    number -N or, under bubblewrap, 128+N for signal N), seconds from start to exit, and whether it ran isolated."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self, *, max_chars: int = 300) -> str:
        """'<status>: <stderr's last non-blank line>' (a traceback's exception), the line cut to max_chars."""
        lines = self.stderr.strip().splitlines()
        tail = lines[-1].strip()[:max_chars] if lines else ""
        return f"{self.status}: {tail}" if tail else self.status


@dataclass(frozen=True)
class Program:
    """One program for ``run_programs``: its source, the text it reads on stdin, its language."""

    source: str
    stdin: str = ""
    language: str = "python"


class SandboxUnavailable(RuntimeError):
    """``isolation="required"`` on a machine where bubblewrap is missing or cannot create namespaces."""


def run_program(
    source: str,
    *,
    stdin: str = "",
    language: str = "python",
    limits: SandboxLimits = DEFAULT_LIMITS,
    isolation: str = "auto",
) -> SandboxResult:
    """Runs ``source`` as a program reading ``stdin``; never raises for anything the program does.

    isolation: "auto" (bubblewrap where it works, else the limits alone with one WARNING per process),
    "required" (SandboxUnavailable where it does not work), "off" (the limits alone, silently: trusted code)."""
    if language not in LANGUAGES:
        raise ValueError(f"language={language!r}: the sandbox runs {', '.join(LANGUAGES)}")
    return _execute(source, stdin=stdin, limits=limits, launcher=_launcher(isolation))


def run_programs(
    programs: Sequence[Program],
    *,
    limits: SandboxLimits = DEFAULT_LIMITS,
    max_parallel: int = 4,
    isolation: str = "auto",
    deadline_s: float | None = None,
) -> list[SandboxResult]:
    """Runs ``programs`` at most ``max_parallel`` at a time; results in the same order.

    deadline_s: a budget for the whole batch, from this call. A program starting late gets the time left as its
    wall limit; one not started before the budget is spent is reported as a timeout without running."""
    if max_parallel < 1:
        raise ValueError(f"max_parallel={max_parallel} must be at least 1")
    for program in programs:
        if program.language not in LANGUAGES:
            raise ValueError(f"language={program.language!r}: the sandbox runs {', '.join(LANGUAGES)}")
    launcher = _launcher(isolation)
    ends_at = None if deadline_s is None else time.monotonic() + deadline_s

    def one(program: Program) -> SandboxResult:
        run_limits = limits
        if ends_at is not None:
            left = ends_at - time.monotonic()
            if left <= 0:
                stderr = f"not started: the batch's {deadline_s:g}s budget was spent"
                return SandboxResult("timeout", None, "", stderr, 0.0, launcher.isolated)
            run_limits = dataclasses.replace(limits, wall_s=min(limits.wall_s, left))
        return _execute(program.source, stdin=program.stdin, limits=run_limits, launcher=launcher)

    if len(programs) <= 1 or max_parallel == 1:
        return [one(p) for p in programs]
    with ThreadPoolExecutor(min(max_parallel, len(programs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, programs))


def isolation_available() -> bool:
    """Whether programs run isolated here (bubblewrap found and working); probes once per process."""
    return _launcher("auto").isolated


def _execute(source: str, *, stdin: str, limits: SandboxLimits, launcher: Launcher) -> SandboxResult:
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="batchrl-sandbox-")
    try:
        with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8") as f:
            f.write(source)
        stdin_path = os.path.join(workdir, "stdin")  # a file, not a pipe: nothing for the parent to feed
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        argv, cwd = launcher.argv(workdir=workdir, limits=limits, python=sys.executable)
        try:
            with open(stdin_path, "rb") as stdin_file:
                process = subprocess.Popen(
                    argv,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=_program_env(home=cwd if not launcher.isolated else "/tmp"),
                    start_new_session=True,  # its own process group, killed as one
                    preexec_fn=None if launcher.prlimit else preexec_limits(limits),
                )
        except OSError as err:
            return SandboxResult("sandbox_error", None, "", f"cannot start: {err}", 0.0, launcher.isolated)
        try:
            stdout, stderr, stopped = _collect(process, ends_at=started + limits.wall_s, cap=limits.max_output_bytes)
        finally:
            if process.poll() is None:
                _kill(process)
            process.stdout.close()
            process.stderr.close()
        seconds = time.monotonic() - started
        exit_code = None if stopped else process.returncode
        text_out, text_err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
        status = stopped or _status(exit_code, text_err, isolated=launcher.isolated)
        return SandboxResult(status, exit_code, text_out, text_err, seconds, launcher.isolated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(process: subprocess.Popen, *, ends_at: float, cap: int) -> tuple[bytearray, bytearray, str | None]:
    """stdout, stderr (each at most ``cap`` bytes) and why the program was stopped ("timeout", "output_limit"), or
    None if it exited on its own."""
    streams = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    out, err = streams.values()
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = ends_at - time.monotonic()
            if left <= 0:
                return out, err, "timeout"
            for key, _ in selector.select(left):
                data = os.read(key.fd, READ_BYTES)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = streams[key.fd]
                buffer += data
                if len(buffer) > cap:
                    del buffer[cap:]
                    return out, err, "output_limit"
    try:  # both streams closed: it exited, or closed them and goes on (a sleeper)
        process.wait(timeout=max(0.0, ends_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        return out, err, "timeout"
    return out, err, None


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


def _status(exit_code: int, stderr: str, *, isolated: bool) -> str:
    if exit_code == 0:
        return "ok"
    if stderr.startswith(_SETUP_PREFIXES):
        return "sandbox_error"
    signum = -exit_code if exit_code < 0 else exit_code - 128 if isolated and 128 < exit_code < 128 + 65 else 0
    if signum == signal.SIGXCPU:
        return "timeout"
    if signum == signal.SIGXFSZ or any(sign in stderr for sign in _FILE_SIGNS):
        return "file_limit"
    if any(sign in stderr for sign in _MEMORY_SIGNS):
        return "memory"
    return "signal" if signum else "error"


def _program_env(*, home: str) -> dict[str, str]:
    """A clean environment: nothing of the parent's (tokens, cloud credentials) reaches the program. A fixed hash
    seed makes a program that prints a set print it the same way each time, so a reward is reproducible."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


_launchers: dict[str, Launcher] = {}
_launchers_lock = threading.Lock()


def _launcher(isolation: str) -> Launcher:
    """The launcher for ``isolation``, found and probed once per process (a probe runs one tiny program)."""
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r} must be one of {', '.join(ISOLATION_MODES)}")
    with _launchers_lock:
        if isolation not in _launchers:
            _launchers[isolation] = _probe(isolation)
        launcher = _launchers[isolation]
    if isolation == "required" and not launcher.isolated:
        raise SandboxUnavailable(f"isolation='required' but bubblewrap is not usable here; {INSTALL_HINT}")
    return launcher


def _probe(isolation: str) -> Launcher:
    unisolated = find_launcher(want_isolation=False)
    if isolation == "off":
        return unisolated
    launcher = find_launcher(want_isolation=True)
    if launcher.isolated:
        probe = _execute("import sys; sys.exit(0)", stdin="", limits=DEFAULT_LIMITS, launcher=launcher)
        if probe.ok:
            return launcher
        why = f"bubblewrap is installed but failed to start a program ({probe.describe(max_chars=400)})"
    else:
        why = "bubblewrap (bwrap) is not installed" if not shutil.which("bwrap") else "setpriv is missing (root)"
    if isolation == "auto":
        logger.warning(
            "SANDBOX ISOLATION IS OFF: %s. Model-written programs run with resource limits only: they can read "
            "what this user can read and reach the network. To isolate them, %s.",
            why,
            INSTALL_HINT,
        )
    return unisolated
