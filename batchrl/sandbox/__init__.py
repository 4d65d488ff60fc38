"""Run model-written programs: isolated by bubblewrap, bounded by resource limits, never trusted.

One module that the code-execution reward (``batchrl.rewards.code``) and the agent loop's ``python`` tool share.

What a program gets (``isolation="auto"`` with bubblewrap installed and working):
  - no network (its own empty network namespace: even 127.0.0.1 of the host is another machine);
  - a read-only view of the system libraries and of the Python installation that runs it (the interpreter's
    prefix and the virtual environment, so numpy and friends import), nothing else of the host's files: no home
    directories, no repository, no host /tmp;
  - a private writable /tmp (a tmpfs of bounded size) as its working directory, holding ``main.py``;
  - its own PID, IPC and UTS namespaces, killed whole when the parent dies or the deadline passes;
  - an unprivileged uid of its own when batchrl runs as root (so root-only files such as /etc/shadow and the
    process limit apply; a fresh uid per program keeps one program's processes from counting against another's);
  - resource limits (``SandboxLimits``): CPU seconds, address space, processes, bytes per written file, open files;
    the parent enforces the wall-clock deadline and reads at most ``max_output_bytes`` of stdout and of stderr.

Why bubblewrap and rlimits rather than checks of our own: an AST or import filter is bypassed by any of a dozen
tricks (``__import__`` through ``getattr``, ctypes, a second interpreter), while namespaces and rlimits are what
the kernel enforces; bubblewrap is the small, audited setuid-free tool Flatpak uses to set them up, one Debian
package away. Containers (Docker, gVisor) isolate more, but need a daemon this pipeline cannot assume.

Without bubblewrap (or where it cannot create namespaces, as in some containers) programs run with the resource
limits alone, a WARNING says so once per process, and every ``SandboxResult`` records ``isolated=False``.
"""

from batchrl.sandbox.run import (
    DEFAULT_LIMITS,
    STATUSES,
    Program,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    isolation_available,
    run_program,
    run_programs,
)

__all__ = [
    "DEFAULT_LIMITS",
    "STATUSES",
    "Program",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "isolation_available",
    "run_program",
    "run_programs",
]
