"""Peak RSS of this process, for the memory benchmarks.

Why not getrusage(RUSAGE_SELF).ru_maxrss: Linux carries it across exec, and Python's subprocess starts children
with vfork + exec, so a child reports at least its PARENT's peak at the time it was started (measured: a child of
a process holding 800 MB reported ru_maxrss 813 MB, VmHWM 13 MB). The benchmarks write their synthetic inputs in
the parent, then measure in a child: ru_maxrss measured the writer. VmHWM is the high-water mark of the address
space exec gave this process, so only its own pages count.
"""

from __future__ import annotations


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")
