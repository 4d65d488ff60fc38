"""The command line that starts one sandboxed program: bubblewrap's mounts, the limits, the uid, the interpreter.

A program runs as ``[bwrap <namespaces and mounts> --] prlimit <limits> -- [setpriv <uid> --] python main.py``.
Each wrapper execs the next, so the program is bubblewrap's direct child and its exit status is the program's.
Why ``prlimit`` and ``setpriv`` (util-linux, on every Debian and Ubuntu) rather than a ``preexec_fn``: the runner
starts programs from several threads, and Python code run between fork and exec in a threaded process can
deadlock (the subprocess documentation's warning); ``preexec_fn`` is only the fallback where prlimit is missing.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# Read-only system paths a Python program needs; symlinks (merged /usr) are recreated as symlinks.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# From /etc only what the dynamic linker and the standard library read; not the whole of it (host secrets live
# there: /etc/shadow, credentials of services).
ETC_PATHS = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
)
SANDBOX_DIR = "/tmp"  # the program's working directory inside the sandbox (a private tmpfs)
PROGRAM_NAME = "main.py"
TMPFS_BYTES = 64 << 20  # the private /tmp: writes beyond it fail with ENOSPC (memory, not the host's disk)
UID_RANGE = (1 << 20, 1 << 30)  # unprivileged uids no account uses; one drawn per program when we are root
_UIDS = random.SystemRandom()  # not the global generator: a caller's random.seed must not repeat our uids


@dataclass(frozen=True)
class Launcher:
    """How programs are started on this machine: with bubblewrap (``isolated``) or with the limits alone."""

    isolated: bool
    bwrap: str | None
    prlimit: str | None
    setpriv: str | None
    bwrap_help: str = ""

    def argv(self, *, workdir: str, limits: Any, python: str) -> tuple[list[str], str]:
        """(argv, cwd) that run ``workdir/main.py`` under ``limits`` (a SandboxLimits)."""
        if not self.isolated:
            command = [python, "-s", "-B", os.path.join(workdir, PROGRAM_NAME)]
            if self.setpriv:  # killed with its parent even though it is in no PID namespace
                command = [self.setpriv, "--pdeathsig", "KILL", "--", *command]
            # No process limit here: RLIMIT_NPROC counts every process of the uid (root is exempt, a user's Ray
            # workers count), so only a PID namespace or a fresh uid can bound a program's own processes.
            return self._limited(command, limits, processes=False), workdir
        command = [python, "-s", "-B", f"{SANDBOX_DIR}/{PROGRAM_NAME}"]
        if os.geteuid() == 0:
            uid = str(_UIDS.randrange(*UID_RANGE))
            drop = [self.setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--no-new-privs"]
            command = [*drop, "--bounding-set", "-all", "--", *command]
        limited = self._limited(command, limits, processes=True)
        return [*self.bwrap_args(workdir=workdir, python=python), "--", *limited], workdir

    def _limited(self, command: list[str], limits: Any, *, processes: bool) -> list[str]:
        if self.prlimit is None:
            return command  # preexec_limits applies them
        flags = [f"--{name}={soft}:{hard}" for name, soft, hard in rlimits(limits, processes=processes)]
        return [self.prlimit, *flags, "--", *command]

    def bwrap_args(self, *, workdir: str, python: str) -> list[str]:
        args = [self.bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
        if os.geteuid() != 0:
            args.append("--unshare-user")  # unprivileged bubblewrap needs it; the process limit then counts per sandbox
        if "--perms" in self.bwrap_help:
            args += ["--perms", "1777"]  # the program's uid (not root) writes there
        if "--size" in self.bwrap_help:
            args += ["--size", str(TMPFS_BYTES)]
        args += ["--tmpfs", SANDBOX_DIR]
        made = {"/", "/etc", SANDBOX_DIR}
        for path in [*SYSTEM_PATHS, *ETC_PATHS, *interpreter_paths(python)]:
            if os.path.islink(path) and os.path.dirname(path) == "/":
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                args += [*self._parents(path, made), "--ro-bind", path, path]
        args += ["--ro-bind", os.path.join(workdir, PROGRAM_NAME), f"{SANDBOX_DIR}/{PROGRAM_NAME}"]
        return [*args, "--chdir", SANDBOX_DIR]

    def _parents(self, path: str, made: set[str]) -> list[str]:
        """Directories above ``path``, made traversable: bubblewrap makes them 0700 when run as root, which would
        hide an interpreter under /root/.pyenv from the program's uid."""
        args: list[str] = []
        parents = []
        parent = os.path.dirname(path)
        while parent not in made:
            parents.append(parent)
            parent = os.path.dirname(parent)
        for parent in reversed(parents):
            args += (["--perms", "0755"] if "--perms" in self.bwrap_help else []) + ["--dir", parent]
            made.add(parent)
        return args


def rlimits(limits: Any, *, processes: bool) -> list[tuple[str, int, int]]:
    """(prlimit name, soft, hard) per limit. CPU: SIGXCPU at the soft limit, SIGKILL a second later."""
    cpu = max(1, int(-(-limits.cpu_s // 1)))
    found = [
        ("cpu", cpu, cpu + 1),
        ("as", limits.memory_mb << 20, limits.memory_mb << 20),
        ("fsize", limits.file_size_mb << 20, limits.file_size_mb << 20),
        ("nofile", limits.max_open_files, limits.max_open_files),
        ("core", 0, 0),
    ]
    return found + ([("nproc", limits.max_processes, limits.max_processes)] if processes else [])


_RESOURCE = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def preexec_limits(limits: Any) -> Any:
    """A preexec_fn setting the limits, for machines without prlimit (see the module docstring for the risk)."""
    pairs = [(_RESOURCE[name], (soft, hard)) for name, soft, hard in rlimits(limits, processes=False)]

    def apply() -> None:
        for which, value in pairs:
            resource.setrlimit(which, value)

    return apply


def interpreter_paths(python: str) -> list[str]:
    """Directories the interpreter needs, outside the system paths: its prefix, the virtual environment. One
    under the host's /tmp (a CI checkout's) is bound after the private /tmp is mounted, so it shows through."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    candidates |= {os.path.dirname(os.path.dirname(os.path.realpath(python))), os.path.dirname(python)}
    kept = sorted(p for p in candidates if p and os.path.isdir(p) and not any(_under(p, s) for s in SYSTEM_PATHS))
    return [p for p in kept if p != "/" and not any(_under(p, q) for q in kept if q != p)]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def find_launcher(*, want_isolation: bool) -> Launcher:
    """The tools found on PATH; isolated only if bubblewrap is there and wanted (whether it works is probed)."""
    bwrap = shutil.which("bwrap") if want_isolation else None
    setpriv = shutil.which("setpriv")
    if bwrap and os.geteuid() == 0 and not setpriv:
        bwrap = None  # as root, without setpriv the program would keep root inside the sandbox
    help_text = ""
    if bwrap:
        try:
            help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            bwrap = None
    return Launcher(
        isolated=bwrap is not None,
        bwrap=bwrap,
        prlimit=shutil.which("prlimit"),
        setpriv=setpriv,
        bwrap_help=help_text,
    )
